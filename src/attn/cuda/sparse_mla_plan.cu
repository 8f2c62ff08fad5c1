// The work plan of the sparse-attention kernel: one CTA, built from the
// device-side lengths so that a decode step needs no host round trip and can
// be captured in a CUDA graph. Run once per step and layer type; every layer
// of that type reuses it (SPEC §7).
//
// Two ways to cut the step's tiles into one contiguous range per work slot
// (a CTA, or a cluster of two for pairs of head blocks):
//  * whole units: range boundaries only at unit boundaries, slot c taking the
//    units that start in [c W / G, (c + 1) W / G) (W tiles, G slots). No
//    merge, but a slot may get up to a unit more than W / G tiles.
//  * even split: slot c takes tiles [c per, (c + 1) per), per = ceil(W / G)
//    (raised so that no unit spans more than kMaxPartials slots); the units
//    cut by a boundary are listed for the combine kernel, which merges their
//    partials (about split_penalty tiles).
// The plan takes whole units when their largest CTA load is within the
// penalty of the even split: large decode batches (many units of similar
// size) then run without any merge, small ones spread a long row over many
// SMs.
#include "attn/cuda/block_scan.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/sparse_mla_internal.cuh"
#include "attn/cuda/step_rows.cuh"

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

// What splitting costs, in tiles: the combine kernel (about 3 us, where a
// tile takes 4-5 us), imbalance, and the partials' traffic, which grows with
// the number of split units (each writes and reads 2 x 128 KB per CTA it
// spans; docs/perf-notes.md, runs 14-15).
__device__ __forceinline__ int split_penalty(int per, int split_units) { return 1 + per / 16 + split_units / 16; }

// At most this many slots share one unit: the combine merges every float4 of
// a split row over all its partials in at most 8 threads (sparse_mla_combine.cu).
constexpr int kMaxPartials = 64;

// Launched with PDL, but it lets no later kernel start before it ends (no
// launch_dependents): the attention and combine kernels then read the plan
// before their own wait, off their critical path.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const __grid_constant__ AttnParams p) {
  wait_for_prior_grids();  // pdl.cuh
  __shared__ int s_makespan, s_splits, s_longest, s_cut, s_parts;
  __shared__ int load[kMaxGrid];  // tiles per slot with whole units
  const int tid = threadIdx.x;
  // Padding (past *real_tokens) gets no units: its rows are not written.
  const int real = real_rows(p);
  const int units = real * p.plan_head_blocks, slots = p.grid / p.cluster;
  const int chunk = (units + kPlanThreads - 1) / kPlanThreads;
  const int u_begin = min(units, tid * chunk), u_end = min(units, u_begin + chunk);
  for (int c = tid; c < slots; c += kPlanThreads) load[c] = 0;
  if (tid == 0) s_makespan = s_longest = s_cut = 0;

  int sum = 0, longest = 0;
  for (int u = u_begin; u < u_end; ++u) {
    const int t = u / p.plan_head_blocks;
    const int tiles = unit_tiles(clamped_length(p.swa, t), clamped_length(p.extra, t));
    sum += tiles;
    longest = max(longest, tiles);
  }
  // The units' first tiles: an exclusive scan of the per-thread sums.
  int total = 0;
  const int offset = block_exclusive_scan<kPlanThreads>(sum, &total);
  atomicMax(&s_longest, longest);  // after the scan's barriers, which order thread 0's initialisation; read after the next
  if (tid == 0) p.plan.unit_info[units] = make_int4(total, 0, 0, 0);
  __syncthreads();
  const int per = max(max(1, (total + slots - 1) / slots), (s_longest + kMaxPartials - 1) / kMaxPartials);
  // The slot of a unit when units stay whole: the window its first tile is in.
  auto whole_cta = [&](int start) { return int(int64_t(start) * slots / total); };

  // Unit records, and the load of each CTA with whole units.
  int start = offset;
  for (int u = u_begin; u < u_end; ++u) {
    const int t = u / p.plan_head_blocks;
    const int ls = clamped_length(p.swa, t), le = clamped_length(p.extra, t);
    const int tiles = unit_tiles(ls, le);
    p.plan.unit_info[u] = make_int4(start, ls, le, 0);
    atomicAdd(&load[whole_cta(start)], tiles);
    if (start / per != (start + tiles - 1) / per) atomicAdd(&s_cut, 1);  // split by the even split
    start += tiles;
  }
  __syncthreads();
  for (int c = tid; c < slots; c += kPlanThreads) atomicMax(&s_makespan, load[c]);
  __syncthreads();
  const bool whole_units = s_makespan < per + split_penalty(per, s_cut);

  // Idle slots first (overwritten below for slots that get work).
  for (int c = tid; c < slots; c += kPlanThreads) p.plan.cta_work[c] = make_int4(total, total, 0, per);
  if (tid == 0) s_splits = s_parts = 0;
  __syncthreads();
  start = offset;
  for (int u = u_begin; u < u_end; ++u) {
    const int end = start + unit_tiles(p.plan.unit_info[u].y, p.plan.unit_info[u].z);
    if (whole_units) {
      // The first unit of its slot writes the slot's record; the range ends
      // where the next slot's first unit starts.
      const int c = whole_cta(start);
      if (u == 0 || whole_cta(p.plan.unit_info[u - 1].x) != c) {
        int next = u + 1;  // units are few per slot: walk to the first unit of another slot
        while (next < units && whole_cta(p.plan.unit_info[next].x) == c) ++next;
        p.plan.cta_work[c] = make_int4(start, next < units ? p.plan.unit_info[next].x : total, u, per);
      }
    } else {
      for (int c = (start + per - 1) / per; c * per < end && c < slots; ++c)
        p.plan.cta_work[c] = make_int4(c * per, min(c * per + per, total), u, per);
      if (start / per != (end - 1) / per) {
        p.plan.split_units[atomicAdd(&s_splits, 1)] = u;  // < slots: one per boundary
        atomicMax(&s_parts, (end - 1) / per - start / per + 1);
      }
    }
    start = end;
  }
  __syncthreads();
  if (tid == 0) {
    p.plan.split_count[0] = s_splits;
    p.plan.split_count[1] = s_parts;
  }
}

}  // namespace

void launch_plan(const AttnParams& p, cudaStream_t stream) {
  pdl_launch(plan_kernel, 1, kPlanThreads, 0, stream, p);
}

}  // namespace dsv4::cuda
