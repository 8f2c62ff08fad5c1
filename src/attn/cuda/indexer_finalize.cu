// The indexer's last step (indexer_select_internal.cuh): per token, the best
// k of its units' lists, sorted best first, mapped to global slots: a sort of
// all candidates when they are few (up to kSortKeys), else a radix select
// (8-bit digits) of a k-th-best threshold and a sort of the keys at or above it.
// The candidates at or above the lists' bound (1 when the group has none)
// are first gathered into shared memory as the lists are read, once; where
// more than kSortKeys pass that bound, a tighter one from the lists' first
// keys (refine_bound) and a second gathering; when more than
// kFinalizeStageKeys remain, the radix passes (and the pass before them that
// finds the bits all keys share) read the lists from global memory again.
// Tokens without keys (padding, nothing visible) get -1 rows and length 0
// and read nothing but the plan.
// Up to kRankTokens tokens (decode steps) a token takes 16 or 32 CTAs
// (rank_ctas) instead of one. Each gathers the same candidates; when they are few (up
// to kSortKeys) there is no sort: each CTA ranks its share of them by
// counting the keys above each one (keys are unique, so a rank is the key's
// place in the best-first order). One CTA sorting 1,024 candidates was
// most of the 15.6 us the kernel took in a batch-1 C4A layer
// (docs/perf-notes.md, runs U3-U4), while 131 SMs idled; ranked, it ends
// 10.1 us after the score kernel, and the batch-1 step at 4K context took
// 3.22 instead of 3.33 ms (runs V1-V2). More candidates (long context), and
// CTA 0 selects and sorts them alone while the others leave: each of 16
// repeating the select over the lists in global memory made the 1M-context
// steps slower (8 x 1M: 8.32-8.51 against 8.51-8.56 ms, run W1).
#include <cuda_runtime.h>

#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/indexer_topk.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/step_rows.cuh"

