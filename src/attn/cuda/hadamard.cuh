#pragma once
// The 128-point Walsh-Hadamard rotation of numerics/hadamard.cpp on one warp
// (indexer keys in the compressor, indexer queries): lane l holds dims
// 4l .. 4l + 3. Strides h = 1, 2 run inside a lane, h = 4 .. 64 between lane
// l and l ^ (h / 4); the lower element of a pair becomes a + b, the upper
// a - b (a the lower's old value), every operation rounded as on the CPU.
#include <cuda_runtime.h>

namespace dsv4::cuda {

// y rotated, then each element times `scale`. All 32 lanes must call it.
__device__ __forceinline__ void hadamard128(float (&y)[4], float scale) {
  const float a0 = __fadd_rn(y[0], y[1]), a1 = __fsub_rn(y[0], y[1]);  // h = 1
  const float a2 = __fadd_rn(y[2], y[3]), a3 = __fsub_rn(y[2], y[3]);
  y[0] = __fadd_rn(a0, a2), y[2] = __fsub_rn(a0, a2);  // h = 2
  y[1] = __fadd_rn(a1, a3), y[3] = __fsub_rn(a1, a3);
  const int lane = int(threadIdx.x & 31);
#pragma unroll
  for (int s = 1; s < 32; s *= 2) {  // h = 4s: the partner is lane ^ s
    const bool upper = lane & s;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float o = __shfl_xor_sync(0xffffffffu, y[k], s);
      y[k] = upper ? __fsub_rn(o, y[k]) : __fadd_rn(y[k], o);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = __fmul_rn(y[k], scale);
}

}  // namespace dsv4::cuda
