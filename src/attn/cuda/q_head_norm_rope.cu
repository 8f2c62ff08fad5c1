// The per-head q norm and RoPE (q_head_norm_rope.h). The (token, head) rows
// are numbered r = t * H + h; a CTA takes 8 consecutive rows:
//  1. all threads copy the rows to shared memory (16-byte loads, coalesced),
//     store the rows' bf16-rounded squares beside them, and compute cos/sin
//     of the tokens the rows belong to;
//  2. one lane per row runs the sequential fp32 sum of those squares (the
//     CPU's order: a chain of 512 dependent adds, about 1 us, so the squares
//     are made in parallel beforehand and rows are spread over many CTAs:
//     a decode token's 64 heads take 8 CTAs) and the row's bf16 factor;
//  3. all threads scale, rotate dims 448..511 and store (16-byte stores).
// Square rows are padded by 4 floats, so the 16-byte reads of step 2 (8
// lanes, 8 rows, one column) hit distinct banks.
#include "attn/cuda/q_head_norm_rope.h"

#include <string>

#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/pdl.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kRows = 8;           // (token, head) rows per CTA
constexpr int kThreads = 256;
constexpr int kChunks = 512 / 8;   // 16-byte chunks per row
constexpr int kSqStride = 512 + 4;  // floats per row of squares
constexpr int kRopeChunk0 = kNopeDim / 8;  // chunk holding dims 448..455
constexpr int kPerThread = kRows * kChunks / kThreads;  // 16-byte chunks each thread copies
static_assert(kRows * kChunks % kThreads == 0 && kRows <= 32);

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
  pdl_start();  // pdl.cuh: launched with pdl_launch
  __shared__ __align__(16) uint4 rows_s[kRows][kChunks];
  __shared__ __align__(16) float sq_s[kRows][kSqStride];
  __shared__ float inv_s[kRows];
  __shared__ float2 cs_s[kRows][kRopeDim / 2];  // per token of the CTA's rows
  const int H = p.num_heads;
  const int r0 = int(blockIdx.x) * kRows;  // rows < 2^31 (checked on the host)
  const int nrows = min(kRows, p.num_tokens * H - r0);
  const int t0 = r0 / H;
  const int ntok = (r0 + nrows - 1) / H - t0 + 1;  // <= kRows

  // All of a thread's loads first, then the copies and squares.
  uint4 x[kPerThread];
  uint16_t* src[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kThreads, r = k / kChunks, c = k % kChunks;
    const int t = (r0 + r) / H, h = (r0 + r) - t * H;
    src[j] = p.q + int64_t(t) * p.q_ld + h * 512 + 8 * c;
    if (r < nrows) x[j] = *reinterpret_cast<const uint4*>(src[j]);
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kThreads, r = k / kChunks, c = k % kChunks;
    if (r >= nrows) continue;
    rows_s[r][c] = x[j];
    float v[8];
    unpack8(x[j], v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = bf16_round(__fmul_rn(v[i], v[i]));
    float4* sq = reinterpret_cast<float4*>(&sq_s[r][8 * c]);
    sq[0] = make_float4(v[0], v[1], v[2], v[3]);
    sq[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  for (int k = threadIdx.x; k < ntok * (kRopeDim / 2); k += kThreads) {
    const int tt = k / (kRopeDim / 2), i = k % (kRopeDim / 2);
    cs_s[tt][i] = rope_cos_sin(__ldg(p.positions + t0 + tt), rf.inv_freq[i]);
  }
  __syncthreads();

  if (int(threadIdx.x) < nrows) {  // rms_norm_bf16_arith, one row per lane
    const float4* sq = reinterpret_cast<const float4*>(sq_s[threadIdx.x]);
    float sum = 0.0f;
#pragma unroll 8
    for (int c = 0; c < 128; ++c) {
      const float4 s = sq[c];
      sum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(sum, s.x), s.y), s.z), s.w);
    }
    const float mean = bf16_round(__fdiv_rn(sum, 512.0f));
    inv_s[threadIdx.x] = bf16_round(__fdiv_rn(1.0f, __fsqrt_rn(bf16_round(__fadd_rn(mean, p.eps)))));
  }
  __syncthreads();

#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int k = int(threadIdx.x) + j * kThreads, r = k / kChunks, c = k % kChunks;
    if (r >= nrows) continue;
    float v[8];
    unpack8(rows_s[r][c], v);
    const float inv = inv_s[r];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = bf16_round(__fmul_rn(v[i], inv));
    if (c >= kRopeChunk0) {  // pairs 4(c - 56) .. 4(c - 56) + 3 of the rotary part
      const float2* cs = cs_s[(r0 + r) / H - t0] + 4 * (c - kRopeChunk0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        rope_rotate(v[2 * i], v[2 * i + 1], cs[i]);
        v[2 * i] = bf16_round(v[2 * i]);
        v[2 * i + 1] = bf16_round(v[2 * i + 1]);
      }
    }
    *reinterpret_cast<uint4*>(src[j]) = pack8(v);
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
  DSV4_REQUIRE(int64_t(p.num_tokens) * p.num_heads + kRows < (int64_t(1) << 31),
          what + ": too many (token, head) rows for one launch (2^31)");
}

void q_head_norm_rope_cuda(const QHeadNormRopeParams& p, CUstream_st* stream) {
  check_q_head_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const int64_t blocks = (int64_t(p.num_tokens) * p.num_heads + kRows - 1) / kRows;
  pdl_launch(q_head_kernel, unsigned(blocks), kThreads, 0, stream, p, rope_freqs(*p.rope));
  cuda_check(cudaGetLastError(), "q_head_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
