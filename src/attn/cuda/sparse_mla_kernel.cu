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
#include "attn/cuda/device_info.h"
#include "attn/cuda/sparse_mla_common.cuh"
#include "attn/cuda/sparse_mla_tiles.cuh"

namespace dsv4::cuda {
namespace {

using namespace mla;

// kCluster = 2: the two CTAs of a cluster run the same tiles for the two
// head blocks of a unit (H = 128), each dequantizing half of every tile for
// both (sparse_mla_tiles.cuh).
// kDiag: the benchmark's diagnostic instantiation (timers, debug_clock).
template <int kCluster, bool kDiag>
__global__ void __launch_bounds__(kAttnThreads, 1) sparse_mla_kernel(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The swizzle atoms must sit on 1024-byte boundaries of the shared window
  // (the same offset in every CTA: the peer's buffers are addressed alike).
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  // The plan before the wait: its kernel lets nothing start before it ends
  // (sparse_mla_plan.cu), so these two dependent loads overlap the previous
  // kernel's tail instead of opening the tile chain.
  // {first tile, end tile, first unit, per}: the same for both CTAs of a cluster.
  const int4 work = __ldg(p.plan.cta_work + blockIdx.x / kCluster);
  if (work.x >= work.y) {
    wait_for_prior_grids();  // pdl.cuh: even a CTA with nothing to do
    return;
  }
  UnitWalker first;
  first.start(p, work.z);
  attention_tiles<kCluster, kDiag>(p, smem, work.x, work.y, first);  // waits after its set-up
  if constexpr (kDiag) stamp(p, kDebugEnd);
}

}  // namespace

int attention_grid(int cluster) {
  auto kernel = cluster == 2 ? sparse_mla_kernel<2, false> : sparse_mla_kernel<1, false>;
  for (auto k : {kernel, cluster == 2 ? sparse_mla_kernel<2, true> : sparse_mla_kernel<1, true>}) {
    const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) return -int(e);
  }
  cudaError_t e = cudaSuccess;
  int sms = 0, n = 0;
  if ((e = query_sm_count(&sms)) != cudaSuccess) return -int(e);
  if (cluster == 1) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kAttnThreads, kSmemBytes);
    return e != cudaSuccess ? -int(e) : n * sms;
  }
  // Pairs need two free SMs of one GPC: fewer may fit than SMs / 2.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(sms));
  cfg.blockDim = dim3(unsigned(kAttnThreads));
  cfg.dynamicSmemBytes = kSmemBytes;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  e = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
  return e != cudaSuccess ? -int(e) : 2 * n;
}

// With programmatic dependent launch, so that the CTAs are set up while the
// previous kernel of the stream (the last call's combine, or the plan)
// finishes; each waits for it before reading anything.
void launch_attention(const AttnParams& p, cudaStream_t stream) {
  const bool diag = p.debug_clock != nullptr;
  if (p.cluster == 2)
    pdl_launch_clustered(diag ? sparse_mla_kernel<2, true> : sparse_mla_kernel<2, false>, dim3(p.grid),
                         dim3(kAttnThreads), kSmemBytes, stream, 2, p);
  else
    pdl_launch(diag ? sparse_mla_kernel<1, true> : sparse_mla_kernel<1, false>, dim3(p.grid), dim3(kAttnThreads),
               kSmemBytes, stream, p);
}

}  // namespace dsv4::cuda
