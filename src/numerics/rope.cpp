#include "numerics/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace dsv4 {
namespace {

// Dimension index whose wavelength makes `rotations` turns over the original context.
double correction_dim(double rotations, const RopeParams& p) {
  return kRopeDim * std::log(double(p.yarn_params.original_max_position) / (rotations * 2 * std::numbers::pi)) /
         (2 * std::log(p.base));
}

}  // namespace

int Rope::yarn_low(const RopeParams& p) {
  return std::max(int(std::floor(correction_dim(p.yarn_params.beta_fast, p))), 0);
}

int Rope::yarn_high(const RopeParams& p) {
  return std::min(int(std::ceil(correction_dim(p.yarn_params.beta_slow, p))), kRopeDim - 1);
}

Rope::Rope(const RopeParams& p) {
  // Computed in float32 like the reference: theta_i = 1 / base^(2i/64).
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const float exponent = float(2 * i) / float(kRopeDim);
    inv_freq_[i] = 1.0f / std::pow(float(p.base), exponent);
  }
  if (!p.yarn) return;
  const int lo = yarn_low(p);
  int hi = yarn_high(p);
  const float span = hi == lo ? 0.001f : float(hi - lo);
  const float factor = float(p.yarn_params.factor);
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const float ramp = std::clamp((float(i) - float(lo)) / span, 0.0f, 1.0f);
    inv_freq_[i] = inv_freq_[i] / factor * ramp + inv_freq_[i] * (1.0f - ramp);
  }
}

void Rope::apply(float* x, int64_t pos, bool inverse) const {
  for (int i = 0; i < kRopeDim / 2; ++i) {
    // The angle is a float32 product, as in the reference's freqs table.
    const float angle = float(pos) * inv_freq_[i];
    const float c = float(std::cos(double(angle)));
    const float s = inverse ? -float(std::sin(double(angle))) : float(std::sin(double(angle)));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

}  // namespace dsv4
