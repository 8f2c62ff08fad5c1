// Sparse MLA attention with sink over fp8_ds_mla pages (SPEC §4.6, §5, §6).
//
// One persistent CTA per SM (8 warps, two warpgroups) walks its range of
// tiles (see sparse_mla_internal.cuh). Per tile of 64 entries, in the
// default kernel (variant 1, sparse_mla_tiles.cuh):
//  1. the tile's 576-byte records and scale bytes were gathered two tiles
//     earlier with cp.async into a raw shared-memory slot (no registers held,
//     two tiles = ~73 KB in flight per SM; empty or out-of-range slots are
//     zero-filled without a read);
//  2. all warps dequantize the raw slot to bf16 K in shared memory;
//  3. S = Q K^T with bf16 operands and fp32 accumulators (wgmma);
//  4. online softmax with the sink; the next gathers are issued;
//  5. O += P V (wgmma).
// Variant 0 does steps 3-5 with mma.sync and ldmatrix; it is tested and
// slower today (docs/perf-notes.md); attention_variant() selects. (Two
// pipelined designs were slower on every row and were removed: K double-
// buffered with register-staged gathers, perf notes runs 5-6, and a
// warp-specialized producer warpgroup, runs 10-12.)
// Units cut by CTA-range boundaries leave fp32 partials for the combine
// kernel (sparse_mla_combine.cu), which every CTA lets start early
// (programmatic dependent launch). Production numerics (SPEC §5): q.k with bf16
// operands and fp32 accumulation, scale after; exp2 in fp32; P rounded to
// bf16 for P.V while the row sum adds the fp32 values; output rounded to bf16.
#include "attn/cuda/sparse_mla_common.cuh"
#include "attn/cuda/sparse_mla_pipe.cuh"
#include "attn/cuda/sparse_mla_tiles.cuh"

namespace dsv4::cuda {
namespace {

using namespace mla;

template <int kVariant>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_kernel(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The swizzle atoms must sit on 1024-byte boundaries of the shared window.
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  wait_for_prior_grids();
  launch_dependents();
  const int4 work = __ldg(p.plan.cta_work + blockIdx.x);  // {first tile, end tile, first unit, per}
  if (work.x >= work.y) return;
  stamp(p, 0);
  attention_tiles<kVariant == 1>(p, smem, work.x, work.y, work.z);
  stamp(p, 3);
}

__global__ void __launch_bounds__(pipe::kThreadsPipe, 1) sparse_mla_pipe_kernel(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  wait_for_prior_grids();
  launch_dependents();
  const int4 work = __ldg(p.plan.cta_work + blockIdx.x);  // {first tile, end tile, first unit, per}
  if (work.x >= work.y) return;
  stamp(p, 0);
  pipe::attention_pipe(p, smem, work.x, work.y, work.z);
  stamp(p, 3);
}

}  // namespace

size_t attention_smem_bytes() { return kSmemBytes; }

AttentionDebug& attention_debug() {
  static AttentionDebug d;
  return d;
}

int& attention_variant() {
  static int v = 1;  // fastest on every row of the benchmark (docs/perf-notes.md)
  return v;
}

int prepare_attention_kernel() {
  int blocks = 1 << 30;
  struct Kernel {
    void (*fn)(AttnParams);
    int threads;
    int smem;
  };
  const Kernel kernels[] = {{&sparse_mla_kernel<1>, kThreads, kSmemBytes},
                            {&sparse_mla_kernel<0>, kThreads, kSmemBytes},
                            {&sparse_mla_pipe_kernel, pipe::kThreadsPipe, pipe::kSmemBytesPipe}};
  for (const Kernel& k : kernels) {
    cudaError_t e = cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem);
    if (e != cudaSuccess) return -int(e);
    int b = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k.fn, k.threads, k.smem);
    if (e != cudaSuccess) return -int(e);
    blocks = b < blocks ? b : blocks;
  }
  return blocks;
}

// With programmatic dependent launch, so that the CTAs are set up while the
// previous kernel of the stream (the last call's combine, or the plan)
// finishes; each waits for it before reading anything.
void launch_attention(const AttnParams& p, cudaStream_t stream) {
  const int v = attention_variant();
  if (v == 2)
    launch_overlapped(sparse_mla_pipe_kernel, p.grid, pipe::kThreadsPipe, pipe::kSmemBytesPipe, stream, p);
  else
    launch_overlapped(v == 0 ? sparse_mla_kernel<0> : sparse_mla_kernel<1>, p.grid, kThreads, kSmemBytes, stream, p);
}

}  // namespace dsv4::cuda
