// Sparse MLA attention with sink over fp8_ds_mla pages (SPEC §4.6, §5, §6).
//
// One persistent CTA per SM walks its range of tiles (see
// sparse_mla_internal.cuh). Inside a CTA:
//  * 4 producer warps gather the 64 entries of a tile straight from the pages
//    (16-byte loads, two threads per 32-byte sector) and dequantize them to
//    bf16 into one of two shared-memory K buffers;
//  * 8 consumer warps run S = Q K^T, the online softmax with the sink and
//    O += P V on bf16 mma.sync (fp32 accumulators), Q staying in shared
//    memory for the whole unit;
//  * at the end, units cut by CTA-range boundaries are merged by their
//    participants (fused combine: no second kernel), each merging one share.
// Production numerics (SPEC §5): q.k with bf16 operands and fp32 accumulation,
// scale after; exp2 in fp32; P rounded to bf16 for P.V while the row sum adds
// the fp32 values; output rounded to bf16.
#include <cuda_bf16.h>

#include <cmath>

#include "attn/cuda/fp8_dequant.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/sparse_mla_internal.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kRowBytes = 1024;  // 512 bf16: one head of Q, one entry of K
constexpr int kQBytes = kHeadBlock * kRowBytes;
constexpr int kKBytes = kTileEntries * kRowBytes;
constexpr int kPBytes = kHeadBlock * kTileEntries * 2;
constexpr int kSxBytes = 4 * 2 * 4 * 32 * 16;  // split-K exchange of S, see consumer

constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kQBytes;            // two buffers
constexpr int kOffP = kOffK + 2 * kKBytes;
constexpr int kOffSx = kOffP + kPBytes;
constexpr int kOffMask = kOffSx + kSxBytes;       // [2][64] bytes: entry valid
constexpr int kOffMx = kOffMask + 2 * kTileEntries;  // [2][64] floats: tile row max per entry half
constexpr int kOffAlpha = kOffMx + 2 * 64 * 4;    // [64] floats: rescale of O rows
constexpr int kOffLp = kOffAlpha + 64 * 4;        // [2][64] floats: row sums per entry half
constexpr int kOffM = kOffLp + 2 * 64 * 4;        // [64] floats: row max at unit end
constexpr int kOffMisc = kOffM + 64 * 4;          // merge bookkeeping
constexpr int kSmemBytes = kOffMisc + 64;

// Named barriers (0 is __syncthreads).
constexpr uint32_t kBarFull = 1;       // + buffer: producer -> consumers, tile ready
constexpr uint32_t kBarEmpty = 3;      // + buffer: consumers -> producer, buffer free
constexpr uint32_t kBarConsumers = 5;  // consumers only

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr uint64_t kSpinTimeoutNs = 100000;  // see merge_phase

struct MergeSlot {  // in shared memory, one per partial slot
  int unit;         // -1: this CTA holds no split unit in this slot
  uint32_t round;   // which call (since the plan) this arrival belongs to
  int last;         // this CTA completed the set of partials
  int pad;
};

__device__ __forceinline__ void stamp(const AttnParams& p, int k) {
  if (p.debug_clock != nullptr) p.debug_clock[blockIdx.x * 8 + k] = global_timer_ns();
}

// Walks the units of a CTA range in order; the next unit's record is loaded
// one unit ahead.
struct UnitWalker {
  const int4* info;
  int u;
  int4 cur, nxt;
  __device__ __forceinline__ void start(const int4* inf, int u0) {
    info = inf;
    u = u0;
    cur = __ldg(info + u0);
    nxt = __ldg(info + u0 + 1);
  }
  __device__ __forceinline__ int begin() const { return cur.x; }
  __device__ __forceinline__ int end() const { return nxt.x; }
  __device__ __forceinline__ void advance() {
    ++u;
    cur = nxt;
    nxt = __ldg(info + u + 1);  // info has units + 1 records; u never passes the last unit
  }
};

// ----------------------------------------------------------------------------
// Producer: 128 threads. Thread pair e handles entry e of a tile; within the
// pair, `half` selects the even or odd 16-byte chunks of the 576-byte record,
// so each load instruction reads whole 32-byte sectors. Chunks 0..27 are fp8
// (16 dims each, scale block chunk / 4); 28..35 hold the 64 bf16 RoPE dims.
// K rows in shared memory: 64 chunks of 16 bytes (8 dims), chunk c stored at
// c ^ (row & 7) so that ldmatrix reads are conflict-free.
// ----------------------------------------------------------------------------
struct EntryRef {
  int32_t slot;
  int list;  // 0: SWA, 1: extra, -1: nothing at this position
};

struct ProducerState {
  const uint8_t* data;    // null: nothing to read for this entry
  const uint8_t* scales;
  uint4 d[18];
  uint2 sc;
};

