#pragma once
// Device encoders of the cache records of SPEC §6, bit for bit the CPU codecs
// (cache/fp8_ds_mla.cpp, cache/index_key_format.cpp), for a vector spread over
// consecutive threads with 4 consecutive elements each (thread i holds
// elements 4i .. 4i+3):
//   fp8_ds_mla        512 dims over 128 threads (4 whole warps), or over 64
//                     lanes of 8 elements (one warp, two calls; store_fp8_ds_mla_piece)
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

// fp8_ds_mla entry t of a page of B entries from kQuads quads of dims a
// thread (already rounded to bf16): piece j holds dims 4kQuads*j and on.
//   kQuads = 1: thread j < 128 holds dims 4j .. 4j+3; 16 threads a 64-dim block;
//   kQuads = 2: lane j < 64 (a warp, two calls) holds 8j .. 8j+7; 8 lanes a block.
// Dims 0..447: e4m3 codes in 64-dim blocks with a UE8M0 scale each; dims
// 448..511 as bf16; the scales' pad byte 0. The lanes of a 64-dim block call
// together (the scale is a shuffle reduction over them).
template <int kQuads>
__device__ __forceinline__ void store_fp8_ds_mla_piece(uint8_t* page, int B, int t, int j,
                                                       const float (&v)[kQuads][4]) {
  constexpr int kDims = 4 * kQuads, kBlockPieces = 64 / kDims, kNopePieces = kNopeDim / kDims;
  int e = 0;
  uint32_t codes[kQuads];
  quantize_e4m3_quads<kBlockPieces>(v, e, codes);  // every lane: the shuffles need them all
  uint8_t* data = page + fp8_ds_mla_data_offset(t);
  uint8_t* scales = page + fp8_ds_mla_scale_offset(B, t);
  if (j < kNopePieces) {
    store_words(data + kDims * j, codes);
    if (j % kBlockPieces == 0) scales[j / kBlockPieces] = ue8m0_from_exponent(e);
  } else {
    const int k = j - kNopePieces;  // dims 448 + kDims k and on, little-endian bf16
    uint32_t w[2 * kQuads];
#pragma unroll
    for (int q = 0; q < kQuads; ++q) w[2 * q] = bf16x2_pack(v[q][0], v[q][1]), w[2 * q + 1] = bf16x2_pack(v[q][2], v[q][3]);
    store_words(data + kNopeDim + 2 * kDims * k, w);
    if (k == 0) scales[kKvScaleBlocks] = 0;  // pad byte
  }
}

// The record from 128 threads of 4 dims each (thread i: dims 4i .. 4i+3).
__device__ __forceinline__ void store_fp8_ds_mla(uint8_t* page, int B, int t, int i, const float (&v)[4]) {
  const float q[1][4] = {{v[0], v[1], v[2], v[3]}};
  store_fp8_ds_mla_piece<1>(page, B, t, i, q);
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
  float amax = amax4(v);
  amax = group_max<8>(amax);
  const int e = e2m1_exponent_of_amax(amax);
  uint32_t packed = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) packed |= uint32_t(e2m1_code(v[k], e)) << (4 * k);
  *reinterpret_cast<uint16_t*>(page + size_t(kIndexDim / 2) * size_t(t) + 2 * lane) = uint16_t(packed);
  if (lane % 8 == 0) page[size_t(kIndexDim / 2) * size_t(B) + 4 * size_t(t) + lane / 8] = ue8m0_from_exponent(e);
}

}  // namespace dsv4::cuda
