#pragma once
// Selection building blocks of the CUDA indexer on order keys
// (indexer_order_key: unique, bigger is better, 0 = empty): the k-th
// largest key by radix select, and a bitonic sort. Candidates are appended
// with shared-memory atomics, so their order in a buffer varies from run to
// run; everything here depends only on the set of keys, and the final lists
// are sorted, so results are the same bits every run.
#include <cstdint>

namespace dsv4::cuda::ix {

// Marker bit of every real key: the first digit of a radix pass starts below it.
inline constexpr int kKeyTopBit = 34;

// One warp: in hist[0 .. 2^kBits) (counts of one digit among the keys that
// match the prefix so far), the largest digit D with at least `need` keys at
// or above it. Writes sel[0] = D and sel[1] = need minus the keys above D.
// Needs 1 <= need <= sum of hist.
template <int kBits>
__device__ __forceinline__ void radix_find(const uint32_t* hist, uint32_t* sel, uint32_t need, int lane) {
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
        sel[0] = uint32_t(top - i);
        sel[1] = need - cum;
        break;
      }
      cum += c;
    }
  }
}

// The k-th largest key among the keys that `visit` enumerates, over the
// threads tid = 0 .. nthreads - 1 that call it together (sync() is their
// barrier; nthreads a multiple of 32). visit(f) calls f(key) for every key
// this thread holds (0 = empty, skipped), from whole warps in step: a
// warp's lanes with the same digit add to the histogram once (scores of a
// step share their leading bits, so plain atomics on the first digit would
// serialize 32 ways). hist: 2^kBits words, sel: 2 words of shared memory,
// used by no other thread while this runs. Needs 1 <= k <= number of keys.
// Digits of kBits from bit 33 down. Three barriers per digit order every
// reuse: hist is zeroed before [1], counted before [2], read by radix_find
// before [3] and zeroed again only after [3]; sel is written before [3],
// read after it, and written again only after the next digit's [1] and [2].
template <int kBits, typename Visit, typename Sync>
__device__ uint64_t radix_kth(Visit&& visit, uint32_t k, uint32_t* hist, uint32_t* sel, int tid, int nthreads,
                              Sync&& sync) {
  uint64_t prefix = uint64_t(1) << kKeyTopBit, mask = prefix;
  uint32_t need = k;
  for (int hi = kKeyTopBit; hi > 0; hi -= kBits) {
    const int width = hi < kBits ? hi : kBits, shift = hi - width;
    const uint32_t digit_mask = (1u << width) - 1u;
    for (int i = tid; i < (1 << kBits); i += nthreads) hist[i] = 0;
    sync();  // [1]
    visit([&](uint64_t key) {
      const bool in = (key & mask) == prefix;
      const uint32_t bin = in ? uint32_t((key >> shift) & digit_mask) : ~0u;
      const uint32_t peers = __match_any_sync(0xffffffffu, bin);
      if (in && __ffs(peers) - 1 == (tid & 31)) atomicAdd(hist + bin, uint32_t(__popc(peers)));
    });
    sync();  // [2]
    if (tid < 32) radix_find<kBits>(hist, sel, need, tid);
    sync();  // [3]
    const uint32_t d = sel[0];
    need = sel[1];
    prefix |= uint64_t(d) << shift;
    mask |= uint64_t(digit_mask) << shift;
  }
  return prefix;  // every bit fixed: the key itself (keys are unique)
}

// Sorts s[0 .. n) (n a power of two) descending; nthreads threads, CTA barriers.
__device__ inline void bitonic_sort_desc(uint64_t* s, int n, int tid, int nthreads) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < n / 2; i += nthreads) {
        const int lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1)), hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const uint64_t a = s[lo], b = s[hi];
        if (desc ? a < b : a > b) {
          s[lo] = b;
          s[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

// Appends the keys for which `take` holds to buf at positions taken from
// *count (one shared-memory atomic per warp). Every lane of the warp must
// call. Positions at or past cap are counted but not written: *count > cap
// afterwards says that buf overflowed.
__device__ __forceinline__ void warp_append(bool take, uint64_t key, uint64_t* buf, int* count, int lane,
                                            int cap = 0x7fffffff) {
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
