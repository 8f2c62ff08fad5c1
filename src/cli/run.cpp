// dsv4 run: the attention stack of a preset or a checkpoint serving a
// synthetic workload, scheduled step by step under a token budget.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "cache/fp8_ds_mla.h"
#include "cli/commands.h"
#include "cli/options.h"
#include "common/error.h"
#include "runtime/workload.h"

namespace dsv4::cli {
namespace {

struct RunArgs {
  std::string preset = "small", config, checkpoint, profile = "production", index_keys = "mxfp4", json;
  std::string device = "auto", gpu_memory = "0.9", cache_memory, request_rate = "inf";
  uint64_t seed = 0;
  int requests = 8, prompt = 512, gen = 32, budget = 512, max_running = 8;
  double weight_cache_gib = 4;
  bool gpu_memory_given = false, index_keys_given = false;
};

// --gpu-memory on a CPU run is left unused; say so, since a user who sized
// the device's memory expects the size to hold.
void note_unused_memory_option(const RunArgs& a, Device d) {
  if (d == Device::kCpu && a.gpu_memory_given)
    std::fprintf(stderr, "note: --gpu-memory is for --device cuda; this run is on the CPU, where --cache-memory caps "
                         "the caches\n");
}

ModelConfig pick_config(const RunArgs& a) {
  if (!a.config.empty()) return load_config(a.config);
  if (!a.checkpoint.empty()) {
    const std::filesystem::path p(a.checkpoint);
    std::error_code ec;
    const auto dir = std::filesystem::is_directory(p, ec) ? p : p.parent_path();
    DSV4_REQUIRE(std::filesystem::exists(dir / "config.json", ec),
            "no config.json in '" + dir.string() + "': pass --config FILE with the checkpoint");
    return load_config(dir / "config.json");
  }
  return preset_config(a.preset);
}

// Bytes the float32 copies of every matrix would take.
double dense_weight_bytes(const ModelConfig& c) {
  double bytes = 0;
  for (int l = 0; l < c.num_layers; ++l)
    for (const TensorSpec& s : attention_tensor_specs(c, l))
      if (s.shape.size() == 2) bytes += 4.0 * double(s.shape[0]) * double(s.shape[1]);
  return bytes;
}

// Request i's prompt: lengths spread over [P/2, P], shortest first, so that
// chunk boundaries land on every residue.
int prompt_of(const RunArgs& a, int64_t i) {
  const int64_t n = a.requests, p = a.prompt;
  return int(std::max<int64_t>(1, n > 1 ? p / 2 + (p - p / 2) * i / (n - 1) : p));
}

// --request-rate: requests a second, or infinity (every request at the start).
double request_rate(const std::string& s) { return s == "inf" ? INFINITY : std::strtod(s.c_str(), nullptr); }

// The requests, made as the scheduler takes them; at a finite rate their
// arrivals are a Poisson process (gaps drawn from --seed).
WorkloadSource make_workload(const RunArgs& a) {
  struct Clock {
    int64_t next = 0;     // the request it is at
    double arrival = 0;   // that request's arrival
  };
  const double rate = request_rate(a.request_rate);
  auto clock = std::make_shared<Clock>();
  return {a.requests, [a, rate, clock](int64_t i) {
            DSV4_REQUIRE(i == clock->next++, "workload: request " + std::to_string(i) + " asked out of order");
            if (std::isfinite(rate)) clock->arrival += poisson_gap(a.seed, i, rate);
            return WorkloadRequest{i, prompt_of(a, i), a.gen, clock->arrival};
          }};
}

nlohmann::json report_json(const WorkloadReport& r, const ModelConfig& c, const RunArgs& a, const Engine& e) {
  nlohmann::json j;
  j["config"] = c.name;
  j["device"] = device_name(e.options().device);
  const BackendMemory m = const_cast<Engine&>(e).backend().memory();
  j["memory_bytes"] = {{"weights", m.weights}, {"weight_copies", m.weight_copies}, {"caches", m.caches},
                       {"workspace", m.workspace}};
  j["profile"] = a.profile;
  j["index_keys"] = a.profile == "exact" ? "float32" : a.index_keys;
  j["requests"] = a.requests;
  if (a.request_rate == "inf") j["request_rate"] = "inf";
  else j["request_rate"] = request_rate(a.request_rate);
  j["steps"] = r.steps;
  j["prefill"] = {{"tokens", r.prefill_tokens}, {"seconds", r.prefill_step_seconds},
                  {"tokens_per_s", r.prefill_step_seconds > 0 ? r.prefill_tokens / r.prefill_step_seconds : 0}};
  j["decode"] = {{"tokens", r.decode_tokens}, {"seconds", r.decode_step_seconds},
                 {"tokens_per_s", r.decode_step_seconds > 0 ? r.decode_tokens / r.decode_step_seconds : 0}};
  j["total_seconds"] = r.total_seconds;
  const auto latency = [](const LatencySummary& l) {
    return nlohmann::json{{"count", l.count}, {"mean", l.mean * 1e3}, {"median", l.median * 1e3},
                          {"p90", l.p90 * 1e3}, {"p99", l.p99 * 1e3}, {"max", l.max * 1e3}};
  };
  j["latency_ms"] = {{"first_token", latency(r.first_token)}, {"between_tokens", latency(r.between_tokens)}};
  for (int t = 0; t < kNumLayerTypes; ++t) {
    const std::string name(layer_type_name(LayerType(t)));
    j["layer_types"][name] = {{"layers", r.layer_counts[size_t(t)]},
                              {"seconds", r.layer_seconds[size_t(t)]},
                              {"peak_cache_bytes", r.peak_cache_bytes[size_t(t)]}};
  }
  j["peak_cache_bytes"] = r.peak_cache_total;
  for (CacheGroup g : kAllCacheGroups)
    j["peak_cache_bytes_by_group"][std::string(cache_group_name(g))] = r.peak_group_bytes[size_t(g)];
  j["peak_tokens_held"] = r.peak_tokens_held;
  j["dense_mla_bytes_at_peak"] = double(r.peak_tokens_held) * c.num_layers * kKvEntryBytes;
  j["finished"] = r.finished;
  j["rejected"] = r.rejected;
  j["errors"] = r.errors;  // the first WorkloadReport::kReasonsKept reasons
  j["stalled_runs"] = r.stalled_runs;
  j["preemptions"] = r.preemptions;
  j["recomputed_tokens"] = r.recomputed_tokens;
  j["checksum"] = r.checksum;
  j["nonfinite_values"] = r.nonfinite_values;
  return j;
}

void print_report(FILE* out, const WorkloadReport& r, const ModelConfig& c) {
  const double mib = 1024.0 * 1024;
  auto rate = [](double n, double s) { return s > 0 ? n / s : 0.0; };
  std::fprintf(out, "steps %d, total %.2f s\n", r.steps, r.total_seconds);
  std::fprintf(out, "prefill: %lld tokens in %.2f s of steps with prefill = %.1f tokens/s\n",
               (long long)r.prefill_tokens, r.prefill_step_seconds,
               rate(double(r.prefill_tokens), r.prefill_step_seconds));
  std::fprintf(out, "decode:  %lld tokens, %.2f s of decode-only steps = %.1f tokens/s\n", (long long)r.decode_tokens,
               r.decode_step_seconds, rate(double(r.decode_tokens), r.decode_step_seconds));
  // From each request's arrival: the first tokens include the wait for a place.
  if (r.first_token.count > 0)
    std::fprintf(out, "latency: first token median %.1f ms, p99 %.1f ms", r.first_token.median * 1e3,
                 r.first_token.p99 * 1e3);
  if (r.between_tokens.count > 0)
    std::fprintf(out, "; between tokens median %.2f ms, p99 %.2f ms", r.between_tokens.median * 1e3,
                 r.between_tokens.p99 * 1e3);
  if (r.first_token.count > 0) std::fprintf(out, "\n");
  std::fprintf(out, "time per layer type (all steps):\n");
  for (int t = 0; t < kNumLayerTypes; ++t) {
    if (!r.layer_counts[size_t(t)]) continue;
    std::fprintf(out, "  %-8s %2d layers %8.2f s  (%.2f ms per layer per step)\n",
                 std::string(layer_type_name(LayerType(t))).c_str(), r.layer_counts[size_t(t)],
                 r.layer_seconds[size_t(t)],
                 1e3 * r.layer_seconds[size_t(t)] / (r.layer_counts[size_t(t)] * std::max(1, r.steps)));
  }
  std::fprintf(out, "cache in use at its peak (%lld context tokens held):\n", (long long)r.peak_tokens_held);
  for (int t = 0; t < kNumLayerTypes; ++t)
    if (r.layer_counts[size_t(t)])
      std::fprintf(out, "  %-8s %10.2f MiB\n", std::string(layer_type_name(LayerType(t))).c_str(),
                   r.peak_cache_bytes[size_t(t)] / mib);
  const double dense = double(r.peak_tokens_held) * c.num_layers * kKvEntryBytes;
  std::fprintf(out, "  total    %10.2f MiB   (dense MLA, %d layers x 584 B per token: %.2f MiB)\n",
               r.peak_cache_total / mib, c.num_layers, dense / mib);
  // What grows with context (compressed entries, indexer keys) against what a
  // request holds at any length (its SWA window pages, the fp32 compressor rows).
  const auto group = [&](CacheGroup g) { return r.peak_group_bytes[size_t(g)] / mib; };
  std::fprintf(out,
               "  by cache: compressed entries + indexer keys %.2f MiB (grow with context); SWA window %.2f MiB and "
               "compressor state %.2f MiB (bounded per request)\n",
               group(CacheGroup::kC4A) + group(CacheGroup::kC128A), group(CacheGroup::kSwa),
               group(CacheGroup::kC4AState) + group(CacheGroup::kC128AState));
  if (r.stalled_runs > 0)
    std::fprintf(out, "cache full: %lld runs waited for pages; %d preemptions, %lld tokens computed again\n",
                 (long long)r.stalled_runs, r.preemptions, (long long)r.recomputed_tokens);
  std::fprintf(out, "finished %lld requests, %lld rejected, checksum %.6f, %lld non-finite values\n",
               (long long)r.finished, (long long)r.rejected, r.checksum, (long long)r.nonfinite_values);
  for (const auto& e : r.errors) std::fprintf(out, "  rejected: %s\n", e.c_str());
  if (r.rejected > int64_t(r.errors.size()))
    std::fprintf(out, "  (and %lld more rejected)\n", (long long)(r.rejected - int64_t(r.errors.size())));
}

// The --json destination, opened before the run so that a bad path fails
// at once; written and closed with every error checked (a full disk too).
class JsonReport {
 public:
  explicit JsonReport(const std::string& path) : path_(path) {
    if (path_.empty() || path_ == "-") return;
    file_ = std::fopen(path_.c_str(), "w");
    DSV4_REQUIRE(file_ != nullptr, "--json: cannot write '" + path_ + "': " + std::strerror(errno));
  }
  ~JsonReport() {
    if (file_) std::fclose(file_);
  }
  JsonReport(const JsonReport&) = delete;
  JsonReport& operator=(const JsonReport&) = delete;

