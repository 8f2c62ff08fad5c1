#pragma once
// The inverse RoPE of the attention output (SPEC §4.7) on the GPU, in place
// on o, bf16 [T, H, 512]: dims 448..511 of every head rotated by -pos
// (numerics/rope.cpp Rope::apply with inverse = true), then bf16; dims
// 0..447 are neither read nor written. wo_a, the FP8 quantization and wo_b
// follow (the linears).
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

struct OutInverseRopeParams {
  int num_tokens = 0;
  int num_heads = 0;
  uint16_t* o = nullptr;  // [T, o_ld] bf16, head h at columns h*512 .. h*512 + 511; in place
  int64_t o_ld = 0;       // elements: >= num_heads * 512, a multiple of 8 (16-byte rows)
  const int32_t* positions = nullptr;  // [T]
  const Rope* rope = nullptr;          // host object: the layer's RoPE
};

void out_inverse_rope_cuda(const OutInverseRopeParams& p, CUstream_st* stream);

// The factors of that rotation for a step, once for all layers sharing the
// RoPE: table[(t * 32 + i) * 2 + {0, 1}] = (cos, -sin) of pair i at
// positions[t], as out_inverse_rope_cuda computes them. The attention
// kernels read it when they apply the rotation themselves (OutputRope in
// sparse_attention_cuda.h). table: device, 16-byte aligned, num_tokens * 64 floats.
void out_rope_table_cuda(const int32_t* positions, int num_tokens, const Rope& rope, float* table,
                         CUstream_st* stream);

// The checks out_inverse_rope_cuda runs first; throws Error naming the problem.
void check_out_inverse_rope_params(const OutInverseRopeParams& p);

}  // namespace dsv4::cuda
