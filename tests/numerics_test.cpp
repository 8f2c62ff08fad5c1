// Number formats, scale rules and block quantizers of SPEC §5, exhaustively
// where the domain is small.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "numerics/bf16.h"
#include "numerics/e2m1.h"
#include "numerics/e4m3.h"
#include "numerics/quant.h"
#include "numerics/ue8m0.h"

using namespace dsv4;

namespace {

// Independent decode of e4m3fn from its definition.
double e4m3_reference(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? m * std::pow(2.0, -9) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

// Nearest representable value by brute force over all finite codes; ties go to
// the code with an even mantissa (lowest bit 0).
int nearest_e4m3(double x) {
  int best = -1;
  double best_d = 1e300;
  for (int c = 0; c < 256; ++c) {
    const double v = e4m3_reference(c);
    if (std::isnan(v)) continue;
    if ((c & 0x80) != (std::signbit(x) ? 0x80 : 0)) continue;  // keep the sign of x
    const double d = std::fabs(v - x);
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) best = c, best_d = d;
  }
  return best;
}

}  // namespace

TEST(Bf16, RoundTripsEveryCode) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(uint16_t(b));
    if (std::isnan(f)) EXPECT_TRUE(std::isnan(bf16_to_float(bf16_bits(f))));
    else EXPECT_EQ(bf16_bits(f), b) << b;
  }
}

TEST(Bf16, TiesRoundToEven) {
  // Halfway between 1.0 (0x3f80) and the next bf16 (0x3f81): goes to the even 0x3f80.
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  // Halfway between 0x3f81 and 0x3f82: goes to the even 0x3f82.
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  // Just above the midpoint rounds up, just below rounds down.
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x3f807fffu)), 0x3f80);
  // Every tie between consecutive positive bf16 codes.
  for (uint32_t b = 0; b < 0x7f80; ++b) {
    const float tie = std::bit_cast<float>((b << 16) | 0x8000u);
    EXPECT_EQ(bf16_bits(tie), (b & 1) ? b + 1 : b) << b;
  }
}

TEST(Bf16, SpecialValues) {
  EXPECT_TRUE(std::isnan(round_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(round_bf16(INFINITY), INFINITY);
  EXPECT_EQ(round_bf16(-INFINITY), -INFINITY);
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  // The largest finite float rounds up to infinity, as RNE requires.
  EXPECT_EQ(round_bf16(std::numeric_limits<float>::max()), INFINITY);
}

TEST(E4m3, DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const double ref = e4m3_reference(c);
    const float got = e4m3_to_float(uint8_t(c));
    if (std::isnan(ref)) EXPECT_TRUE(std::isnan(got)) << c;
    else EXPECT_EQ(double(got), ref) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
}

// The host decoders' table: the same value as the reference for every code.
TEST(E4m3, ValuesTableDecodesEveryCode) {
  const float* table = e4m3_values();
  for (int c = 0; c < 256; ++c) {
    const double ref = e4m3_reference(c);
    if (std::isnan(ref)) EXPECT_TRUE(std::isnan(table[c])) << c;
    else EXPECT_EQ(double(table[c]), ref) << c;
  }
}

TEST(E4m3, EncodesEveryCodeBack) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(uint8_t(c));
    if (std::isnan(v)) continue;
    EXPECT_EQ(float_to_e4m3(v), c) << c;
  }
}

TEST(E4m3, EveryTieGoesToTheEvenCode) {
  for (int c = 0; c < 0x7e; ++c) {  // positive neighbours c, c+1
    const double lo = e4m3_reference(c), hi = e4m3_reference(c + 1);
    const float mid = float((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2);  // midpoints are exact in float
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(float_to_e4m3(mid), even) << c;
    EXPECT_EQ(float_to_e4m3(-mid), even | 0x80) << c;
    // Off the midpoint by one float ulp: the nearer neighbour wins.
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 1e9f)), c + 1) << c;
  }
}

TEST(E4m3, MatchesBruteForceNearestOnRandomValues) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exp_dist(-12, 9);
  for (int i = 0; i < 20000; ++i) {
    float x = std::exp2(exp_dist(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    if (std::fabs(x) >= 448) continue;
    EXPECT_EQ(float_to_e4m3(x), nearest_e4m3(x)) << x;
  }
}

TEST(E4m3, MatchesBruteForceOnAFloatSweep) {
  // Every float with the low 17 bits fixed, both signs, up to 448: 2 * 3.5e4 values
  // covering every exponent of the normal and subnormal ranges.
  for (uint32_t hi = 0; hi < (0x43e00000u >> 17); ++hi) {
    for (uint32_t low : {0x00000u, 0x0ffffu, 0x10000u, 0x1ffffu}) {
      const float x = std::bit_cast<float>((hi << 17) | low);
      ASSERT_EQ(float_to_e4m3(x), nearest_e4m3(x)) << x;
      ASSERT_EQ(float_to_e4m3(-x), nearest_e4m3(-x)) << -x;
    }
  }
}

TEST(E4m3, SaturatesAndHandlesNaN) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);  // would round past 448: saturates
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::nanf("")), kE4m3NaN);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // exactly half: tie to even (0)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -10)), 0x01);
}

