// The q/kv kernel (qkv_norm_rope.h). One CTA per token: warps 0 .. nq-1 hold
// the q part (warp w = 128-wide block w, 4 elements per lane), the last four
// warps the 512-dim kv part (thread i of the part holds dims 4i .. 4i+3).
// One block reduction gives both sums of squares.
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

__global__ void __launch_bounds__(1024)
    qkv_norm_rope_kernel(const QkvNormRopeParams p, const __grid_constant__ RopeFreqs rf) {
  __shared__ double red[32];
  const int t = blockIdx.x, warp = int(threadIdx.x >> 5);
  const int nq = p.q_lora / 128;
  const bool is_q = warp < nq;
  const int i = is_q ? int(threadIdx.x) : int(threadIdx.x) - 32 * nq;  // elements 4i .. 4i+3 of its part
  // Before the wait (pdl.cuh): the norm weights, and from the step metadata
  // the rotation's factors and the SWA record (nothing of the chain writes them).
  const float* w = (is_q ? p.q_norm : p.kv_norm) + 4 * i;
  float wn[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) wn[k] = __ldg(w + k);
  const bool rotates = !is_q && i >= kRopeThread0;  // dims 448..511: pairs q0 and q0 + 1 of the rotary part
  float2 cs[2] = {};
  if (rotates) rope_quad_factors(cs, __ldg(p.positions + t), rf.inv_freq, i - kRopeThread0);
  int te = 0;
  uint8_t* page = is_q ? nullptr : record_page(p.swa, __ldg(p.swa_slot + t), te);  // the same for the four kv warps
  pdl_start();  // pdl.cuh: launched with pdl_launch

  float v[4];
  load_bf16x4(p.qkv + int64_t(t) * p.qkv_ld + (is_q ? 0 : p.q_lora) + 4 * i, v);
  warp_partial(sum_squares4(v), red);
  __syncthreads();
  const float inv = is_q ? rms_inv(red_sum(red, 0, nq), p.q_lora, p.eps)
                         : rms_inv(red_sum(red, nq, kKvWarps), kKvDim, p.eps);
  float y[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = bf16_round(__fmul_rn(__fmul_rn(v[k], inv), wn[k]));

  if (is_q) {
    if (p.cq) store_bf16x4(p.cq + int64_t(t) * p.cq_ld + 4 * i, y);
    if (p.cq_fp8.data) store_act_block(p.cq_fp8, t, warp, y);
    return;
  }
  if (rotates) rope_rotate_quad_bf16(y, cs);
  if (page) store_fp8_ds_mla(page, p.swa.entries_per_page, te, i, y);
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
}

void qkv_norm_rope_cuda(const QkvNormRopeParams& p, CUstream_st* stream) {
  check_qkv_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const int threads = 32 * (p.q_lora / 128 + kKvWarps);
  pdl_launch(qkv_norm_rope_kernel, unsigned(p.num_tokens), unsigned(threads), 0, stream, p, p.rope->freqs());
  cuda_check(cudaGetLastError(), "qkv_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
