// The indexer of a short decode step in one kernel (IndexerSelectCuda::
// run_short): no plan, no unit lists, no finalize kernel. At batch 1 and 4K
// context the chain score -> finalize ended 18 us after the index keys
// (9.4 + 8.5, docs/perf-notes.md BZ4) for 1,024 keys: most of it the two
// kernels' boundaries and the lists' write and reread.
//
// A token is a cluster of kShortCtas CTAs of the decode scorer's shape
// (indexer_score.cuh: four warpgroups, one token). CTA r of the cluster
//  1. scores tiles [T r / kShortCtas, T (r + 1) / kShortCtas) of the token's
//     T tiles with the scorer's own code, every key kept (no threshold: a
//     warpgroup's buffer holds its few tiles whole);
//  2. sorts its keys best first (run_rank_sort_desc) and publishes them and
//     their count in its shared memory;
//  3. after a cluster barrier, copies every CTA's sorted run from DSMEM;
//  4. ranks its own keys: a key's place among the token's keys is the sum
//     over the runs of the keys above it, a binary search in each (keys are
//     unique), so no sort of the whole set; the keys placed below k write
//     their pick and slot, and the CTA writes its share of the -1 rows.
// The same picks as score + finalize: the same scores (the same code) and
// the same total order (indexer_order_key).
#include <cuda_runtime.h>

#include "attn/cuda/indexer_score.cuh"
#include "attn/cuda/indexer_select_cuda.h"
#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/indexer_topk.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/step_rows.cuh"

namespace dsv4::cuda::ix {
namespace {

constexpr int kShortCtas = kShortSelectCtas;
constexpr int kShortTiles = int(kShortSelectMaxKeys / kTileKeys);
// A CTA's keys at most: its share of the tiles, whole.
constexpr int kCtaKeys = (kShortTiles + kShortCtas - 1) / kShortCtas * kTileKeys;

template <bool kFp8>
struct ShortShape {
  using C = Decode<kFp8>;
  static_assert(kCtaKeys <= C::kThreads, "run_rank_sort_desc: a key a thread");
  static_assert(kCtaKeys / C::kW <= C::kBufCap - kTileKeys, "a warpgroup's buffer never cut");
  // In the stages, free once the tiles are scored: the CTA's keys (loc, room
  // for a key a thread), sorted (its run, published), every CTA's run (all),
  // the runs' counts.
  static constexpr int kOffRun = C::kThreads * 8, kOffAll = kOffRun + kCtaKeys * 8;
  static constexpr int kOffCounts = kOffAll + int(kShortSelectMaxKeys) * 8;
  static_assert(kOffCounts + 4 * (kShortCtas + 1) <= C::kW * C::kStages * C::kStageBytes, "fits the stages");
};

// Keys of run a[0 .. c) (best first) above key: c <= kCtaKeys, a power of two.
__device__ __forceinline__ int count_above(const uint64_t* a, int c, uint64_t key) {
  static_assert((kCtaKeys & (kCtaKeys - 1)) == 0, "binary steps");
  int at = 0;
#pragma unroll
  for (int step = kCtaKeys; step >= 1; step >>= 1)
    if (at + step <= c && a[at + step - 1] > key) at += step;
  return at;
}

template <bool kFp8>
__global__ void __launch_bounds__(Decode<kFp8>::kThreads, 1) short_kernel(const IndexerSelectParams p) {
  using C = Decode<kFp8>;
  using S = ShortShape<kFp8>;
  const int t = blockIdx.y, r = int(cluster_ctarank()), tid = threadIdx.x, k = p.topk;
  // Step metadata before the wait (pdl.cuh): the token's keys and run.
  const int real = real_rows(p);
  const int64_t n = t < real ? indexer_visible(p.positions[t]) : 0;
  const int run = t < real ? p.token_run[t] : 0;
  pdl_start();
  int32_t* picks = p.picks + int64_t(t) * k;
  int32_t* slots = p.slots + int64_t(t) * k;
  auto empty_rows = [&](int from) {  // this CTA's share of the -1 rows
    for (int i = from + r * C::kThreads + tid; i < k; i += kShortCtas * C::kThreads) picks[i] = slots[i] = -1;
  };
  // Padding, no key, or more keys than the kernel takes (the backend routes
  // such steps to score + finalize): an empty selection. Uniform over the
  // cluster, which then meets at no barrier.
  if (n == 0 || n > kShortSelectMaxKeys) {
    empty_rows(0);
    if (r == 0 && tid == 0) p.lengths[t] = 0;
    return;
  }
  extern __shared__ uint8_t smem_raw[];
  const Smem<C> s{smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)};
  auto* m = s.misc();
  const int tiles = int((n + kTileKeys - 1) / kTileKeys);
  const Group gr{run, t, 1, tiles, 1, 0, 0, 0};
  const Unit un{0, tiles * r / kShortCtas, tiles * (r + 1) / kShortCtas, r};
  load_queries(p, s, gr);
  consume<C, true, 1>(p, s, gr, un);  // every key appended (the thresholds stay 0)
  __syncthreads();

