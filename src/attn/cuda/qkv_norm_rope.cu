// The q/kv kernels (qkv_norm_rope.h): a CTA a token for decode sizes, a warp
// a token for prefill sizes. Both give the CPU's bits; they differ only in
// how a token's elements are spread over threads (and so in the order of the
// double sums of squares, exact for bf16 inputs of a moderate range).
//
// History at 8,192 tokens (x the bytes at 4.3 TB/s): a CTA a token 4.7x
// (BJ1); CTAs of two or four tokens with their loads at once 3.4x (BK2),
// each CTA still running its tokens' chains (block reduction, rms_inv, FP8
// maxima) one after another; a warp a token 1.8x (23.6 us, BL3, H100).
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
constexpr int kRopeLane0 = (kNopeDim - 256) / 8;    // warp kernel: kv round 1's lane holding dims 448..455
constexpr int kMaxWarpsACta = 8;
// Tokens a CTA by launch size (fused_bench, BL3 on an H100, us for a CTA a
// token / a warp a token with 2, 4, 8 a CTA): 256 tokens 2.9 / 4.5 / 4.5 /
// 4.7, 512: 5.5 / 4.8 / 5.7 / 6.0, 1,024: 9.0 / 6.1 / 8.0 / 8.5, 8,192:
// 61.9 / 24.4 / 23.6 / 23.6. A lone warp's chain (48 elements a lane) is
// longer than a CTA's (4 a thread), so small launches keep a CTA a token.
constexpr int kWarpTokens = 512, kEightWarpTokens = 4096;

// Normalizes four loaded values: bf16(x * inv * w), the CPU's order.
__device__ __forceinline__ void norm_quad(float (&y)[4], float inv, const float (&w)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) y[j] = bf16_round(__fmul_rn(__fmul_rn(y[j], inv), w[j]));
}

// Four norm weights w[c .. c+3] (c a multiple of 4, w 16-byte aligned).
__device__ __forceinline__ void weights4(const float* w, int c, float (&out)[4]) {
  const float4 f = *reinterpret_cast<const float4*>(w + c);
  out[0] = f.x, out[1] = f.y, out[2] = f.z, out[3] = f.w;
}

// A CTA a token (decode sizes, and shapes the warp kernel does not take):
// warps 0 .. nq-1 hold the q part (warp w = 128-wide block w, 4 elements per
// lane), the last four warps the 512-dim kv part (thread i of the part holds
// dims 4i .. 4i+3); one block reduction gives both sums of squares. Spread
// over the SMs, a decode step's few tokens finish soonest this way; the
// rotation's factors are computed before the PDL wait (reading the step's
// table after it made the 1 x 4K step 0.5-0.7% slower, BK2).
__global__ void __launch_bounds__(1024)
    qkv_norm_rope_cta_kernel(const QkvNormRopeParams p, const __grid_constant__ RopeFreqs rf) {
  __shared__ double red[32];
  const int t = int(blockIdx.x), warp = int(threadIdx.x >> 5);
  const int nq = p.q_lora / 128;
  const bool is_q = warp < nq;
  const int i = is_q ? int(threadIdx.x) : int(threadIdx.x) - 32 * nq;  // elements 4i .. 4i+3 of its part
  const bool rotates = !is_q && i >= kRopeThread0;  // dims 448..511: pairs q0 and q0 + 1 of the rotary part
  // Before the wait (pdl.cuh): the norm weights, and from the step metadata
  // the SWA slot and the rotation's factors.
  const float* w = (is_q ? p.q_norm : p.kv_norm) + 4 * i;
  float wn[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) wn[k] = __ldg(w + k);
  const int32_t slot = is_q ? -1 : __ldg(p.swa_slot + t);
  float2 cs[2] = {};
  if (rotates) rope_quad_factors(cs, __ldg(p.positions + t), rf.inv_freq, i - kRopeThread0);
  pdl_start();  // pdl.cuh: launched with pdl_launch

  float y[4];
  load_bf16x4(p.qkv + int64_t(t) * p.qkv_ld + (is_q ? 0 : p.q_lora) + 4 * i, y);
  warp_partial(sum_squares4(y), red);
  __syncthreads();
  const float inv = is_q ? rms_inv(red_sum(red, 0, nq), p.q_lora, p.eps)
                         : rms_inv(red_sum(red, nq, kKvWarps), kKvDim, p.eps);
  norm_quad(y, inv, wn);
  if (is_q) {
    if (p.cq) store_bf16x4(p.cq + int64_t(t) * p.cq_ld + 4 * i, y);
    if (p.cq_fp8.data) store_act_block(p.cq_fp8, t, warp, y);
    return;
  }
  if (rotates) rope_rotate_quad_bf16(y, cs);
  int te = 0;
  uint8_t* page = record_page(p.swa, slot, te);  // the same for the four kv warps
  if (page) store_fp8_ds_mla(page, p.swa.entries_per_page, te, i, y);
}

