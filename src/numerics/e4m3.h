#pragma once
// float8 e4m3fn (OCP FP8): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits.
// No infinities; S.1111.111 is NaN, so the largest finite value is 448.
#include <algorithm>
#include <bit>
#include <cstdint>

namespace dsv4 {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3NaN = 0x7f;

// Decodes any of the 256 codes (0x7f and 0xff are NaN). Bit arithmetic only,
// so device code runs the same function (constexpr, see common/hd.h).
constexpr float e4m3_to_float(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80) << 24, exp = (code >> 3) & 0xfu, man = code & 0x7u;
  if (exp == 0xf && man == 0x7) return std::bit_cast<float>(sign | 0x7fc00000u);
  // Subnormal m * 2^-9: exact as a float product; normal: rebias 7 -> 127.
  const float mag = exp == 0 ? float(man) * 0x1p-9f : std::bit_cast<float>(((exp + 120u) << 23) | (man << 20));
  return sign ? -mag : mag;
}

// Round to nearest even; magnitudes beyond 448 saturate to +-448; NaN -> 0x7f.
// Bit arithmetic without branches or libm calls, so loops over it vectorize
// and device code runs the same function.
constexpr uint8_t float_to_e4m3(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  // |x| >= 2^-6: round the float's mantissa to 3 bits (ties to even) and rebias 127 -> 7.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t normal = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  // |x| < 2^-6: subnormal code m for m * 2^-9; adding 2^23 rounds to an
  // integer (ties to even). Clamped first so the conversion stays in range.
  const float small = std::min(std::bit_cast<float>(a), 0.015625f);
  const uint32_t subnormal = uint32_t(int((small * 512.0f + 8388608.0f) - 8388608.0f));
  uint32_t code = a < 0x3c800000u ? subnormal : normal;  // 0x3c800000 = 2^-6
  code = a >= 0x43e00000u ? 0x7eu : code;                // >= 448 saturates
  return a > 0x7f800000u ? kE4m3NaN : uint8_t(code | sign);
}

}  // namespace dsv4
