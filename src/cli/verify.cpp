// dsv4 verify DIR CASE [--profile exact|production]: replays a golden case
// (SPEC §10) and reports per layer and call how far each tensor is. Without
// --profile a case replays in its own numerics: exact where its "precision"
// is float32 (`mini`), production otherwise (`mini-fp8`).
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <tuple>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/options.h"
#include "common/error.h"
#include "runtime/golden_replay.h"

namespace dsv4::cli {
namespace {

struct VerifyArgs {
  std::string dir, name, profile, index_keys = "mxfp4", device = "cpu";  // profile: empty = the case's
  int max_chunk = 0;
  bool sequential = false, verbose = false, index_keys_given = false;
};

// One cell: "-" where the golden holds no such tensor, "nan" where a value was
// not finite, "size" where ours and the golden's differ in size.
std::string cell(const ReplayMetric* m, const char* format) {
  if (!m) return "-";
  if (m->size_mismatch) return "size";
  if (std::isnan(m->value)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, format, m->value);
  return buf;
}

void print_table(const ReplayResult& r, const GoldenCase& gc) {
  // One line per (request, call, layer): the distances of every tensor compared.
  std::printf("%-4s %-5s %-5s %-6s %10s %10s %10s %10s %10s %10s %8s\n", "req", "call", "layer", "type", "output", "kv",
              "q", "attn", "compressed", "idx_keys", "topk");
  std::map<std::tuple<int, int, int>, std::map<std::string, const ReplayMetric*>> rows;
  for (const auto& m : r.metrics) rows[{m.request, m.call, m.layer}][m.tensor] = &m;
  for (const auto& [key, vals] : rows) {
    const auto [req, call, layer] = key;
    std::printf("r%-3d c%-4d l%-4d %-6s", req, call, layer,
                std::string(layer_type_name(gc.config.layer_type(layer))).c_str());
    auto find = [&](const char* t) -> const ReplayMetric* {
      const auto it = vals.find(t);
      return it == vals.end() ? nullptr : it->second;
    };
    for (const char* t : {"output", "kv", "q", "attn", "compressed", "index_keys"})
      std::printf(" %10s", cell(find(t), "%.2e").c_str());
    std::printf(" %8s\n", cell(find("topk"), "%.4f").c_str());
  }
}

void print_summary(const ReplayResult& r) {
  std::printf("\n%-11s %6s %10s %10s %10s %10s %11s\n", "tensor", "n", "median", "p90", "p99", "max", "non-finite");
  for (const char* t : {"output", "kv", "q", "attn", "compressed", "index_keys"}) {
    const MetricSummary s = summarize(r.metrics, t);
    if (s.count)
      std::printf("%-11s %6lld %10.2e %10.2e %10.2e %10.2e %11lld\n", t, (long long)s.count, s.median, s.p90, s.p99,
                  s.max, (long long)s.nonfinite_values);
  }
  const MetricSummary k = summarize(r.metrics, "topk");
  if (k.count) std::printf("%-11s %6lld  overlap %.5f over all picks\n", "topk", (long long)k.count, k.topk_overlap);
  int64_t nonfinite = 0, mismatched = 0;
  for (const auto& m : r.metrics) nonfinite += m.nonfinite, mismatched += m.size_mismatch;
  if (nonfinite) std::printf("%lld values were not finite (NaN or Inf)\n", (long long)nonfinite);
  if (mismatched) std::printf("%lld tensors differ in size from the golden's\n", (long long)mismatched);
}

int run_verify(const VerifyArgs& a) {
  const GoldenCase gc = load_golden_case(a.dir, a.name);
  const bool chosen = !a.profile.empty();
  const std::string profile = chosen ? a.profile : gc.precision == "float32" ? "exact" : "production";
  ReplayOptions opt;
  opt.profile = parse_profile(profile);
  opt.index_keys = parse_index_key_format(a.index_keys);
  opt.max_chunk = a.max_chunk;
  opt.lockstep = !a.sequential;
  // The GPU runs production numerics only: auto picks the CPU for the exact profile.
  const bool exact = opt.profile == Profile::kExact;
  DSV4_REQUIRE(!exact || a.device != "cuda",
               chosen ? "--device cuda: the GPU runs production numerics only; the exact profile is CPU-only"
                      : "--device cuda: case " + a.name + " is float32, replayed in the exact profile, which is "
                            "CPU-only (the GPU runs production numerics): replay it on the CPU, or pass --profile "
                            "production to measure production numerics against it");
  opt.device = exact ? Device::kCpu : parse_device(a.device);
  const std::string whose = chosen ? "" : exact ? " (the case is float32)" : " (the default for a case not float32)";
  if (exact && a.index_keys_given) note_index_keys_unused_in_exact();
  const std::string caches = exact ? "float32 caches" : "indexer keys " + a.index_keys;
  std::printf("verify %s (%zu requests), profile %s%s, %s, %s, on %s\n", a.name.c_str(),
              gc.requests.size(), profile.c_str(), whose.c_str(), caches.c_str(),
              opt.lockstep ? "requests batched in lockstep" : "one request at a time",
              std::string(device_name(opt.device)).c_str());
  const ReplayResult r = replay_golden(gc, opt);
  if (a.verbose) print_table(r, gc);
  print_summary(r);
  const std::string why = judge_replay(r, opt.profile);
  std::printf("\n%s: %s (%d steps)\n", why.empty() ? "PASS" : "FAIL", why.empty() ? "within tolerance" : why.c_str(),
              r.steps);
  return why.empty() ? 0 : 1;
}

}  // namespace

void register_verify(CLI::App& app) {
  auto* cmd = app.add_subcommand("verify", "Replay a golden case through the stack and compare every tensor");
  auto a = std::make_shared<VerifyArgs>();
  cmd->add_option("dir", a->dir, "directory of the golden files")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("case", a->name, "case name, e.g. mini or mini-fp8")->required();
  cmd->add_option("--profile", a->profile,
                  "numerics: exact or production (default: the case's own, exact for a float32 case such as mini)")
      ->check(CLI::IsMember({"exact", "production"}));
  auto* index_keys = cmd->add_option("--index-keys", a->index_keys, "indexer key cache format: mxfp4 or fp8")
                         ->check(CLI::IsMember({"mxfp4", "fp8"}));
  cmd->add_option("--max-chunk", a->max_chunk, "split calls into runs of at most this many tokens (0: whole calls)")
      ->check(integer_in(0, std::numeric_limits<int32_t>::max()));
  cmd->add_flag("--sequential", a->sequential, "one request per step instead of batching them in lockstep");
  cmd->add_option("--device", a->device, "cpu (default), cuda or auto (the GPU where there is one, for production numerics)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_flag("-v,--verbose", a->verbose, "print every (request, call, layer)");
  cmd->callback([a, index_keys] {
    a->index_keys_given = index_keys->count() > 0;
    const int rc = run_verify(*a);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace dsv4::cli
