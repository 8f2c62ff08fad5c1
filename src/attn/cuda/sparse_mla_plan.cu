// The work plan of the sparse-attention kernel: one CTA, built from the
// device-side lengths so that a decode step needs no host round trip and can
// be captured in a CUDA graph. Run once per step and layer type; every layer
// of that type reuses it (SPEC §7).
#include "attn/cuda/sparse_mla_internal.cuh"

namespace dsv4::cuda {
namespace {

__device__ __forceinline__ int clamped_length(const ListView& l, int t) {
  if (l.width <= 0) return 0;
  const int n = l.lengths[t];
  return n < 0 ? 0 : (n > l.width ? l.width : n);
}

// Tiles of one unit: at least one, so that an empty row still writes its output.
__device__ __forceinline__ int unit_tiles(int swa_len, int extra_len) {
  const int n = (swa_len + extra_len + kTileEntries - 1) / kTileEntries;
  return n > 0 ? n : 1;
}

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const __grid_constant__ AttnParams p) {
  __shared__ int warp_sums[kPlanThreads / 32];
  __shared__ int s_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int units = p.num_tokens * p.head_blocks;
  const int chunk = (units + kPlanThreads - 1) / kPlanThreads;
  const int u_begin = min(units, tid * chunk), u_end = min(units, u_begin + chunk);

  int sum = 0;
  for (int u = u_begin; u < u_end; ++u) {
    const int t = u / p.head_blocks;
    sum += unit_tiles(clamped_length(p.swa, t), clamped_length(p.extra, t));
  }
  // Block-wide exclusive scan of the per-thread sums.
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int v = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += o;
    }
    warp_sums[lane] = v;  // inclusive
  }
  __syncthreads();
  const int offset = (warp > 0 ? warp_sums[warp - 1] : 0) + incl - sum;
  if (tid == kPlanThreads - 1) {
    s_total = offset + sum;
    p.plan.unit_info[units] = make_int4(offset + sum, 0, 0, 0);
  }
  __syncthreads();
  const int total = s_total;
  const int per = max(1, (total + p.grid - 1) / p.grid);

  // Unit records, and the record of every CTA whose range starts inside the unit.
  int start = offset;
  for (int u = u_begin; u < u_end; ++u) {
    const int t = u / p.head_blocks;
    const int ls = clamped_length(p.swa, t), le = clamped_length(p.extra, t);
    const int end = start + unit_tiles(ls, le);
    p.plan.unit_info[u] = make_int4(start, ls, le, 0);
    for (int c = (start + per - 1) / per; c * per < end && c < p.grid; ++c)
      p.plan.cta_work[c] = make_int4(c * per, min(c * per + per, total), u, per);
    start = end;
  }
  for (int c = tid; c < p.grid; c += kPlanThreads) {
    if (int64_t(c) * per >= total) p.plan.cta_work[c] = make_int4(total, total, 0, per);  // idle CTA
    p.plan.arrive[2 * c] = p.plan.arrive[2 * c + 1] = 0;
    p.plan.claim[2 * c] = p.plan.claim[2 * c + 1] = 0;
  }
}

}  // namespace

void launch_plan(const AttnParams& p, cudaStream_t stream) {
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(p);
}

}  // namespace dsv4::cuda