namespace dsv4::cuda::ix {
namespace {

constexpr int kBits = 8;  // 32 lanes x 8 bins in radix_find
constexpr int kStageKeys = kFinalizeStageKeys;
// A list costs two dependent loads (its count, then its keys): the CTA's
// warps take one list each, and a lane loads kBatch keys (or, from sorted
// lists, the first keys of kBatch lists) before using any.
constexpr int kWarps = kFinalizeThreads / 32;
constexpr int kBatch = 8;
// Rounds of refine_bound: per grows at least 3x a round (6x at top-512), so
// three reach a whole list of 512 keys from Flash's 24 at 128 lists.
constexpr int kRefineRounds = 4;
// Candidates the sort takes at once (four per thread: up to 2,048 are sorted
// at once, not cut by a radix select first; with the sort's idle warps
// skipping its stages, finalize of 128 decode tokens at 64K context went from
// 17.7 to 14.2 us, docs/perf-notes.md runs N1 and N4); the best k fit.
constexpr int kSortPer = 4;
constexpr int kSortKeys = kSortPer * kFinalizeThreads;
static_assert(kIndexerMaxTopk <= kSortKeys && kSortKeys < kStageKeys, "the sort's buffers; the 0 after a ranked set");
// The rank path: CTAs per token, for up to kRankTokens tokens (up to 256
// CTAs: one wave): kRankCtasFew for up to kRankFewTokens tokens, else
// kRankCtas. CTA c of a token ranks the keys whose index is c modulo the
// CTAs (every CTA holds the same set, each in its own order: the appends
// race), kKeys keys at a time (their counts in hist), each compared with a
// (kFinalizeThreads / kKeys)-th of the set by one thread: the more CTAs, the
// fewer keys each and the shorter each thread's run of compares. At batch 1
// and 4K context (1,024 candidates) 16 CTAs ran 128 compares a thread, most
// of the kernel's ~1,700 instructions a warp (Nsight Compute, run AB3); 32
// CTAs run 64, and finalize ends 8.5 us after the score kernel instead of
// 10.2 (docs/perf-notes.md, run AB4).
constexpr int kRankTokens = 16;
constexpr int kRankCtas = 16;
constexpr int kRankFewTokens = 8;
constexpr int kRankCtasFew = 32;
static_assert(kRankFewTokens * kRankCtasFew <= 256 && kRankTokens * kRankCtas <= 256, "one wave");
static_assert((kRankCtas & (kRankCtas - 1)) == 0 && (kRankCtasFew & (kRankCtasFew - 1)) == 0,
              "a CTA's share of the keys by a mask");

int rank_ctas(int tokens) { return tokens <= kRankFewTokens ? kRankCtasFew : tokens <= kRankTokens ? kRankCtas : 1; }

// f(rank, key) for the keys s[pos[0 .. c)] of the m unique keys s[0 .. m),
// rank = how many of s are above the key, over the CTA's threads (every
// thread calls it; counts: kKeys words of shared memory). A warp's lanes
// take 32 keys and the same part of s, so their loads of s broadcast. The
// parts are read as pairs of keys (one 16-byte load for two compares; s is
// 16-byte aligned and s[m] is 0, above no key, for a part ending at an odd m):
// finalize of one token 12.3 -> 11.4 us at 1M context, 6.1 -> 5.9 at 4K
// (docs/perf-notes.md, run AJ3). Narrowing the set to the best k by a radix
// select before ranking, where it holds more than 2k keys, was slower (64K:
// 8.8 -> 10.4 us, run AJ1).
template <int kKeys, typename F>
__device__ void rank_keys(const uint64_t* s, int m, const uint16_t* pos, int c, uint32_t* counts, int tid, F&& f) {
  static_assert(kKeys % 32 == 0 && kKeys <= (1 << kBits), "whole warps of keys; their counts fit hist");
  constexpr int kParts = kFinalizeThreads / kKeys;
  const int part_len = ((m + kParts - 1) / kParts + 1) & ~1, part = tid / kKeys;  // even: parts start on a pair
  const int lo = min(m, part * part_len), hi = min(m, lo + part_len);
  const int p0 = lo >> 1, p1 = lo < hi ? (hi + 1) >> 1 : p0;
  const ulonglong2* pairs = reinterpret_cast<const ulonglong2*>(s);
  for (int j0 = 0; j0 < c; j0 += kKeys) {  // uniform
    if (tid < kKeys) counts[tid] = 0;
    __syncthreads();
    const int j = j0 + tid % kKeys;
    if (j < c) {
      const uint64_t key = s[pos[j]];
      uint32_t above = 0;
#pragma unroll 4
      for (int i = p0; i < p1; ++i) {
        const ulonglong2 v = pairs[i];
        above += (v.x > key ? 1u : 0u) + (v.y > key ? 1u : 0u);
      }
      atomicAdd(counts + (j - j0), above);
    }
    __syncthreads();
    if (tid < kKeys && j0 + tid < c) f(counts[tid], s[pos[j0 + tid]]);
    __syncthreads();  // counts are read before the next keys zero them
  }
}

// kMinBlocks: CTAs an SM must hold. Left to ptxas (launch bounds without
// it), the kernel got 64 registers and spilled 44/264 bytes; with one CTA an
// SM it gets 96 and no spills, with two 64 and 8/80 (nvcc 13.0). One an SM for
// launches that fit one wave that way (up to kOneWaveCtas: batch 1-4 of the
// rank path's 32 CTAs a token), two for the rest (the rank path's up to 256
// CTAs, a prefill chunk's one a token). Decode after a 256K prefill: 4.149 ->
// 4.024 ms a step with this alone (docs/perf-notes.md, AX3).
constexpr unsigned kOneWaveCtas = 128;  // of the H100's and H200's 132 SMs
template <int kMinBlocks>
__global__ void __launch_bounds__(kFinalizeThreads, kMinBlocks) finalize_kernel(const SelectArgs a) {
  __shared__ uint32_t hist[1 << kBits];
  __shared__ uint32_t sel[2];
  __shared__ uint64_t sorted[kIndexerMaxTopk];
  // The rank path's set: 16-byte aligned, and room (kSortKeys < kStageKeys)
  // for the 0 after it (rank_keys' pairs).
  __shared__ __align__(16) uint64_t staged[kStageKeys];
  __shared__ unsigned long long bound;
  __shared__ uint16_t owned[kSortKeys];  // the rank path: where this CTA's keys are in the set
  __shared__ int total, kept_count, staged_count, owned_count, live_count;
  __shared__ uint16_t live[2][kMaxGroupUnits];  // refine_bound's live lists, by round
  __shared__ int counts[kMaxGroupUnits];  // list s's count, loaded once
  __shared__ int32_t table_first;  // the token's block-table row starts at this logical block
  const IndexerSelectParams& p = a.p;
  const Workspace& ws = a.ws;
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, k = p.topk;
  const int ctas = int(gridDim.y), cta = int(blockIdx.y);  // this token's CTAs (the rank path when > 1)
  // The plan, before the wait (the plan kernel lets nothing start before it ends).
  const int real = real_rows(p);
  const TokenRef ref = t < real ? ws.tokens[t] : TokenRef{-1, 0};
  Group gr{};
  if (ref.group >= 0) gr = ws.groups[ref.group];
  // The token's row of the compressed cache's block table (step metadata,
  // pdl.cuh) before the wait too: mapping the ranked keys to slots through
  // it were the kernel's last two dependent loads (the row's first block,
  // then a page). Its first block goes to shared memory, its lines to L1.
  BlockTableView table = p.c4a_table;
  if (ref.group >= 0) {
    table.pages += int64_t(gr.run) * table.width;
    if (tid == 0) table_first = table.first[gr.run];
    for (int i = 32 * tid; i < table.width; i += 32 * kFinalizeThreads) prefetch_l1(table.pages + i);
  }
  table.first = &table_first;  // row 0 of the view is the token's row
  pdl_start();  // pdl.cuh: launched with pdl_launch
  // The score kernel has finished taking units: rewind its counter, so that
  // the next score on this plan (run_planned, the next layer) starts again.
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) a.ws.counters->next_unit = 0;
  const int lists = ref.group >= 0 ? gr.units : 0;
  const bool bounded = ref.group >= 0 && has_list_bounds(gr);
  auto list_of = [&](int s) { return list_index(gr, s, ref.tl); };

