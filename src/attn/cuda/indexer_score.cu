// The indexer's persistent score kernel (indexer_select_internal.cuh): one
// CTA per multiprocessor takes units in turn, scores each unit's tiles
// (indexer_score.cuh) and writes each token's best k of the unit as a list.
#include <cuda_runtime.h>

#include "attn/cuda/indexer_score.cuh"
#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/indexer_topk.cuh"
#include "attn/cuda/pdl.cuh"

namespace dsv4::cuda::ix {
namespace {

// The unit's list per token: the best k of the warpgroups' candidates.
template <class C>
__device__ void write_lists(const SelectArgs& a, const Smem<C>& s, const Group& gr, const Unit& un) {
  constexpr int kPer = C::kMergePerThread;
  const int tid = threadIdx.x, lane = tid & 31;
  auto* m = s.misc();
  const int k = a.p.topk;
  const bool sort = has_list_bounds(gr);
  for (int tl = 0; tl < min(gr.count, C::kMaxG); ++tl) {
    // Thread tid holds keys tid, tid + kThreads, ... of the buffers laid end
    // to end (no indexed array: it would live in local memory).
    int cnt[C::kW], n = 0;
#pragma unroll
    for (int w = 0; w < C::kW; ++w) n += cnt[w] = m->count[w][tl];
    uint64_t keys[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      int w = 0, at = tid + C::kThreads * i;
#pragma unroll
      for (int v = 0; v + 1 < C::kW; ++v) {  // past buffer v: on to v + 1
        const bool past = w == v && at >= cnt[v];
        at -= past ? cnt[v] : 0;
        w += past;
      }
      keys[i] = tid + C::kThreads * i < n ? s.buf(w, tl)[at] : 0;
    }
    const uint64_t kth = n <= k ? 1  // fewer than k: keep every key
                                : radix_kth<8, false>(
                                      [&](auto&& f) {
#pragma unroll
                                        for (int i = 0; i < kPer; ++i) f(keys[i]);
                                      },
                                      uint32_t(k), s.hist(C::kW), m->sel[C::kW], tid, C::kThreads, [] { __syncthreads(); });
    const int64_t list = list_index(gr, un.split, tl);
    uint64_t* out = a.ws.list_keys + list * a.ws.list_stride;
    // A list with a bound is sorted best first, so that finalize reads only
    // its keys at or above the token's bound, a prefix (see
    // indexer_select_internal.cuh); the bound is then the sorted list's m-th
    // key. It is sorted in buf(0, tl), whose keys every thread holds in
    // registers by the barrier below.
    // (The sort goes through the shared buffer's own pointer, not `dst`: its
    // accesses then compile as shared, not generic, ones.)
    uint64_t* const sorted = s.buf(0, tl);
    uint64_t* const dst = sort ? sorted : out;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPer; ++i) warp_append(keys[i] != 0 && keys[i] >= kth, keys[i], dst, &m->out_count, lane);
    __syncthreads();
    const int need = (k + gr.units - 1) / gr.units;  // m = ceil(k / units)
    // Up to a key a thread, each key's place by run_rank_sort_desc: the
    // network of bitonic_sort_desc was 2.8-3.9 us of the score kernel at
    // 64K-1M context, one or eight tokens (docs/perf-notes.md, run AJ4).
    // (Every thread reads the count only to sort: the sort's barriers order
    // thread 0's reset below after those reads.)
    const int kept = sort ? m->out_count : 0;
    auto put = [&](uint32_t rank, uint64_t key) {  // the sorted list's key at `rank`; the m-th is the bound
      out[rank] = key;
      if (int(rank) == need - 1) a.ws.list_bounds[list] = key;
    };
    if (sort && kept <= C::kThreads) {
      run_rank_sort_desc<C::kThreads>(sorted, kept, tid, put);
    } else if (sort) {
      bitonic_sort_desc<C::kThreads, C::kSortPerThread>(sorted, kept, tid);
      for (int i = tid; i < kept; i += C::kThreads) put(uint32_t(i), sorted[i]);
    }
    if (tid == 0) {
      if (sort && kept < need) a.ws.list_bounds[list] = 0;  // fewer than m keys: no bound
      a.ws.list_counts[list] = m->out_count;
      m->out_count = 0;
    }
    __syncthreads();
  }
}

template <class C, bool kSelect>
__global__ void __launch_bounds__(C::kThreads, 1) score_kernel(const SelectArgs a) {
  // Units are taken in turn, last planned first: CTA b first takes unit
  // units - 1 - b, then units from the counter (past the grid). A prefill
  // chunk's later tokens see more keys, so its largest units go first and
  // the smallest fill the tail (the first 8K chunk 4% faster, run AL2).
  // The plan is read before the wait: the plan kernel lets nothing start
  // before it ends (indexer_plan.cu).
  const int units = a.ws.counters->units;
  auto unit_at = [&](int u) { return a.ws.units[units - 1 - u]; };  // the u-th taken
  int u = blockIdx.x;
  Unit un = u < units ? unit_at(u) : Unit{};
  Group gr = u < units ? a.ws.groups[un.group] : Group{};
  pdl_start();  // pdl.cuh: launched with pdl_launch
  extern __shared__ uint8_t smem_raw[];
  // The 1024-aligned base as smem_raw plus a pad: derived from the shared
  // array, so the compiler knows every access through it is to shared memory.
  // (Rebuilt from an integer it made them generic loads, stores and gpu-scope
  // atomics: Nsight Compute, run J2.)
  const Smem<C> s{smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)};
  auto* m = s.misc();
  if (threadIdx.x == 0) m->out_count = 0;
  // m->unit: thread 0 writes it before the barrier at the loop's end, every
  // thread reads it after; the next write comes after the CTA barriers in
  // load_queries, after consume and in write_lists, all passed after those reads.
  // (compute-sanitizer racecheck reports this pair, and hist(kW) / sel[kW] in
  // write_lists, as hazards; since the shared accesses are no longer generic,
  // also hist(wg) / sel[wg] in compact, ordered by the warpgroup's named
  // barrier; and in write_lists' sorted lists, the loads of buf(0, tl) into
  // keys[] against the appends and the sort that rewrite it, the sort's
  // last stores against the reads of the sorted list, and inside
  // bitonic_sort_desc the stores and loads of one barrier phase against
  // another's; in run_rank_sort_desc, its first loads against the appends,
  // and its stores of the sorted runs against the searches' loads (run
  // AJ5). Each write_lists pair is ordered by a __syncthreads of all
  // threads, and the same radix_kth and sort under __syncthreads in
  // finalize_kernel are reported clean: the tool seems to mis-pair barrier 0
  // once the warpgroups have passed different numbers of their named barriers
  // 1 + wg, as units whose tiles do not split evenly over the warpgroups, or
  // tiles without pages, make them do.)
  while (u < units) {
    load_queries(a.p, s, gr);
    if constexpr (C::kMaxG == 1) {
      consume<C, kSelect, 1>(a.p, s, gr, un);
    } else {
      static_assert(C::kMaxG == 4, "the general shape's group sizes");
      switch (gr.count) {  // uniform: one instantiation per group size
        case 1: consume<C, kSelect, 1>(a.p, s, gr, un); break;
        case 2: consume<C, kSelect, 2>(a.p, s, gr, un); break;
        case 3: consume<C, kSelect, 3>(a.p, s, gr, un); break;
        default: consume<C, kSelect, 4>(a.p, s, gr, un); break;
      }
    }
    __syncthreads();
    if constexpr (kSelect) {
      write_lists(a, s, gr, un);
    } else {
      if (threadIdx.x < gr.count)
        a.ws.list_counts[list_index(gr, un.split, threadIdx.x)] = 0;
      __syncthreads();
    }
    if (units <= int(gridDim.x)) break;  // every unit was someone's first
    if (threadIdx.x == 0) m->unit = int(gridDim.x) + atomicAdd(&a.ws.counters->next_unit, 1);
    __syncthreads();
    u = m->unit;
    if (u < units) {
      un = unit_at(u);
      gr = a.ws.groups[un.group];
    }
  }
}

