#include "cache/fp8_ds_mla.h"

#include <cmath>
#include <cstring>

#include "numerics/bf16.h"
#include "numerics/e4m3.h"
#include "numerics/quant.h"
#include "numerics/ue8m0.h"

namespace dsv4 {

void fp8_ds_mla_encode(const float* kv, uint8_t* page, int entries_per_page, int t) {
  uint8_t* data = page + fp8_ds_mla_data_offset(t);
  uint8_t* scales = page + fp8_ds_mla_scale_offset(entries_per_page, t);
  for (int b = 0; b < kKvScaleBlocks; ++b) {
    const int e = quantize_e4m3_block(kv + 64 * b, 64, data + 64 * b);
    scales[b] = ue8m0_from_exponent(e);
  }
  scales[kKvScaleBlocks] = 0;  // pad
  for (int i = 0; i < kKvDim - kNopeDim; ++i) {
    const uint16_t bits = bf16_bits(kv[kNopeDim + i]);
    data[kNopeDim + 2 * i] = uint8_t(bits & 0xff);
    data[kNopeDim + 2 * i + 1] = uint8_t(bits >> 8);
  }
}

void fp8_ds_mla_decode(const uint8_t* page, int entries_per_page, int t, float* kv) {
  const uint8_t* data = page + fp8_ds_mla_data_offset(t);
  const uint8_t* scales = page + fp8_ds_mla_scale_offset(entries_per_page, t);
  const float* e4m3 = e4m3_values();
  for (int b = 0; b < kKvScaleBlocks; ++b) {
    const float s = ue8m0_to_float(scales[b]);
    for (int i = 0; i < 64; ++i) kv[64 * b + i] = e4m3[data[64 * b + i]] * s;
  }
  for (int i = 0; i < kKvDim - kNopeDim; ++i) {
    const uint16_t bits = uint16_t(data[kNopeDim + 2 * i] | (data[kNopeDim + 2 * i + 1] << 8));
    kv[kNopeDim + i] = bf16_to_float(bits);
  }
}

void fp8_ds_mla_round_trip(float* kv) {
  fake_quant_e4m3(kv, kNopeDim, 64);
  round_bf16(kv + kNopeDim, kKvDim - kNopeDim);
}

}  // namespace dsv4
