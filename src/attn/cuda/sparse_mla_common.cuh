#pragma once
// Shared pieces of the sparse-attention kernels (sparse_mla_kernel.cu,
// sparse_mla_combine.cu): the plane layout of Q, K and P, the unit walker,
// where an entry's record lives and small helpers.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "attn/cuda/fp8_dequant.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/rope.cuh"
#include "attn/cuda/sparse_mla_internal.cuh"

namespace dsv4::cuda::mla {

// Q, K and P are stored as planes of 64 dims (128 bytes) per row: plane
// c / 8 holds 16-byte chunk c of every row, rows 128 bytes apart, and the
// chunk sits at position (c % 8) ^ (row % 8). That is the 128B-swizzle
// layout of wgmma (8-row atoms of 1024 bytes), and it keeps the 16-byte
// accesses of 8 consecutive rows conflict-free.
constexpr int kPlane = 64 * 128;
constexpr int kQBytes = 8 * kPlane;  // 64 heads x 512 dims
constexpr int kKBytes = 8 * kPlane;  // 64 entries x 512 dims
constexpr int kPBytes = kHeadBlock * kTileEntries * 2;
constexpr int kOffQ = 0;  // Q opens the kernel's shared memory (layout: sparse_mla_tiles.cuh)

// Byte offset of 16-byte chunk c (8 dims) of a row in a plane-major array.
__device__ __forceinline__ uint32_t chunk_off(int row, int c) {
  return uint32_t((c >> 3) * kPlane + row * 128 + (((c & 7) ^ (row & 7)) << 4));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ void stamp(const AttnParams& p, int k, unsigned thread = 0) {
  if (threadIdx.x == thread) p.debug_clock[blockIdx.x * kDebugSlots + k] = global_timer_ns();
}

// Walks the units of a CTA range in order; the next unit's record is loaded
// one unit ahead. The attention kernel starts it before its PDL wait (the
// plan is complete by then: sparse_mla_plan.cu) and each role copies it. Also tracks the unit's token and head block
// (u = tok * plan_head_blocks + hb; hb is the unit's group of head blocks)
// without a division per step.
struct UnitWalker {
  const int4* info;
  int u, tok, hb, head_blocks;
  int4 cur, nxt;
  __device__ __forceinline__ void start(const AttnParams& p, int u0) {
    info = p.plan.unit_info;
    u = u0;
    head_blocks = p.plan_head_blocks;
    tok = u0 / head_blocks;
    hb = u0 - tok * head_blocks;
    cur = __ldg(info + u0);
    nxt = __ldg(info + u0 + 1);
  }
  __device__ __forceinline__ int begin() const { return cur.x; }
  __device__ __forceinline__ int end() const { return nxt.x; }
  __device__ __forceinline__ void advance() {
    ++u;
    if (++hb == head_blocks) {
      hb = 0;
      ++tok;
    }
    cur = nxt;
    nxt = __ldg(info + u + 1);  // info has units + 1 records; u never passes the last unit
  }
  // Moves to the unit of tile a + s of a CTA range of n tiles from a (tiles
  // in order) and says whether the tile is that unit's first or last there.
  struct Place {
    bool unit_first, unit_last;
  };
  __device__ __forceinline__ Place place(int a, int s, int n) {
    const int tile = a + s;
    if (tile >= end()) advance();
    return {s == 0 || tile == begin(), s + 1 == n || tile + 1 == end()};
  }
};

// Entry e of a tile: its slot and list (0: SWA, 1: extra, -1: nothing there).
struct EntryRef {
  int32_t slot;
  int list;  // 0: SWA, 1: extra, -1: nothing at this position
};

// Entry `pos` of token t's row (its SWA list, then its extra list); nothing
// at or past `end`.
__device__ __forceinline__ EntryRef row_entry(const AttnParams& p, int t, int ls, int pos, int end) {
  EntryRef r{-1, -1};
  if (pos < ls && pos < end) {
    r.slot = __ldg(p.swa.indices + int64_t(t) * p.swa.width + pos);
    r.list = 0;
  } else if (pos >= ls && pos < end) {
    r.slot = __ldg(p.extra.indices + int64_t(t) * p.extra.width + (pos - ls));
    r.list = 1;
  }
  return r;
}

// Entry e of tile `tile` (the walker moved to the tile's unit).
__device__ __forceinline__ EntryRef fetch_ref(const AttnParams& p, UnitWalker& w, int tile, int e) {
  while (tile >= w.end()) w.advance();
  const int ls = w.cur.y;
  return row_entry(p, w.tok, ls, (tile - w.begin()) * kTileEntries + e, ls + w.cur.z);
}

// The record and scale bytes of an entry, or null for an empty (< 0) or
// out-of-range slot, which must read nothing.
struct RecordPtrs {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
};

__device__ __forceinline__ RecordPtrs record_ptrs(const AttnParams& p, EntryRef r) {
  RecordPtrs rp;
  if (r.list >= 0 && r.slot >= 0) {
    const CacheView& c = r.list == 0 ? p.swa_cache : p.extra_cache;
    if (int64_t(r.slot) < c.capacity) {
      const uint32_t page = c.page_shift >= 0 ? uint32_t(r.slot) >> c.page_shift : uint32_t(r.slot) / c.entries_per_page;
      const uint32_t off = uint32_t(r.slot) - page * c.entries_per_page;
      const uint8_t* base = c.base + int64_t(page) * c.page_stride;  // 64-bit: pages * stride passes 2^31
      rp.data = base + size_t(576) * off;
      rp.scales = base + size_t(576) * c.entries_per_page + size_t(8) * off;
    }
  }
  return rp;
}

__device__ __forceinline__ bool has_nan_codes(uint4 v) {
  return (e4m3_nan_flags(v.x) | e4m3_nan_flags(v.y) | e4m3_nan_flags(v.z) | e4m3_nan_flags(v.w)) != 0;
}

// ---- one entry's record, a quarter per thread ---------------------------------
// Four threads share an entry: thread q (0..3) reads record chunks q + 4 j:
// fp8 chunks q + 4 j for j < 7 (scale block j), then the bf16 chunks
// 28 + q + 4 j for j < 2. A quad reads 64 contiguous bytes per load.
struct Quarter {
  uint4 c[9];
  uint2 scales;
  bool valid;
};
__host__ __device__ constexpr int record_chunk(int q, int step) { return step < 7 ? q + 4 * step : 28 + q + 4 * (step - 7); }

// Cached loads; nothing is read for an empty or out-of-range slot (zeros).
__device__ __forceinline__ void load_quarter(const AttnParams& p, EntryRef r, int q, Quarter& x) {
  const RecordPtrs rp = record_ptrs(p, r);
  x.valid = rp.data != nullptr;
  const uint4* d = reinterpret_cast<const uint4*>(rp.data);
#pragma unroll
  for (int i = 0; i < 9; ++i) x.c[i] = x.valid ? __ldg(d + record_chunk(q, i)) : make_uint4(0, 0, 0, 0);
  x.scales = x.valid ? __ldg(reinterpret_cast<const uint2*>(rp.scales)) : make_uint2(0, 0);
}

// The scale byte of step `step` (< 7: 64-dim block `step`) of a quarter.
__device__ __forceinline__ uint32_t step_scale(uint2 scales, int step) {
  return (step < 4 ? scales.x >> (8 * step) : scales.y >> (8 * (step - 4))) & 0xffu;
}

// Record chunk k < 28 (16 e4m3 codes v, sb: the scale byte of its 64-dim
// block) as 16 bf16: dims 16 k .. 16 k + 7 in lo, the next 8 in hi. NaN
// codes (never written by the quantizer) come out NaN, as on the CPU.
__device__ __forceinline__ void dequant_record_chunk(uint4 v, uint32_t sb, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  const ScaleFactors f = scale_factors(sb);
  uint32_t o[8];
  if (sb <= 134u)
    dequant_chunk<false>(w, f, o);
  else  // scales >= 2^8: never produced for real caches, exact two-step path
    dequant_chunk<true>(w, f, o);
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
  if (has_nan_codes(v)) {
    lo = patch_nan_codes(v.x, v.y, lo);
    hi = patch_nan_codes(v.z, v.w, hi);
  }
}

// Record chunk k (16 bytes v; sb: the scale byte of its 64-dim block when
// k < 28) as bf16 into row e of a K buffer whose 16-byte chunk c of row r is
// at byte off(r, c): the tile kernel's planes (chunk_off) or the decode
// kernel's rows.
template <class Off>
__device__ __forceinline__ void store_record_chunk(uint8_t* kbuf, Off off, int e, int k, uint4 v, uint32_t sb) {
  if (k >= 28) {  // dims 448..511 are bf16 already: record chunk k is K chunk k + 28
    *reinterpret_cast<uint4*>(kbuf + off(e, k + 28)) = v;
    return;
  }
  uint4 lo, hi;
  dequant_record_chunk(v, sb, lo, hi);
  *reinterpret_cast<uint4*>(kbuf + off(e, 2 * k)) = lo;
  *reinterpret_cast<uint4*>(kbuf + off(e, 2 * k + 1)) = hi;
}

// A thread's quarter record into row e (store_record_chunk).
template <class Off>
__device__ __forceinline__ void store_quarter(uint8_t* kbuf, Off off, int e, int q, const Quarter& x) {
#pragma unroll
  for (int step = 0; step < 9; ++step)
    store_record_chunk(kbuf, off, e, record_chunk(q, step), x.c[step], step_scale(x.scales, step));
}

// A thread's quarter record into shared memory by cp.async: the record's
// chunks at their offsets in the 576-byte record at `raw`, the entry's 8
// scale bytes (a copy per thread) at `scales_dst`. An empty or out-of-range
// slot reads nothing and zero-fills. Returns whether the entry is there.
__device__ __forceinline__ bool stage_quarter(const AttnParams& p, EntryRef r, int q, uint32_t raw, uint32_t scales_dst) {
  auto [data, scales] = record_ptrs(p, r);
  const bool valid = data != nullptr;
  if (!valid) data = scales = reinterpret_cast<const uint8_t*>(p.q);  // any valid address: nothing is read
  const uint32_t nb = valid ? 16u : 0u;
#pragma unroll
  for (int step = 0; step < 9; ++step) {
    const int c = record_chunk(q, step);
    cp_async_16(raw + 16 * c, data + 16 * c, nb);
  }
  cp_async_8(scales_dst, scales, nb / 2);
  return valid;
}

// What stage_quarter copied, as bf16 into row e (store_record_chunk). Only
// this thread's own cp.async wait is needed: it reads the bytes it copied.
template <class Off>
__device__ __forceinline__ void store_staged_quarter(uint8_t* kbuf, Off off, int e, int q, const uint8_t* raw,
                                                     const uint8_t* scales_src) {
  const uint2 scales = *reinterpret_cast<const uint2*>(scales_src);
#pragma unroll 1  // a chunk at a time: the callers' accumulators are live
  for (int step = 0; step < 9; ++step) {
    const int k = record_chunk(q, step);
    store_record_chunk(kbuf, off, e, k, *reinterpret_cast<const uint4*>(raw + 16 * k), step_scale(scales, step));
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace dsv4::cuda::mla
