#pragma once
// The q/kv kernel of a layer (SPEC §4.1-2, §5, §7 step 2) on the GPU: one
// kernel over the fused projection output [x wq_a^T | x wkv^T] (bf16) that
//  - q part: cq = bf16(RMSNorm(q; q_norm)), written as the FP8 activation
//    (1x128 blocks) that wq_b and indexer.wq_b read and, when asked (the
//    tests; the layer does not), as bf16;
//  - kv part: kv = bf16(RMSNorm(kv; kv_norm)), RoPE on dims 448..511 at the
//    token's position, bf16, then the fp8_ds_mla record (SPEC §6) into the
//    SWA cache at swa_slot[t] (-1, or a slot past the capacity: nothing).
// Numerics are the CPU layer's (numerics/rmsnorm.cpp rms_norm,
// numerics/rope.cpp Rope::apply, cache/fp8_ds_mla.cpp): same bits (see
// fused_common.cuh for the two rare exceptions).
//
// All pointers are device pointers except `rope` (a host object whose 32
// frequencies are passed by value). The launcher only launches (no
// allocation, no synchronisation): capturable in a CUDA graph. Bad
// parameters throw Error before anything launches.
#include <cstdint>

#include "attn/cuda/fp8_act.h"
#include "cache/pages.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4 {
class Rope;
}

namespace dsv4::cuda {

struct QkvNormRopeParams {
  int num_tokens = 0;
  int q_lora = 0;                 // multiple of 128, at most 3584 (Flash 1024, Pro 1536)
  const uint16_t* qkv = nullptr;  // [T, qkv_ld] bf16: q at [0, q_lora), kv at [q_lora, q_lora + 512)
  int64_t qkv_ld = 0;             // elements, a multiple of 4
  const float* q_norm = nullptr;  // [q_lora]
  const float* kv_norm = nullptr; // [512]
  float eps = 1e-6f;
  const int32_t* positions = nullptr;  // [T]
  const Rope* rope = nullptr;          // host object: the layer's RoPE
  uint16_t* cq = nullptr;              // [T, cq_ld] bf16 (null: not written)
  int64_t cq_ld = 0;                   // elements, a multiple of 4
  Fp8ActOut cq_fp8;                    // [T, q_lora] (data null: not written)
  KvPagesMut swa;                      // fp8_ds_mla pages
  const int32_t* swa_slot = nullptr;   // [T]
  // Tokens a CTA takes: 0 chooses by size (a CTA a token below 512 tokens,
  // else a warp a token, 2 a CTA, from 4,096 tokens 8); 1 forces a CTA a
  // token, 2, 4 or 8 a warp a token with that many a CTA (tests,
  // fused_bench). A warp a token needs
  // q_lora 1024 or 1536, 16-byte aligned rows, norm weights and cq with
  // strides a multiple of 8, and 8-byte aligned FP8 rows; otherwise a CTA
  // takes one token whatever is asked.
  int tokens_per_cta = 0;
};

void qkv_norm_rope_cuda(const QkvNormRopeParams& p, CUstream_st* stream);

// The tokens a CTA of qkv_norm_rope_cuda takes for these parameters (1: a CTA
// a token; 2, 4, 8: a warp a token).
int qkv_norm_rope_tokens_per_cta(const QkvNormRopeParams& p);

// The checks qkv_norm_rope_cuda runs first; throws Error naming the problem.
void check_qkv_norm_rope_params(const QkvNormRopeParams& p);

}  // namespace dsv4::cuda
