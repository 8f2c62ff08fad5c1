#include "numerics/e4m3.h"

#include <array>
#include <cmath>
#include <limits>

namespace dsv4 {
namespace {

float decode(uint8_t code) {
  const int exp = (code >> 3) & 0xf, man = code & 0x7;
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  if (exp == 0xf && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(float(man), -9);  // subnormal: m * 2^-9
  return sign * std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
}

const std::array<float, 256> kTable = [] {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[c] = decode(uint8_t(c));
  return t;
}();

}  // namespace

float e4m3_to_float(uint8_t code) { return kTable[code]; }

uint8_t float_to_e4m3(float x) {
  if (std::isnan(x)) return kE4m3NaN;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= kE4m3Max) return sign | 0x7e;
  // The spacing of representable values around a: 2^(e-3) for normals with
  // leading bit 2^e, and 2^-9 throughout the subnormal range (e < -6).
  int e2 = 0;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  const int lead = a == 0.0f ? -6 : (e2 - 1 < -6 ? -6 : e2 - 1);
  const float quantum = std::ldexp(1.0f, lead - 3);
  const float q = std::nearbyint(a / quantum);  // exact division; RNE
  const float v = q * quantum;                  // <= 448 because a < 448
  if (v == 0.0f) return sign;
  std::frexp(v, &e2);
  const int vlead = e2 - 1;
  if (vlead < -6) return sign | uint8_t(std::ldexp(v, 9));  // subnormal code = m
  const int man = int(std::ldexp(v, 3 - vlead)) - 8;
  return sign | uint8_t((vlead + 7) << 3) | uint8_t(man);
}

}  // namespace dsv4
