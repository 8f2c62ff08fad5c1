// Hadamard rotation, RoPE with YaRN, RMSNorm (SPEC §4, §5).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "model/config.h"
#include "numerics/bf16.h"
#include "numerics/hadamard.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope.h"
#include "support/random.h"

using namespace dsv4;

TEST(Hadamard, MatchesTheSylvesterMatrix) {
  const auto x = randn(128, 1);
  auto y = x;
  hadamard_rotate(y.data(), 128);
  for (int i = 0; i < 128; ++i) {
    double ref = 0;  // H[i][j] = (-1)^popcount(i & j) in natural (Sylvester) order
    for (int j = 0; j < 128; ++j) ref += (std::popcount(unsigned(i & j)) % 2 ? -1.0 : 1.0) * x[j];
    EXPECT_NEAR(y[i], ref / std::sqrt(128.0), 1e-5) << i;
  }
}

TEST(Hadamard, IsOrthonormalAndAnInvolution) {
  auto a = randn(128, 2), b = randn(128, 3);
  double dot0 = 0;
  for (int i = 0; i < 128; ++i) dot0 += double(a[i]) * b[i];
  const auto a0 = a;
  hadamard_rotate(a.data(), 128);
  hadamard_rotate(b.data(), 128);
  double dot1 = 0;
  for (int i = 0; i < 128; ++i) dot1 += double(a[i]) * b[i];
  EXPECT_NEAR(dot0, dot1, 1e-4);
  hadamard_rotate(a.data(), 128);
  for (int i = 0; i < 128; ++i) EXPECT_NEAR(a[i], a0[i], 1e-5);
  // No such transform of 96 values: NaN says so (it never throws: OpenMP regions call it).
  hadamard_rotate(a.data(), 96);
  for (int i = 0; i < 96; ++i) EXPECT_TRUE(std::isnan(a[size_t(i)]));
}

TEST(Rope, YarnRampBoundsAndFrequencies) {
  const ModelConfig flash = preset_config("flash");
  const RopeParams p = flash.rope_params(LayerType::kC4A);
  EXPECT_EQ(Rope::yarn_low(p), 15);
  EXPECT_EQ(Rope::yarn_high(p), 25);
  const Rope yarn(p);
  const Rope plain(RopeParams{160000, false, flash.yarn});
  for (int i = 0; i < 32; ++i) {
    const float base = plain.inv_freq()[i];
    EXPECT_NEAR(base, std::pow(160000.0, -2.0 * i / 64), 1e-6 * std::pow(160000.0, -2.0 * i / 64));
    if (i <= 15) EXPECT_EQ(yarn.inv_freq()[i], base) << i;
    else if (i >= 25) EXPECT_FLOAT_EQ(yarn.inv_freq()[i], base / 16) << i;
    else {
      const float ramp = (i - 15) / 10.0f;
      EXPECT_FLOAT_EQ(yarn.inv_freq()[i], base / 16 * ramp + base * (1 - ramp)) << i;
    }
  }
  // SWA-only layers: base 10000, no YaRN.
  const Rope swa(flash.rope_params(LayerType::kSwaOnly));
  EXPECT_NEAR(swa.inv_freq()[31], std::pow(10000.0, -62.0 / 64), 1e-9);
}

TEST(Rope, RotatesPairsAndInverts) {
  const Rope rope(preset_config("flash").rope_params(LayerType::kC128A));
  const auto x = randn(64, 4);
  auto y = x;
  rope.apply(y.data(), 0);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(y[i], x[i]);  // position 0 is the identity
  rope.apply(y.data(), 123457);
  for (int i = 0; i < 32; ++i) {
    const float n0 = std::hypot(x[2 * i], x[2 * i + 1]), n1 = std::hypot(y[2 * i], y[2 * i + 1]);
    EXPECT_NEAR(n0, n1, 1e-5);
    const float angle = float(123457) * rope.inv_freq()[i];
    EXPECT_NEAR(y[2 * i], x[2 * i] * std::cos(angle) - x[2 * i + 1] * std::sin(angle), 1e-4);
  }
  rope.apply(y.data(), 123457, true);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

TEST(RmsNorm, MatchesTheFormula) {
  const auto x = randn(512, 5), w = randn(512, 6);
  std::vector<float> y(512);
  rms_norm(x.data(), w.data(), 512, 1e-6f, y.data());
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double inv = 1 / std::sqrt(ss / 512 + 1e-6);
  for (int i = 0; i < 512; ++i) EXPECT_NEAR(y[i], x[i] * inv * w[i], 1e-5);
  rms_norm(x.data(), nullptr, 512, 1e-6f, y.data());
  for (int i = 0; i < 512; ++i) EXPECT_NEAR(y[i], x[i] * inv, 1e-6);
}

TEST(RmsNorm, Bf16ArithmeticRoundsEveryStep) {
  auto x = randn(512, 7);
  for (auto& v : x) v = round_bf16(v);
  auto y = x;
  rms_norm_bf16_arith(y.data(), 512, 1e-6f);
  for (float v : y) EXPECT_EQ(v, round_bf16(v));  // outputs are bf16 values
  std::vector<float> exact(512);
  rms_norm(x.data(), nullptr, 512, 1e-6f, exact.data());
  double err = 0, ref = 0;
  for (int i = 0; i < 512; ++i) err += std::pow(y[i] - exact[i], 2), ref += exact[i] * exact[i];
  EXPECT_LT(std::sqrt(err / ref), 1e-2);  // close to the exact norm, but...
  EXPECT_GT(std::sqrt(err / ref), 0.0);   // ...not identical: the roundings happened
}
