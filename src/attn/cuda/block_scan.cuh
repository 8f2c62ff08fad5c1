#pragma once
// A CTA-wide exclusive prefix sum in thread order, for the one-CTA plan
// kernels (sparse_mla_plan.cu, indexer_plan.cu): warp scans by shuffles,
// then one warp scans the warps' sums. Every thread of the CTA (kThreads,
// a multiple of 32) must call it; *total gets the sum over all threads.
// It ends with a barrier, so it may be called again at once.
#include <cuda_runtime.h>

namespace dsv4::cuda {

template <int kThreads, typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* total) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr int kWarps = kThreads / 32;
  __shared__ T warp_sums[kWarps + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const T w = lane < kWarps ? warp_sums[lane] : T(0);
    T wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T x = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += x;
    }
    if (lane < kWarps) warp_sums[lane] = wi - w;  // the warps before this one
    if (lane == 31) warp_sums[kWarps] = wi;
  }
  __syncthreads();
  const T excl = warp_sums[warp] + incl - v;
  *total = warp_sums[kWarps];
  __syncthreads();  // warp_sums is free for the next call
  return excl;
}

}  // namespace dsv4::cuda
