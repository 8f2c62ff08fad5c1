// The q/kv kernel (qkv_norm_rope.h). A CTA takes kTok consecutive tokens:
// warps 0 .. nq-1 hold the q part (warp w = 128-wide block w, 4 elements per
// lane), the last four warps the 512-dim kv part (thread i of the part holds
// dims 4i .. 4i+3). One block reduction gives both sums of squares of every
// token of the CTA.
//
// Why several tokens a CTA: a token's row is 3 KB, and three CTAs of 384
// threads fit an SM, so with one token a CTA an SM had about 9 KB in flight
// (fused_bench: 4.7x the bytes at 8,192 tokens on an H100). Each thread now
// issues its tokens' loads at once, and the rotary threads read the step's
// table instead of computing two double-precision sincos a token. At 8,192
// tokens that took 60.8 to 43.8 us (BK2), still 3.4x the bytes: after its
// loads a CTA runs its tokens' chains (the double block sums, rms_inv's
// divisions and square root, the FP8 block maxima) one after another.
// Decode-size launches keep one token a CTA, spread over the SMs.
#include "attn/cuda/qkv_norm_rope.h"

#include <string>

#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/kv_record.cuh"
#include "attn/cuda/pdl.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kKvWarps = kKvDim / 128;              // 4
constexpr int kMaxQLora = (32 - kKvWarps) * 128;    // 3584: 1024 threads at most
constexpr int kRopeThread0 = kNopeDim / 4;          // kv thread holding dims 448..451
// Tokens a CTA by launch size: the fastest of 1, 2 and 4 in fused_bench
// (BK2, H100; the factors from the table): at 1,024 tokens 4 (7.2 us; 1:
// 7.7, 2: 8.3), whose 256 CTAs fit one wave at two an SM; at 8,192 tokens 2
// (43.8 us; 4: 49.2, 1: 49.0), three CTAs an SM over many waves.
constexpr int kFourTokens = 1024, kTwoTokens = 4096;
constexpr int kManyMaxThreads = 512;

// Thread rotating quad r of the rotary part (pairs 2r, 2r + 1): its factors
// for token t from out_rope_table_cuda's (cos, -sin) table, sines negated
// back (exact), so the same bits as rope_quad_factors.
__device__ __forceinline__ void table_quad_factors(float2 (&cs)[2], const float* table, int t, int r) {
  const float4 f = __ldg(reinterpret_cast<const float4*>(table) + int64_t(t) * (kRopeDim / 4) + r);
  cs[0] = make_float2(f.x, -f.y);
  cs[1] = make_float2(f.z, -f.w);
}

// kTok > 1 only up to kManyMaxThreads threads (q_lora up to 1536: Flash,
// Pro), so that the kTok rows and factors fit in registers without spills.
template <int kTok>
__global__ void __launch_bounds__(kTok == 1 ? 1024 : kManyMaxThreads)
    qkv_norm_rope_kernel(const QkvNormRopeParams p, const __grid_constant__ RopeFreqs rf) {
  __shared__ double red[kTok][32];
  const int t0 = int(blockIdx.x) * kTok, warp = int(threadIdx.x >> 5);
  const int n = min(kTok, p.num_tokens - t0);  // tokens of this CTA
  const int nq = p.q_lora / 128;
  const bool is_q = warp < nq;
  const int i = is_q ? int(threadIdx.x) : int(threadIdx.x) - 32 * nq;  // elements 4i .. 4i+3 of its part
  const bool rotates = !is_q && i >= kRopeThread0;  // dims 448..511: pairs q0 and q0 + 1 of the rotary part
  const int quad = i - kRopeThread0;
  // Before the wait (pdl.cuh): the norm weights, and from the step metadata
  // the SWA slots and, for one token, the rotation's computed factors
  // (nothing of the chain writes them; the table is a kernel's output).
  const float* w = (is_q ? p.q_norm : p.kv_norm) + 4 * i;
  float wn[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) wn[k] = __ldg(w + k);
  int32_t slot[kTok];
#pragma unroll
  for (int k = 0; k < kTok; ++k) slot[k] = is_q || k >= n ? -1 : __ldg(p.swa_slot + t0 + k);
  float2 cs[kTok][2] = {};
  if (kTok == 1 && rotates && !p.rope_table) rope_quad_factors(cs[0], __ldg(p.positions + t0), rf.inv_freq, quad);
  pdl_start();  // pdl.cuh: launched with pdl_launch

  uint2 raw[kTok] = {};  // the rows' bf16 as loaded: half the registers of floats
#pragma unroll
  for (int k = 0; k < kTok; ++k)
    if (k < n) raw[k] = *reinterpret_cast<const uint2*>(p.qkv + int64_t(t0 + k) * p.qkv_ld + (is_q ? 0 : p.q_lora) + 4 * i);
  if (rotates && p.rope_table) {
#pragma unroll
    for (int k = 0; k < kTok; ++k)
      if (k < n) table_quad_factors(cs[k], p.rope_table, t0 + k, quad);
  }
#pragma unroll
  for (int k = 0; k < kTok; ++k) {
    float v[4];
    bf16x4_floats(raw[k], v);
    warp_partial(sum_squares4(v), red[k]);
  }
  __syncthreads();

#pragma unroll
  for (int k = 0; k < kTok; ++k) {
    if (k >= n) break;
    const float inv = is_q ? rms_inv(red_sum(red[k], 0, nq), p.q_lora, p.eps)
                           : rms_inv(red_sum(red[k], nq, kKvWarps), kKvDim, p.eps);
    float y[4];
    bf16x4_floats(raw[k], y);
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = bf16_round(__fmul_rn(__fmul_rn(y[j], inv), wn[j]));
    if (is_q) {
      if (p.cq) store_bf16x4(p.cq + int64_t(t0 + k) * p.cq_ld + 4 * i, y);
      if (p.cq_fp8.data) store_act_block(p.cq_fp8, t0 + k, warp, y);
      continue;
    }
    if (rotates) {
      if (kTok > 1 && !p.rope_table) rope_quad_factors(cs[k], __ldg(p.positions + t0 + k), rf.inv_freq, quad);
      rope_rotate_quad_bf16(y, cs[k]);
    }
    int te = 0;
    uint8_t* page = record_page(p.swa, slot[k], te);  // the same for the four kv warps
    if (page) store_fp8_ds_mla(page, p.swa.entries_per_page, te, i, y);
  }
}

