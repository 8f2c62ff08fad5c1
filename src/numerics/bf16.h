#pragma once
// bfloat16: the top 16 bits of an IEEE float32, rounded to nearest even.
#include <bit>
#include <cstddef>
#include <cstdint>

namespace dsv4 {

// fp32 -> bf16 bits, round to nearest even. NaN stays a (quiet) NaN; +-inf stay.
constexpr uint16_t bf16_bits(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

constexpr float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

// The nearest bf16 value, as a float.
constexpr float round_bf16(float f) { return bf16_to_float(bf16_bits(f)); }

// Rounds n floats in place to bf16 (production numerics keep activations in bf16).
inline void round_bf16(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

}  // namespace dsv4
