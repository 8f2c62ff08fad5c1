#include "runtime/workload.h"

#include "common/hash.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numbers>
#include <optional>
#include <span>
#include <thread>
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

// One run of a workload: the requests that have arrived go to the scheduler
// (as long as its queue is shorter than a step may admit), its steps go
// through every layer, and the report adds up as they end.
class WorkloadRun {
 public:
  WorkloadRun(Engine& engine, Scheduler& scheduler, const WorkloadSource& requests, uint64_t seed)
      : engine_(engine), scheduler_(scheduler), requests_(requests), seed_(seed), servable_(engine) {
    prog_.requests_total = requests.count;
    const ModelConfig& c = engine.config();
    for (int l = 0; l < c.num_layers; ++l) ++rep_.layer_counts[size_t(c.layer_type(l))];
  }

  // Gives the scheduler the requests that have arrived while it wants more.
  // One that can never be served fails alone, before any step computes a
  // token of it.
  void admit_arrived() {
    const double now = seconds_since(t_start_);
    while (scheduler_.wants_requests()) {
      if (!pending_ && next_ < requests_.count) pending_ = requests_.at(next_++);
      if (!pending_ || pending_->arrival > now) return;
      const WorkloadRequest r = *std::exchange(pending_, std::nullopt);
      if (std::string why = servable_.why_not(r); !why.empty()) {
        reject(rep_, std::move(why));
      } else {
        scheduler_.add(r);
        times_.add_request(r.id, r.prompt_len, r.arrival);
      }
    }
  }

  // With nothing to run: sleeps towards the next request's arrival (an hour
  // at most at a time); false when none is left to come.
  bool wait_for_next_arrival() const {
    if (!pending_) return false;
    const double wait = pending_->arrival - seconds_since(t_start_);
    if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(std::min(wait, 3600.0)));
    return true;
  }

  void step();
  const StepProgress& progress() const { return prog_; }

  WorkloadReport finish() {
    rep_.total_seconds = seconds_since(t_start_);
    rep_.checksum = sums_.mean();
    rep_.first_token = LatencySummary::of(times_.first_token());
    rep_.between_tokens = LatencySummary::of(times_.between_tokens());
    return std::move(rep_);
  }

 private:
  void account(const ScheduledStep& step, const StepMetadata& s, const StepOutcome& out, double seconds);

  Engine& engine_;
  Scheduler& scheduler_;
  const WorkloadSource& requests_;
  const uint64_t seed_;
  Servability servable_;
  int64_t next_ = 0;                        // the source's next request
  std::optional<WorkloadRequest> pending_;  // drawn, not yet arrived
  WorkloadReport rep_;
  StepProgress prog_;
  RequestSums sums_;
  TokenTimes times_;
  const std::chrono::steady_clock::time_point t_start_ = std::chrono::steady_clock::now();
};

// The step's synthetic inputs, on every core: at V4-Flash's width one
// token's draw takes about 60 us on one core of the development machine,
// half a GPU decode step's time at batch 8.
std::vector<float> draw_inputs(const StepMetadata& s, uint64_t seed, int D) {
  const int T = s.num_tokens();
  std::vector<float> h(size_t(T) * D);
#pragma omp parallel for schedule(static) if (int64_t(T) * D >= (1 << 16))
  for (int t = 0; t < T; ++t)
    synthetic_embedding(seed, s.runs[size_t(s.token_run()[size_t(t)])].request, s.positions()[size_t(t)], D,
                        h.data() + size_t(t) * D);
  return h;
}

void WorkloadRun::step() {
  // Timed: the plan, the layers and the commit, not the drawing of inputs a
  // server would have from its embedding table.
  const auto t_plan = std::chrono::steady_clock::now();
  const int D = engine_.config().hidden_size;
  ScheduledStep step = scheduler_.next_step();
  for (int64_t id : step.admitted) engine_.open_request(id);
  std::vector<RunError> rejected;
  const StepMetadata s = engine_.plan(step.runs, rejected);
  for (const RunError& e : rejected) rep_.stalled_runs += e.cache_full;
  double seconds = seconds_since(t_plan);
  const int T = s.num_tokens();
  std::vector<float> h = draw_inputs(s, seed_, D);
  const auto t_forward = std::chrono::steady_clock::now();
  engine_.forward_step(s, h, h, &rep_.layer_seconds);
  engine_.commit(s);
  seconds += seconds_since(t_forward);
  times_.step_ended(s, seconds_since(t_start_));
  note_peak(engine_, rep_);  // before finished requests let go
  for (float v : h) rep_.nonfinite_values += !std::isfinite(v);
  for (int t = 0; t < T; ++t)
    sums_.add(s.runs[size_t(s.token_run()[size_t(t)])].request, std::span<const float>(h).subspan(size_t(t) * D, D));
  const StepOutcome out = scheduler_.complete(step, rejected);
  for (int64_t id : out.finished) engine_.close_request(id), sums_.finish(id), times_.remove_request(id);
  for (int64_t id : out.preempted) engine_.close_request(id), sums_.drop(id);
  for (const auto& f : out.failed)
    engine_.close_request(f.request), sums_.drop(f.request), times_.remove_request(f.request), reject(rep_, f.reason);
  account(step, s, out, seconds);
}

void WorkloadRun::account(const ScheduledStep& step, const StepMetadata& s, const StepOutcome& out, double seconds) {
  rep_.finished += int64_t(out.finished.size());
  rep_.preemptions += int(out.preempted.size());
  rep_.recomputed_tokens += out.recomputed_tokens;
  int64_t prefill = 0, decode = 0;
  for (size_t r = 0; r < s.runs.size(); ++r) (step.decode[s.input_index[r]] ? decode : prefill) += s.runs[r].len;
  rep_.prefill_tokens += prefill, rep_.decode_tokens += decode;
  (prefill > 0 ? rep_.prefill_step_seconds : rep_.decode_step_seconds) += seconds;
  ++rep_.steps;
  prog_.step = rep_.steps, prog_.tokens_done += s.num_tokens(), prog_.running = scheduler_.running();
  prog_.requests_ended = rep_.finished + rep_.rejected;
}

}  // namespace

double poisson_gap(uint64_t seed, int64_t i, double rate) {
  uint64_t st = seed ^ 0xA0761D6478BD642Full ^ (uint64_t(i) * 0x9E3779B97F4A7C15ull);
  const double u = (double(splitmix64(st) >> 11) + 1.0) * 0x1p-53;  // in (0, 1]
  return -std::log(u) / rate;
}

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
  WorkloadRun run(engine, scheduler, requests, seed);
  while (true) {
    run.admit_arrived();
    if (scheduler.done()) {
      if (!run.wait_for_next_arrival()) break;  // every request served or rejected
      continue;
    }
    run.step();
    if (progress) progress(run.progress());
  }
  return run.finish();
}

WorkloadReport run_workload(Engine& engine, Scheduler& scheduler, const std::vector<WorkloadRequest>& requests,
                            uint64_t seed, const std::function<void(const StepProgress&)>& progress) {
  const WorkloadSource source{int64_t(requests.size()), [&](int64_t i) { return requests[size_t(i)]; }};
  return run_workload(engine, scheduler, source, seed, progress);
}

}  // namespace dsv4
