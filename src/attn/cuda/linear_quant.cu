// bf16 -> Fp8Act quantization and the scale repack for cuBLASLt.
#include <cuda_runtime.h>

#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/linear_internal.h"
#include "attn/cuda/pdl.cuh"

namespace dsv4::cuda::detail {
namespace {

constexpr int kQuantWarps = 8;

// One warp per (row, 128-block): lane l quantizes elements 4l .. 4l+3.
__global__ void __launch_bounds__(32 * kQuantWarps) quantize_bf16_kernel(const uint16_t* x, int64_t ldx, Fp8ActOut out) {
  pdl_start();  // pdl.cuh: launched with pdl_launch
  const int kblocks = out.cols / kActBlock;
  const int64_t item = int64_t(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
  if (item >= int64_t(out.rows) * kblocks) return;
  const int r = int(item / kblocks), kb = int(item % kblocks);
  const uint16_t* src = x + r * ldx + kb * kActBlock + 4 * (threadIdx.x & 31);
  const float v[4] = {bf16_load(src[0]), bf16_load(src[1]), bf16_load(src[2]), bf16_load(src[3])};
  store_act_block(out, r, kb, v);
}

__global__ void repack_scales_kernel(const float* in, int64_t ld_in, float* out, int rows, int kblocks) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * kblocks) return;
  const int64_t kb = i / rows, r = i % rows;
  out[i] = in[kb * ld_in + r];
}

}  // namespace

void launch_quantize_bf16(const uint16_t* x, int64_t ldx, const Fp8ActOut& out, CUstream_st* stream) {
  const int64_t items = int64_t(out.rows) * (out.cols / kActBlock);
  if (items == 0) return;
  const unsigned blocks = unsigned((items + kQuantWarps - 1) / kQuantWarps);
  pdl_launch(quantize_bf16_kernel, blocks, 32 * kQuantWarps, 0, stream, x, ldx, out);
  check_cuda(cudaGetLastError(), "quantize kernel launch");
}

void launch_repack_scales(const float* in, int64_t ld_in, float* out, int rows, int kblocks, CUstream_st* stream) {
  const int64_t n = int64_t(rows) * kblocks;
  if (n == 0) return;
  repack_scales_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(in, ld_in, out, rows, kblocks);
  check_cuda(cudaGetLastError(), "scale repack launch");
}

}  // namespace dsv4::cuda::detail
