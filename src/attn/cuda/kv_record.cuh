#pragma once
// Device encoders of the cache records of SPEC §6, bit for bit the CPU codecs
// (cache/fp8_ds_mla.cpp, cache/index_key_format.cpp), for a vector spread over
// consecutive threads with 4 consecutive elements each (thread i holds
// elements 4i .. 4i+3):
//   fp8_ds_mla        512 dims over 128 threads (4 whole warps)
//   index key, FP8    128 dims over one warp
//   index key, MXFP4  128 dims over one warp
// Every lane of the participating warps must call (the block scales are
// shuffle reductions over 16, 32 or 8 lanes); a caller that has no slot skips
// the call for the whole warp.
#include <cstdint>

#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/warp.cuh"
#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "cache/pages.h"
#include "numerics/quant.h"
#include "numerics/ue8m0.h"

namespace dsv4::cuda {

// The page of global slot `slot` and the entry's index t in it; nullptr for
// a slot outside the cache (-1, or past its capacity): nothing is written.
__device__ __forceinline__ uint8_t* record_page(const KvPagesMut& c, int64_t slot, int& t) {
  if (slot < 0 || slot >= c.capacity()) return nullptr;
  t = int(slot % c.entries_per_page);
  return c.page(slot / c.entries_per_page);
}

// fp8_ds_mla entry t of a page of B entries; thread i < 128 holds dims 4i..4i+3
// (already rounded to bf16). Threads 0..111: dims 0..447, e4m3 in 64-dim
// blocks (16 threads per block); threads 112..127: dims 448..511 as bf16.
__device__ __forceinline__ void store_fp8_ds_mla(uint8_t* page, int B, int t, int i, const float (&v)[4]) {
  int e = 0;
  const uint32_t codes = quantize_e4m3_x4<16>(v, e);  // every lane: the shuffles need them all
  uint8_t* data = page + fp8_ds_mla_data_offset(t);
  uint8_t* scales = page + fp8_ds_mla_scale_offset(B, t);
  constexpr int kNopeThreads = kNopeDim / 4;  // 112
  if (i < kNopeThreads) {
    *reinterpret_cast<uint32_t*>(data + 4 * i) = codes;
    if (i % 16 == 0) scales[i / 16] = ue8m0_from_exponent(e);
  } else {
    const int k = i - kNopeThreads;  // dims 448 + 4k .. 448 + 4k + 3, little-endian bf16
    uint2 w;
    w.x = bf16x2_pack(v[0], v[1]);
    w.y = bf16x2_pack(v[2], v[3]);
    *reinterpret_cast<uint2*>(data + kNopeDim + 8 * k) = w;
    if (k == 0) scales[kKvScaleBlocks] = 0;  // pad byte
  }
}

// FP8 indexer key t of a page of B entries (lane l holds dims 4l..4l+3): a
// plane of 128 e4m3 bytes per key, then a plane of one fp32 scale per key.
__device__ __forceinline__ void store_index_key_fp8(uint8_t* page, int B, int t, int lane, const float (&v)[4]) {
  int e = 0;
  const uint32_t codes = quantize_e4m3_x4<32>(v, e);
  *reinterpret_cast<uint32_t*>(page + size_t(kIndexDim) * size_t(t) + 4 * lane) = codes;
  if (lane == 0) *reinterpret_cast<float*>(page + size_t(kIndexDim) * size_t(B) + 4 * size_t(t)) = exp2_int(e);
}

// MXFP4 indexer key t of a page of B entries (lane l holds dims 4l..4l+3):
// 64 bytes of e2m1 pairs (element 2i in the low nibble) per key, then 4 UE8M0
// bytes per key, one per 32-dim block (8 lanes).
__device__ __forceinline__ void store_index_key_mxfp4(uint8_t* page, int B, int t, int lane, const float (&v)[4]) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = group_max<8>(amax);
  const int e = e2m1_exponent_of_amax(amax);
  uint32_t packed = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) packed |= uint32_t(e2m1_code(v[k], e)) << (4 * k);
  *reinterpret_cast<uint16_t*>(page + size_t(kIndexDim / 2) * size_t(t) + 2 * lane) = uint16_t(packed);
  if (lane % 8 == 0) page[size_t(kIndexDim / 2) * size_t(B) + 4 * size_t(t) + lane / 8] = ue8m0_from_exponent(e);
}

}  // namespace dsv4::cuda
