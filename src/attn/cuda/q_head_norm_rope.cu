// The per-head q norm and RoPE (q_head_norm_rope.h). The (token, head) rows
// are numbered r = t * H + h; a CTA takes 32 consecutive rows:
//  1. all threads copy the rows to shared memory (16-byte loads, coalesced)
//     and compute cos/sin of the tokens the rows belong to;
//  2. warp 0, one row per lane, runs the sequential fp32 sum of bf16 squares
//     (the CPU's order) and the row's bf16 factor;
//  3. all threads scale, rotate dims 448..511 and store (16-byte stores).
// Rows are padded by 16 bytes in shared memory, so the 16-byte reads of
// step 2 (8 lanes per phase, 8 different rows) hit distinct banks.
#include "attn/cuda/q_head_norm_rope.h"

#include <string>

#include "attn/cuda/fused_common.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kRows = 32;          // (token, head) rows per CTA
constexpr int kThreads = 256;
constexpr int kChunks = 512 / 8;   // 16-byte chunks per row
constexpr int kRowBytes = 1024 + 16;
constexpr int kRopeChunk0 = kNopeDim / 8;  // chunk holding dims 448..455
constexpr int kPerThread = kRows * kChunks / kThreads;  // 16-byte chunks each thread copies
static_assert(kRows * kChunks % kThreads == 0);

__device__ __forceinline__ void unpack8(const uint4& x, float (&v)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = bf16_load(uint16_t(w[k] & 0xffffu));
    v[2 * k + 1] = bf16_load(uint16_t(w[k] >> 16));
  }
}

__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = uint32_t(bf16_store(v[2 * k])) | (uint32_t(bf16_store(v[2 * k + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__global__ void __launch_bounds__(kThreads)
    q_head_kernel(const QHeadNormRopeParams p, const __grid_constant__ RopeFreqs rf) {
  __shared__ __align__(16) uint8_t rows_s[kRows * kRowBytes];
  __shared__ float inv_s[kRows];
  __shared__ float2 cs_s[kRows][kRopeDim / 2];  // per token of the CTA's rows
  const int H = p.num_heads;
  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  const int nrows = int(min(int64_t(kRows), int64_t(p.num_tokens) * H - r0));
  const int64_t t0 = r0 / H;
  const int ntok = int((r0 + nrows - 1) / H - t0 + 1);  // <= kRows

  // All of a thread's loads first (8 x 16 bytes in flight), then the stores.
  uint4 x[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kThreads, r = k / kChunks, c = k % kChunks;
    const int64_t t = (r0 + r) / H, h = (r0 + r) - t * H;
    if (r < nrows) x[j] = *reinterpret_cast<const uint4*>(p.q + t * p.q_ld + h * 512 + 8 * c);
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kThreads, r = k / kChunks, c = k % kChunks;
    if (r < nrows) *reinterpret_cast<uint4*>(rows_s + r * kRowBytes + 16 * c) = x[j];
  }
  for (int k = threadIdx.x; k < ntok * (kRopeDim / 2); k += kThreads) {
    const int tt = k / (kRopeDim / 2), i = k % (kRopeDim / 2);
    cs_s[tt][i] = rope_cos_sin(__ldg(p.positions + t0 + tt), rf.inv_freq[i]);
  }
  __syncthreads();

  if (int(threadIdx.x) < nrows) {  // rms_norm_bf16_arith, one row per lane
    const uint8_t* row = rows_s + threadIdx.x * kRowBytes;
    float sum = 0.0f;
    for (int c = 0; c < kChunks; ++c) {
      float v[8];
      unpack8(*reinterpret_cast<const uint4*>(row + 16 * c), v);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum = __fadd_rn(sum, bf16_round(__fmul_rn(v[k], v[k])));
    }
    const float mean = bf16_round(__fdiv_rn(sum, 512.0f));
    inv_s[threadIdx.x] = bf16_round(__fdiv_rn(1.0f, __fsqrt_rn(bf16_round(__fadd_rn(mean, p.eps)))));
  }
  __syncthreads();

  for (int k = threadIdx.x; k < nrows * kChunks; k += kThreads) {
    const int r = k / kChunks, c = k % kChunks;
    const int64_t t = (r0 + r) / H, h = (r0 + r) - t * H;
    float v[8];
    unpack8(*reinterpret_cast<const uint4*>(rows_s + r * kRowBytes + 16 * c), v);
    const float inv = inv_s[r];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = bf16_round(__fmul_rn(v[j], inv));
    if (c >= kRopeChunk0) {  // pairs 4(c - 56) .. 4(c - 56) + 3 of the rotary part
      const float2* cs = cs_s[t - t0] + 4 * (c - kRopeChunk0);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        rope_rotate(v[2 * j], v[2 * j + 1], cs[j]);
        v[2 * j] = bf16_round(v[2 * j]);
        v[2 * j + 1] = bf16_round(v[2 * j + 1]);
      }
    }
    *reinterpret_cast<uint4*>(p.q + t * p.q_ld + h * 512 + 8 * c) = pack8(v);
  }
}

}  // namespace

void check_q_head_norm_rope_params(const QHeadNormRopeParams& p) {
  const std::string what = "q_head_norm_rope (cuda)";
  DSV4_REQUIRE(p.num_tokens >= 0, what + ": negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.num_heads > 0, what + ": num_heads must be positive");
  DSV4_REQUIRE(p.q && p.positions && p.rope, what + ": q, positions and rope are required");
  DSV4_REQUIRE(p.q_ld >= int64_t(p.num_heads) * 512 && p.q_ld % 8 == 0 && aligned(p.q, 16),
          what + ": q must be 16-byte aligned with a row stride >= num_heads * 512, a multiple of 8");
  DSV4_REQUIRE(p.eps >= 0.0f && p.eps < 1.0f, what + ": eps out of range");
  DSV4_REQUIRE((int64_t(p.num_tokens) * p.num_heads + kRows - 1) / kRows < (int64_t(1) << 31),
          what + ": too many rows for one launch");
}

void q_head_norm_rope_cuda(const QHeadNormRopeParams& p, CUstream_st* stream) {
  check_q_head_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const int64_t blocks = (int64_t(p.num_tokens) * p.num_heads + kRows - 1) / kRows;
  q_head_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p, rope_freqs(*p.rope));
  cuda_check(cudaGetLastError(), "q_head_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
