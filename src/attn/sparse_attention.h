#pragma once
// Sparse MLA attention with a per-head sink (SPEC §4.6, numerics SPEC §5),
// reading fp8_ds_mla pages (SPEC §6) directly. One interface, two backends:
// sparse_attention_cpu (attn/cpu/) and the CUDA kernels (attn/cuda/).
//
// For query token t and head h the attended set is the SWA entries
// swa.indices[t][0 .. swa.lengths[t]) plus the extra (compressed) entries
// extra.indices[t][0 .. extra.lengths[t]). Indices are global slots
// (page * entries_per_page + offset). A slot < 0, or >= the cache's capacity,
// is an empty position: it is skipped and nothing is read for it.
//
//   s_i = (q_th . k_i) * softmax_scale
//   lse = log(sum_i exp(s_i))                      (natural log; sink excluded;
//                                                   -inf when nothing is attended)
//   o   = sum_i exp(s_i) k_i / (sum_i exp(s_i) + exp(sink_h))
// V is the full 512-dim k (RoPE dims included); an empty row gives o = 0.
#include <cstddef>
#include <cstdint>

#include "cache/pages.h"

namespace dsv4 {

// Row-major [num_tokens, width] global slots plus per-token lengths (<= width).
struct IndexList {
  const int32_t* indices = nullptr;
  const int32_t* lengths = nullptr;
  int width = 0;  // 0: no entries of this kind
};

struct SparseAttentionParams {
  int num_tokens = 0;
  int num_heads = 0;              // q heads
  const uint16_t* q = nullptr;    // [num_tokens, num_heads, 512] bf16 bits
  KvPages swa_cache;
  IndexList swa;
  KvPages extra_cache;            // compressed entries (optional)
  IndexList extra;
  const float* attn_sink = nullptr;  // [num_heads]
  float softmax_scale = 0.0f;        // 512^-0.5 for V4
  uint16_t* out = nullptr;           // [num_tokens, num_heads, 512] bf16 bits
  float* lse = nullptr;              // [num_tokens, num_heads]; may be null
};

// Validates shapes and pointers of a call; throws Error naming the problem.
// `need_q_out`: q and out are required (the exact-profile CPU variant passes
// float arrays of its own instead).
void check_sparse_attention_params(const SparseAttentionParams& p, bool need_q_out = true);

}  // namespace dsv4
