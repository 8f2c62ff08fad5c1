// The indexer's work plan, built on the device from the step's positions
// (so a decode step's graph replays with new positions): token groups,
// units and list offsets (indexer_select_internal.cuh). One CTA.
//
// Groups: a token starts a group unless it continues the previous token's
// run at the next position inside the same aligned block of 4 positions, so
// a group's tokens see the same keys but for the last one (one more). With
// a.solo every token starts one (the decode kernel's groups).
// Units: with W = sum over groups of tokens x tiles ("token-tiles", the
// scoring work), each unit carries about L = ceil(W / target_units) of it,
// and at least min_unit_tiles tiles, one per warpgroup of the score kernel
// (so a decode token at 4K context, 16 tiles, scores on four CTAs, and on
// eight with the general kernel; on one CTA it took 39 us, docs/perf-notes.md);
// a group has at most max_group_units units (finalize merges a token's lists
// on one CTA).
// A group of c tokens and n tiles is cut into
// S = min(max(1, round(c n / L)), max(1, n / min_unit_tiles), max_group_units)
// units of consecutive tiles. Then sum S <= target + groups and
// sum S c <= 4 target + tokens, the workspace's bounds. (Rounded, not
// rounded up: every unit costs a list of k keys, and 128 decode tokens of
// 256 tiles on 132 CTAs would otherwise take two units each.)
#include <cuda_runtime.h>

#include "attn/cuda/block_scan.cuh"
#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/step_rows.cuh"

namespace dsv4::cuda::ix {
namespace {

__device__ __forceinline__ bool starts_group(const IndexerSelectParams& p, int t, int real, bool solo) {
  if (t >= real) return false;
  if (t == 0 || solo) return true;
  const int64_t a = p.positions[t - 1], b = p.positions[t];
  return p.token_run[t] != p.token_run[t - 1] || b != a + 1 || (a >> 2) != (b >> 2);
}

// Launched with PDL, but it lets no later kernel start before it ends (no
// launch_dependents): the score and finalize kernels then read the plan
// before their own wait, off their critical path.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const SelectArgs a) {
  wait_for_prior_grids();  // pdl.cuh
  const IndexerSelectParams& p = a.p;
  const Workspace& ws = a.ws;
  const int T = p.num_tokens;
  const int real = real_rows(p);
  const int per = (T + kPlanThreads - 1) / kPlanThreads;
  const int t0 = min(T, int(threadIdx.x) * per), t1 = min(T, t0 + per);

  // Groups that start in this thread's tokens.
  int64_t starts = 0;
  for (int t = t0; t < t1; ++t) starts += starts_group(p, t, real, a.solo);
  int64_t num_groups = 0;
  int g = int(block_exclusive_scan<kPlanThreads>(starts, &num_groups));
  int64_t work = 0;  // token-tiles of this thread's groups
  for (int t = t0; t < t1; ++t) {
    if (t >= real) {
      ws.tokens[t] = TokenRef{-1, 0};
      continue;
    }
    if (!starts_group(p, t, real, a.solo)) continue;
    int count = 1;
    while (t + count < real && !starts_group(p, t + count, real, a.solo)) ++count;
    int64_t n = 0;
    for (int i = 0; i < count; ++i) {
      n = max(n, indexer_visible(p.positions[t + i]));
      ws.tokens[t + i] = TokenRef{g, i};
    }
    const int tiles = int((n + kTileKeys - 1) / kTileKeys);
    ws.groups[g] = Group{p.token_run[t], t, count, tiles, 0, 0, 0, 0};
    work += int64_t(count) * tiles;
    ++g;
  }
  int64_t total_work = 0;
  block_exclusive_scan<kPlanThreads>(work, &total_work);  // (the sum is what matters)
  const int64_t target = ws.target_units;
  const int min_unit_tiles = a.solo ? kDecodeWarpgroups : kGeneralMinUnitTiles;
  const int64_t unit_work = max(int64_t(1), (total_work + target - 1) / target);
  auto units_of = [&](const Group& gr) -> int64_t {
    if (gr.tiles == 0) return 0;
    const int64_t by_work = max(int64_t(1), (int64_t(gr.count) * gr.tiles + unit_work / 2) / unit_work);
    return min(min(by_work, max(int64_t(1), int64_t(gr.tiles) / min_unit_tiles)), int64_t(ws.max_group_units));
  };

  // Units and lists of this thread's groups (the same groups as above).
  const int g0 = g - int(starts);
  int64_t units = 0, lists = 0;
  for (int i = g0; i < g; ++i) {
    const Group& gr = ws.groups[i];
    const int64_t s = units_of(gr);
    units += s;
    lists += s * gr.count;
  }
  int64_t total_units = 0, total_lists = 0;
  int64_t unit_base = block_exclusive_scan<kPlanThreads>(units, &total_units);
  int64_t list_base = block_exclusive_scan<kPlanThreads>(lists, &total_lists);
  // The bounds hold by construction; refuse to write past the workspace anyway
  // (then nothing is scored and every token gets an empty selection).
  const bool fits = total_units <= ws.max_units && total_lists <= ws.max_lists;
  for (int i = g0; i < g; ++i) {
    // A copy in registers: through a reference into global memory, every
    // unit store below (which may alias it) reloaded the group, and one
    // thread writes all 128 units of a long-context decode token (the plan
    // of one token at 64K context took 33 us that way, 7 us now: run M4 in
    // docs/perf-notes.md).
    Group gr = ws.groups[i];
    const int s = fits ? int(units_of(gr)) : 0;
    gr.units = s;
    gr.unit_base = int(unit_base);
    gr.list_base = int(list_base);
    ws.groups[i] = gr;
    // Unit k takes tiles [floor(tiles k / s), floor(tiles (k + 1) / s)),
    // stepped without a division per unit: tiles = q s + r.
    const int q = s > 0 ? gr.tiles / s : 0, r = s > 0 ? gr.tiles % s : 0;
    int begin = 0, frac = 0;  // floor(tiles k / s) and (r k) mod s
    for (int k = 0; k < s; ++k) {
      int end = begin + q;
      frac += r;
      if (frac >= s) frac -= s, ++end;
      ws.units[unit_base + k] = Unit{i, begin, end, k};
      begin = end;
    }
    unit_base += s;
    list_base += int64_t(s) * gr.count;
  }
  if (threadIdx.x == 0)
    *ws.counters = Counters{fits ? int(total_units) : 0, 0, int(num_groups), fits ? int(total_lists) : 0};
}

}  // namespace

void launch_plan(const SelectArgs& a, cudaStream_t stream) { pdl_launch(plan_kernel, 1, kPlanThreads, 0, stream, a); }

}  // namespace dsv4::cuda::ix
