#pragma once
// Token latencies as a client of the server would see them, the figures
// vLLM's serving benchmark reports: the time to a request's first token and
// the time between its later tokens, each request timed from its arrival
// (`dsv4 run --request-rate`; all at the start by default, as vLLM's
// `--request-rate inf`).
#include <array>
#include <cstdint>
#include <map>

#include "step/step.h"

namespace dsv4 {

// Quantiles of a stream of durations in bounded memory: counts in buckets
// 1% wide (log-spaced from 1 us to 32 hours; longer ones count in the last),
// so a quantile is within 1% of the true one; the mean and the largest are
// exact.
class DurationHistogram {
 public:
  void add(double seconds);
  int64_t count() const { return count_; }
  double mean() const { return count_ ? sum_ / double(count_) : 0; }
  double max() const { return max_; }
  // The q-quantile (0 < q <= 1): the geometric middle of the bucket where the
  // cumulative count reaches q * count (0 when empty).
  double quantile(double q) const;

 private:
  static constexpr int kBuckets = 2560;
  std::array<int64_t, kBuckets> counts_{};
  int64_t count_ = 0;
  double sum_ = 0, max_ = 0;
};

struct LatencySummary {
  int64_t count = 0;
  double mean = 0, median = 0, p90 = 0, p99 = 0, max = 0;  // seconds
  static LatencySummary of(const DurationHistogram& h);
};

// Per request, the tokens it has produced: one when its prompt ends, one
// more per decode token. A preempted request computes its tokens again, but
// they were already sent: only a position past the furthest it reached
// yields a token, and that token's gap includes the recomputation.
class TokenTimes {
 public:
  // A request that arrived at `arrival` seconds from the run's start.
  void add_request(int64_t id, int prompt_len, double arrival) { live_[id] = {prompt_len, 0, arrival}; }
  void remove_request(int64_t id) { live_.erase(id); }
  // A step's accepted runs ended at `seconds` from the run's start.
  void step_ended(const StepMetadata& s, double seconds);
  const DurationHistogram& first_token() const { return first_; }
  const DurationHistogram& between_tokens() const { return between_; }

 private:
  struct Live {
    int prompt_len = 0;
    int64_t tokens = 0;  // produced so far
    double last = 0;     // when the last of them came (before the first: the arrival)
  };
  std::map<int64_t, Live> live_;
  DurationHistogram first_, between_;
};

}  // namespace dsv4
