#pragma once
// The pieces of residual_norm (residual_norm.h) that its kernel and the FP8
// linears' residual tail (wo_b's kernel: linear_gemv.cuh) share, so both
// give the same bits. A warp handles one 128-wide block of a row at a time,
// lane l its elements 4l .. 4l+3. A row's sum of squares is each block's
// sum over its lanes (xor tree) added block after block in order: the same
// order whatever the number of warps.
#include <cuda_runtime.h>

#include <cstdint>

#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/residual_norm.h"

namespace dsv4::cuda {

// Rows of p at and past the real count are padding: never read, h left alone.
__device__ __forceinline__ int residual_real_rows(const ResidualNormParams& p) {
  if (!p.num_real_tokens) return p.num_tokens;
  const int real = __ldg(p.num_real_tokens);
  return real < p.num_tokens ? real : p.num_tokens;
}

// This lane's four values of block kb of row t: kAddNorm h (+ y, stored back
// to h where p.y), kLoad the input. Through L2 (ld.global.cg): in the tail,
// y was written by other CTAs of the same kernel.
__device__ __forceinline__ float4 residual_block_in(const ResidualNormParams& p, int t, int kb) {
  const int col = kb * 128 + 4 * int(threadIdx.x & 31);
  if (p.mode == ResidualMode::kLoad) return __ldcg(reinterpret_cast<const float4*>(p.input + int64_t(t) * p.input_ld + col));
  float4* hp = reinterpret_cast<float4*>(p.h + int64_t(t) * p.h_ld + col);
  float4 a = __ldcg(hp);
  if (p.y) {
    float y[4];
    bf16x4_floats(__ldcg(reinterpret_cast<const uint2*>(p.y + int64_t(t) * p.y_ld + col)), y);
    a.x = __fadd_rn(a.x, y[0]);
    a.y = __fadd_rn(a.y, y[1]);
    a.z = __fadd_rn(a.z, y[2]);
    a.w = __fadd_rn(a.w, y[3]);
    *hp = a;
  }
  return a;
}

// The block's sum of squares, in every lane of the warp.
__device__ __forceinline__ double residual_block_squares(float4 a) {
  const float v[4] = {a.x, a.y, a.z, a.w};
  return group_sum<32>(sum_squares4(v));
}

// A row's sum of squares from its blocks' sums (red[0 .. blocks)), in block order.
__device__ __forceinline__ float residual_row_inv(const ResidualNormParams& p, const double* red) {
  return rms_inv(red_sum(red, 0, p.dim / 128), p.dim, p.eps);
}

// Writes x (bf16 and/or FP8) of block kb of row t from its values a: scaled
// by inv (kAddNorm), as is (kLoad), or zeros (padding). Every lane of the
// warp takes part (the FP8 block's amax).
__device__ __forceinline__ void residual_block_out(const ResidualNormParams& p, int t, int kb, float4 a, float inv,
                                                   bool real) {
  const bool norm = p.mode == ResidualMode::kAddNorm;
  const float in[4] = {a.x, a.y, a.z, a.w};
  float x[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = real ? bf16_round(norm ? __fmul_rn(in[k], inv) : in[k]) : 0.0f;
  if (p.x) store_bf16x4(p.x + int64_t(t) * p.x_ld + kb * 128 + 4 * int(threadIdx.x & 31), x);
  if (p.x_fp8.data) store_act_block(p.x_fp8, t, kb, x);
}

}  // namespace dsv4::cuda
