#pragma once
// Pieces shared by the fused elementwise ops (qkv_norm_rope, q_head_norm_rope,
// compressor_cuda, out_rope, residual_norm): RoPE and RMSNorm in the CPU's
// exact operation order (numerics/rope.cpp, numerics/rmsnorm.cpp), a fixed-order
// block reduction, and the host-side checks every launcher runs.
//
// Bitwise parity with the CPU: every float operation that the CPU rounds
// separately is an _rn intrinsic here (nvcc would otherwise contract a*b+c
// into an FMA). Two things can still differ, both in the last bit of a double
// before it is rounded to float, so the float result differs only where that
// double lies within a few double ulps of a float rounding boundary:
//  - cos/sin: glibc's and CUDA's double sin/cos (<= 2 ulp) may differ there;
//  - RMSNorm's double sum of squares: the CPU adds sequentially, the kernels
//    in a tree (identical whenever the sum is exact, e.g. bf16 inputs of a
//    moderate range).
// The tests detect those inputs and say so (tests/gpu/ops/fused_support.cuh).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "attn/cuda/fp8_act.h"
#include "attn/cuda/rope.cuh"
#include "attn/cuda/warp.cuh"
#include "cache/fp8_ds_mla.h"
#include "cache/pages.h"
#include "common/error.h"

namespace dsv4::cuda {

// ---- bf16 vectors ------------------------------------------------------------

// Four bf16 (8 bytes, the lowest first) as floats.
__device__ __forceinline__ void bf16x4_floats(uint2 raw, float (&v)[4]) {
  v[0] = bf16_load(uint16_t(raw.x & 0xffffu));
  v[1] = bf16_load(uint16_t(raw.x >> 16));
  v[2] = bf16_load(uint16_t(raw.y & 0xffffu));
  v[3] = bf16_load(uint16_t(raw.y >> 16));
}

__device__ __forceinline__ void load_bf16x4(const uint16_t* src, float (&v)[4]) {
  bf16x4_floats(*reinterpret_cast<const uint2*>(src), v);
}

__device__ __forceinline__ void store_bf16x4(uint16_t* dst, const float (&v)[4]) {
  uint2 w;
  w.x = bf16x2_pack(v[0], v[1]);
  w.y = bf16x2_pack(v[2], v[3]);
  *reinterpret_cast<uint2*>(dst) = w;
}

// Eight consecutive bf16 (16 bytes) as two quads of floats, and back.
__device__ __forceinline__ void bf16x8_floats(uint4 raw, float (&v)[2][4]) {
  bf16x4_floats(make_uint2(raw.x, raw.y), v[0]);
  bf16x4_floats(make_uint2(raw.z, raw.w), v[1]);
}

__device__ __forceinline__ void store_bf16x8(uint16_t* dst, const float (&v)[2][4]) {
  *reinterpret_cast<uint4*>(dst) = bf16x8_pack(v);
}

// ---- RMSNorm -----------------------------------------------------------------

// Sum of squares of four values in double, in element order.
__device__ __forceinline__ double sum_squares4(const float (&v)[4]) {
  double s = __dmul_rn(double(v[0]), double(v[0]));  // products of floats are exact in double
  s = __dadd_rn(s, __dmul_rn(double(v[1]), double(v[1])));
  s = __dadd_rn(s, __dmul_rn(double(v[2]), double(v[2])));
  return __dadd_rn(s, __dmul_rn(double(v[3]), double(v[3])));
}

// RMSNorm's factor from the sum of squares of n values, as rms_norm computes
// it: float(1 / sqrt(double(float(ss / n)) + double(eps))).
__device__ __forceinline__ float rms_inv(double ss, int n, float eps) {
  const float mean = __double2float_rn(__ddiv_rn(ss, double(n)));
  return __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(double(mean), double(eps)))));
}

// Block reduction in two steps: every warp sums its lanes (xor tree; all
// lanes get the same bits) and lane 0 stores the warp's sum in red[warp];
// after a __syncthreads() the caller adds red[first .. first + count) in
// warp order with red_sum. Fixed order: the same bits run to run.
__device__ __forceinline__ void warp_partial(double v, double* red) {
  v = group_sum<32>(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
}

__device__ __forceinline__ double red_sum(const double* red, int first, int count) {
  double s = red[first];
  for (int w = 1; w < count; ++w) s = __dadd_rn(s, red[first + w]);
  return s;
}

// ---- host side ---------------------------------------------------------------

inline void cuda_check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw Error(what + ": " + cudaGetErrorString(e));
}

inline bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// A cache written with 4- and 8-byte stores inside 16-byte aligned pages.
inline void check_pages_out(const KvPagesMut& c, size_t min_stride, const std::string& what) {
  DSV4_REQUIRE(c.base && c.num_pages > 0 && c.entries_per_page > 0, what + ": cache without pages");
  DSV4_REQUIRE(c.page_stride >= min_stride, what + ": page stride " + std::to_string(c.page_stride) +
                                           " smaller than a page of its records (" + std::to_string(min_stride) + ")");
  DSV4_REQUIRE(aligned(c.base, 16) && c.page_stride % 16 == 0,
          what + ": cache base and page stride must be 16-byte aligned");
}

}  // namespace dsv4::cuda
