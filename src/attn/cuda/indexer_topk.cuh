#pragma once
// Selection building blocks of the CUDA indexer on order keys
// (indexer_order_key: unique, bigger is better, 0 = empty): a threshold with
// exactly k keys at or above it by radix select, and two sorts (a bitonic
// network over the CTA, and warp runs ranked by binary search).
// Candidates are appended with shared-memory atomics, so their order in a
// buffer varies from run to run; everything here depends only on the set of
// keys, and the final lists are sorted, so results are the same bits every run.
#include <cstdint>

namespace dsv4::cuda::ix {

// sel[0] flag: the keys wanted from the digit's bin are all of its keys.
inline constexpr uint32_t kWholeBin = 0x80000000u;

// One warp: in hist[0 .. 2^kBits) (counts of one digit among the keys that
// match the prefix so far), the largest digit D with at least `need` keys at
// or above it. Writes sel[0] = D (| kWholeBin when at most need + slack keys
// are at or above D) and sel[1] = need minus the keys above D.
// Needs 1 <= need <= sum of hist.
template <int kBits>
__device__ __forceinline__ void radix_find(const uint32_t* hist, uint32_t* sel, uint32_t need, uint32_t slack,
                                           int lane) {
  constexpr int kBins = 1 << kBits, kPerLane = kBins / 32;
  static_assert(kPerLane >= 1, "at least 32 bins");
  const int top = kBins - 1 - lane * kPerLane;  // this lane's bins top, top - 1, ... (high digits first)
  uint32_t sum = 0;
  for (int i = 0; i < kPerLane; ++i) sum += hist[top - i];
  uint32_t incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  const uint32_t excl = incl - sum;
  if (excl < need && need <= incl) {
    uint32_t cum = excl;
    for (int i = 0; i < kPerLane; ++i) {
      const uint32_t c = hist[top - i];
      if (cum + c >= need) {
        sel[0] = uint32_t(top - i) | (cum + c - need <= slack ? kWholeBin : 0u);
        sel[1] = need - cum;
        break;
      }
      cum += c;
    }
  }
}

// A threshold with exactly k of the keys that `visit` enumerates at or above
// it: the k-th largest key, or a smaller value with no key between the two.
// With slack > 0, a threshold with k to k + slack keys at or above it: the
// passes stop at the first digit whose bin takes at most that many (a cut
// of a candidate buffer only needs to keep every key of the best k, and each
// digit's pass costs three barriers).
// Over the threads tid = 0 .. nthreads - 1 that call it together (sync() is
// their barrier; nthreads a multiple of 32). visit(f) calls f(key) for every
// key this thread holds (0 = empty, skipped), from whole warps in step.
// kWarpAggregate: a warp's adjacent lanes with the same digit add to the
// histogram once (finalize; the score kernel uses one plain atomic per key,
// which was faster there: docs/perf-notes.md run G1).
// hist: 2^kBits words, sel: 2 words of shared memory, used by no other
// thread while this runs. Needs 1 <= k <= number of keys.
// The digits start below the bits every key shares (found by a first pass
// that ANDs and ORs the keys): a unit's candidates share their score's
// leading bits, which as a first digit put them all in a few bins, each a
// chain of same-address atomics. Digits of kBits follow; the passes stop at
// a digit whose bin is taken whole (k to k + slack keys at or above it). Three
// barriers per digit order every reuse: hist is zeroed before [1], counted
// before [2], read by radix_find before [3] and zeroed again only after [3];
// sel is written before [3], read after it, and written again only after the
// next digit's [1] and [2]. The shared bits use hist[0..3] between [a], [b]
// and [c].
template <int kBits, bool kWarpAggregate = true, typename Visit, typename Sync>
__device__ uint64_t radix_kth(Visit&& visit, uint32_t k, uint32_t* hist, uint32_t* sel, int tid, int nthreads,
                              Sync&& sync, uint32_t slack = 0) {
  if (tid < 4) hist[tid] = tid < 2 ? ~0u : 0u;  // AND of the low, high halves; OR of the low, high halves
  uint32_t and_lo = ~0u, and_hi = ~0u, or_lo = 0, or_hi = 0;
  visit([&](uint64_t key) {
    if (key == 0) return;
    and_lo &= uint32_t(key), and_hi &= uint32_t(key >> 32);
    or_lo |= uint32_t(key), or_hi |= uint32_t(key >> 32);
  });
  and_lo = __reduce_and_sync(0xffffffffu, and_lo), and_hi = __reduce_and_sync(0xffffffffu, and_hi);
  or_lo = __reduce_or_sync(0xffffffffu, or_lo), or_hi = __reduce_or_sync(0xffffffffu, or_hi);
  sync();  // [a]
  if ((tid & 31) == 0) {
    atomicAnd(hist, and_lo), atomicAnd(hist + 1, and_hi);
    atomicOr(hist + 2, or_lo), atomicOr(hist + 3, or_hi);
  }
  sync();  // [b]
  const uint64_t all = (uint64_t(hist[1]) << 32) | hist[0], any = (uint64_t(hist[3]) << 32) | hist[2];
  sync();  // [c]
  int hi = 64 - __clzll(all ^ any);  // bits hi and up are the same in every key
  uint64_t mask = hi < 64 ? ~((uint64_t(1) << hi) - 1) : 0, prefix = all & mask;
  uint32_t need = k;
  for (; hi > 0; hi -= kBits) {
    const int width = hi < kBits ? hi : kBits, shift = hi - width;
    const uint32_t digit_mask = (1u << width) - 1u;
    for (int i = tid; i < (1 << kBits); i += nthreads) hist[i] = 0;
    sync();  // [1]
    visit([&](uint64_t key) {
      const bool in = (key & mask) == prefix;  // (not 0: every key has the marker bit 34, a shared bit)
      const uint32_t bin = in ? uint32_t((key >> shift) & digit_mask) : ~0u;
      if constexpr (kWarpAggregate) {
        // Runs of one bin in lane order add once, from their first lane: the
        // keys come in sorted runs (a list's chunk, or its passing prefix as
        // staged), so the high digits' bins run long. A shuffle and a ballot
        // instead of __match_any_sync: finalize's rounds over ~2,900 staged
        // keys took their radix from 4.2-8.0 to 2.4-6.7 us with this alone
        // (docs/perf-notes.md, AX1). Right in any order: a bin split over
        // several runs adds once per run.
        const int lane = tid & 31;
        const uint32_t before = __shfl_up_sync(0xffffffffu, bin, 1);
        const uint32_t heads = __ballot_sync(0xffffffffu, lane == 0 || before != bin);
        const uint32_t later = lane < 31 ? heads >> (lane + 1) : 0u;  // heads past this lane
        const int run = later ? __ffs(later) : 32 - lane;              // this lane to the next head
        if (in && ((heads >> lane) & 1u)) atomicAdd(hist + bin, uint32_t(run));
      } else if (in) {
        atomicAdd(hist + bin, 1u);
      }
    });
    sync();  // [2]
    if (tid < 32) radix_find<kBits>(hist, sel, need, slack, tid);
    sync();  // [3]
    const uint32_t d = sel[0];
    need = sel[1];
    prefix |= uint64_t(d & ~kWholeBin) << shift;
    mask |= uint64_t(digit_mask) << shift;
    if (d & kWholeBin) break;  // k to k + slack keys are >= prefix (its lower bits 0)
  }
  return prefix;  // (with every bit fixed: the k-th key itself; keys are unique)
}

// A compare-exchange of a bitonic network between this lane and lane ^ mask:
// the larger of their two values where keep_max, else the smaller.
__device__ __forceinline__ uint64_t exchange_lanes(uint64_t v, int mask, bool keep_max) {
  const uint64_t o = __shfl_xor_sync(0xffffffffu, v, mask);
  return keep_max == (o > v) ? o : v;
}

// Sorts s[0 .. n) descending in place (keys unique but for 0s), over the
// kThreads threads of the CTA, n <= kPer * kThreads; s has room for n
// rounded up to a power of two (at least kPer). A bitonic network: each
// thread holds elements kPer tid .. kPer tid + kPer - 1, so exchanges less
// than 32 kPer elements apart run in registers (within the thread, or
// shuffles: no barrier) and only the wider ones go through shared memory
// (10 of the 55 stages of 1,024 keys with kPer = 2; the network in shared
// memory alone took a barrier per stage). A warp whose elements all lie at
// or past len holds 0s that only it exchanges: it skips those stages and
// passes the barriers only, so a short list costs the issue slots of the
// warps that hold it, not of the whole CTA.
template <int kThreads, int kPer = 2>
__device__ void bitonic_sort_desc(uint64_t* s, int n, int tid) {
  static_assert(kThreads % 32 == 0, "whole warps");
  static_assert(kPer >= 2 && (kPer & (kPer - 1)) == 0, "a power of two per thread");
  constexpr int kWarpSpan = 32 * kPer;  // elements a warp holds
  int len = kPer;
  while (len < n) len <<= 1;
  for (int i = n + tid; i < len; i += kThreads) s[i] = 0;
  __syncthreads();
  const int i0 = kPer * tid;
  const bool live = i0 < len;  // the others hold 0s, exchanged only among themselves
  const bool warp_live = kPer * (tid & ~31) < len;  // some lane of this warp is live (uniform)
  uint64_t v[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) v[e] = live ? s[i0 + e] : 0;
  for (int size = 2; size <= len; size <<= 1) {
    if (size > kWarpSpan) {  // strides of a warp's span and more: in shared memory, one barrier each
      if (live) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) s[i0 + e] = v[e];
      }
      __syncthreads();
      for (int stride = size >> 1; stride >= kWarpSpan; stride >>= 1) {
        for (int i = tid; i < len / 2; i += kThreads) {
          const int lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1)), hi = lo + stride;
          const uint64_t a = s[lo], b = s[hi];
          if ((lo & size) == 0 ? a < b : a > b) s[lo] = b, s[hi] = a;
        }
        __syncthreads();
      }
      if (live) {  // own elements: no barrier before the next write
#pragma unroll
        for (int e = 0; e < kPer; ++e) v[e] = s[i0 + e];
      }
    }
    if (!warp_live) continue;  // (a warp past len passes every barrier above, none below)
    for (int stride = size > kWarpSpan ? kWarpSpan / 2 : size >> 1; stride >= kPer; stride >>= 1) {
#pragma unroll
      for (int e = 0; e < kPer; ++e) {  // the partner is element e of lane ^ stride / kPer
        const int i = i0 + e;
        v[e] = exchange_lanes(v[e], stride / kPer, ((i & stride) == 0) == ((i & size) == 0));
      }
    }
