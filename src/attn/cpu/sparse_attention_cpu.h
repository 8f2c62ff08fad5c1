#pragma once
// The CPU backend of the sparse-attention interface (attn/sparse_attention.h).
#include "attn/sparse_attention.h"

namespace dsv4 {

// Production numerics of SPEC §5, reading fp8_ds_mla pages: q.k with bf16
// operands and fp32 accumulation, scale applied after; exp in fp32;
// probabilities rounded to bf16 before P.V while the denominator sums the fp32
// values; output rounded to bf16. The twin of the CUDA kernels. Host pointers.
void sparse_attention_cpu(const SparseAttentionParams& p);

// The exact profile's variant: q and out are float arrays [T, H, 512] (p.q and
// p.out unused), the caches hold float32 entries (512 floats each), nothing is
// rounded.
void sparse_attention_exact_cpu(const SparseAttentionParams& p, const float* q, float* out);

// Page stride of a float32 cache of 512-dim entries.
constexpr size_t f32_kv_page_stride(int entries_per_page) { return sizeof(float) * 512 * size_t(entries_per_page); }

}  // namespace dsv4