__device__ __forceinline__ EntryRef fetch_ref(const AttnParams& p, UnitWalker& w, int tile, int e) {
  while (tile >= w.end()) w.advance();
  const int t = w.u / p.head_blocks;
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

// Resolves a slot to its record and scale addresses; null when the slot is
// empty (< 0) or out of range, so nothing is read for it.
__device__ __forceinline__ void resolve(const AttnParams& p, EntryRef r, ProducerState& st) {
  st.data = nullptr;
  st.scales = nullptr;
  if (r.list < 0 || r.slot < 0) return;
  const CacheView& c = r.list == 0 ? p.swa_cache : p.extra_cache;
  if (int64_t(r.slot) >= c.capacity) return;
  const uint32_t page = uint32_t(r.slot) / c.entries_per_page;
  const uint32_t off = uint32_t(r.slot) - page * c.entries_per_page;
  const uint8_t* base = c.base + int64_t(page) * c.page_stride;  // 64-bit: pages * stride passes 2^31
  st.data = base + size_t(576) * off;
  st.scales = base + size_t(576) * c.entries_per_page + size_t(8) * off;
}

__device__ __forceinline__ void issue_loads(ProducerState& st, int half) {
  if (st.data != nullptr) {
#pragma unroll
    for (int i = 0; i < 18; ++i) st.d[i] = ldg_stream_16(st.data + 16 * (2 * i + half));
    st.sc = ldg_stream_8(st.scales);
  }
}

__device__ __forceinline__ void sts128(uint8_t* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  *reinterpret_cast<uint4*>(p) = make_uint4(a, b, c, d);
}

template <bool kTwoStep>
__device__ __forceinline__ uint32_t store_entry(const uint4 (&d)[18], uint2 sc, uint8_t* row, int x, int half) {
  uint32_t nan = 0;
#pragma unroll
  for (int i = 0; i < 14; ++i) {  // fp8 chunk k = 2i + half, scale block k / 4 = i / 2
    const int blk = i >> 1;
    const ScaleFactors f = scale_factors((blk < 4 ? sc.x >> (8 * blk) : sc.y >> (8 * (blk - 4))) & 0xffu);
    const uint32_t w[4] = {d[i].x, d[i].y, d[i].z, d[i].w};
    uint32_t o[8];
    dequant_chunk<kTwoStep>(w, f, o);
    nan |= e4m3_nan_flags(w[0]) | e4m3_nan_flags(w[1]) | e4m3_nan_flags(w[2]) | e4m3_nan_flags(w[3]);
    const int k = 2 * i + half;
    sts128(row + (((2 * k) ^ x) << 4), o[0], o[1], o[2], o[3]);
    sts128(row + (((2 * k + 1) ^ x) << 4), o[4], o[5], o[6], o[7]);
  }
#pragma unroll
  for (int i = 14; i < 18; ++i) {  // bf16 chunk k = 2i + half -> K chunk k + 28 (dims 448..511)
    const int k = 2 * i + half;
    sts128(row + (((k + 28) ^ x) << 4), d[i].x, d[i].y, d[i].z, d[i].w);
  }
  return nan;
}

// Slow path for entries holding e4m3 NaN codes (never written by the
// quantizer): re-read this thread's fp8 chunks and store NaN where the CPU
// decode gives NaN.
__device__ __noinline__ void patch_nan_codes(const uint8_t* data, uint8_t* row, int x, int half) {
  for (int i = 0; i < 14; ++i) {
    const int k = 2 * i + half;
    for (int byte = 0; byte < 16; ++byte) {
      if ((data[16 * k + byte] & 0x7f) == 0x7f) {
        const int dim = 16 * k + byte;  // K chunk dim / 8, element dim % 8
        *reinterpret_cast<uint16_t*>(row + (((dim >> 3) ^ x) << 4) + 2 * (dim & 7)) = 0x7fc0;
      }
    }
  }
}

__device__ __forceinline__ void store_tile(const ProducerState& st, uint8_t* kbuf, uint8_t* mask, int e, int half) {
  const int x = e & 7;
  uint8_t* row = kbuf + e * kRowBytes;
  const bool valid = st.data != nullptr;
  if (half == 0) mask[e] = valid ? 1 : 0;
  if (!valid) {  // zeros, so that P = 0 times stale data can never give NaN
#pragma unroll
    for (int i = 0; i < 14; ++i) {
      const int k = 2 * i + half;
      sts128(row + (((2 * k) ^ x) << 4), 0, 0, 0, 0);
      sts128(row + (((2 * k + 1) ^ x) << 4), 0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 14; i < 18; ++i) sts128(row + (((2 * i + half + 28) ^ x) << 4), 0, 0, 0, 0);
    return;
  }
  // Scale bytes above 134 (scales >= 2^8, never produced for real caches)
  // take the exact two-multiply path.
  uint32_t max_scale = 0;
#pragma unroll
  for (int b = 0; b < 7; ++b) max_scale = max(max_scale, (b < 4 ? st.sc.x >> (8 * b) : st.sc.y >> (8 * (b - 4))) & 0xffu);
  const uint32_t nan = max_scale > 134u ? store_entry<true>(st.d, st.sc, row, x, half)
                                        : store_entry<false>(st.d, st.sc, row, x, half);
  if (nan) patch_nan_codes(st.data, row, x, half);
}

__device__ __forceinline__ void producer(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int ptid = threadIdx.x - kConsumerThreads;
  const int e = ptid >> 1, half = ptid & 1;
  const int n = b - a;
  UnitWalker w;
  w.start(p.plan.unit_info, u0);
  ProducerState st;
  const bool loads = !(p.debug_flags & kDebugNoLoads), stores = !(p.debug_flags & kDebugNoStore);
  if (!loads) st = ProducerState{};
  resolve(p, fetch_ref(p, w, a, e), st);
  if (loads) issue_loads(st, half);
  if (ptid == 0) stamp(p, 5);
  EntryRef next{-1, -1};
  if (n > 1) next = fetch_ref(p, w, a + 1, e);
  for (int s = 0; s < n; ++s) {
    const int buf = s & 1;
    if (s >= 2) bar_sync(kBarEmpty + buf, kAttnThreads);
    if (stores) store_tile(st, smem + kOffK + buf * kKBytes, smem + kOffMask + buf * kTileEntries, e, half);
    if (s == 0 && ptid == 0) stamp(p, 6);
    bar_arrive(kBarFull + buf, kAttnThreads);
    if (s + 1 < n) {  // loads of the next tile fly while we wait for its buffer
      resolve(p, next, st);
      if (loads) issue_loads(st, half);
      if (s + 2 < n) next = fetch_ref(p, w, a + s + 2, e);
    }
  }
  if (ptid == 0) stamp(p, 7);
}

// ----------------------------------------------------------------------------
// Consumers: 8 warps, cw = 0..7.
//  S = Q K^T (64 heads x 64 entries x 512 dims): warp (hbk, eb, kh) computes
//  heads [32 hbk, +32) x entries [32 eb, +32) over dims [256 kh, +256); the
//  two kh halves swap 16-row halves through shared memory, so that afterwards
//  warp (hbk, eb, kh) owns rows [32 hbk + 16 kh, +16) x entries [32 eb, +32)
//  of S (the "softmax role").
//  O += P V: warp cw owns all 64 heads x dims [64 cw, +64) (the "PV role").
// Fragment layouts are those of mma.m16n8k16: g = lane / 4 picks rows g and
// g + 8, c4 = lane % 4 picks columns 2 c4, 2 c4 + 1 of each n8 tile.
// ----------------------------------------------------------------------------
__device__ __forceinline__ void load_q_async(const AttnParams& p, uint8_t* smem, int unit, int tid) {
  const int t = unit / p.head_blocks, hb = unit - t * p.head_blocks;
  const uint32_t qs = smem_u32(smem + kOffQ);
#pragma unroll
  for (int i = 0; i < (kHeadBlock * 64) / kConsumerThreads; ++i) {
    const int chunk = tid + i * kConsumerThreads;
    const int row = chunk >> 6, c = chunk & 63;
    const int head = hb * kHeadBlock + row;
    const bool valid = head < p.num_heads;  // padded heads read as zeros
    const uint16_t* src = p.q + (int64_t(t) * p.num_heads + (valid ? head : 0)) * 512 + c * 8;
    cp_async_16(qs + row * kRowBytes + ((c ^ (row & 7)) << 4), src, valid ? 16 : 0);
  }
  cp_async_commit();
}

__device__ __forceinline__ void consumer_sync() { bar_sync(kBarConsumers, kConsumerThreads); }

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

template <bool kSplitK>
__device__ void consumer(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tid = threadIdx.x, lane = tid & 31, cw = tid >> 5;
  // kSplitK: warp (hbk, eb, kh) as described above. Otherwise warp (rb4, eb)
  // computes rows [16 rb4, +16) x entries [32 eb, +32) over all 512 dims
  // (no exchange, but 1.5x the ldmatrix traffic).
  const int hbk = cw & 1, kh = cw >> 2, rb4 = cw & 3;
  const int eb = kSplitK ? (cw >> 1) & 1 : cw >> 2;
  const int g = lane >> 2, c4 = lane & 3;
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);

  // Swizzled 16-byte column offsets, shared by every ldmatrix below: rows
  // are addressed so that row & 7 == lane & 7, and lanes 16..31 take the
  // second 16-byte chunk of each k16 step (logical chunk 2 jj + lane / 16 of a
  // group of 8 chunks).
  uint32_t off[4], off_k[4];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    off[jj] = uint32_t(((2 * jj) | (lane >> 4)) ^ (lane & 7)) << 4;
    off_k[jj] = uint32_t(((2 * jj) | ((lane >> 3) & 1)) ^ (lane & 7)) << 4;
  }
  // Row of this lane inside a 16-row block. A operands (Q, P) use lane & 15
  // with chunk lane / 16: the x4 matrices are (rows 0-7, chunk 0), (8-15, 0),
  // (0-7, 1), (8-15, 1) = a0..a3. V (ldmatrix.trans) uses the same matrix
  // order with rows brow = (lane & 7) + 8 ((lane >> 3) & 1), giving
  // {b0, b1} of n8 tile 0 then of tile 1. K for Q K^T (no .trans) uses rows
  // krow = (lane & 7) + 8 (lane / 16) and chunk (lane / 8) & 1, i.e. matrices
  // (rows 0-7, chunk 0), (0-7, 1), (8-15, 0), (8-15, 1): again {b0, b1} of
  // n8 tile 0 then tile 1, so each MMA takes an adjacent register pair.
  const int brow = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int krow = (lane & 7) + ((lane >> 4) << 3);
  const uint32_t qk_a = kSplitK ? sbase + kOffQ + (32 * hbk + (lane & 15)) * kRowBytes + kh * 512
                                : sbase + kOffQ + (16 * rb4 + (lane & 15)) * kRowBytes;
  const uint32_t qk_b = kOffK + (32 * eb + krow) * kRowBytes + (kSplitK ? kh * 512 : 0);
  const uint32_t pv_a = sbase + kOffP + (lane & 15) * 128;
  const uint32_t pv_b = kOffK + brow * kRowBytes + cw * 128;

  const int r0 = kSplitK ? 32 * hbk + 16 * kh + g : 16 * rb4 + g;  // softmax-role rows r0, r0 + 8
  float* mx_buf = reinterpret_cast<float*>(smem + kOffMx);
  float* alpha_buf = reinterpret_cast<float*>(smem + kOffAlpha);
  float* lp_buf = reinterpret_cast<float*>(smem + kOffLp);
  float* m_buf = reinterpret_cast<float*>(smem + kOffM);
  MergeSlot* merge = reinterpret_cast<MergeSlot*>(smem + kOffMisc);

  float acc[4][8][4];
  float m_run[2], l_run[2];

  UnitWalker w;
  w.start(p.plan.unit_info, u0);
  load_q_async(p, smem, u0, tid);

  for (int s = 0; s < n; ++s) {
    const int tile = a + s;
    if (tile >= w.end()) w.advance();
    const bool unit_first = s == 0 || tile == w.begin();
    const bool unit_last = s + 1 == n || tile + 1 == w.end();
    const int buf = s & 1;
    if (unit_first) {
      cp_async_wait_all();
      consumer_sync();  // Q of this unit visible to all warps
      if (s == 0 && tid == 0) stamp(p, 1);
#pragma unroll
      for (int rb = 0; rb < 4; ++rb)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[rb][j][e] = 0.0f;
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
    }
    bar_sync(kBarFull + buf, kAttnThreads);
    if (s == 0 && tid == 0) stamp(p, 2);
    if (p.debug_flags & kDebugNoCompute) {
      if (s + 2 < n) bar_arrive(kBarEmpty + buf, kAttnThreads);
    } else {

    // ---- S = Q K^T -----------------------------------------------------------
    const uint32_t kb = sbase + qk_b + buf * kKBytes;
    float s_[4][4];
    if constexpr (kSplitK) {
      float sacc[2][4][4];
#pragma unroll
      for (int rb = 0; rb < 2; ++rb)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[rb][j][e] = 0.0f;
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        const uint32_t col = kq * 128;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          uint32_t a0[4], a1[4], b0[4], b1[4];
          ldsm_x4(qk_a + col + off[jj], a0);
          ldsm_x4(kb + col + off_k[jj], b0);
          ldsm_x4(kb + 16 * kRowBytes + col + off_k[jj], b1);
          ldsm_x4(qk_a + 16 * kRowBytes + col + off[jj], a1);
          mma_bf16(sacc[0][0], a0, b0[0], b0[1]);
          mma_bf16(sacc[0][1], a0, b0[2], b0[3]);
          mma_bf16(sacc[0][2], a0, b1[0], b1[1]);
          mma_bf16(sacc[0][3], a0, b1[2], b1[3]);
          mma_bf16(sacc[1][0], a1, b0[0], b0[1]);
          mma_bf16(sacc[1][1], a1, b0[2], b0[3]);
          mma_bf16(sacc[1][2], a1, b1[0], b1[1]);
          mma_bf16(sacc[1][3], a1, b1[2], b1[3]);
        }
      }
      // Swap halves: warp kh keeps row block kh and sends the other one to
      // its partner (same hbk, eb; other kh). Layout [pair][receiver kh][j][lane].
      float4* sx = reinterpret_cast<float4*>(smem + kOffSx) + (hbk * 2 + eb) * 2 * 4 * 32;
      if (kh == 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) sx[(1 * 4 + j) * 32 + lane] = make_float4(sacc[1][j][0], sacc[1][j][1], sacc[1][j][2], sacc[1][j][3]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s_[j][e] = sacc[0][j][e];
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) sx[(0 * 4 + j) * 32 + lane] = make_float4(sacc[0][j][0], sacc[0][j][1], sacc[0][j][2], sacc[0][j][3]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s_[j][e] = sacc[1][j][e];
      }
      consumer_sync();
      // All warps are past their QK: Q may now be replaced by the next unit's.
      if (unit_last && s + 1 < n) load_q_async(p, smem, w.u + 1, tid);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 v = sx[(kh * 4 + j) * 32 + lane];
        s_[j][0] += v.x;
        s_[j][1] += v.y;
        s_[j][2] += v.z;
        s_[j][3] += v.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_[j][e] = 0.0f;
#pragma unroll
      for (int kq = 0; kq < 8; ++kq) {
        const uint32_t col = kq * 128;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          uint32_t a0[4], b0[4], b1[4];
          ldsm_x4(qk_a + col + off[jj], a0);
          ldsm_x4(kb + col + off_k[jj], b0);
          ldsm_x4(kb + 16 * kRowBytes + col + off_k[jj], b1);
          mma_bf16(s_[0], a0, b0[0], b0[1]);
          mma_bf16(s_[1], a0, b0[2], b0[3]);
          mma_bf16(s_[2], a0, b1[0], b1[1]);
          mma_bf16(s_[3], a0, b1[2], b1[3]);
        }
      }
    }

    // ---- online softmax (softmax role) -----------------------------------
    {
      const uint8_t* mask = smem + kOffMask + buf * kTileEntries;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = 32 * eb + 8 * j + 2 * c4;
        const bool v0 = mask[col] != 0, v1 = mask[col + 1] != 0;
        s_[j][0] = v0 ? s_[j][0] * p.scale_log2 : -INFINITY;
        s_[j][1] = v1 ? s_[j][1] * p.scale_log2 : -INFINITY;
        s_[j][2] = v0 ? s_[j][2] * p.scale_log2 : -INFINITY;
        s_[j][3] = v1 ? s_[j][3] * p.scale_log2 : -INFINITY;
        mx0 = fmaxf(mx0, fmaxf(s_[j][0], s_[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s_[j][2], s_[j][3]));
      }
      mx0 = quad_max(mx0);
      mx1 = quad_max(mx1);
      if (c4 == 0) {
        mx_buf[eb * 64 + r0] = mx0;
        mx_buf[eb * 64 + r0 + 8] = mx1;
      }
      consumer_sync();
      if (!kSplitK && unit_last && s + 1 < n) load_q_async(p, smem, w.u + 1, tid);  // all past QK
      const float mn0 = fmaxf(m_run[0], fmaxf(mx0, mx_buf[(1 - eb) * 64 + r0]));
      const float mn1 = fmaxf(m_run[1], fmaxf(mx1, mx_buf[(1 - eb) * 64 + r0 + 8]));
      // Rows with nothing attended yet keep max -inf: use 0 as the exponent base.
      const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
      const float alpha0 = fast_exp2(m_run[0] - base0), alpha1 = fast_exp2(m_run[1] - base1);
      m_run[0] = mn0;
      m_run[1] = mn1;
      float sum0 = 0.0f, sum1 = 0.0f;
      uint8_t* prow0 = smem + kOffP + r0 * 128 + 4 * c4;
      uint8_t* prow1 = prow0 + 8 * 128;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p0 = fast_exp2(s_[j][0] - base0), p1 = fast_exp2(s_[j][1] - base0);
        const float p2 = fast_exp2(s_[j][2] - base1), p3 = fast_exp2(s_[j][3] - base1);
        sum0 += p0 + p1;
        sum1 += p2 + p3;
        const int chunk = ((4 * eb + j) ^ g) << 4;  // rows r0, r0 + 8 both have row & 7 == g
        *reinterpret_cast<uint32_t*>(prow0 + chunk) = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t*>(prow1 + chunk) = pack_bf16(p2, p3);
      }
      l_run[0] = l_run[0] * alpha0 + sum0;
      l_run[1] = l_run[1] * alpha1 + sum1;
      if (eb == 0 && c4 == 0) {
        alpha_buf[r0] = alpha0;
        alpha_buf[r0 + 8] = alpha1;
      }
      consumer_sync();
    }

    // ---- O = alpha O + P V (PV role) -------------------------------------
    {
      float al[4][2];
      bool rescale = false;
#pragma unroll
      for (int rb = 0; rb < 4; ++rb) {
        al[rb][0] = alpha_buf[16 * rb + g];
        al[rb][1] = alpha_buf[16 * rb + g + 8];
        rescale |= al[rb][0] != 1.0f || al[rb][1] != 1.0f;
      }
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int rb = 0; rb < 4; ++rb)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            acc[rb][j][0] *= al[rb][0];
            acc[rb][j][1] *= al[rb][0];
            acc[rb][j][2] *= al[rb][1];
            acc[rb][j][3] *= al[rb][1];
          }
      }
      const uint32_t vb = sbase + pv_b + buf * kKBytes;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t pa[4][4];