#pragma unroll
    for (int stride = kPer / 2; stride >= 1; stride >>= 1) {  // within the thread
      if (stride >= size) continue;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        if (e & stride) continue;
        const bool desc = ((i0 + e) & size) == 0;
        if (desc ? v[e] < v[e + stride] : v[e] > v[e + stride]) {
          const uint64_t t = v[e];
          v[e] = v[e + stride], v[e + stride] = t;
        }
      }
    }
  }
  if (live) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) s[i0 + e] = v[e];
  }
  __syncthreads();
}

// The n <= kThreads unique keys s[0 .. n) best first, over the kThreads
// threads of the CTA, without a sorting network across warps: each warp
// sorts its 32 keys (a bitonic network over its lanes, no barrier), then a
// key's place is the number of keys above it in every warp's run, one
// binary search per run, all runs' searches step by step at once (their
// loads independent). Calls put(rank, key) for thread tid's key (tid < n).
// s needs room for kThreads keys (the runs are padded with 0s).
// Against the network of bitonic_sort_desc (45 dependent stages for 512
// keys, three through shared memory) this is 15 stages and 5 search steps.
template <int kThreads, typename Put>
__device__ void run_rank_sort_desc(uint64_t* s, int n, int tid, Put&& put) {
  static_assert(kThreads % 32 == 0, "whole warps");
  constexpr int kRuns = kThreads / 32;
  const int lane = tid & 31;
  uint64_t v = tid < n ? s[tid] : 0;
  for (int size = 2; size <= 32; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1)  // descending blocks of size
      v = exchange_lanes(v, stride, ((lane & stride) == 0) == ((lane & size) == 0));
  }
  s[tid] = v;  // this thread's own element: read above, by no other thread
  __syncthreads();
  if (tid >= n) return;
  // c[r]: keys of run r above v among its first 31 (a prefix: runs are
  // sorted), then its last key.
  int c[kRuns];
