#pragma once
// Warp-level building blocks shared by the CUDA ops: reductions over groups
// of lanes and bf16 conversions with the CPU's rounding (numerics/bf16.h).
#include <cuda_bf16.h>

#include <cstdint>

#include "numerics/bf16.h"

namespace dsv4::cuda {

// Word i of v, for an i that may vary by thread (no indexed array: it would
// live in local memory).
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Reductions over aligned groups of kLanes consecutive lanes (a power of two
// <= 32); every lane of the group gets the result. The order of the
// additions is fixed, so results are reproducible run to run.
template <int kLanes = 32>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int kLanes = 32>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int kLanes = 32>
__device__ __forceinline__ double group_sum(double v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// bf16 bits <-> float, and float rounded to bf16 by the hardware's conversion
// (cvt.rn.bf16x2.f32, one ALU instruction, where dsv4::bf16_bits's integer
// rounding and NaN test take six or seven, and cvt.rn.bf16.f32 runs on the
// slower conversion pipe; the elementwise kernels round every value two or
// three times and were bound by those instructions, BI3). For every float but
// NaN the bits are dsv4::bf16_bits's: nearest even, subnormals and infinities
// included. A NaN stays a NaN, as the canonical 0x7fff where the CPU keeps its
// payload.
__device__ __forceinline__ float bf16_load(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }
// Two floats as one bf16x2 word (lo at the lower address).
__device__ __forceinline__ uint32_t bf16x2_pack(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// Eight floats, as two quads, as 16 bytes of bf16 (v[0][0] first).
__device__ __forceinline__ uint4 bf16x8_pack(const float (&v)[2][4]) {
  return make_uint4(bf16x2_pack(v[0][0], v[0][1]), bf16x2_pack(v[0][2], v[0][3]), bf16x2_pack(v[1][0], v[1][1]),
                    bf16x2_pack(v[1][2], v[1][3]));
}
__device__ __forceinline__ uint16_t bf16_store(float v) { return uint16_t(bf16x2_pack(v, 0.0f)); }
// v rounded, as a float: its bf16 in the upper half of the word, zeros below.
__device__ __forceinline__ float bf16_round(float v) { return __uint_as_float(bf16x2_pack(0.0f, v)); }

// The halves of a bf16x2 word as floats (low half: the lower address).
__device__ __forceinline__ float bf16x2_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Both halves multiplied and rounded once to bf16 (the product of two bf16
// values is exact in fp32, so this is bf16(fp32(a * b))).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

}  // namespace dsv4::cuda