#pragma unroll
        for (int rb = 0; rb < 4; ++rb) ldsm_x4(pv_a + rb * 16 * 128 + off[ks], pa[rb]);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          uint32_t v[4];
          ldsm_x4_trans(vb + ks * 16 * kRowBytes + off[jj], v);
#pragma unroll
          for (int rb = 0; rb < 4; ++rb) {
            mma_bf16(acc[rb][2 * jj], pa[rb], v[0], v[1]);
            mma_bf16(acc[rb][2 * jj + 1], pa[rb], v[2], v[3]);
          }
        }
      }
      if (s + 2 < n) bar_arrive(kBarEmpty + buf, kAttnThreads);
    }
    }  // debug: kDebugNoCompute

    if (!unit_last) continue;
    // ---- end of this CTA's part of the unit --------------------------------
    {
      const float l0 = quad_sum(l_run[0]), l1 = quad_sum(l_run[1]);
      if (c4 == 0) {
        lp_buf[eb * 64 + r0] = l0;
        lp_buf[eb * 64 + r0 + 8] = l1;
        if (eb == 0) {
          m_buf[r0] = m_run[0];
          m_buf[r0 + 8] = m_run[1];
        }
      }
      consumer_sync();
      const int u = w.u;
      const int t = u / p.head_blocks, hb = u - t * p.head_blocks;
      const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
      const bool whole = w.begin() >= a && w.end() <= b;
      const int pslot = u == u0 ? 0 : 1;
      const int cta = blockIdx.x;
      // Row r = 16 rb + 8 hf + g: only g is run-time, so every per-row
      // address below is one base plus an immediate.
      if (whole) {
        uint16_t* ob = p.out + (int64_t(t) * p.num_heads + hb * kHeadBlock + g) * 512 + 64 * cw + 2 * c4;
        const float* sk = p.sink + hb * kHeadBlock + g;
        float* lse = p.lse == nullptr || cw != 0 || c4 != 0 ? nullptr : p.lse + int64_t(t) * p.num_heads + hb * kHeadBlock + g;
#pragma unroll
        for (int rb = 0; rb < 4; ++rb) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int ro = 16 * rb + 8 * hf;
            if (ro + g >= heff) continue;
            const float m = m_buf[ro + g], l = lp_buf[ro + g] + lp_buf[64 + ro + g];
            // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
            const float inv = 1.0f / (l + fast_exp2(sk[ro] * kLog2e - m));
#pragma unroll
            for (int j = 0; j < 8; ++j)
              *reinterpret_cast<uint32_t*>(ob + ro * 512 + 8 * j) = pack_bf16(acc[rb][j][2 * hf] * inv, acc[rb][j][2 * hf + 1] * inv);
            if (lse != nullptr) lse[ro] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
          }
        }
      } else {
        float* ob = p.partial_o + (int64_t(cta * 2 + pslot) * 64 + g) * 512 + 64 * cw + 2 * c4;
        float2* ml = cw != 0 || c4 != 0 ? nullptr : p.partial_ml + (cta * 2 + pslot) * 64 + g;
#pragma unroll
        for (int rb = 0; rb < 4; ++rb) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int ro = 16 * rb + 8 * hf;
            if (ro + g >= heff) continue;
#pragma unroll
            for (int j = 0; j < 8; ++j)
              *reinterpret_cast<float2*>(ob + ro * 512 + 8 * j) = make_float2(acc[rb][j][2 * hf], acc[rb][j][2 * hf + 1]);
            if (ml != nullptr) ml[ro] = make_float2(m_buf[ro + g], lp_buf[ro + g] + lp_buf[64 + ro + g]);
          }
        }
      }
      if (!whole) {
        // All partial stores precede the barrier; thread 0's fence then
        // publishes them (cumulatively) before the arrival, the pattern of
        // cooperative groups' grid sync.
        consumer_sync();
        if (tid == 0) {
          __threadfence();
          const int per = __ldg(&p.plan.cta_work[cta]).w;
          const int start = w.begin(), end = w.end();
          const int c_first = start / per, n_part = (end - 1) / per - c_first + 1;
          const int first_slot = c_first * per >= start ? 0 : 1;
          const uint32_t old = atomicAdd(p.plan.arrive + 2 * c_first + first_slot, 1u);
          __threadfence();
          merge[pslot].unit = u;
          merge[pslot].round = old / uint32_t(n_part);
          merge[pslot].last = (old + 1) % uint32_t(n_part) == 0;
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------
// Fused combine. The participants of split unit u are CTAs c_first..c_last;
// the unit's 64 x 512 outputs are cut into n = c_last - c_first + 1 shares and
// each participant merges one. A participant that finished its own work waits
// (bounded) for all partials; the participant whose arrival completed the set
// merges every share nobody claimed, so the result never depends on CTAs
// being co-resident. Claims are atomicMax on a per-partial flag with the
// call's round number, so counters need no reset between calls of one plan.
// ----------------------------------------------------------------------------
__device__ __noinline__ void merge_share(const AttnParams& p, uint8_t* smem, int u, int k, int n_part, int c_first, int first_slot) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t = u / p.head_blocks, hb = u - t * p.head_blocks;
  const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
  const int n4 = heff * 128;  // float4 per unit
  const int lo = k * n4 / n_part, hi = (k + 1) * n4 / n_part;
  if (lo >= hi) return;
  const int h_lo = lo >> 7, nh = ((hi - 1) >> 7) - h_lo + 1;
  // Scratch (Q, K, P and Sx are all free by now): one weighted float4 per
  // (row chunk, partial) pair, then m, l and the weights per (head, partial).
  const int items = hi - lo, pairs = items * n_part;
  float4* pair_buf = reinterpret_cast<float4*>(smem);
  float* mm = reinterpret_cast<float*>(pair_buf + pairs);
  float* ll = mm + nh * n_part;
  float* wt = ll + nh * n_part;
  auto partial_index = [&](int i) { return (c_first + i) * 2 + (i == 0 ? first_slot : 0); };

  for (int idx = tid; idx < nh * n_part; idx += kConsumerThreads) {
    const int hl = idx / n_part, i = idx - hl * n_part;
    const float2 v = __ldcg(p.partial_ml + partial_index(i) * 64 + h_lo + hl);
    mm[idx] = v.x;
    ll[idx] = v.y;
  }
  consumer_sync();
  for (int hl = warp; hl < nh; hl += kConsumerThreads / 32) {
    const float* m_h = mm + hl * n_part;
    float m = -INFINITY;
    for (int i = lane; i < n_part; i += 32) m = fmaxf(m, m_h[i]);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    const float base = m == -INFINITY ? 0.0f : m;
    float l = 0.0f;
    for (int i = lane; i < n_part; i += 32) l += ll[hl * n_part + i] * fast_exp2(m_h[i] - base);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) l += __shfl_xor_sync(0xffffffffu, l, d);
    const int h = h_lo + hl;
    const float sink2 = p.sink[hb * kHeadBlock + h] * kLog2e;
    const float inv = 1.0f / (l + fast_exp2(sink2 - m));
    for (int i = lane; i < n_part; i += 32) wt[hl * n_part + i] = fast_exp2(m_h[i] - base) * inv;
    if (lane == 0 && p.lse != nullptr && h * 128 >= lo)
      p.lse[int64_t(t) * p.num_heads + hb * kHeadBlock + h] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
  }
  consumer_sync();
  // Gather: 8 independent L2 loads in flight per thread (the partials were
  // written by other SMs: .cg loads, never a stale L1 line).
  constexpr int kBatch = 8;
  for (int p0 = tid; p0 < pairs; p0 += kBatch * kConsumerThreads) {
    float4 v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int pi = p0 + q * kConsumerThreads;
      if (pi < pairs) {
        const int j = pi / n_part, i = pi - j * n_part;
        const int f = lo + j;
        v[q] = __ldcg(reinterpret_cast<const float4*>(p.partial_o + (int64_t(partial_index(i)) * 64 + (f >> 7)) * 512) + (f & 127));
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int pi = p0 + q * kConsumerThreads;
      if (pi < pairs) {
        const int j = pi / n_part, i = pi - j * n_part;
        const float w = wt[(((lo + j) >> 7) - h_lo) * n_part + i];
        pair_buf[pi] = make_float4(w * v[q].x, w * v[q].y, w * v[q].z, w * v[q].w);
      }
    }
  }
  consumer_sync();
  // Sum over partials in a fixed order (results do not depend on who merges).
  for (int j = tid; j < items; j += kConsumerThreads) {
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i = 0; i < n_part; ++i) {
      const float4 v = pair_buf[j * n_part + i];
      o.x += v.x;
      o.y += v.y;
      o.z += v.z;
      o.w += v.w;
    }
    const int f = lo + j;
    uint16_t* dst = p.out + (int64_t(t) * p.num_heads + hb * kHeadBlock + (f >> 7)) * 512 + 4 * (f & 127);
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
  }
  consumer_sync();  // scratch reuse by the next share
}

