#include "numerics/rmsnorm.h"

#include <cmath>

#include "numerics/bf16.h"

namespace dsv4 {

void rms_norm(const float* x, const float* weight, int n, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float inv = float(1.0 / std::sqrt(float(ss / n) + double(eps)));
  for (int i = 0; i < n; ++i) y[i] = weight ? (x[i] * inv) * weight[i] : x[i] * inv;
}

void rms_norm_bf16_arith(float* x, int n, float eps) {
  float sum = 0;  // the mean of bf16 squares accumulates in float32
  for (int i = 0; i < n; ++i) sum += round_bf16(x[i] * x[i]);
  const float mean = round_bf16(sum / float(n));
  const float inv = round_bf16(1.0f / std::sqrt(round_bf16(mean + eps)));
  for (int i = 0; i < n; ++i) x[i] = round_bf16(x[i] * inv);
}

}  // namespace dsv4
