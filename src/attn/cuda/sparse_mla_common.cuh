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

__device__ __forceinline__ void stamp(const AttnParams& p, int k) {
  if (threadIdx.x == 0) p.debug_clock[blockIdx.x * kDebugSlots + k] = global_timer_ns();
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

__device__ __forceinline__ EntryRef fetch_ref(const AttnParams& p, UnitWalker& w, int tile, int e) {
  while (tile >= w.end()) w.advance();
  const int t = w.tok;
  const int pos = (tile - w.begin()) * kTileEntries + e;
  const int ls = w.cur.y, le = w.cur.z;
  EntryRef r{-1, -1};
  if (pos < ls) {
    r.slot = __ldg(p.swa.indices + int64_t(t) * p.swa.width + pos);
    r.list = 0;
  } else if (pos - ls < le) {
    r.slot = __ldg(p.extra.indices + int64_t(t) * p.extra.width + (pos - ls));
    r.list = 1;
  }
  return r;
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