// A warp a token, for prefill sizes (q_lora 1024 or 1536: kQRounds = q_lora
// / 256). Lane l holds elements 8l .. 8l+7 of every 256-wide round of the q
// part, then of the kv part's two rounds (16-byte loads, a row's all issued
// at once); warp shuffles give the sums of squares, so no block barrier.
// Why: with a CTA a token an SM held three CTAs of up to four tokens (about
// 18 KB of loads in flight) and ran each token's chain (block reduction,
// rms_inv, FP8 maxima) one after another, 3.4x the bytes at 8,192 tokens
// (BK2); here up to 32 warps an SM each have a 3-4 KB row in flight.
template <int kQRounds>
__global__ void __launch_bounds__(kMaxWarpsACta * 32)
    qkv_norm_rope_warp_kernel(const QkvNormRopeParams p, const __grid_constant__ RopeFreqs rf) {
  constexpr int kRounds = kQRounds + 2;
  // The norm weights, q's then kv's, for the CTA's warps. In shared memory,
  // not read from global memory round by round: the compiler must keep such
  // loads after the previous round's global stores (they may alias), a
  // round trip a round (4.5 us for 8 tokens, 29 at 8,192; BL2).
  __shared__ __align__(16) float w_s[kRounds * 256];
  const int lane = int(threadIdx.x & 31);
  const int t = int(blockIdx.x) * int(blockDim.x >> 5) + int(threadIdx.x >> 5);
  const bool live = t < p.num_tokens;
  const bool rotates = lane >= kRopeLane0;  // kv round 1: rotary quads 2r, 2r + 1 with r = lane - kRopeLane0
  const int quad = 2 * (lane - kRopeLane0);
  // Before the wait: the weights (no kernel writes them), the slot and the
  // rotation's factors (step metadata). Computed here, not read from the
  // step's table after the wait: as fast at 8,192 tokens, 0.7-2 us faster
  // at 512-1,024 (BL3).
  for (int k = int(threadIdx.x); k < kRounds * 64; k += int(blockDim.x)) {
    const float* w = k < kQRounds * 64 ? p.q_norm + 4 * k : p.kv_norm + 4 * (k - kQRounds * 64);
    reinterpret_cast<float4*>(w_s)[k] = __ldg(reinterpret_cast<const float4*>(w));
  }
  const int32_t slot = live ? __ldg(p.swa_slot + t) : -1;
  float2 cs[2][2] = {};
  if (live && rotates) {
    const int32_t pos = __ldg(p.positions + t);
    rope_quad_factors(cs[0], pos, rf.inv_freq, quad);
    rope_quad_factors(cs[1], pos, rf.inv_freq, quad + 1);
  }
  pdl_start();

  const uint16_t* row = p.qkv + int64_t(t) * p.qkv_ld + 8 * lane;
  uint4 raw[kRounds] = {};  // the row's bf16 as loaded
  if (live) {
#pragma unroll
    for (int r = 0; r < kRounds; ++r)
      raw[r] = *reinterpret_cast<const uint4*>(row + (r < kQRounds ? 256 * r : p.q_lora + 256 * (r - kQRounds)));
  }
  __syncthreads();  // w_s
  if (!live) return;  // the whole warp
  double ss[2] = {0.0, 0.0};  // q, kv
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    float v[2][4];
    bf16x8_floats(raw[r], v);
    double& s = ss[r < kQRounds ? 0 : 1];
    s = __dadd_rn(s, __dadd_rn(sum_squares4(v[0]), sum_squares4(v[1])));
  }
  const float inv_q = rms_inv(group_sum<32>(ss[0]), p.q_lora, p.eps);
  const float inv_kv = rms_inv(group_sum<32>(ss[1]), kKvDim, p.eps);

