#pragma once
// RMSNorm (SPEC §4): y = x / sqrt(mean(x^2) + eps) * w, computed in float32
// with a double accumulator for the mean. w may be null (per-head norm).

namespace dsv4 {

void rms_norm(const float* x, const float* weight, int n, float eps, float* y);

// The per-head q norm of the production profile, in bf16 arithmetic as the
// reference runs it on bf16 tensors: every intermediate (x^2, mean, +eps,
// rsqrt, product) is rounded to bf16.
void rms_norm_bf16_arith(float* x, int n, float eps);

}  // namespace dsv4