  uint8_t* base = s.stage(0, 0);
  uint64_t* loc = reinterpret_cast<uint64_t*>(base);
  uint64_t* own = reinterpret_cast<uint64_t*>(base + S::kOffRun);
  uint64_t* all = reinterpret_cast<uint64_t*>(base + S::kOffAll);
  int* counts = reinterpret_cast<int*>(base + S::kOffCounts);
  int c = 0;  // the warpgroups' buffers end to end
#pragma unroll
  for (int w = 0; w < C::kW; ++w) {
    const int cw = m->count[w][0];
    for (int i = tid; i < cw; i += C::kThreads) loc[c + i] = s.buf(w, 0)[i];
    c += cw;
  }
  __syncthreads();
  run_rank_sort_desc<C::kThreads>(loc, c, tid, [&](uint32_t rank, uint64_t key) { own[rank] = key; });
  if (tid == 0) m->out_count = c;
  cluster_sync();  // every CTA's run and count are written

  if (tid < kShortCtas) counts[tid] = int(ld_cluster_u32(map_to_cta(smem_u32(&m->out_count), uint32_t(tid))));
  __syncthreads();
  int total = 0, at[kShortCtas];
#pragma unroll
  for (int q = 0; q < kShortCtas; ++q) at[q] = total, total += counts[q];
#pragma unroll
  for (int q = 0; q < kShortCtas; ++q) {
    const uint32_t src = map_to_cta(smem_u32(own), uint32_t(q));
    for (int i = tid; i < counts[q]; i += C::kThreads) all[at[q] + i] = ld_cluster_u64(src + 8u * uint32_t(i));
  }
  cluster_arrive();  // this CTA reads no other's shared memory after this
  __syncthreads();

  // Ranks: thread pair (key i, run q) with the 8 runs of a key in adjacent
  // lanes, summed by shuffles.
  static_assert(kShortCtas == 8, "a key's runs are 8 lanes");
  const int q = tid % kShortCtas;  // this thread's run
  int q_at = 0;
  for (int v = 0; v < q; ++v) q_at += counts[v];
  const uint64_t* const q_run = all + q_at;
  const int q_count = counts[q];
  for (int i0 = 0; i0 < c * kShortCtas; i0 += C::kThreads) {  // uniform
    const int i = (i0 + tid) / kShortCtas;
    const uint64_t key = i < c ? own[i] : 0;
    int above = i < c ? count_above(q_run, q_count, key) : 0;
    above += __shfl_xor_sync(0xffffffffu, above, 1);
    above += __shfl_xor_sync(0xffffffffu, above, 2);
    above += __shfl_xor_sync(0xffffffffu, above, 4);
    if (i < c && q == 0 && above < k) {
      const int32_t j = indexer_key_index(key);
      picks[above] = j;
      slots[above] = block_table_slot(p.c4a_table, run, j);
    }
  }
  const int kept = min(total, k);
  empty_rows(kept);
  if (r == 0 && tid == 0) p.lengths[t] = kept;
  cluster_wait();  // no CTA leaves while another reads its run
}

template <bool kFp8>
void launch(const IndexerSelectParams& p, cudaStream_t stream) {
  pdl_launch_clustered(short_kernel<kFp8>, dim3(kShortCtas, unsigned(p.num_tokens)), Decode<kFp8>::kThreads,
                       Decode<kFp8>::kSmemBytes, stream, dim3(kShortCtas), p);
}

}  // namespace

void prepare_short_kernels() {
  cudaFuncSetAttribute(short_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, Decode<true>::kSmemBytes);
  cudaFuncSetAttribute(short_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, Decode<false>::kSmemBytes);
}

void launch_short(const IndexerSelectParams& p, cudaStream_t stream) {
  if (p.queries.format == IndexKeyFormat::kFp8) launch<true>(p, stream);
  else launch<false>(p, stream);
}

}  // namespace dsv4::cuda::ix