__device__ __noinline__ void merge_phase(const AttnParams& p, uint8_t* smem, int per) {
  MergeSlot* merge = reinterpret_cast<MergeSlot*>(smem + kOffMisc);
  volatile int* flag = reinterpret_cast<volatile int*>(smem + kOffMisc + 2 * sizeof(MergeSlot));
  const int cta = blockIdx.x;
  for (int slot = 0; slot < 2; ++slot) {
    const int u = merge[slot].unit;
    if (u < 0) continue;
    const uint32_t round = merge[slot].round;
    const bool last = merge[slot].last != 0;
    const int start = __ldg(p.plan.unit_info + u).x, end = __ldg(p.plan.unit_info + u + 1).x;
    const int c_first = start / per, n_part = (end - 1) / per - c_first + 1;
    const int first_slot = c_first * per >= start ? 0 : 1;
    if (threadIdx.x == 0) {
      bool ready = last;
      if (!ready) {
        const uint32_t* counter = p.plan.arrive + 2 * c_first + first_slot;
        const uint32_t target = (round + 1) * uint32_t(n_part);
        const uint64_t t0 = global_timer_ns();
        while (!(ready = ld_acquire_gpu(counter) >= target) && global_timer_ns() - t0 < kSpinTimeoutNs) __nanosleep(64);
        __threadfence();
      }
      *flag = ready;
    }
    consumer_sync();
    const bool ready = *flag != 0;
    consumer_sync();
    if (!ready) continue;  // timed out: the last arrival merges our share
    const int k_me = cta - c_first;
    for (int step = 0; step < (last ? n_part : 1); ++step) {
      const int k = (k_me + step) % n_part;
      if (threadIdx.x == 0) {
        uint32_t* c = p.plan.claim + 2 * (c_first + k) + (k == 0 ? first_slot : 0);
        *flag = atomicMax(c, round + 1) < round + 1;
      }
      consumer_sync();
      const bool mine = *flag != 0;
      consumer_sync();
      if (mine) merge_share(p, smem, u, k, n_part, c_first, first_slot);
    }
  }
}

