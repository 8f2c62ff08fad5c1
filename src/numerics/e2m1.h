#pragma once
// float4 e2m1 (MXFP4 element): 1 sign, 2 exponent bits, 1 mantissa bit.
// Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no NaN or infinity. Both directions
// are constexpr bit arithmetic, so device code runs the same functions.
#include <bit>
#include <cstdint>

namespace dsv4 {

inline constexpr float kE2m1Max = 6.0f;

constexpr float e2m1_to_float(uint8_t code) {
  constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMag[code & 0x7];
  return (code & 0x8) ? -m : m;
}

// Round to nearest, ties to the even code (the one with mantissa bit 0);
// saturates at +-6. NaN has no code: it maps to +0.
constexpr uint8_t float_to_e2m1(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0;
  const uint8_t sign = (u >> 31) ? 0x8 : 0x0;
  const float a = std::bit_cast<float>(u & 0x7fffffffu);
  // Midpoints between neighbours; at an exact midpoint the even code wins,
  // hence <= towards an even code and < towards an odd one.
  uint8_t c = 7;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  return sign | c;
}

}  // namespace dsv4