int tokens_per_cta(const QkvNormRopeParams& p) {
  if (32 * (p.q_lora / 128 + kKvWarps) > kManyMaxThreads) return 1;
  if (p.tokens_per_cta > 0) return p.tokens_per_cta;
  return p.num_tokens >= kTwoTokens ? 2 : p.num_tokens >= kFourTokens ? 4 : 1;
}

}  // namespace

void check_qkv_norm_rope_params(const QkvNormRopeParams& p) {
  const std::string what = "qkv_norm_rope (cuda)";
  DSV4_REQUIRE(p.num_tokens >= 0, what + ": negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.q_lora > 0 && p.q_lora % 128 == 0 && p.q_lora <= kMaxQLora,
          what + ": q_lora must be a positive multiple of 128 up to " + std::to_string(kMaxQLora) + ", not " +
              std::to_string(p.q_lora));
  DSV4_REQUIRE(p.qkv && p.q_norm && p.kv_norm && p.positions && p.rope && p.swa_slot,
          what + ": qkv, q_norm, kv_norm, positions, rope and swa_slot are required");
  DSV4_REQUIRE(p.qkv_ld >= p.q_lora + kKvDim && p.qkv_ld % 4 == 0 && aligned(p.qkv, 8),
          what + ": qkv must be 8-byte aligned with a row stride >= q_lora + 512, a multiple of 4");
  DSV4_REQUIRE(p.eps >= 0.0f && p.eps < 1.0f, what + ": eps out of range");
  if (p.cq)
    DSV4_REQUIRE(p.cq_ld >= p.q_lora && p.cq_ld % 4 == 0 && aligned(p.cq, 8),
            what + ": cq must be 8-byte aligned with a row stride >= q_lora, a multiple of 4");
  if (p.cq_fp8.data || p.cq_fp8.scales) check_fp8_out(p.cq_fp8, p.num_tokens, p.q_lora, what + " cq_fp8");
  check_pages_out(p.swa, fp8_ds_mla_page_stride(p.swa.entries_per_page), what + " swa");
  DSV4_REQUIRE(p.rope_table == nullptr || aligned(p.rope_table, 16), what + ": rope_table must be 16-byte aligned");
  DSV4_REQUIRE(p.tokens_per_cta == 0 || p.tokens_per_cta == 1 || p.tokens_per_cta == 2 || p.tokens_per_cta == 4,
               what + ": tokens_per_cta must be 0 (chosen by size), 1, 2 or 4, not " + std::to_string(p.tokens_per_cta));
}

void qkv_norm_rope_cuda(const QkvNormRopeParams& p, CUstream_st* stream) {
  check_qkv_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const unsigned threads = 32u * unsigned(p.q_lora / 128 + kKvWarps);
  const int tok = tokens_per_cta(p);
  const unsigned ctas = unsigned((p.num_tokens + tok - 1) / tok);
  // One token a CTA computes its factors before the PDL wait, behind the
  // previous kernel's tail, even where a table is given: reading the table
  // after the wait made the 1 x 4K step 0.5-0.7% slower (BK2, H100).
  QkvNormRopeParams q = p;
  if (tok == 1) q.rope_table = nullptr;
  if (tok == 4)
    pdl_launch(qkv_norm_rope_kernel<4>, ctas, threads, 0, stream, q, p.rope->freqs());
  else if (tok == 2)
    pdl_launch(qkv_norm_rope_kernel<2>, ctas, threads, 0, stream, q, p.rope->freqs());
  else
    pdl_launch(qkv_norm_rope_kernel<1>, ctas, threads, 0, stream, q, p.rope->freqs());
  cuda_check(cudaGetLastError(), "qkv_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
