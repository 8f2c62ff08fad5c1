#include "runtime/latency.h"

#include <algorithm>
#include <cmath>

namespace dsv4 {
namespace {

constexpr double kFloor = 1e-6;      // the first bucket's lower edge
const double kStep = std::log(1.01);  // a bucket's width, in log space

}  // namespace

void DurationHistogram::add(double seconds) {
  seconds = std::max(seconds, 0.0);
  const double b = seconds > kFloor ? std::floor(std::log(seconds / kFloor) / kStep) : 0;
  ++counts_[size_t(std::clamp(b, 0.0, double(kBuckets - 1)))];
  ++count_;
  sum_ += seconds;
  max_ = std::max(max_, seconds);
}

double DurationHistogram::quantile(double q) const {
  if (count_ == 0) return 0;
  const int64_t rank = std::max<int64_t>(1, int64_t(std::ceil(q * double(count_))));
  int64_t seen = 0;
  for (int b = 0; b < kBuckets; ++b)
    if ((seen += counts_[size_t(b)]) >= rank) return std::min(max_, kFloor * std::exp((b + 0.5) * kStep));
  return max_;
}

LatencySummary LatencySummary::of(const DurationHistogram& h) {
  return {h.count(), h.mean(), h.quantile(0.5), h.quantile(0.9), h.quantile(0.99), h.max()};
}

void TokenTimes::step_ended(const StepMetadata& s, double seconds) {
  for (const Run& r : s.runs) {
    const auto it = live_.find(r.request);
    if (it == live_.end()) continue;
    Live& l = it->second;
    // Tokens produced once positions [0, start + len) are computed.
    const int64_t tokens = std::max<int64_t>(0, r.start_pos + r.len - l.prompt_len + 1);
    if (tokens <= l.tokens) continue;  // computed again after a preemption: already sent
    // A run yields one token (its last position's): the first since the
    // request's arrival, a later one since the token before.
    (l.tokens == 0 ? first_ : between_).add(seconds - l.last);
    l.tokens = tokens, l.last = seconds;
  }
}

}  // namespace dsv4
