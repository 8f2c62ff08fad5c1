#pragma once
// The per-head q norm and RoPE on up to kQHeadRows (token, head) rows, by
// one CTA of kQHeadThreads: the body of q_head_norm_rope.cu's kernel and of
// the wq_b kernel's fused tail (linear_gemv.cuh), so both give the same bits.
//  1. every thread loads its 16-byte chunks of the rows (held in registers
//     until step 3), stores their bf16-rounded squares in shared memory, and
//     the (cos, sin) of each row's position are computed or read (cs_of);
//  2. one lane per row runs the sequential fp32 sum of those squares (the
//     CPU's order: a chain of 512 dependent adds, about 1 us) and the row's
//     bf16 factor;
//  3. every thread scales its chunks, rotates dims 448..511 and stores them.
// Square rows are padded by 4 floats, so the 16-byte reads of step 2 (8
// lanes, 8 rows, one column) hit distinct banks.
#include <cuda_runtime.h>

#include <cstdint>

#include "attn/cuda/rope.cuh"
#include "attn/cuda/warp.cuh"
#include "cache/fp8_ds_mla.h"

namespace dsv4::cuda {

inline constexpr int kQHeadRows = 8;
inline constexpr int kQHeadThreads = 256;

struct QHeadSmem {
  float sq[kQHeadRows][512 + 4];
  float inv[kQHeadRows];
  float2 cs[kQHeadRows][kRopeDim / 2];
};

namespace qhead {

constexpr int kChunks = 512 / 8;              // 16-byte chunks per row
constexpr int kRopeChunk0 = kNopeDim / 8;     // chunk holding dims 448..455
constexpr int kPerThread = kQHeadRows * kChunks / kQHeadThreads;  // chunks each thread holds
static_assert(kQHeadRows * kChunks % kQHeadThreads == 0 && kQHeadRows <= 32);

__device__ __forceinline__ void unpack8(const uint4& x, float (&v)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = bf16_load(uint16_t(w[k] & 0xffffu));
    v[2 * k + 1] = bf16_load(uint16_t(w[k] >> 16));
  }
}

__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  return make_uint4(bf16x2_pack(v[0], v[1]), bf16x2_pack(v[2], v[3]), bf16x2_pack(v[4], v[5]),
                    bf16x2_pack(v[6], v[7]));
}

// f(j, r, c, v) for each chunk j this thread holds of a row r < nrows:
// columns 8c .. 8c + 7 of row r, unpacked to floats.
template <typename F>
__device__ __forceinline__ void each_held(const uint4 (&x)[kPerThread], int nrows, F&& f) {
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kQHeadThreads, r = k / kChunks, c = k % kChunks;
    if (r >= nrows) continue;
    float v[8];
    unpack8(x[j], v);
    f(j, r, c, v);
  }
}

}  // namespace qhead

// Rows i < nrows (<= kQHeadRows) of q, row i at row_ptr(i) (512 bf16, 16-byte
// aligned), rotated by cs_of(i, p) = (cos, sin) of pair p at its position
// (rope_cos_sin's bits), normed and rotated in place. Called by all
// kQHeadThreads threads of the CTA (it has barriers). The rows are read
// through L2 (ld.global.cg): in the fused tail other CTAs wrote them.
template <typename RowPtr, typename CsOf>
__device__ __forceinline__ void q_head_rows(int nrows, RowPtr row_ptr, CsOf cs_of, float eps, QHeadSmem& sm) {
  using namespace qhead;
  const int tid = int(threadIdx.x);
  uint4 x[kPerThread];
  uint16_t* dst[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = tid + j * kQHeadThreads, r = k / kChunks, c = k % kChunks;
    dst[j] = r < nrows ? row_ptr(r) + 8 * c : nullptr;
    if (r < nrows) x[j] = __ldcg(reinterpret_cast<const uint4*>(dst[j]));
  }
  each_held(x, nrows, [&](int, int r, int c, float(&v)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = bf16_round(__fmul_rn(v[i], v[i]));
    float4* sq = reinterpret_cast<float4*>(&sm.sq[r][8 * c]);
    sq[0] = make_float4(v[0], v[1], v[2], v[3]);
    sq[1] = make_float4(v[4], v[5], v[6], v[7]);
  });
  for (int k = tid; k < nrows * (kRopeDim / 2); k += kQHeadThreads) {
    const int r = k / (kRopeDim / 2), i = k % (kRopeDim / 2);
    sm.cs[r][i] = cs_of(r, i);
  }
  __syncthreads();

  if (tid < nrows) {  // rms_norm_bf16_arith, one row per lane
    const float4* sq = reinterpret_cast<const float4*>(sm.sq[tid]);
    float sum = 0.0f;
#pragma unroll 8
    for (int c = 0; c < 128; ++c) {
      const float4 s = sq[c];
      sum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(sum, s.x), s.y), s.z), s.w);
    }
    const float mean = bf16_round(__fdiv_rn(sum, 512.0f));
    sm.inv[tid] = bf16_round(__fdiv_rn(1.0f, __fsqrt_rn(bf16_round(__fadd_rn(mean, eps)))));
  }
  __syncthreads();

  each_held(x, nrows, [&](int j, int r, int c, float(&v)[8]) {
    const float inv = sm.inv[r];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = bf16_round(__fmul_rn(v[i], inv));
    if (c >= kRopeChunk0) {  // pairs 4(c - 56) .. 4(c - 56) + 3 of the rotary part
      const float2* cs = sm.cs[r] + 4 * (c - kRopeChunk0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        rope_rotate(v[2 * i], v[2 * i + 1], cs[i]);
        v[2 * i] = bf16_round(v[2 * i]);
        v[2 * i + 1] = bf16_round(v[2 * i + 1]);
      }
    }
    *reinterpret_cast<uint4*>(dst[j]) = pack8(v);
  });
}

}  // namespace dsv4::cuda
