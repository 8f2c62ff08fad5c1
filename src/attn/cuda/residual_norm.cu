// Residual add + RMSNorm + bf16/FP8 (residual_norm.h). One CTA per row, up to
// 16 warps; warp w holds the 128-wide blocks w, w + warps, ... (4 elements per
// lane and block, at most kBlocks blocks per warp: an instantiation per bound
// keeps registers low enough for two CTAs of 512 threads per SM) in registers
// between the sum of squares and the stores. The blocks' pieces are
// residual_rows.cuh's, which wo_b's residual tail runs too.
#include "attn/cuda/residual_norm.h"

#include <algorithm>
#include <string>

#include "attn/cuda/pdl.cuh"
#include "attn/cuda/residual_rows.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kMaxWarps = 16;
constexpr int kMaxBlocks = 8;  // per warp
constexpr int kMaxDim = kResidualMaxDim;
static_assert(kMaxDim == kMaxWarps * kMaxBlocks * 128);

int warps_for(int dim) { return std::min(kMaxWarps, dim / 128); }

template <int kBlocks>
__global__ void __launch_bounds__(kMaxWarps * 32, 2) residual_norm_kernel(const ResidualNormParams p) {
  __shared__ double red[kMaxDim / 128];  // the row's block sums
  const int t = blockIdx.x, warp = int(threadIdx.x >> 5);
  const int warps = int(blockDim.x >> 5), blocks = p.dim / 128;
  const bool real = t < residual_real_rows(p);  // step metadata: before the wait
  pdl_start();  // pdl.cuh: launched with pdl_launch
  const bool norm = p.mode == ResidualMode::kAddNorm;
  float4 v[kBlocks];
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
    const int kb = warp + j * warps;
    v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (kb >= blocks) continue;
    if (real) v[j] = residual_block_in(p, t, kb);
    if (norm) {
      const double s = residual_block_squares(v[j]);
      if ((threadIdx.x & 31) == 0) red[kb] = s;
    }
  }
  float inv = 1.0f;
  if (norm) {  // uniform over the CTA: every thread reaches the barrier
    __syncthreads();
    inv = residual_row_inv(p, red);
  }
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
    const int kb = warp + j * warps;
    if (kb >= blocks) break;
    residual_block_out(p, t, kb, v[j], inv, real);
  }
}

}  // namespace

void check_residual_norm_params(const ResidualNormParams& p) {
  const std::string what = "residual_norm (cuda)";
  DSV4_REQUIRE(p.num_tokens >= 0, what + ": negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.dim > 0 && p.dim % 128 == 0 && p.dim <= kMaxDim,
          what + ": dim must be a positive multiple of 128 up to " + std::to_string(kMaxDim) + ", not " +
              std::to_string(p.dim));
  DSV4_REQUIRE(p.x || p.x_fp8.data, what + ": neither x nor x_fp8 is written");
  if (p.mode == ResidualMode::kAddNorm) {
    DSV4_REQUIRE(p.h && p.h_ld >= p.dim && p.h_ld % 4 == 0 && aligned(p.h, 16),
            what + ": h must be 16-byte aligned with a row stride >= dim, a multiple of 4");
    if (p.y)
      DSV4_REQUIRE(p.y_ld >= p.dim && p.y_ld % 4 == 0 && aligned(p.y, 8),
              what + ": y must be 8-byte aligned with a row stride >= dim, a multiple of 4");
    DSV4_REQUIRE(p.eps >= 0.0f && p.eps < 1.0f, what + ": eps out of range");
  } else {
    DSV4_REQUIRE(p.input && p.input_ld >= p.dim && p.input_ld % 4 == 0 && aligned(p.input, 16),
            what + ": input must be 16-byte aligned with a row stride >= dim, a multiple of 4");
  }
  if (p.x)
    DSV4_REQUIRE(p.x_ld >= p.dim && p.x_ld % 4 == 0 && aligned(p.x, 8),
            what + ": x must be 8-byte aligned with a row stride >= dim, a multiple of 4");
  if (p.x_fp8.data || p.x_fp8.scales) check_fp8_out(p.x_fp8, p.num_tokens, p.dim, what + " x_fp8");
  DSV4_REQUIRE(!p.num_real_tokens || aligned(p.num_real_tokens, 4), what + ": num_real_tokens misaligned");
}

void residual_norm_cuda(const ResidualNormParams& p, CUstream_st* stream) {
  check_residual_norm_params(p);
  if (p.num_tokens == 0) return;
  const int warps = warps_for(p.dim), per_warp = (p.dim / 128 + warps - 1) / warps;
  const dim3 grid(unsigned(p.num_tokens)), block(unsigned(32 * warps));
  if (per_warp <= 2)
    pdl_launch(residual_norm_kernel<2>, grid, block, 0, stream, p);
  else if (per_warp <= 4)
    pdl_launch(residual_norm_kernel<4>, grid, block, 0, stream, p);
  else
    pdl_launch(residual_norm_kernel<kMaxBlocks>, grid, block, 0, stream, p);
  cuda_check(cudaGetLastError(), "residual_norm (cuda): launch");
}

}  // namespace dsv4::cuda
