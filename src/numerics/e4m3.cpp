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

}  // namespace dsv4
