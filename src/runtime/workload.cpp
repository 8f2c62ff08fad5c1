#include "runtime/workload.h"

#include "common/hash.h"

#include <chrono>
#include <cmath>
#include <map>
#include <numbers>
#include <span>
#include <utility>


namespace dsv4 {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The checksum's sums: |h| per request until it finishes, then into the
// total. A preempted request's sums are dropped (its tokens are computed
// again), as are a dropped request's (they were never served).
class RequestSums {
 public:
  void add(int64_t request, std::span<const float> h) {
    Sum& s = open_[request];
    for (float v : h) s.abs += std::fabs(v);
    s.values += h.size();
  }
  void finish(int64_t request) {
    const Sum s = open_[request];
    open_.erase(request);
    total_.abs += s.abs, total_.values += s.values;
  }
  void drop(int64_t request) { open_.erase(request); }
  double mean() const { return total_.values ? total_.abs / double(total_.values) : 0; }

 private:
  struct Sum {
    double abs = 0;
    size_t values = 0;
  };
  std::map<int64_t, Sum> open_;
  Sum total_;
};

// Why a request can never be served whole (empty: it can): its last token's
// position is past the model's, or the caches could not hold it even alone.
// Planning and the caches would reject it too, but only once its prefill got
// there, after up to a million tokens of work. The caches' verdict depends on
// the request's length alone and only worsens with it (a longer request
// reaches every position a shorter one does, and the reason found for the
// shorter holds for it), so where it turns is remembered: most requests need
// no scan of the block manager.
class Servability {
 public:
  explicit Servability(const Engine& engine) : engine_(engine) {}

  std::string why_not(const WorkloadRequest& r) {
    const int64_t total = int64_t(r.prompt_len) + r.gen_len, limit = engine_.config().max_position_embeddings;
    const std::string who = "request " + std::to_string(r.id) + ": ";
    if (total > limit)
      return who + "a prompt of " + std::to_string(r.prompt_len) + " tokens and " + std::to_string(r.gen_len) +
             " generated need positions up to " + std::to_string(total - 1) + ", past max_position_embeddings (" +
             std::to_string(limit) + ")";
    const std::string cache = caches_why_not(total);
    return cache.empty() ? cache : who + cache;
  }

 private:
  std::string caches_why_not(int64_t total) {
    if (total <= fits_up_to_) return {};
    if (total >= fails_from_) return fails_why_;
    std::string why = engine_.blocks().why_never_fits(total);
    if (why.empty()) fits_up_to_ = total;
    else fails_from_ = total, fails_why_ = why;
    return why;
  }

  const Engine& engine_;
  int64_t fits_up_to_ = 0;          // every length up to this fits
  int64_t fails_from_ = INT64_MAX;  // every length from this on does not, for fails_why_
  std::string fails_why_;
};

void reject(WorkloadReport& rep, std::string why) {
  ++rep.rejected;
  if (rep.errors.size() < WorkloadReport::kReasonsKept) rep.errors.push_back(std::move(why));
}

// The caches' footprint after a step's writes, kept where it peaks.
void note_peak(const Engine& engine, WorkloadReport& rep) {
  size_t total = 0;
  std::array<size_t, kNumLayerTypes> bytes{};
  for (int t = 0; t < kNumLayerTypes; ++t)
    total += bytes[size_t(t)] = size_t(engine.blocks().bytes_in_use(LayerType(t)));
  if (total <= rep.peak_cache_total) return;
  rep.peak_cache_total = total, rep.peak_cache_bytes = bytes;
  for (CacheGroup g : kAllCacheGroups) rep.peak_group_bytes[size_t(g)] = size_t(engine.blocks().bytes_in_use(g));
  rep.peak_tokens_held = engine.blocks().tokens_held();
}

}  // namespace

void synthetic_embedding(uint64_t seed, int64_t request, int64_t pos, int dim, float* out) {
  uint64_t s = seed ^ (uint64_t(request) * 0xD1B54A32D192ED03ull) ^ (uint64_t(pos) * 0x8CB92BA72F3D8DD7ull);
  for (int i = 0; i < dim; i += 2) {  // Box-Muller, two values per draw
    const double u1 = (double(splitmix64(s) >> 11) + 1.0) * 0x1p-53, u2 = double(splitmix64(s) >> 11) * 0x1p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = float(r * std::cos(2 * std::numbers::pi * u2));
    if (i + 1 < dim) out[i + 1] = float(r * std::sin(2 * std::numbers::pi * u2));
  }
}

