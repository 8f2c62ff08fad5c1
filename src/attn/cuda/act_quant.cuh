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

// The largest magnitude of four values (fmaxf: a NaN never wins over a number).
__device__ __forceinline__ float amax4(const float (&v)[4]) {
  return fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
}

// Four values times s (e4m3_code's own product x * 2^-e) as e4m3 codes,
// packed little-endian.
__device__ __forceinline__ uint32_t e4m3x4_codes(const float (&v)[4], float s) {
  return e4m3x2_codes(__fmul_rn(v[0], s), __fmul_rn(v[1], s)) |
         e4m3x2_codes(__fmul_rn(v[2], s), __fmul_rn(v[3], s)) << 16;
}

// One block of values held by kLanes consecutive lanes, kQuads quads of 4
// consecutive elements each (lane i of the group holds elements 4kQuads i
// and on): sets this lane's codes (each quad's four e4m3 codes packed
// little-endian, the lowest element in the low byte) and `exponent` to the
// block's scale exponent (the same in every lane). The block's maximum does
// not depend on how its elements are grouped, so any kQuads gives the same
// scale and codes. kLanes * 4 kQuads = 128: an FP8-linear block; 64: a KV block.
template <int kLanes, int kQuads>
__device__ __forceinline__ void quantize_e4m3_quads(const float (&v)[kQuads][4], int& exponent,
                                                    uint32_t (&codes)[kQuads]) {
  float amax = amax4(v[0]);
#pragma unroll
  for (int q = 1; q < kQuads; ++q) amax = fmaxf(amax, amax4(v[q]));
  exponent = e4m3_exponent_of_amax(group_max<kLanes>(amax));
  const float s = exp2_int(-exponent);  // e4m3_code's own product x * 2^-e
#pragma unroll
  for (int q = 0; q < kQuads; ++q) codes[q] = e4m3x4_codes(v[q], s);
}

// One quad a lane: returns its four codes.
template <int kLanes>
__device__ __forceinline__ uint32_t quantize_e4m3_x4(const float (&v)[4], int& exponent) {
  const float q[1][4] = {{v[0], v[1], v[2], v[3]}};
  uint32_t codes[1];
  quantize_e4m3_quads<kLanes>(q, exponent, codes);
  return codes[0];
}

// 1, 2 or 4 words to dst (aligned to their size) in one store.
template <int kWords>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kWords]) {
  if constexpr (kWords == 1)
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  else if constexpr (kWords == 2)
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Row m's columns col .. col + 4kQuads - 1 of an FP8 activation (this lane's
// quads, already rounded to bf16 by the producer when production numerics ask
// for it): 32 / kQuads consecutive lanes hold a 128-wide block and call
// together (one quad a lane: a warp a block; two: a half warp).
template <int kQuads>
__device__ __forceinline__ void store_act_piece(const Fp8ActOut& out, int m, int col, const float (&v)[kQuads][4]) {
  constexpr int kLanes = kActBlock / (4 * kQuads);
  int e = 0;
  uint32_t codes[kQuads];
  quantize_e4m3_quads<kLanes>(v, e, codes);
  store_words(out.data + int64_t(m) * out.ld + col, codes);
  if (threadIdx.x % kLanes == 0) out.scales[int64_t(col / kActBlock) * out.scale_ld + m] = exp2_int(e);
}

// A warp quantizes row m's 128-wide block kb: lane l holds elements 4l .. 4l+3.
__device__ __forceinline__ void store_act_block(const Fp8ActOut& out, int m, int kb, const float (&v)[4]) {
  const float q[1][4] = {{v[0], v[1], v[2], v[3]}};
  store_act_piece<1>(out, m, kb * kActBlock + 4 * int(threadIdx.x & 31), q);
}

}  // namespace dsv4::cuda