  void write(const std::string& text) {
    if (path_.empty()) return;
    FILE* f = file_ ? file_ : stdout;
    const std::string where = file_ ? "'" + path_ + "'" : "standard output";
    errno = 0;
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
    DSV4_REQUIRE(ok, "--json: cannot write " + where + ": " + std::strerror(errno ? errno : EIO));
    if (!file_) return;
    FILE* done = std::exchange(file_, nullptr);
    DSV4_REQUIRE(std::fclose(done) == 0, "--json: cannot write " + where + ": " + std::strerror(errno));
  }

 private:
  std::string path_;
  FILE* file_ = nullptr;
};

// Half of the machine's memory: the default limit of the host caches (pages
// are allocated as requests hold them; the limit turns a workload that would
// exhaust the machine into refused requests).
int64_t default_cache_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page / 2 : int64_t(8) << 30;
}

// --gpu-memory: a fraction of the free device memory (<= 1) or a size.
double gpu_memory(const std::string& s) {
  char* end = nullptr;
  const double f = std::strtod(s.c_str(), &end);
  if (!s.empty() && end == s.c_str() + s.size() && f > 0 && f <= 1) return f;
  const int64_t bytes = parse_size(s);
  DSV4_REQUIRE(bytes > 1, "--gpu-memory '" + s + "': expected a fraction in (0, 1] or a size such as 80G");
  return double(bytes);
}

// Bytes in GiB from 1 GiB up, else in MiB (a small preset's caches are 0.00 GiB).
std::string size_text(int64_t bytes) {
  const double mib = double(bytes) / (1024.0 * 1024.0);
  char buf[32];
  if (mib >= 1024.0) std::snprintf(buf, sizeof buf, "%.2f GiB", mib / 1024.0);
  else std::snprintf(buf, sizeof buf, "%.1f MiB", mib);
  return buf;
}

void print_memory(FILE* out, const Engine& e) {
  const BackendMemory m = const_cast<Engine&>(e).backend().memory();
  std::fprintf(out, "%s memory: weights %s", e.options().device == Device::kCuda ? "device" : "host",
               size_text(m.weights).c_str());
  if (m.weight_copies > 0) std::fprintf(out, " + %s of float32 copies", size_text(m.weight_copies).c_str());
  const bool gpu = e.options().device == Device::kCuda;
  // Host arenas grow to each cache's own peak, so together they may hold more than the cap on pages in use.
  const std::string cap = gpu ? "" : " (pages in use capped at " + size_text(e.blocks().limits().max_bytes) + ")";
  std::fprintf(out, ", caches %s%s, workspace %s", size_text(m.caches).c_str(), cap.c_str(),
               size_text(m.workspace).c_str());
  if (gpu)
    std::fprintf(out, "; the caches admit %lld tokens of compressed context over %lld requests",
                 (long long)e.blocks().limits().context_tokens(e.cache_spec()),
                 (long long)e.options().workload.max_requests);
  std::fprintf(out, "\n");
}

void run_main(const RunArgs& a) {
  JsonReport json(a.json);
  FILE* const out = a.json == "-" ? stderr : stdout;  // standard output holds the JSON alone
  const ModelConfig c = pick_config(a);
  EngineOptions eo;
  eo.device = parse_device(a.device);
  eo.gpu_memory = gpu_memory(a.gpu_memory);
  // The GPU's caches are bounded by --gpu-memory already; the host's need a default.
  if (!a.cache_memory.empty()) eo.cache_bytes = parse_size(a.cache_memory);
  else if (eo.device == Device::kCpu) eo.cache_bytes = default_cache_bytes();
  note_unused_memory_option(a, eo.device);
  eo.profile = parse_profile(a.profile);
  eo.index_keys = parse_index_key_format(a.index_keys);
  if (eo.profile == Profile::kExact && a.index_keys_given) note_index_keys_unused_in_exact();
  if (eo.profile == Profile::kProduction) check_production_dims(c);
  eo.workload = CacheWorkload{a.max_running, int64_t(a.prompt) + a.gen, a.budget};
  eo.cache_weights = dense_weight_bytes(c) <= a.weight_cache_gib * 1024 * 1024 * 1024;
  std::fprintf(out, "dsv4 run: %s, %d layers (swaonly %d, c4a %d, c128a %d), hidden %d, %d heads, %s numerics, %s\n",
               c.name.c_str(), c.num_layers, c.count_layers(LayerType::kSwaOnly), c.count_layers(LayerType::kC4A),
               c.count_layers(LayerType::kC128A), c.hidden_size, c.num_heads, a.profile.c_str(),
               std::string(device_name(eo.device)).c_str());
  std::fprintf(out, "weights: %s%s\n",
               a.checkpoint.empty() ? ("synthetic, seed " + std::to_string(a.seed)).c_str() : a.checkpoint.c_str(),
               eo.cache_weights ? "" : " (dequantized per use: float32 copies would not fit --weight-cache-gib)");
  const WorkloadSource workload = make_workload(a);
  const std::string arriving =
      a.request_rate == "inf" ? "all at the start" : a.request_rate + " a second (Poisson)";
  std::fprintf(out,
               "workload: %d requests, prompts %d..%d tokens, %d decode steps each, %d tokens per step, %d running, "
               "arriving %s\n",
               a.requests, prompt_of(a, 0), prompt_of(a, a.requests - 1), a.gen, a.budget, a.max_running,
               arriving.c_str());
  std::fflush(out);
  auto engine = a.checkpoint.empty() ? Engine::from_seed(c, a.seed, eo) : Engine::from_checkpoint(c, a.checkpoint, eo);
  print_memory(out, *engine);
  Scheduler sched(SchedulerOptions{a.budget, a.max_running});
  const bool tty = isatty(fileno(stderr));
  auto progress = [&](const StepProgress& p) {
    if (!tty) return;
    std::fprintf(stderr, "\r  step %4d  %7lld tokens  %lld / %lld requests ended  %zu running ", p.step,
                 (long long)p.tokens_done, (long long)p.requests_ended, (long long)p.requests_total, p.running);
    std::fflush(stderr);
  };
  const WorkloadReport r = run_workload(*engine, sched, workload, a.seed, progress);
  if (tty) std::fprintf(stderr, "\n");
  print_report(out, r, c);
  print_memory(out, *engine);
  json.write(report_json(r, c, a, *engine).dump(2) + "\n");
  // A run that served nothing, or served NaN, did not do its job.
  DSV4_REQUIRE(r.finished > 0, "every request was rejected (" + std::to_string(r.rejected) + " rejected" +
                                   (r.errors.empty() ? ")" : "; the first: " + r.errors.front() + ")"));
  DSV4_REQUIRE(r.nonfinite_values == 0, "the outputs went non-finite: " + std::to_string(r.nonfinite_values) +
                                       " values of the hidden state were NaN or Inf (are the weights finite? "
                                       "`dsv4 inspect` lists tensors holding NaN or Inf)");
}

}  // namespace