// Register budget: each SM sub-partition holds one warp of every warpgroup,
// 3 x 168 registers at launch. The producers give theirs down to 104 so that
// the consumers (O accumulators alone are 128 per thread) get 200.
constexpr int kProducerRegs = 104;
constexpr int kConsumerRegs = 200;
static_assert(2 * kConsumerRegs + kProducerRegs <= 3 * 168, "register budget of one SM sub-partition");

template <bool kSplitK>
__global__ void __launch_bounds__(kAttnThreads, 1) sparse_mla_kernel(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int4 work = __ldg(p.plan.cta_work + blockIdx.x);  // {first tile, end tile, first unit, per}
  if (work.x >= work.y) return;
  if (threadIdx.x == 0) stamp(p, 0);
  if (threadIdx.x < 2) {
    MergeSlot* merge = reinterpret_cast<MergeSlot*>(smem + kOffMisc);
    merge[threadIdx.x].unit = -1;
  }
  __syncthreads();
  // Each warpgroup's role is one branch (setmaxnreg needs that); the producers
  // simply exit when their tiles are stored, the merge is the consumers' job.
  if (threadIdx.x >= kConsumerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    producer(p, smem, work.x, work.y, work.z);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    consumer<kSplitK>(p, smem, work.x, work.y, work.z);
    consumer_sync();
    if (threadIdx.x == 0) stamp(p, 3);
    merge_phase(p, smem, work.w);
    if (threadIdx.x == 0) stamp(p, 4);
  }
}

}  // namespace

size_t attention_smem_bytes() { return kSmemBytes; }

AttentionDebug& attention_debug() {
  static AttentionDebug d;
  return d;
}

int& attention_variant() {
  static int v = 0;
  return v;
}

int prepare_attention_kernel() {
  int blocks = 1 << 30;
  for (auto* k : {&sparse_mla_kernel<true>, &sparse_mla_kernel<false>}) {
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) return -int(e);
    int b = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, kAttnThreads, kSmemBytes);
    if (e != cudaSuccess) return -int(e);
    blocks = b < blocks ? b : blocks;
  }
  return blocks;
}

void launch_attention(const AttnParams& p, cudaStream_t stream) {
  if (attention_variant() == 0)
    sparse_mla_kernel<true><<<p.grid, kAttnThreads, kSmemBytes, stream>>>(p);
  else
    sparse_mla_kernel<false><<<p.grid, kAttnThreads, kSmemBytes, stream>>>(p);
}

}  // namespace dsv4::cuda
