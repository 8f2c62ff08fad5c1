// Indexer query preparation on the GPU: RoPE, Hadamard rotation and block
// quantization of every head, and the head weights (attn/indexer_params.h).
// Each step reproduces indexer_queries_cpu's float operations in the same
// order, with explicit round-to-nearest intrinsics so that nvcc contracts
// nothing into an FMA.
#include <cuda_runtime.h>

#include <string>

#include "attn/cuda/indexer_queries_cuda.h"
#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/hadamard.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/step_rows.cuh"
#include "attn/cuda/warp.cuh"
#include "common/error.h"
#include "numerics/quant.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;  // 8 warps, one head each: CTA (t, y) serves heads 8y .. 8y + 7
constexpr int kHeadsPerCta = kThreads / 32;

__global__ void __launch_bounds__(kThreads) queries_kernel(const IndexerQueryParams p, float hadamard_scale,
                                                           float head_scale) {
  // The step metadata (real count, positions) and the RoPE factors before
  // the wait (pdl.cuh): they overlap the projection's tail.
  const int t = blockIdx.x;
  const int real = cuda::real_rows(p);
  __shared__ float2 cs_s[32];
  if (t < real && threadIdx.x < 32) cs_s[threadIdx.x] = cuda::rope_cos_sin(p.positions[t], p.rope.inv_freq[threadIdx.x]);
  cuda::pdl_start();  // pdl.cuh: launched with pdl_launch
  if (t >= real) return;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nI = p.num_heads;
  const bool fp8 = p.out.format == IndexKeyFormat::kFp8;
  // One head per warp (a warp's loop over several heads would serialize its
  // loads behind its stores, which may alias as far as the compiler knows).
  for (int h = int(blockIdx.y) * kHeadsPerCta + warp; h < nI; h += int(gridDim.y) * kHeadsPerCta) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p.q_raw + t * p.q_ld + int64_t(kIndexDim) * h + 4 * lane);
    float x[4] = {cuda::bf16x2_lo(raw.x), cuda::bf16x2_hi(raw.x), cuda::bf16x2_lo(raw.y), cuda::bf16x2_hi(raw.y)};
    if (lane >= 16) {  // dims 64..127: rope pairs i = 2 (lane - 16) and i + 1
#pragma unroll
      for (int k = 0; k < 2; ++k) cuda::rope_rotate(x[2 * k], x[2 * k + 1], cs_s[2 * (lane - 16) + k]);
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = cuda::bf16_round(x[k]);
    }
    cuda::hadamard128(x, hadamard_scale);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = cuda::bf16_round(x[k]);
    const int64_t e = int64_t(t) * nI + h;  // record index
    if (fp8) {
      int ex;
      const uint32_t codes = cuda::quantize_e4m3_x4<32>(x, ex);
      *reinterpret_cast<uint32_t*>(p.out.codes + e * kIndexDim + 4 * lane) = codes;
      if (lane == 0) *reinterpret_cast<float*>(p.out.scales + e * kIndexerScaleBytes) = exp2_int(ex);
    } else {
      float amax = cuda::amax4(x);
      amax = cuda::group_max<8>(amax);  // a 32-wide block per 8 lanes
      const int ex = e2m1_exponent_of_amax(amax);
      uint32_t codes = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) codes |= uint32_t(e2m1_code(x[k], ex)) << (4 * k);
      *reinterpret_cast<uint16_t*>(p.out.codes + e * (kIndexDim / 2) + 2 * lane) = uint16_t(codes);
      if ((lane & 7) == 0) p.out.scales[e * kIndexerScaleBytes + lane / 8] = ue8m0_from_exponent(ex);
    }
  }
  if (blockIdx.y == 0)
    for (int h = threadIdx.x; h < nI; h += kThreads)
      p.out.weights[int64_t(t) * nI + h] = round_bf16(__fmul_rn(round_bf16(p.proj[t * p.proj_ld + h]), head_scale));
}

bool aligned(const void* ptr, size_t a) { return reinterpret_cast<uintptr_t>(ptr) % a == 0; }

}  // namespace

void check_indexer_queries_cuda_params(const IndexerQueryParams& p) {
  check_indexer_query_params(p);
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(aligned(p.q_raw, 8) && p.q_ld % 4 == 0, "indexer queries (cuda): q_raw must be 8-byte aligned, q_ld a multiple of 4");
  DSV4_REQUIRE(aligned(p.positions, 8) && aligned(p.proj, 4) && aligned(p.real_tokens, 4),
          "indexer queries (cuda): positions must be 8-byte, proj and real_tokens 4-byte aligned");
  DSV4_REQUIRE(aligned(p.out.codes, 4) && aligned(p.out.scales, 4) && aligned(p.out.weights, 4),
          "indexer queries (cuda): output codes, scales and weights must be 4-byte aligned");
}

void indexer_queries_cuda(const IndexerQueryParams& p, CUstream_st* stream) {
  check_indexer_queries_cuda_params(p);
  if (p.num_tokens == 0) return;
  const dim3 grid(unsigned(p.num_tokens), unsigned((p.num_heads + kHeadsPerCta - 1) / kHeadsPerCta));
  cuda::pdl_launch(queries_kernel, grid, kThreads, 0, stream, p, indexer_hadamard_scale(),
                    indexer_head_scale(p.weight_heads()));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Error(std::string("indexer queries (cuda): launch: ") + cudaGetErrorString(e));
}

}  // namespace dsv4