WorkloadReport run_workload(Engine& engine, Scheduler& scheduler, const WorkloadSource& requests, uint64_t seed,
                            const std::function<void(const StepProgress&)>& progress) {
  const ModelConfig& c = engine.config();
  const int D = c.hidden_size;
  WorkloadReport rep;
  StepProgress prog;
  prog.requests_total = requests.count;
  Servability servable(engine);
  TokenTimes times;
  int64_t next = 0;  // the source's next request
  // The scheduler's queue, kept as long as the next step could admit: a
  // request that can never be served fails alone, before any step computes a
  // token of it.
  auto top_up = [&] {
    while (next < requests.count && scheduler.wants_requests()) {
      const WorkloadRequest r = requests.at(next++);
      if (std::string why = servable.why_not(r); !why.empty()) {
        reject(rep, std::move(why));
      } else {
        scheduler.add(r);
        times.add_request(r.id, r.prompt_len);
      }
    }
  };
  for (int l = 0; l < c.num_layers; ++l) ++rep.layer_counts[size_t(c.layer_type(l))];
  const auto t_start = std::chrono::steady_clock::now();
  RequestSums sums;
  for (top_up(); !scheduler.done(); top_up()) {
    const auto t_step = std::chrono::steady_clock::now();
    ScheduledStep step = scheduler.next_step();
    for (int64_t id : step.admitted) engine.open_request(id);
    std::vector<RunError> rejected;
    const StepMetadata s = engine.plan(step.runs, rejected);
    for (const RunError& e : rejected) rep.stalled_runs += e.cache_full;
    const int T = s.num_tokens();
    std::vector<float> h(size_t(T) * D);
    for (int t = 0; t < T; ++t)
      synthetic_embedding(seed, s.runs[size_t(s.token_run()[size_t(t)])].request, s.positions()[size_t(t)], D,
                          h.data() + size_t(t) * D);
    engine.forward_step(s, h, h, &rep.layer_seconds);
    engine.commit(s);
    times.step_ended(s, seconds_since(t_start));
    note_peak(engine, rep);  // before finished requests let go
    for (float v : h) rep.nonfinite_values += !std::isfinite(v);
    for (int t = 0; t < T; ++t)
      sums.add(s.runs[size_t(s.token_run()[size_t(t)])].request, std::span<const float>(h).subspan(size_t(t) * D, D));
    const StepOutcome out = scheduler.complete(step, rejected);
    for (int64_t id : out.finished) engine.close_request(id), sums.finish(id), times.remove_request(id);
    for (int64_t id : out.preempted) engine.close_request(id), sums.drop(id);
    for (const auto& f : out.failed)
      engine.close_request(f.request), sums.drop(f.request), times.remove_request(f.request), reject(rep, f.reason);
    rep.finished += int64_t(out.finished.size());
    rep.preemptions += int(out.preempted.size());
    rep.recomputed_tokens += out.recomputed_tokens;
    const double dt = seconds_since(t_step);
    int64_t prefill = 0, decode = 0;
    for (size_t r = 0; r < s.runs.size(); ++r) (step.decode[s.input_index[r]] ? decode : prefill) += s.runs[r].len;
    rep.prefill_tokens += prefill, rep.decode_tokens += decode;
    (prefill > 0 ? rep.prefill_step_seconds : rep.decode_step_seconds) += dt;
    ++rep.steps;
    prog.step = rep.steps, prog.tokens_done += T, prog.running = scheduler.running();
    prog.requests_ended = rep.finished + rep.rejected;
    if (progress) progress(prog);
  }
  rep.total_seconds = seconds_since(t_start);
  rep.checksum = sums.mean();
  rep.first_token = LatencySummary::of(times.first_token());
  rep.between_tokens = LatencySummary::of(times.between_tokens());
  return rep;
}

WorkloadReport run_workload(Engine& engine, Scheduler& scheduler, const std::vector<WorkloadRequest>& requests,
                            uint64_t seed, const std::function<void(const StepProgress&)>& progress) {
  const WorkloadSource source{int64_t(requests.size()), [&](int64_t i) { return requests[size_t(i)]; }};
  return run_workload(engine, scheduler, source, seed, progress);
}

}  // namespace dsv4