TEST(E2m1, EveryCodeAndEveryTie) {
  const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_float(uint8_t(c));
    EXPECT_EQ(std::fabs(v), mags[c & 7]);
    EXPECT_EQ(std::signbit(v), bool(c & 8));
    EXPECT_EQ(float_to_e2m1(v), c);
  }
  for (int c = 0; c < 7; ++c) {
    const float mid = (mags[c] + mags[c + 1]) / 2;
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(float_to_e2m1(mid), even) << mid;
    EXPECT_EQ(float_to_e2m1(-mid), even | 8) << mid;
    EXPECT_EQ(float_to_e2m1(std::nextafter(mid, 0.0f)), c) << mid;
    EXPECT_EQ(float_to_e2m1(std::nextafter(mid, 10.0f)), c + 1) << mid;
  }
  EXPECT_EQ(float_to_e2m1(7.0f), 7);
  EXPECT_EQ(float_to_e2m1(-100.0f), 15);
}

TEST(Ue8m0, EveryByte) {
  for (int b = 0; b < 255; ++b) EXPECT_EQ(ue8m0_to_float(uint8_t(b)), std::ldexp(1.0f, b - 127)) << b;
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
  EXPECT_EQ(ue8m0_from_exponent(0), 127);
  EXPECT_EQ(ue8m0_from_exponent(-3), 124);
}

TEST(ScaleRule, PowerOfTwoCeiling) {
  EXPECT_EQ(pow2_scale_exponent(448.0f, kFp8AmaxFloor, kE4m3Max), 0);  // exactly 1
  EXPECT_EQ(pow2_scale_exponent(449.0f, kFp8AmaxFloor, kE4m3Max), 1);
  EXPECT_EQ(pow2_scale_exponent(224.0f, kFp8AmaxFloor, kE4m3Max), -1);
  EXPECT_EQ(pow2_scale_exponent(225.0f, kFp8AmaxFloor, kE4m3Max), 0);
  // amax below the floor uses the floor: 1e-4 / 448 = 2.23e-7 -> 2^-22.
  EXPECT_EQ(pow2_scale_exponent(0.0f, kFp8AmaxFloor, kE4m3Max), -22);
  EXPECT_EQ(pow2_scale_exponent(6.0f, kFp4AmaxFloor, kE2m1Max), 0);
  EXPECT_EQ(pow2_scale_exponent(0.0f, kFp4AmaxFloor, kE2m1Max), -126);
  for (int e = -20; e < 20; ++e) {
    const float amax = std::ldexp(448.0f, e);
    EXPECT_EQ(pow2_scale_exponent(amax, kFp8AmaxFloor, kE4m3Max), e);
    EXPECT_EQ(pow2_scale_exponent(std::nextafter(amax, 1e30f), kFp8AmaxFloor, kE4m3Max), e + 1);
  }
}

TEST(BlockQuant, E4m3BlockUsesOneScaleAndRoundsEachElement) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0, 3);
  std::vector<float> x(128);
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> codes(128);
  const int e = quantize_e4m3_block(x.data(), 128, codes.data());
  float amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(e, pow2_scale_exponent(amax, kFp8AmaxFloor, kE4m3Max));
  for (int i = 0; i < 128; ++i) {
    EXPECT_EQ(codes[i], nearest_e4m3(double(x[i]) / std::ldexp(1.0, e))) << i;
  }
  std::vector<float> y = x;
  fake_quant_e4m3(y.data(), y.size(), 128);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(y[i], e4m3_to_float(codes[i]) * std::ldexp(1.0f, e));
}

TEST(BlockQuant, E2m1BlocksOf32) {
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = (i < 32 ? 0.01f : 10.0f) * float(i % 7 - 3);
  std::vector<float> y = x;
  fake_quant_e2m1(y.data(), y.size(), 32);
  // Block 0: amax 0.03 -> scale 2^ceil(log2(0.005)) = 2^-7; block 1: amax 30 -> 2^3.
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], e2m1_to_float(float_to_e2m1(x[i] * 128.0f)) / 128.0f);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(y[i], e2m1_to_float(float_to_e2m1(x[i] / 8.0f)) * 8.0f);
  // A shorter last block is a block of its own (33 = 32 + 1).
  std::vector<float> z(x.begin(), x.begin() + 33), tail(1, x[32]);
  fake_quant_e2m1(z.data(), 33, 32);
  fake_quant_e2m1(tail.data(), 1, 32);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(z[size_t(i)], y[size_t(i)]);
  EXPECT_EQ(z[32], tail[0]);
}