void register_run(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "Serve a synthetic workload through the attention stack (the main job)");
  auto a = std::make_shared<RunArgs>();
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  auto* preset = cmd->add_option("--preset", a->preset, "built-in config: small (default), mini, flash, pro; not "
                                                       "with --config or --checkpoint, which bring their own")
                     ->check(CLI::IsMember({"small", "mini", "flash", "pro"}));
  auto* config = cmd->add_option("--config", a->config, "a DeepSeek-V4 config.json")->check(CLI::ExistingFile);
  auto* checkpoint =
      cmd->add_option("--checkpoint", a->checkpoint, "checkpoint directory or .safetensors file (else synthetic weights)")
          ->check(CLI::ExistingPath);
  preset->excludes(config)->excludes(checkpoint);
  cmd->add_option("--seed", a->seed, "seed of the synthetic weights and inputs")->check(any_uint64());
  cmd->add_option("--requests", a->requests, "number of requests")->check(integer_in(1, kIntMax));
  cmd->add_option("--prompt", a->prompt, "longest prompt; prompts spread over [P/2, P]")->check(integer_in(1, kIntMax));
  cmd->add_option("--gen", a->gen, "decode steps per request")->check(integer_in(0, kIntMax));
  cmd->add_option("--budget", a->budget, "tokens per step")->check(integer_in(1, kIntMax));
  cmd->add_option("--max-running", a->max_running, "requests holding cache at once")->check(integer_in(1, kIntMax));
  cmd->add_option("--request-rate", a->request_rate,
                  "requests arriving a second, a Poisson process (default inf: every request at the start)")
      ->check(rate_or_inf());
  cmd->add_option("--profile", a->profile, "numerics: production (default) or exact")
      ->check(CLI::IsMember({"exact", "production"}));
  auto* index_keys = cmd->add_option("--index-keys", a->index_keys, "indexer key cache: mxfp4 (default) or fp8")
      ->check(CLI::IsMember({"mxfp4", "fp8"}));
  cmd->add_option("--weight-cache-gib", a->weight_cache_gib, "keep float32 weight copies up to this size")
      ->check(number_at_least(0));
  cmd->add_option("--json", a->json,
                  "also write the report as JSON to FILE ('-': standard output, the text report then going to "
                  "standard error); checked before the run");
  cmd->add_option("--device", a->device, "cpu, cuda, or auto (default: the GPU where there is one)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  auto* gpu_memory =
      cmd->add_option("--gpu-memory", a->gpu_memory,
                      "cuda: device memory for weights, workspaces and caches: a fraction of the free memory "
                      "(default 0.9) or a size (e.g. 80G)");
  cmd->add_option("--cache-memory", a->cache_memory,
                  "limit of the cache pages (cpu: in use, default half the machine's memory; cuda: allocated, "
                  "within what --gpu-memory leaves); when it is reached, runs wait and the youngest request is "
                  "preempted and computed again later")
      ->check(memory_size());
  cmd->callback([a, gpu_memory, index_keys] {
    a->gpu_memory_given = gpu_memory->count() > 0;
    a->index_keys_given = index_keys->count() > 0;
    run_main(*a);
  });
}

}  // namespace dsv4::cli
