// The indexer's exact FP8 dot on the device, for the score kernel's exact
// path (indexer_score.cu, tile_exact): indexer_fp8_dot's result bit for bit.
// The same integer sum S of (512 q_i)(512 k_i), exact in 64 bits whatever the
// order, then the same scaling; but the 128-byte records are read a word at
// a time and the codes decoded without branches. (The CPU function's byte
// loads from global memory and a branch per code made one token off the
// fast path cost 141 ms a call of the last 8K chunk of a 64K prefill: run
// AN4 in docs/perf-notes.md.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attn/cuda/fp8_dequant.cuh"
#include "attn/indexer_params.h"

namespace dsv4::cuda::ix {

// Byte b of w as indexer_e4m3_times512: a normal code (e > 0) is
// (8 + m) << (e - 1), a subnormal one m. (NaN codes decode as some integer:
// the caller checks them apart.) Not the CPU function itself: called on each
// byte here, one token off the fast path cost 49 ms a call instead of 45
// (run AO1 in docs/perf-notes.md); ExactFp8DotMatchesTheCpu checks the two
// agree on every code.
__device__ __forceinline__ int32_t e4m3_times512_byte(uint32_t w, int b) {
  const uint32_t c = (w >> (8 * b)) & 0xffu, e = (c >> 3) & 15u, normal = e != 0u ? 1u : 0u;
  const int32_t mag = int32_t(((c & 7u) | (normal << 3)) << (e - normal));
  return (c & 0x80u) ? -mag : mag;
}

// q: a query head's 128 codes in global memory; k: a key's (any memory);
// both 4-byte aligned. (A word at a time, not rolled further: an array of
// words indexed in a loop would live in local memory, and unrolled wider the
// kernels that inline this took 20-40 registers more.)
__device__ __forceinline__ float fp8_dot_exact(const uint8_t* q, float qs, const uint8_t* k, float ks) {
  int64_t s = 0;
  uint32_t nan = 0;
#pragma unroll 1
  for (int c = 0; c < kIndexDim / 4; ++c) {
    const uint32_t a = __ldg(reinterpret_cast<const uint32_t*>(q) + c), b = reinterpret_cast<const uint32_t*>(k)[c];
    nan |= e4m3_nan_flags(a) | e4m3_nan_flags(b);
#pragma unroll
    for (int j = 0; j < 4; ++j) s += int64_t(e4m3_times512_byte(a, j)) * e4m3_times512_byte(b, j);
  }
  return nan != 0 ? __int_as_float(0x7fc00000) : indexer_fp8_scale(double(s), qs, ks);  // (the CPU's quiet NaN)
}

}  // namespace dsv4::cuda::ix