#pragma unroll
  for (int r = 0; r < kQRounds; ++r) {
    const int c = 256 * r + 8 * lane;
    float y[2][4], w[2][4];
    bf16x8_floats(raw[r], y);
    weights4(w_s, c, w[0]);
    weights4(w_s, c + 4, w[1]);
    norm_quad(y[0], inv_q, w[0]);
    norm_quad(y[1], inv_q, w[1]);
    if (p.cq) store_bf16x8(p.cq + int64_t(t) * p.cq_ld + c, y);
    if (p.cq_fp8.data) store_act_piece<2>(p.cq_fp8, t, c, y);
  }
  int te = 0;
  uint8_t* page = record_page(p.swa, slot, te);  // the same for the whole warp
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int c = 256 * r + 8 * lane;
    float y[2][4], w[2][4];
    bf16x8_floats(raw[kQRounds + r], y);
    weights4(w_s, 256 * kQRounds + c, w[0]);
    weights4(w_s, 256 * kQRounds + c + 4, w[1]);
    norm_quad(y[0], inv_kv, w[0]);
    norm_quad(y[1], inv_kv, w[1]);
    if (r == 1 && rotates) {
      rope_rotate_quad_bf16(y[0], cs[0]);
      rope_rotate_quad_bf16(y[1], cs[1]);
    }
    if (page) store_fp8_ds_mla_piece<2>(page, p.swa.entries_per_page, te, 32 * r + lane, y);
  }
}

// Whether the warp kernel takes these parameters: its q_lora instantiations,
// and the 16-byte loads and stores (8-byte FP8 codes) it issues.
bool warp_kernel_takes(const QkvNormRopeParams& p) {
  return (p.q_lora == 1024 || p.q_lora == 1536) && aligned(p.qkv, 16) && p.qkv_ld % 8 == 0 &&
         aligned(p.q_norm, 16) && aligned(p.kv_norm, 16) &&
         (!p.cq || (aligned(p.cq, 16) && p.cq_ld % 8 == 0)) &&
         (!p.cq_fp8.data || (aligned(p.cq_fp8.data, 8) && p.cq_fp8.ld % 8 == 0));
}

}  // namespace

int qkv_norm_rope_tokens_per_cta(const QkvNormRopeParams& p) {
  if (!warp_kernel_takes(p)) return 1;
  if (p.tokens_per_cta > 0) return p.tokens_per_cta;
  return p.num_tokens >= kEightWarpTokens ? kMaxWarpsACta : p.num_tokens >= kWarpTokens ? 2 : 1;
}

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
  DSV4_REQUIRE(p.tokens_per_cta == 0 || p.tokens_per_cta == 1 || p.tokens_per_cta == 2 || p.tokens_per_cta == 4 ||
                   p.tokens_per_cta == kMaxWarpsACta,
               what + ": tokens_per_cta must be 0 (chosen by size), 1, 2, 4 or 8, not " + std::to_string(p.tokens_per_cta));
}

void qkv_norm_rope_cuda(const QkvNormRopeParams& p, CUstream_st* stream) {
  check_qkv_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const int tok = qkv_norm_rope_tokens_per_cta(p);
  const unsigned ctas = unsigned((p.num_tokens + tok - 1) / tok);
  if (tok == 1)
    pdl_launch(qkv_norm_rope_cta_kernel, ctas, 32u * unsigned(p.q_lora / 128 + kKvWarps), 0, stream, p,
               p.rope->freqs());
  else if (p.q_lora == 1024)
    pdl_launch(qkv_norm_rope_warp_kernel<4>, ctas, 32u * unsigned(tok), 0, stream, p, p.rope->freqs());
  else
    pdl_launch(qkv_norm_rope_warp_kernel<6>, ctas, 32u * unsigned(tok), 0, stream, p, p.rope->freqs());
  cuda_check(cudaGetLastError(), "qkv_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
