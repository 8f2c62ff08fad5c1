#pragma once
// Device building blocks of the block quantizers (SPEC §5) for kernels that
// produce an activation or a cache record and quantize it before storing it
// (the quantization fused into the producer). The scale is numerics/quant.h's
// (e4m3_exponent_of_amax) and the codes are e4m3_code's (the hardware's
// conversion gives float_to_e4m3's codes), so they equal the CPU's bit for bit.
#include <cstdint>

#include "attn/cuda/fp8_act.h"
#include "attn/cuda/warp.cuh"
#include "numerics/quant.h"

namespace dsv4::cuda {

// Two floats as two e4m3 codes (lo in the low byte) by the hardware's
// conversion (cvt.rn.satfinite.e4m3x2.f32: nearest even, magnitudes past 448
// to +-448): float_to_e4m3's codes for every float but NaN, which stays a NaN
// code (its sign may differ from the CPU's 0x7f). One ALU instruction for two
// codes where float_to_e4m3's bit arithmetic takes about nineteen a code.
__device__ __forceinline__ uint32_t e4m3x2_codes(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// One block of kLanes * 4 values held by kLanes consecutive lanes, 4 each
// (lane i of the group holds elements 4i .. 4i+3): returns the four e4m3
// codes of this lane packed little-endian (element 4i in the low byte) and
// sets `exponent` to the block's scale exponent (the same in every lane).
// kLanes = 32: a 128-wide FP8-linear block; kLanes = 16: a 64-wide KV block.
template <int kLanes>
__device__ __forceinline__ uint32_t quantize_e4m3_x4(const float (&v)[4], int& exponent) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = group_max<kLanes>(amax);
  exponent = e4m3_exponent_of_amax(amax);
  const float s = exp2_int(-exponent);  // e4m3_code's own product x * 2^-e
  return e4m3x2_codes(__fmul_rn(v[0], s), __fmul_rn(v[1], s)) |
         e4m3x2_codes(__fmul_rn(v[2], s), __fmul_rn(v[3], s)) << 16;
}

// A warp quantizes row m's 128-wide block kb of an FP8 activation: lane l
// holds elements 4l .. 4l+3 of the block (already rounded to bf16 by the
// producer when production numerics ask for it).
__device__ __forceinline__ void store_act_block(const Fp8ActOut& out, int m, int kb, const float (&v)[4]) {
  int e = 0;
  const uint32_t codes = quantize_e4m3_x4<32>(v, e);
  const int lane = threadIdx.x & 31;
  *reinterpret_cast<uint32_t*>(out.data + int64_t(m) * out.ld + kb * kActBlock + 4 * lane) = codes;
  if (lane == 0) out.scales[int64_t(kb) * out.scale_ld + m] = exp2_int(e);
}

}  // namespace dsv4::cuda