#pragma unroll
  for (int r = 0; r < kRuns; ++r) c[r] = 0;
#pragma unroll
  for (int step = 16; step >= 1; step >>= 1) {
#pragma unroll
    for (int r = 0; r < kRuns; ++r) c[r] += s[32 * r + c[r] + step - 1] > v ? step : 0;
  }
  uint32_t rank = 0;
#pragma unroll
  for (int r = 0; r < kRuns; ++r) rank += uint32_t(c[r]) + (s[32 * r + 31] > v ? 1u : 0u);
  put(rank, v);
}

// Appends the keys for which `take` holds to buf at positions taken from
// *count (one shared-memory atomic per warp). Every lane of the warp must
// call. Positions at or past cap are counted but not written: *count > cap
// afterwards says that buf overflowed.
template <typename T>
__device__ __forceinline__ void warp_append(bool take, T key, T* buf, int* count, int lane, int cap = 0x7fffffff) {
  const uint32_t ballot = __ballot_sync(0xffffffffu, take);
  if (ballot == 0) return;
  const int leader = __ffs(ballot) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(count, __popc(ballot));
  base = __shfl_sync(0xffffffffu, base, leader);
  const int at = base + __popc(ballot & ((1u << lane) - 1u));
  if (take && at < cap) buf[at] = key;
}

}  // namespace dsv4::cuda::ix
