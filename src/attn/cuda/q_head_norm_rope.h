#pragma once
// The per-head q norm and RoPE (SPEC §4.1, §5) on the GPU, in place on the
// wq_b output q, bf16 [T, H * 512]: for every (token, head), the production
// per-head norm in bf16 arithmetic (numerics/rmsnorm.cpp rms_norm_bf16_arith:
// its fp32 sum of bf16 squares runs over the 512 dims in order, one thread
// per head, so the bits match), then RoPE on dims 448..511 at the token's
// position (numerics/rope.cpp Rope::apply) and bf16. The result is the sparse
// attention kernel's q [T, H, 512].
//
// All pointers are device pointers except `rope` (a host object whose 32
// frequencies are passed by value). Launch only (CUDA-graph capturable); bad
// parameters throw Error before anything launches.
#include <cstdint>

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4 {
class Rope;
}

namespace dsv4::cuda {

struct QHeadNormRopeParams {
  int num_tokens = 0;
  int num_heads = 0;
  uint16_t* q = nullptr;  // [T, q_ld] bf16, head h at columns h*512 .. h*512 + 511; in place
  int64_t q_ld = 0;       // elements: >= num_heads * 512, a multiple of 8 (16-byte rows)
  float eps = 1e-6f;
  const int32_t* positions = nullptr;  // [T]
  const Rope* rope = nullptr;          // host object: the layer's RoPE
  // Optional: out_rope_table_cuda's table for these positions and this RoPE
  // ([T][32] of (cos, -sin), 16-byte aligned). The kernel then reads the
  // rotation's factors (sin negated back: the same bits) instead of running
  // a double-precision sincos per (row, pair), 2,048 per token at 64 heads
  // where 32 are distinct, whose code takes the kernel to 46 registers (5
  // CTAs an SM: two waves at 128 tokens). Null: computed.
  const float* rope_table = nullptr;
};

void q_head_norm_rope_cuda(const QHeadNormRopeParams& p, CUstream_st* stream);

// The checks q_head_norm_rope_cuda runs first; throws Error naming the problem.
void check_q_head_norm_rope_params(const QHeadNormRopeParams& p);

}  // namespace dsv4::cuda
