#pragma once
// Float64 reference of sparse attention with sink (SPEC §4.6) for the tests of
// every backend of attn/sparse_attention.h. Plain C++ on host pointers, no
// BLAS: it decodes each attended fp8_ds_mla entry with the project's codec and
// computes one token at a time, so that a test can spread tokens over threads.
//
// For token t and head h, with the attended entries k_i (SWA list first, then
// the extra list; empty or out-of-range slots skipped, lengths clamped to
// [0, width]):
//   s_i = (q . k_i) * softmax_scale                 (double)
//   m   = max_i s_i,  e_i = exp(s_i - m),  Z = sum_i e_i
//   lse = m + log(Z)                                (-inf when nothing is attended)
//   o   = sum_i p_i k_i / (Z + exp(sink_h - m)),    p_i = bf16(e_i) or e_i
// With bf16_probs (production numerics, SPEC §5) each e_i is rounded to bf16
// before P.V while Z sums the unrounded values, like the CPU backend. q is
// read as bf16 and every decoded entry is exact in float, so the only
// deliberate rounding is that of the probabilities.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "attn/sparse_attention.h"
#include "cache/fp8_ds_mla.h"
#include "numerics/bf16.h"

namespace dsv4::test {

struct ReferenceOptions {
  bool bf16_probs = true;
};

// Appends the decoded entries of token t's list to `keys` (kKvDim floats each).
inline void reference_gather(const KvPages& cache, const IndexList& list, int t, std::vector<float>& keys) {
  if (list.width <= 0) return;
  int len = list.lengths[t];
  len = len < 0 ? 0 : (len > list.width ? list.width : len);
  const int32_t* idx = list.indices + size_t(t) * size_t(list.width);
  for (int i = 0; i < len; ++i) {
    const int64_t slot = idx[i];
    if (slot < 0 || slot >= cache.capacity()) continue;  // empty position
    const uint8_t* page = cache.base + size_t(slot / cache.entries_per_page) * cache.page_stride;
    keys.resize(keys.size() + kKvDim);
    fp8_ds_mla_decode(page, cache.entries_per_page, int(slot % cache.entries_per_page), keys.data() + keys.size() - kKvDim);
  }
}

// out: [num_heads * 512] for token t; lse: [num_heads].
inline void reference_sparse_attention_token(const SparseAttentionParams& p, int t, const ReferenceOptions& opt,
                                             double* out, double* lse) {
  std::vector<float> keys;
  reference_gather(p.swa_cache, p.swa, t, keys);
  reference_gather(p.extra_cache, p.extra, t, keys);
  const size_t n = keys.size() / kKvDim;
  std::vector<double> s(n), q(kKvDim);
  for (int h = 0; h < p.num_heads; ++h) {
    const uint16_t* qh = p.q + (size_t(t) * p.num_heads + h) * kKvDim;
    for (int d = 0; d < kKvDim; ++d) q[d] = bf16_to_float(qh[d]);
    double* oh = out + size_t(h) * kKvDim;
    for (int d = 0; d < kKvDim; ++d) oh[d] = 0.0;
    if (n == 0) {
      lse[h] = -std::numeric_limits<double>::infinity();
      continue;
    }
    double m = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
      const float* k = keys.data() + i * kKvDim;
      double dot = 0.0;
      for (int d = 0; d < kKvDim; ++d) dot += q[d] * double(k[d]);
      s[i] = dot * double(p.softmax_scale);
      m = s[i] > m ? s[i] : m;
    }
    double z = 0.0;
    for (size_t i = 0; i < n; ++i) {
      const double e = std::exp(s[i] - m);
      z += e;
      s[i] = opt.bf16_probs ? double(round_bf16(float(e))) : e;
    }
    lse[h] = m + std::log(z);
    // The sink joins the denominator only: it has no value vector.
    const double denom = z + std::exp(double(p.attn_sink[h]) - m);
    for (size_t i = 0; i < n; ++i) {
      const float* k = keys.data() + i * kKvDim;
      const double w = s[i] / denom;
      for (int d = 0; d < kKvDim; ++d) oh[d] += w * double(k[d]);
    }
  }
}

}  // namespace dsv4::test
