// The indexer's last step (indexer_select_internal.cuh): per token, the best
// k of its units' lists (radix select over the lists in global memory,
// 12-bit digits), sorted best first (bitonic), mapped to global slots.
// Tokens without keys (padding, nothing visible) get -1 rows and length 0
// and read nothing but the plan.
#include <cuda_runtime.h>

#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/indexer_topk.cuh"

namespace dsv4::cuda::ix {
namespace {

constexpr int kBits = 12;

__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const SelectArgs a) {
  __shared__ uint32_t hist[1 << kBits];
  __shared__ uint32_t sel[2];
  __shared__ uint64_t sorted[kIndexerMaxTopk];
  __shared__ int total, kept_count;
  const IndexerSelectParams& p = a.p;
  const Workspace& ws = a.ws;
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, k = p.topk;
  const int real = p.real_tokens ? min(max(*p.real_tokens, 0), p.num_tokens) : p.num_tokens;
  const TokenRef ref = t < real ? ws.tokens[t] : TokenRef{-1, 0};
  Group gr{};
  if (ref.group >= 0) gr = ws.groups[ref.group];
  const int lists = ref.group >= 0 ? gr.units : 0;
  auto list_of = [&](int s) { return int64_t(gr.list_base) + int64_t(s) * gr.count + ref.tl; };

  if (tid == 0) total = kept_count = 0;
  __syncthreads();
  int mine = 0;
  for (int s = tid; s < lists; s += kFinalizeThreads) mine += ws.list_counts[list_of(s)];
  if (mine) atomicAdd(&total, mine);
  __syncthreads();
  const int n = total;

  uint64_t kth = 1;  // at most k candidates: keep them all
  if (n > k) {
    kth = radix_kth<kBits>(
        [&](auto&& f) {
          for (int s = 0; s < lists; ++s) {
            const int64_t l = list_of(s);
            const int c = ws.list_counts[l];
            for (int i = tid; i < c; i += kFinalizeThreads) f(ws.list_keys[l * ws.list_stride + i]);
          }
        },
        uint32_t(k), hist, sel, tid, kFinalizeThreads, [] { __syncthreads(); });
  }
  for (int s = 0; s < lists; ++s) {
    const int64_t l = list_of(s);
    const int c = ws.list_counts[l];
    for (int i0 = 0; i0 < c; i0 += kFinalizeThreads) {  // uniform trip count: warp_append is collective
      const int i = i0 + tid;
      const uint64_t key = i < c ? ws.list_keys[l * ws.list_stride + i] : 0;
      warp_append(key != 0 && key >= kth, key, sorted, &kept_count, lane);
    }
  }
  __syncthreads();
  const int kept = kept_count;  // min(n, k): keys are unique
  int padded = 1;
  while (padded < kept) padded <<= 1;
  for (int i = kept + tid; i < padded; i += kFinalizeThreads) sorted[i] = 0;
  __syncthreads();
  bitonic_sort_desc(sorted, padded, tid, kFinalizeThreads);

  int32_t* picks = p.picks + int64_t(t) * k;
  int32_t* slots = p.slots + int64_t(t) * k;
  for (int i = tid; i < k; i += kFinalizeThreads) {
    const int32_t j = i < kept ? indexer_key_index(sorted[i]) : -1;
    picks[i] = j;
    slots[i] = i < kept ? block_table_slot(p.c4a_table, gr.run, j) : -1;
  }
  if (tid == 0) p.lengths[t] = kept;
}

}  // namespace

void launch_finalize(const SelectArgs& a, cudaStream_t stream) {
  finalize_kernel<<<a.p.num_tokens, kFinalizeThreads, 0, stream>>>(a);
}

}  // namespace dsv4::cuda::ix
