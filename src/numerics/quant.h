#pragma once
// Block quantizers of SPEC §5: each block of values shares one power-of-two
// scale s = 2^ceil(log2(max(amax, floor) / qmax)); elements are x / s rounded
// to the element format (e4m3 or e2m1).
#include <cstddef>
#include <cstdint>

namespace dsv4 {

// Floors of the scale rule (SPEC §5).
inline constexpr float kFp8AmaxFloor = 1e-4f;
inline constexpr float kFp4AmaxFloor = 6.0f * 1.1754943508222875e-38f;  // 6 * 2^-126

// Block widths used by the stack.
inline constexpr int kKvQuantBlock = 64;     // KV cache dims 0..447
inline constexpr int kGemmQuantBlock = 128;  // FP8 linear inputs
inline constexpr int kFp4QuantBlock = 32;    // MXFP4 indexer q/k

// Scale exponent of one block: e4m3 elements, floor 1e-4.
int e4m3_block_exponent(const float* x, int n);
// Scale exponent of one block: e2m1 elements, floor 6 * 2^-126.
int e2m1_block_exponent(const float* x, int n);

// Quantizes one block to e4m3 codes; returns the scale exponent.
int quantize_e4m3_block(const float* x, int n, uint8_t* codes);
// Quantizes one block to e2m1 codes (one code per byte, low nibble); returns the exponent.
int quantize_e2m1_block(const float* x, int n, uint8_t* codes);

// Quantize-then-dequantize in place, block by block over n values (n % block == 0):
// what a consumer of the quantized tensor sees.
void fake_quant_e4m3(float* x, size_t n, int block);
void fake_quant_e2m1(float* x, size_t n, int block);

}  // namespace dsv4
