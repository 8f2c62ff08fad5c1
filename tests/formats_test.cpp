// Cache byte formats of SPEC §6: the fp8_ds_mla page and both indexer-key
// formats, checked byte by byte on hand-built entries.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "numerics/bf16.h"
#include "numerics/e4m3.h"

using namespace dsv4;

TEST(Fp8DsMla, PageStrideIsPaddedToMultiplesOf576) {
  EXPECT_EQ(fp8_ds_mla_page_stride(64), 37440u);  // 584 * 64 = 37376 -> 37440
  EXPECT_EQ(fp8_ds_mla_page_stride(2), 1728u);    // 1168 -> 1728
  EXPECT_EQ(fp8_ds_mla_page_stride(1), 1152u);
  EXPECT_EQ(fp8_ds_mla_scale_offset(64, 3), 576u * 64 + 24);
}

TEST(Fp8DsMla, HandBuiltEntryByteByByte) {
  // Entry 1 of a 2-entry page. Block b of the NoPE part has amax 448 * 2^(b-3),
  // so its scale is exactly 2^(b-3) and x = k * 2^(b-3) encodes as the code of k.
  std::vector<float> kv(512);
  for (int b = 0; b < 7; ++b)
    for (int i = 0; i < 64; ++i) kv[64 * b + i] = std::ldexp(i == 0 ? 448.0f : (i % 2 ? 1.0f : -0.5f), b - 3);
  for (int i = 0; i < 64; ++i) kv[448 + i] = 1.0f + i / 64.0f;  // RoPE dims, bf16-exact
  std::vector<uint8_t> page(fp8_ds_mla_page_stride(2), 0xAA);
  fp8_ds_mla_encode(kv.data(), page.data(), 2, 1);
  const uint8_t* e = page.data() + 576;
  for (int b = 0; b < 7; ++b) {
    EXPECT_EQ(e[64 * b], 0x7e);              // 448
    EXPECT_EQ(e[64 * b + 1], 0x38);          // +1.0 = exp 7, mantissa 0
    EXPECT_EQ(e[64 * b + 2], 0x80 | 0x30);   // -0.5
    EXPECT_EQ(page[576 * 2 + 8 + b], 127 + b - 3);  // scale bytes of entry 1
  }
  EXPECT_EQ(page[576 * 2 + 8 + 7], 0);  // pad byte
  for (int i = 0; i < 64; ++i) {
    const uint16_t bits = bf16_bits(1.0f + i / 64.0f);
    EXPECT_EQ(e[448 + 2 * i], bits & 0xff);  // little-endian bf16
    EXPECT_EQ(e[448 + 2 * i + 1], bits >> 8);
  }
  // Entry 0 and the bytes past the scales were not touched.
  for (int i = 0; i < 576; ++i) ASSERT_EQ(page[i], 0xAA);
  for (size_t i = 576 * 2; i < 576 * 2 + 8; ++i) ASSERT_EQ(page[i], 0xAA);
  for (size_t i = 576 * 2 + 16; i < page.size(); ++i) ASSERT_EQ(page[i], 0xAA);
  std::vector<float> back(512);
  fp8_ds_mla_decode(page.data(), 2, 1, back.data());
  for (int i = 0; i < 512; ++i) EXPECT_EQ(back[i], kv[i]) << i;
}

TEST(Fp8DsMla, RoundTripEqualsTheCacheRounding) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0, 2);
  std::vector<uint8_t> page(fp8_ds_mla_page_stride(64));
  for (int t = 0; t < 64; ++t) {
    std::vector<float> kv(512);
    for (auto& v : kv) v = nd(rng) * float(t + 1);
    fp8_ds_mla_encode(kv.data(), page.data(), 64, t);
    std::vector<float> back(512), rounded = kv;
    fp8_ds_mla_decode(page.data(), 64, t, back.data());
    fp8_ds_mla_round_trip(rounded.data());
    for (int i = 0; i < 512; ++i) ASSERT_EQ(back[i], rounded[i]);
    for (int i = 0; i < 448; ++i) ASSERT_NEAR(back[i], kv[i], std::fabs(kv[i]) * 0.0625 + 1e-3);
  }
}

TEST(IndexKeys, Fp8LayoutDataPlaneThenScalePlane) {
  std::vector<float> key(128);
  for (int i = 0; i < 128; ++i) key[i] = (i == 5) ? 896.0f : 2.0f;  // amax 896 -> scale 2
  const int B = 64;
  std::vector<uint8_t> page(index_key_page_stride(IndexKeyFormat::kFp8, B), 0);
  EXPECT_EQ(page.size(), 132u * 64);
  index_key_encode(IndexKeyFormat::kFp8, key.data(), page.data(), B, 3);
  EXPECT_EQ(page[128 * 3 + 5], 0x7e);  // 896 / 2 = 448
  EXPECT_EQ(page[128 * 3 + 0], 0x38);  // 2 / 2 = 1.0
  float scale;
  std::memcpy(&scale, page.data() + 128 * B + 4 * 3, 4);
  EXPECT_EQ(scale, 2.0f);
  std::vector<float> back(128);
  index_key_decode(IndexKeyFormat::kFp8, page.data(), B, 3, back.data());
  for (int i = 0; i < 128; ++i) EXPECT_EQ(back[i], key[i]);
}

TEST(IndexKeys, Mxfp4LayoutNibblesThenScales) {
  std::vector<float> key(128);
  for (int i = 0; i < 128; ++i) key[i] = (i % 2 ? -1.0f : 3.0f) * float(1 << (i / 32));  // amax 3*2^b -> scale 2^(b-1)
  const int B = 64;
  std::vector<uint8_t> page(index_key_page_stride(IndexKeyFormat::kMxfp4, B), 0);
  EXPECT_EQ(page.size(), 68u * 64);
  index_key_encode(IndexKeyFormat::kMxfp4, key.data(), page.data(), B, 2);
  // Element 2i in the low nibble: 3/0.5 = 6 -> code 7; -1/0.5 = -2 -> code 0xC.
  EXPECT_EQ(page[64 * 2 + 0], 0xC7);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(page[64 * B + 4 * 2 + b], 127 + b - 1);
  std::vector<float> back(128);
  index_key_decode(IndexKeyFormat::kMxfp4, page.data(), B, 2, back.data());
  for (int i = 0; i < 128; ++i) EXPECT_EQ(back[i], key[i]);
  EXPECT_EQ(parse_index_key_format("fp8"), IndexKeyFormat::kFp8);
  EXPECT_THROW(parse_index_key_format("fp16"), std::runtime_error);
}
