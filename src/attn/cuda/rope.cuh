#pragma once
// RoPE on the device in the CPU's exact operation order (numerics/rope.cpp):
// cos/sin of a pair at a position (the layer's frequencies come by value as
// RopeFreqs, numerics/rope.h), the rotation of a pair and of a thread's four
// rotary dims. Shared by the fused elementwise ops (fused_common.cuh), the
// compressors and the attention kernels' fused output rotation.
#include <cuda_runtime.h>

#include <cstdint>

#include "attn/cuda/warp.cuh"
#include "numerics/rope.h"

namespace dsv4::cuda {

// cos and sin of pair i at position pos, as Rope::apply computes them: the
// angle a float product, cos and sin in double, each rounded to float.
// inverse: the sine negated (rotation by -angle).
__device__ __forceinline__ float2 rope_cos_sin(int64_t pos, float inv_freq, bool inverse = false) {
  const float angle = __fmul_rn(__ll2float_rn(pos), inv_freq);
  double s = 0, c = 0;
  sincos(double(angle), &s, &c);
  const float sf = __double2float_rn(s);
  return make_float2(__double2float_rn(c), inverse ? -sf : sf);
}

// Pair (a, b) rotated by cs = (cos, sin): a*c - b*s, a*s + b*c, every product rounded.
__device__ __forceinline__ void rope_rotate(float& a, float& b, float2 cs) {
  const float x0 = __fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, cs.y));
  const float x1 = __fadd_rn(__fmul_rn(a, cs.y), __fmul_rn(b, cs.x));
  a = x0;
  b = x1;
}

// A thread holding the rotary dims four at a time (quad r: dims 4r .. 4r + 3
// of the rotary part, pairs 2r and 2r + 1): its two pairs' factors, and its
// four values rotated and rounded to bf16, as the kv path and the
// compressors finish a vector.
__device__ __forceinline__ void rope_quad_factors(float2 (&cs)[2], int64_t pos, const float* inv_freq, int r) {
  cs[0] = rope_cos_sin(pos, inv_freq[2 * r]);
  cs[1] = rope_cos_sin(pos, inv_freq[2 * r + 1]);
}
__device__ __forceinline__ void rope_rotate_quad_bf16(float (&y)[4], const float2 (&cs)[2]) {
  rope_rotate(y[0], y[1], cs[0]);
  rope_rotate(y[2], y[3], cs[1]);
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = bf16_round(y[k]);
}

// A word of two bf16 (the lower one first: pair element 0) rotated by cs and
// rounded back to bf16: the output path's inverse RoPE on one pair, the same
// bits whether out_rope.cu or an attention kernel's output writes apply it.
__device__ __forceinline__ uint32_t rope_rotate_bf16x2(uint32_t w, float2 cs) {
  float a = __uint_as_float(w << 16), b = __uint_as_float(w & 0xffff0000u);
  rope_rotate(a, b, cs);
  return bf16x2_pack(a, b);
}

}  // namespace dsv4::cuda
