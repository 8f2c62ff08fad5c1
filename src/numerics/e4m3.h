#pragma once
// float8 e4m3fn (OCP FP8): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits.
// No infinities; S.1111.111 is NaN, so the largest finite value is 448.
#include <cstdint>

namespace dsv4 {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3NaN = 0x7f;

// Decodes any of the 256 codes (0x7f and 0xff are NaN).
float e4m3_to_float(uint8_t code);

// Round to nearest even; magnitudes beyond 448 saturate to +-448; NaN -> 0x7f.
uint8_t float_to_e4m3(float x);

}  // namespace dsv4
