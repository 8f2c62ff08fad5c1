#pragma once
// Serves a synthetic workload through the whole attention stack: every step
// the scheduler's runs go through all layers as h <- h + attn(RMSNorm(h)),
// timed per layer type, with the caches' footprint tracked.
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "runtime/latency.h"
#include "runtime/scheduler.h"

namespace dsv4 {

struct WorkloadReport {
  int steps = 0;
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_step_seconds = 0;  // steps that carried prefill tokens
  double decode_step_seconds = 0;   // decode-only steps
  double total_seconds = 0;
  std::array<double, kNumLayerTypes> layer_seconds{};  // summed over layers of each type
  std::array<int, kNumLayerTypes> layer_counts{};
  std::array<size_t, kNumLayerTypes> peak_cache_bytes{};  // pages in use, per layer type
  std::array<size_t, kNumCacheGroups> peak_group_bytes{};  // the same bytes, per cache group
  size_t peak_cache_total = 0;
  int64_t peak_tokens_held = 0;    // context tokens held at that peak
  int64_t finished = 0;
  int64_t rejected = 0;             // requests dropped, before their first step or during the run
  std::vector<std::string> errors;  // why, for the first kReasonsKept of them
  static constexpr size_t kReasonsKept = 32;
  int64_t stalled_runs = 0;         // runs the caches could not hold when they came (retried)
  int preemptions = 0;              // requests sent back to position 0 to free their pages
  int64_t recomputed_tokens = 0;    // tokens those requests had served, served again
  double checksum = 0;              // mean |h| after the last layer over the finished requests'
                                    // tokens as last computed, to compare runs: the exact
                                    // profile gives it for any schedule (chunks, batches,
                                    // preemptions), production numerics to about 1e-5
  int64_t nonfinite_values = 0;     // NaN or Inf among every value computed (the checksum is then NaN)
  // From each request's arrival to its first token (the step that ends its
  // prompt), then between its tokens (one a decode step): TokenTimes.
  LatencySummary first_token, between_tokens;
};

struct StepProgress {
  int step = 0;
  int64_t tokens_done = 0;
  int64_t requests_ended = 0, requests_total = 0;  // ended: finished or rejected
  size_t running = 0;
};

// A workload's requests, made one at a time as the scheduler has room for
// them and they have arrived: a run of 2^31 requests holds a few of them at
// once, not 2^31. Arrivals do not decrease.
struct WorkloadSource {
  int64_t count = 0;
  std::function<WorkloadRequest(int64_t)> at;  // request i, called for i = 0, 1, ... count - 1 in order
};

// Seconds between arrivals at `rate` requests a second: gap i of a Poisson
// process, drawn from (seed, i).
double poisson_gap(uint64_t seed, int64_t i, double rate);

// The synthetic input of (request, position): a deterministic N(0, 1) vector.
void synthetic_embedding(uint64_t seed, int64_t request, int64_t pos, int dim, float* out);

// Serves every request of the source (or of the vector) through `engine`,
// scheduled by `scheduler`; `progress` is called after each step.
WorkloadReport run_workload(Engine& engine, Scheduler& scheduler, const WorkloadSource& requests, uint64_t seed,
                            const std::function<void(const StepProgress&)>& progress = {});
WorkloadReport run_workload(Engine& engine, Scheduler& scheduler, const std::vector<WorkloadRequest>& requests,
                            uint64_t seed, const std::function<void(const StepProgress&)>& progress = {});

}  // namespace dsv4
