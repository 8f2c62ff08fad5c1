#include "numerics/quant.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "numerics/e2m1.h"
#include "numerics/e4m3.h"
#include "numerics/ue8m0.h"

namespace dsv4 {
namespace {

float block_amax(const float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

// x * 2^-e, clamped to +-qmax. inv = 2^-e is exact (e is in [-126, 127]), so the
// product rounds exactly like a division by the scale.
inline float scaled(float x, float inv, float qmax) {
  const float y = x * inv;
  return y > qmax ? qmax : (y < -qmax ? -qmax : y);
}

}  // namespace

int e4m3_block_exponent(const float* x, int n) { return e4m3_exponent_of_amax(block_amax(x, n)); }

int e2m1_block_exponent(const float* x, int n) { return e2m1_exponent_of_amax(block_amax(x, n)); }

int quantize_e4m3_block(const float* x, int n, uint8_t* codes) {
  const int e = e4m3_block_exponent(x, n);
  const float inv = exp2_int(-e);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e4m3(scaled(x[i], inv, kE4m3Max));
  return e;
}

int quantize_e2m1_block(const float* x, int n, uint8_t* codes) {
  const int e = e2m1_block_exponent(x, n);
  const float inv = exp2_int(-e);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e2m1(scaled(x[i], inv, kE2m1Max));
  return e;
}

namespace {

// Quantize-dequantize block by block with one element format's codec.
template <typename Exponent, typename Round>
void fake_quant(float* x, size_t n, int block, float qmax, Exponent exponent, Round round) {
  // A last block shorter than `block` is a block of its own. Never throws:
  // callers run it inside OpenMP regions.
  for (size_t b = 0; b < n; b += size_t(block)) {
    const int len = int(std::min(size_t(block), n - b));
    const int e = exponent(x + b, len);
    const float inv = exp2_int(-e), s = exp2_int(e);
    for (int i = 0; i < len; ++i) x[b + i] = round(scaled(x[b + i], inv, qmax)) * s;
  }
}

}  // namespace

const float* e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = e4m3_to_float(uint8_t(i));
    return t;
  }();
  return table.data();
}

void fake_quant_e4m3(float* x, size_t n, int block) {
  fake_quant(x, n, block, kE4m3Max, e4m3_block_exponent, [](float v) { return e4m3_to_float(float_to_e4m3(v)); });
}

void fake_quant_e2m1(float* x, size_t n, int block) {
  fake_quant(x, n, block, kE2m1Max, e2m1_block_exponent, [](float v) { return e2m1_to_float(float_to_e2m1(v)); });
}

}  // namespace dsv4
