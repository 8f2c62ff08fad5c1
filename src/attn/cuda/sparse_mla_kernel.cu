// Sparse MLA attention with sink over fp8_ds_mla pages (SPEC §4.6, §5, §6).
//
// One persistent CTA per SM walks its range of tiles (see
// sparse_mla_internal.cuh) with three warpgroups (sparse_mla_tiles.cuh): a
// producer and a "V" warpgroup gather and dequantize the two halves of each
// 64-entry tile into one of two bf16 K buffers ahead of time; an "S"
// warpgroup computes S = Q K^T (bf16 operands, fp32 accumulators, wgmma) and
// the online softmax with the sink; S and V each compute half of O += P V.
// Empty or out-of-range slots read nothing. Units cut by CTA-range
// boundaries leave fp32 partials for the combine kernel
// (sparse_mla_combine.cu), which every CTA lets start early (programmatic
// dependent launch). Production numerics (SPEC §5): q.k with bf16 operands
// and fp32 accumulation, scale after; exp2 in fp32; P rounded to bf16 for
// P.V while the row sum adds the fp32 values; output rounded to bf16.
// Designs measured and dropped are in docs/perf-notes.md and git history.
#include "attn/cuda/sparse_mla_common.cuh"
#include "attn/cuda/sparse_mla_tiles.cuh"

namespace dsv4::cuda {
namespace {

using namespace mla;

__global__ void __launch_bounds__(kAttnThreads, 1) sparse_mla_kernel(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The swizzle atoms must sit on 1024-byte boundaries of the shared window.
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  wait_for_prior_grids();
  launch_dependents();
  const int4 work = __ldg(p.plan.cta_work + blockIdx.x);  // {first tile, end tile, first unit, per}
  if (work.x >= work.y) return;
  stamp(p, kDebugStart);
  attention_tiles(p, smem, work.x, work.y, work.z);
  stamp(p, kDebugEnd);
}

}  // namespace

AttentionDebug& attention_debug() {
  static AttentionDebug d;
  return d;
}

int prepare_attention_kernel() {
  cudaError_t e = cudaFuncSetAttribute(sparse_mla_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return -int(e);
  int blocks = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, sparse_mla_kernel, kAttnThreads, kSmemBytes);
  return e != cudaSuccess ? -int(e) : blocks;
}

// With programmatic dependent launch, so that the CTAs are set up while the
// previous kernel of the stream (the last call's combine, or the plan)
// finishes; each waits for it before reading anything.
void launch_attention(const AttnParams& p, cudaStream_t stream) {
  launch_overlapped(sparse_mla_kernel, p.grid, kAttnThreads, kSmemBytes, stream, p);
}

}  // namespace dsv4::cuda
