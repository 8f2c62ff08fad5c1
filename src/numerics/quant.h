#pragma once
// Block quantizers of SPEC §5: each block of values shares one power-of-two
// scale s = 2^ceil(log2(max(amax, floor) / qmax)); elements are x / s rounded
// to the element format (e4m3 or e2m1).
#include <bit>
#include <cstddef>
#include <cstdint>

#include "numerics/e2m1.h"
#include "numerics/e4m3.h"
#include "numerics/ue8m0.h"

namespace dsv4 {

// Floors of the scale rule (SPEC §5).
inline constexpr float kFp8AmaxFloor = 1e-4f;
inline constexpr float kFp4AmaxFloor = 6.0f * 1.1754943508222875e-38f;  // 6 * 2^-126

// Block widths used by the stack.
inline constexpr int kKvQuantBlock = 64;     // KV cache dims 0..447
inline constexpr int kGemmQuantBlock = 128;  // FP8 linear inputs
inline constexpr int kFp4QuantBlock = 32;    // MXFP4 indexer q/k

// 2^e as a float, built from bits: exact for e in [-149, 127] (subnormal
// below -126), +inf above, 0 below (what ldexp(1, e) gives).
constexpr float exp2_int(int e) {
  if (e > 127) return std::bit_cast<float>(0x7f800000u);
  if (e >= -126) return std::bit_cast<float>(uint32_t(e + 127) << 23);
  return e >= -149 ? std::bit_cast<float>(1u << (e + 149)) : 0.0f;
}

// One element of a block whose scale exponent is e: x * 2^-e rounded to the
// element format (saturating). The product is exact, so this rounds exactly
// like x / scale. Shared by the CPU quantizers and the CUDA kernels.
constexpr uint8_t e4m3_code(float x, int e) { return float_to_e4m3(x * exp2_int(-e)); }
constexpr uint8_t e2m1_code(float x, int e) { return float_to_e2m1(x * exp2_int(-e)); }

// Scale exponent of a block from its amax (SPEC §5).
constexpr int e4m3_exponent_of_amax(float amax) { return pow2_scale_exponent(amax, kFp8AmaxFloor, kE4m3Max); }
constexpr int e2m1_exponent_of_amax(float amax) { return pow2_scale_exponent(amax, kFp4AmaxFloor, kE2m1Max); }

// Scale exponent of one block: e4m3 elements, floor 1e-4.
int e4m3_block_exponent(const float* x, int n);
// Scale exponent of one block: e2m1 elements, floor 6 * 2^-126.
int e2m1_block_exponent(const float* x, int n);

// Quantizes one block to e4m3 codes; returns the scale exponent.
int quantize_e4m3_block(const float* x, int n, uint8_t* codes);
// Quantizes one block to e2m1 codes (one code per byte, low nibble); returns the exponent.
int quantize_e2m1_block(const float* x, int n, uint8_t* codes);

// The 256 e4m3 codes as floats (e4m3_to_float's values, NaNs included), for
// host loops that decode FP8: one load an element where the bit arithmetic's
// branches keep a loop scalar (fp8_ds_mla_decode: 1.1 us a record -> 0.1).
const float* e4m3_values();

// Quantize-then-dequantize in place, block by block over n values (a shorter
// last block is quantized on its own): what a consumer of the quantized tensor
// sees.
void fake_quant_e4m3(float* x, size_t n, int block);
void fake_quant_e2m1(float* x, size_t n, int block);

}  // namespace dsv4
