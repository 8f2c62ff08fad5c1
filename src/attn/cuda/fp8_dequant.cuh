#pragma once
// Device-side dequantization of fp8_ds_mla entries (SPEC §6) to bf16.
//
// Every dequantized value bf16(e4m3) * 2^k is exactly a bf16 (3 mantissa bits
// times a power of two, inside bf16's exponent range for every real scale), so
// tiles are dequantized once into bf16 shared memory and fed to bf16 tensor
// cores. The conversion avoids float32 entirely:
//  1. prmt places each e4m3 byte in the low byte of a 16-bit half and copies
//     its sign bit across the high byte;
//  2. (x << 4) & 0x87f0 keeps the sign at bit 15 and puts the 7 magnitude bits
//     at bits 10..4. Read as bf16 that is the e4m3 value times 2^-120 exactly:
//     a normal code 2^(e-7)(1+m/8) gets exponent field e, i.e.
//     2^(e-127)(1+m/8); a subnormal code m*2^-9 becomes the bf16 subnormal
//     (m/8)*2^-126;
//  3. one bf16x2 multiply by 2^(120 + scale exponent) restores the value.
// Codes 0x7f/0xff are NaN in e4m3; the kernel detects them per chunk
// (e4m3_nan_flags) and patches them on a slow path (patch_nan_codes), so
// that a corrupt cache shows up as NaN, as on the CPU.
#include <cstdint>

#include "attn/cuda/warp.cuh"

namespace dsv4::cuda {

// bf16 bits of 2^e for e in [-133, 127] (subnormals below -126); e = 128
// stands for the UE8M0 NaN byte and yields a quiet NaN.
__host__ __device__ __forceinline__ uint32_t bf16_pow2_bits(int e) {
  if (e >= 128) return 0x7fc0u;
  if (e >= -126) return uint32_t(e + 127) << 7;
  return 0x40u >> (-127 - e);  // 2^-127 = 0x0040 ... 2^-133 = 0x0001
}

// Two bf16x2 factors whose product, applied in order, multiplies a
// "times 2^-120" value by the UE8M0 scale 2^(byte-127). One factor suffices
// (f1 = 1.0) when 2^(byte-7) is a normal bf16, i.e. byte <= 134.
struct ScaleFactors {
  uint32_t f0, f1;
};

__host__ __device__ __forceinline__ ScaleFactors scale_factors(uint32_t ue8m0_byte) {
  ScaleFactors s;
  if (ue8m0_byte <= 134u) {
    const uint32_t b = (ue8m0_byte + 120u) << 7;  // 2^(byte - 7)
    s.f0 = b | (b << 16);
    s.f1 = 0x3f803f80u;  // 1.0
  } else {
    const uint32_t a = bf16_pow2_bits(120);
    const uint32_t b = bf16_pow2_bits(int(ue8m0_byte) - 127);
    s.f0 = a | (a << 16);
    s.f1 = b | (b << 16);
  }
  return s;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t d;
  // Generic prmt mode: selector nibble bit 3 replicates the selected byte's sign.
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

// Two e4m3 codes (bytes 0,1 or bytes 2,3 of w) -> bf16x2 bits times 2^-120.
__device__ __forceinline__ uint32_t e4m3x2_lo_scaled(uint32_t w) { return (prmt(w, 0x9180u) << 4) & 0x87f087f0u; }
__device__ __forceinline__ uint32_t e4m3x2_hi_scaled(uint32_t w) { return (prmt(w, 0xb3a2u) << 4) & 0x87f087f0u; }

// Nonzero iff some byte of w is an e4m3 NaN code (low 7 bits all set).
__device__ __forceinline__ uint32_t e4m3_nan_flags(uint32_t w) { return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }

// 16 e4m3 codes (one 16-byte chunk, dims in byte order) -> 16 bf16 in out[0..7]
// (out[i] holds dims 2i, 2i+1). kTwoStep selects the path for scale bytes
// above 134. NaN codes are not handled here (see e4m3_nan_flags).
template <bool kTwoStep>
__device__ __forceinline__ void dequant_chunk(const uint32_t (&w)[4], const ScaleFactors& s, uint32_t (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo = bf16x2_mul(e4m3x2_lo_scaled(w[i]), s.f0);
    uint32_t hi = bf16x2_mul(e4m3x2_hi_scaled(w[i]), s.f0);
    if (kTwoStep) {
      lo = bf16x2_mul(lo, s.f1);
      hi = bf16x2_mul(hi, s.f1);
    }
    out[2 * i] = lo;
    out[2 * i + 1] = hi;
  }
}

// Replaces the bf16 of each e4m3 NaN code (low 7 bits set) by a bf16 NaN,
// as the CPU decodes it: o holds the dequantized codes of w0, w1 (o.x: the
// two low bytes of w0, ...). Out of line: it is the slow path, and inlined
// at every chunk it made the kernel spill registers.
static __device__ __noinline__ uint4 patch_nan_codes(uint32_t w0, uint32_t w1, uint4 o) {
  uint32_t out[4] = {o.x, o.y, o.z, o.w};
  const uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t f = e4m3_nan_flags(w[i >> 1]) >> (16 * (i & 1));  // bit 8 b + 7: byte b is a NaN code
    const uint32_t mask = (((f >> 7) & 1u) * 0xffffu) | (((f >> 15) & 1u) * 0xffff0000u);
    out[i] = (out[i] & ~mask) | (0x7fc07fc0u & mask);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace dsv4::cuda