  if (tid == 0) total = kept_count = staged_count = owned_count = 0, bound = ~0ull;
  __syncthreads();
  int mine = 0;
  for (int s = tid; s < lists; s += kFinalizeThreads) {
    const int64_t l = list_of(s);
    counts[s] = ws.list_counts[l];
    mine += counts[s];
    if (bounded) atomicMin(&bound, (unsigned long long)ws.list_bounds[l]);
  }
  if (mine) atomicAdd(&total, mine);
  __syncthreads();
  // Keys below lo are not among the best k (a bound of 0: that unit had
  // fewer than m keys, no bound). Raised below where many keys pass it.
  uint64_t lo = bounded ? max(uint64_t(bound), uint64_t(1)) : 1;
  // With stop > 0 (bounded lists), each_listed ends early, whole warps at a
  // time, once more than stop keys were staged (staged_count): before it
  // reads on past a list's first chunk.
  int stop = 0;
  auto stopped = [&] {  // uniform over the warp
    return stop > 0 && __any_sync(0xffffffffu, *reinterpret_cast<volatile int*>(&staged_count) > stop);
  };
  // f(key) for every key >= lo of the lists (0 for the others and for a
  // lane past a list's end: whole warps call f, as warp_append needs).
  auto each_listed = [&](auto&& f) {
    if (bounded) {
      // Sorted lists (write_lists): the keys >= lo are a prefix. A warp reads
      // the first 32 keys of kBatch lists at once, and reads on in a list
      // only while a whole chunk of it passes.
      for (int s0 = warp; s0 < lists; s0 += kWarps * kBatch) {
        uint64_t v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int s = s0 + kWarps * b;
          v[b] = s < lists && lane < counts[s] ? ws.list_keys[list_of(s) * ws.list_stride + lane] : 0;
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          f(v[b] >= lo ? v[b] : 0);
          const int s = s0 + kWarps * b;
          if (s >= lists || __shfl_sync(0xffffffffu, v[b], 31) < lo) continue;  // uniform
          const uint64_t* keys = ws.list_keys + list_of(s) * ws.list_stride;
          for (int i0 = 32; i0 < counts[s]; i0 += 32) {
            if (stopped()) return;
            const uint64_t w = i0 + lane < counts[s] ? keys[i0 + lane] : 0;
            f(w >= lo ? w : 0);
            if (__shfl_sync(0xffffffffu, w, 31) < lo) break;
          }
        }
      }
      return;
    }
    for (int s = warp; s < lists; s += kWarps) {
      const int64_t l = list_of(s);
      const int c = counts[s];
      const uint64_t* keys = ws.list_keys + l * ws.list_stride;
      for (int i0 = 0; i0 < c; i0 += 32 * kBatch) {
        uint64_t v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) v[b] = i0 + 32 * b + lane < c ? keys[i0 + 32 * b + lane] : 0;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) f(v[b] >= lo ? v[b] : 0);
      }
    }
  };
  // f(key) for the first c staged keys, as whole warps (0 past c).
  auto each_staged = [&](int c, auto&& f) {
    for (int i0 = 0; i0 < c; i0 += kFinalizeThreads) f(i0 + tid < c ? staged[i0 + tid] : 0);
  };
  // A tighter bound than lo where many keys pass it, in rounds: the k-th
  // best of the first `per` keys (those >= lo) of every list still live is a
  // bound (they are keys of the token, so their k-th best is at most the
  // token's k-th best); a list stays live while its per-th key passes the
  // new bound, since keys past its first per may then pass it too. Live
  // lists hold at most k / per of the keys above the bound, so per grows
  // k_stage / k-fold a round (6x at top-512): where the best keys tie in
  // long runs (one bf16 score, ties to the lower j) the rounds close in on
  // the first units' lists. Ends where no list is live (the token then has
  // k to k + k / 2 keys at or above the bound), where the live lists' first keys are
  // fewer than k, or after kRefineRounds. The same in every CTA of the
  // token: each round depends only on the set of keys it stages.
  auto refine_bound = [&] {
    int n_live = lists, per = min(k, kStageKeys / max(lists, 1));
    const uint16_t* ids = nullptr;  // the live lists (nullptr: all)
    for (int round = 0; round < kRefineRounds && n_live > 0; ++round) {
      __syncthreads();  // earlier reads of staged, staged_count and live are done
      if (tid == 0) staged_count = 0, live_count = 0;
      __syncthreads();
      // The live lists' first per keys, as (list, 32-key chunk) pairs a
      // warp takes kBatch at a time, loads first.
      const int chunks = (per + 31) / 32, pairs = n_live * chunks;
      for (int q0 = warp; q0 < pairs; q0 += kWarps * kBatch) {
        uint64_t v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int q = q0 + kWarps * b, a = q / chunks, i = (q - a * chunks) * 32 + lane;
          const int s = q < pairs ? (ids ? int(ids[a]) : a) : 0;
          v[b] = q < pairs && i < min(counts[s], per) ? ws.list_keys[list_of(s) * ws.list_stride + i] : 0;
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) warp_append(v[b] >= lo, v[b], staged, &staged_count, lane, kStageKeys);
      }
      __syncthreads();
      const int c = staged_count;  // <= n_live * per <= kStageKeys
      if (c < k) return;           // uniform
      // A bound needs only k keys at or above it: the digit passes stop at
      // the first bin taken whole with at most k + k / 2 of them (the exact
      // k-th best took 4-8 us over ~2,900 staged keys, 2-4 this way:
      // docs/perf-notes.md, AW5 and AX1).
      lo = max(lo, radix_kth<kBits>([&](auto&& f) { each_staged(c, f); }, uint32_t(k), hist, sel, tid,
                                    kFinalizeThreads, [] { __syncthreads(); }, uint32_t(k / 2)));
      uint16_t* next = live[round & 1];
      for (int a = tid; a < n_live; a += kFinalizeThreads) {
        const int s = ids ? int(ids[a]) : a;
        if (counts[s] > per && ws.list_keys[list_of(s) * ws.list_stride + per - 1] >= lo)
          next[atomicAdd(&live_count, 1)] = uint16_t(s);
      }
      __syncthreads();
      n_live = live_count, ids = next;
      per = min(k, kStageKeys / max(n_live, 1));
    }
  };
  // The keys >= lo into staged (staged_count: how many passed, also past
  // the stage's end). The first staging starts from the zeroed count; a
  // later one (again, uniform) first waits for the reads of the last.
  auto stage_listed = [&](bool again) {
    if (again) {
      __syncthreads();  // earlier reads of staged and staged_count are done
      if (tid == 0) staged_count = 0;
      __syncthreads();
    }
    each_listed([&](uint64_t key) { warp_append(key != 0, key, staged, &staged_count, lane, kStageKeys); });
    __syncthreads();
  };
  int n = total;  // keys in lists are nonzero and unique
  bool in_smem = false;
  if (bounded || n <= kStageKeys) {
    // Bounded lists: first only until more than kSortKeys pass the bound.
    stop = bounded ? kSortKeys : 0;
    stage_listed(false);
    n = staged_count;  // the keys >= lo (past kSortKeys: at least that many)
    stop = 0;
    if (bounded && n > kSortKeys) {
      // Many keys pass the lists' bound where the token's best keys crowd
      // into a few units, or tie in long runs of one bf16 score: decode after
      // a real prefill, where finalize then took 33 us a C4A layer at 64K
      // context and 69 at 256K against 8.5 and 12.5 over synthetic caches
      // (docs/perf-notes.md, run AU3). A tighter bound from the lists'
      // first keys (refine_bound); the picks are the same.
      refine_bound();
      stage_listed(true);
      n = staged_count;
    }
    in_smem = n <= kStageKeys;
  }
  // Every candidate once, as whole warps (0 stands for none).
  auto each_key = [&](auto&& f) {
    if (in_smem) {
      each_staged(n, f);
    } else {
      each_listed(f);
    }
  };

  int32_t* picks = p.picks + int64_t(t) * k;
  int32_t* slots = p.slots + int64_t(t) * k;
  auto write = [&](int i, uint64_t key) {
    const int32_t j = indexer_key_index(key);
    picks[i] = j;
    slots[i] = block_table_slot(table, 0, j);
  };
  // Few candidates (all of them at short context): all of them are the set,
  // ranked by the token's CTAs (or sorted where it has one). More (long
  // context): a threshold with k keys at or above it by radix select, which
  // reads the lists again when they do not fit shared memory, and the keys
  // at or above it, sorted by CTA 0 alone: the token's other CTAs leave
  // rather than repeat the select.
  const bool few = in_smem && n <= kSortKeys;  // the same in every CTA of the token
  const int parts = few ? ctas : 1;            // CTAs that write this token's rows
  if (cta >= parts) return;
  uint64_t* set = staged;
  int m = n;
  if (!few) {
    const uint64_t kth = radix_kth<kBits>(each_key, uint32_t(k), hist, sel, tid, kFinalizeThreads,
                                          [] { __syncthreads(); });
    each_key([&](uint64_t key) { warp_append(key != 0 && key >= kth, key, sorted, &kept_count, lane); });
    __syncthreads();
    set = sorted, m = kept_count;  // k: keys are unique
  }
  const int kept = min(m, k);
  if (parts > 1) {
    const uint64_t mask = uint64_t(parts - 1);  // parts: a power of two
    for (int i0 = 0; i0 < m; i0 += kFinalizeThreads) {  // uniform: whole warps append
      const int i = i0 + tid;
      warp_append(i < m && int(set[i] & mask) == cta, uint16_t(i), owned, &owned_count, lane);
    }
    if (tid == 0) staged[m] = 0;  // rank_keys' pairs (set is staged: few)
    __syncthreads();
    auto f = [&](uint32_t rank, uint64_t key) {
      if (int(rank) < k) write(int(rank), key);
    };
    // About m / parts keys each: 32 at a time with 32 CTAs a token (1,024
    // candidates: one round), else 64.
    if (parts >= 32)
      rank_keys<32>(set, m, owned, owned_count, hist, tid, f);
    else
      rank_keys<64>(set, m, owned, owned_count, hist, tid, f);
  } else {
    bitonic_sort_desc<kFinalizeThreads, kSortPer>(set, m, tid);
  }
  for (int i = cta * kFinalizeThreads + tid; i < k; i += parts * kFinalizeThreads) {
    if (i >= kept) picks[i] = slots[i] = -1;
    else if (parts == 1) write(i, set[i]);
  }
  if (cta == 0 && tid == 0) p.lengths[t] = kept;
}

}  // namespace

void launch_finalize(const SelectArgs& a, cudaStream_t stream) {
  const dim3 grid(unsigned(a.p.num_tokens), unsigned(rank_ctas(a.p.num_tokens)));
  const bool one_wave = grid.x * grid.y <= kOneWaveCtas;
  pdl_launch(one_wave ? finalize_kernel<1> : finalize_kernel<2>, grid, kFinalizeThreads, 0, stream, a);
}

}  // namespace dsv4::cuda::ix
