#include "cache/index_key_format.h"

#include <cmath>
#include <cstring>
#include <string>

#include "common/error.h"
#include "numerics/e2m1.h"
#include "numerics/e4m3.h"
#include "numerics/quant.h"
#include "numerics/ue8m0.h"

namespace dsv4 {

std::string_view index_key_format_name(IndexKeyFormat f) { return f == IndexKeyFormat::kFp8 ? "fp8" : "mxfp4"; }

IndexKeyFormat parse_index_key_format(std::string_view name) {
  if (name == "fp8") return IndexKeyFormat::kFp8;
  if (name == "mxfp4") return IndexKeyFormat::kMxfp4;
  throw Error("unknown indexer key format '" + std::string(name) + "' (expected fp8 or mxfp4)");
}

void index_key_encode(IndexKeyFormat f, const float* key, uint8_t* page, int entries_per_page, int t) {
  if (f == IndexKeyFormat::kFp8) {
    uint8_t* data = page + size_t(kIndexDim) * t;
    const int e = quantize_e4m3_block(key, kIndexDim, data);
    const float scale = std::ldexp(1.0f, e);
    std::memcpy(page + size_t(kIndexDim) * entries_per_page + 4 * size_t(t), &scale, 4);
    return;
  }
  uint8_t* data = page + size_t(kIndexDim / 2) * t;
  uint8_t* scales = page + size_t(kIndexDim / 2) * entries_per_page + 4 * size_t(t);
  uint8_t codes[kIndexDim];
  for (int b = 0; b < kIndexDim / kFp4QuantBlock; ++b)
    scales[b] = ue8m0_from_exponent(quantize_e2m1_block(key + 32 * b, 32, codes + 32 * b));
  for (int i = 0; i < kIndexDim / 2; ++i) data[i] = uint8_t(codes[2 * i] | (codes[2 * i + 1] << 4));
}

void index_key_decode(IndexKeyFormat f, const uint8_t* page, int entries_per_page, int t, float* key) {
  if (f == IndexKeyFormat::kFp8) {
    const uint8_t* data = page + size_t(kIndexDim) * t;
    float scale;
    std::memcpy(&scale, page + size_t(kIndexDim) * entries_per_page + 4 * size_t(t), 4);
    const float* e4m3 = e4m3_values();
    for (int i = 0; i < kIndexDim; ++i) key[i] = e4m3[data[i]] * scale;
    return;
  }
  const uint8_t* data = page + size_t(kIndexDim / 2) * t;
  const uint8_t* scales = page + size_t(kIndexDim / 2) * entries_per_page + 4 * size_t(t);
  for (int i = 0; i < kIndexDim; ++i) {
    const uint8_t code = (i % 2 == 0) ? (data[i / 2] & 0xf) : (data[i / 2] >> 4);
    key[i] = e2m1_to_float(code) * ue8m0_to_float(scales[i / 32]);
  }
}

}  // namespace dsv4