template <class C, bool kSelect>
void launch(const SelectArgs& a, int grid, cudaStream_t stream) {
  pdl_launch(score_kernel<C, kSelect>, grid, C::kThreads, C::kSmemBytes, stream, a);
}

template <class C>
void launch_shape(const SelectArgs& a, int grid, bool score_only, cudaStream_t stream) {
  if (score_only) launch<C, false>(a, grid, stream);
  else launch<C, true>(a, grid, stream);
}

template <bool kFp8>
void launch_format(const SelectArgs& a, int grid, bool score_only, cudaStream_t stream) {
  if (a.solo) launch_shape<Decode<kFp8>>(a, grid, score_only, stream);
  else if (a.p.topk > kGeneralMaxTopk) launch_shape<GeneralWide<kFp8>>(a, grid, score_only, stream);
  else launch_shape<General<kFp8>>(a, grid, score_only, stream);
}

template <class C>
void raise_smem_limit() {
  cudaFuncSetAttribute(score_kernel<C, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  cudaFuncSetAttribute(score_kernel<C, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
}

}  // namespace

void prepare_score_kernels() {
  raise_smem_limit<General<true>>();
  raise_smem_limit<General<false>>();
  raise_smem_limit<GeneralWide<true>>();
  raise_smem_limit<GeneralWide<false>>();
  raise_smem_limit<Decode<true>>();
  raise_smem_limit<Decode<false>>();
}

void launch_score(const SelectArgs& a, int grid, bool score_only, cudaStream_t stream) {
  if (a.p.queries.format == IndexKeyFormat::kFp8) launch_format<true>(a, grid, score_only, stream);
  else launch_format<false>(a, grid, score_only, stream);
}

}  // namespace dsv4::cuda::ix
