#pragma once
// UE8M0: an unsigned power-of-two scale, value 2^(byte - 127); 0xff is NaN.
#include <bit>
#include <cstdint>

namespace dsv4 {

// Bit arithmetic (2^-127, byte 0, is a float subnormal), so device code runs it too.
constexpr float ue8m0_to_float(uint8_t byte) {
  if (byte == 0xff) return std::bit_cast<float>(0x7fc00000u);
  return std::bit_cast<float>(byte == 0 ? 0x00400000u : uint32_t(byte) << 23);
}

// The byte for 2^exponent; exponent must lie in [-127, 127].
constexpr uint8_t ue8m0_from_exponent(int exponent) { return uint8_t(exponent + 127); }

// ceil(log2(v)) for a positive normal float, read off its bits the way the
// reference does (exponent, plus one when any mantissa bit is set).
constexpr int ceil_log2(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const int e = int((u >> 23) & 0xff) - 127;
  return (u & 0x7fffffu) ? e + 1 : e;
}

// SPEC §5 scale rule: s = 2^ceil(log2(max(amax, floor) / qmax)), as an exponent.
// The division is done in float32, as in the reference.
constexpr int pow2_scale_exponent(float amax, float floor, float qmax) {
  return ceil_log2((amax > floor ? amax : floor) / qmax);
}

}  // namespace dsv4
