#pragma once
// Interleaved rotary position embedding on the last 64 dims of a vector
// (SPEC §4): pair (2i, 2i+1) rotates by p * theta_i. C4A/C128A layers use base
// 160000 with YaRN frequency interpolation, SWA-only layers base 10000 plain.
#include <array>
#include <cstddef>
#include <cstdint>

namespace dsv4 {

inline constexpr int kRopeDim = 64;

struct YarnParams {
  double factor = 16;
  int64_t original_max_position = 65536;
  double beta_fast = 32;
  double beta_slow = 1;
};

struct RopeParams {
  double base = 10000;
  bool yarn = false;
  YarnParams yarn_params;
};

// The 32 frequencies by value: what kernels and the indexer's parameters take.
struct RopeFreqs {
  float inv_freq[kRopeDim / 2] = {};
};

class Rope {
 public:
  explicit Rope(const RopeParams& params);

  // Rotates x[0..63] in place by angle pos * theta_i (by -pos * theta_i when inverse).
  void apply(float* x, int64_t pos, bool inverse = false) const;

  // theta_i (after YaRN), i = 0..31.
  const std::array<float, kRopeDim / 2>& inv_freq() const { return inv_freq_; }
  RopeFreqs freqs() const {
    RopeFreqs f;
    for (int i = 0; i < kRopeDim / 2; ++i) f.inv_freq[i] = inv_freq_[std::size_t(i)];
    return f;
  }

  // YaRN ramp bounds lo/hi for these params (only meaningful with yarn).
  static int yarn_low(const RopeParams& p);
  static int yarn_high(const RopeParams& p);

 private:
  std::array<float, kRopeDim / 2> inv_freq_{};
};

}  // namespace dsv4
