#include "attn/cpu/attend.h"

#include "attn/cpu/sgemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cache/fp8_ds_mla.h"
#include "numerics/bf16.h"

namespace dsv4 {

void attend_heads(const float* q, int num_heads, const float* keys, int n, const float* sink,
                  const AttendOptions& opt, float* out, float* lse, float* scratch) {
  constexpr int d = kKvDim;
  if (n == 0) {
    std::memset(out, 0, sizeof(float) * size_t(num_heads) * d);
    if (lse) std::fill(lse, lse + num_heads, -std::numeric_limits<float>::infinity());
    return;
  }
  // S = q K^T, fp32 accumulation; the scale is applied after the product.
  float* s = scratch;
  sgemm_nt(num_heads, n, d, q, d, keys, d, s, n);
  for (int h = 0; h < num_heads; ++h) {
    float* row = s + size_t(h) * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; ++i) m = std::max(m, row[i] *= opt.softmax_scale);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float p = std::exp(row[i] - m);
      sum += p;
      row[i] = opt.bf16_probs ? round_bf16(p) : p;
    }
    if (lse) lse[h] = m + std::log(sum);
    // The sink joins the denominator only: it has no value vector.
    const float denom = sum + std::exp(sink[h] - m);
    for (int i = 0; i < n; ++i) row[i] /= denom;
  }
  // O = P V with V = K.
  sgemm_nn(num_heads, d, n, s, n, keys, d, out, d);
}

}  // namespace dsv4
