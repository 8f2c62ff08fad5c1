#pragma once
// The tile loop of the sparse-attention kernel: three warpgroups with
// different roles, one CTA per SM, two bf16 K buffers (tile s in buffer
// s % 2). Included by sparse_mla_kernel.cu only.
//  * Producer (warpgroup 2): loads the records of entries 0..31 of each tile
//    into registers two tiles ahead, dequantizes them into rows 0..31 of the
//    tile's K buffer once S and V have released it ("empty" mbarrier) and
//    signals "full".
//  * V (warpgroup 1): gathers entries 32..63 of the next tile but one with
//    cp.async into a staging slot, dequantizes them into rows 32..63 while
//    its P V of the current tile runs, and signals "half"; its P V covers
//    dims 256..511 with P from shared memory.
//  * S (warpgroup 0): waits for "full" and "half", computes all of
//    S = Q K^T (64 heads x 64 entries, two accumulation chains: one chain of
//    32 steps was 4-7% faster but put the lse error at 1e-5, the tests'
//    bound), runs the online softmax with the sink over whole rows, writes P
//    (and the rows' rescale factors) for V, and computes P V for dims 0..255.
// So the gathers and dequantization of both halves overlap the tensor work,
// and S and V meet once per tile (P ready / P free).
// With kCluster = 2 (H = 128) the two CTAs of a cluster run the same tiles
// for the two head blocks of a token. The producer of rank r alone
// dequantizes entries 32 r .. 32 r + 31 of each tile into its K buffer, and
// the copy engine copies those rows into the peer's; V only computes its
// P V. S waits for its producer ("full") and for the peer's bytes ("remote"
// mbarrier, counted in transaction bytes); a K buffer is free once the S and
// V of both CTAs released it. So each record is gathered by one SM: when
// both CTAs of a pair loaded the same records at the same time, the
// producer's stores waited 2.8 times as long for their loads
// (docs/perf-notes.md, runs 42-45).
// Shared memory: Q 64 KB, two K buffers 128 KB, P 8 KB, the staging slot
// 19 KB (a whole tile of raw records next to two K buffers would not fit).
// Why this split: docs/perf-notes.md (runs 26-35).
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla {

static_assert(kAttnThreads == 3 * 128, "S, V and producer warpgroups");
// Registers per thread by role (setmaxnreg): the launch gives 168 each
// (65,536 / 384, rounded down to a multiple of 8). S needs 224 for its O
// accumulators plus two Q K^T chains (with fewer, ptxas serializes its
// wgmma); V then has 160 and the producer 120. (In a pair V does no
// dequantization, but at 152 ptxas spilled its accumulators.)
constexpr int kLaunchRegs = 168, kRegsS = 224, kRegsV = 160, kRegsProducer = 120;
static_assert(kRegsS + kRegsV + kRegsProducer <= 3 * kLaunchRegs, "register file");

// setmaxnreg: .inc may only raise a warpgroup's count, .dec only lower it.
template <int N>
__device__ __forceinline__ void set_regs() {
  if constexpr (N > kLaunchRegs)
    reg_alloc<N>();
  else if constexpr (N < kLaunchRegs)
    reg_dealloc<N>();
}

constexpr int kHalf = kTileEntries / 2;  // entries per producer / V half
constexpr int kStageData = kHalf * 576;
constexpr int kOffK0 = kQBytes;                             // K buffer b at kOffK0 + b * kKBytes
constexpr int kOffP = kOffK0 + 2 * kKBytes;                 // P: 64 heads x 64 entries bf16
constexpr int kOffStage = kOffP + kPBytes;                  // 32 records, then V's scale copies (8 bytes a thread)
constexpr int kOffMask = kOffStage + kStageData + 128 * 8;  // [2 buffers][8 groups of 8 entries][16 bytes]: entry valid
constexpr int kOffAlpha = kOffMask + 2 * 8 * 16;            // [64] floats: this tile's rescale of O rows
constexpr int kOffStats = kOffAlpha + 64 * 4;               // m[64], l[64] at a unit end
constexpr int kOffBar = kOffStats + 2 * 64 * 4;             // mbarriers full[2], half[2], empty[2], remote[2]
constexpr int kSmemBytes = kOffBar + 64 + 1024;             // + room to align the base
static_assert(kOffP % 1024 == 0 && kOffBar % 8 == 0, "alignment");
static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM");

// Named barriers: P ready (S arrives, V syncs), P free (V arrives, S syncs),
// each 256 threads; S's and V's own barriers (128 each).
constexpr uint32_t kBarPReady = 1, kBarPFree = 2, kBarS = 3, kBarV = 4;

__device__ __forceinline__ uint32_t full_bar(uint32_t sbase, int b) { return sbase + kOffBar + 8 * b; }
__device__ __forceinline__ uint32_t half_bar(uint32_t sbase, int b) { return sbase + kOffBar + 16 + 8 * b; }
__device__ __forceinline__ uint32_t empty_bar(uint32_t sbase, int b) { return sbase + kOffBar + 32 + 8 * b; }
__device__ __forceinline__ uint32_t remote_bar(uint32_t sbase, int b) { return sbase + kOffBar + 48 + 8 * b; }

// The valid flag of entry e of K buffer b: a byte, the 8 bytes of 8
// consecutive entries in one 16-byte group (the other 8 stay 0), which a
// producer warp copies to the peer along with its rows.
__host__ __device__ constexpr int mask_off(int b, int e) { return kOffMask + b * 128 + (e >> 3) * 16 + (e & 7); }

constexpr uint32_t kPeerBytes = kHalf * 1024 + 4 * 16;  // the peer's 32 K rows (bf16) and their 4 mask groups
// The other CTA of a pair (its shared memory by cluster address); unused
// when kCluster = 1.
struct PeerCta {
  uint32_t rank = 0;  // this CTA's rank in the cluster; its head block is unit group * kCluster + rank
  uint32_t base = 0;  // the peer's shared-memory base (the same layout as ours)
};

// S and V release K buffer b, one arrive per warp (lane 0): ours, and in a
// pair the peer's, which our writers fill too. The warp syncs first: the
// copy-out of a finished unit (finish_half) reads the buffer from every lane,
// and those reads must come before the arrive that lets writers in.
template <int kCluster>
__device__ __forceinline__ void release_buffer(uint32_t sbase, const PeerCta& peer, int b, int lane) {
  __syncwarp();
  if (lane != 0) return;
  mbar_arrive(empty_bar(sbase, b));
  if constexpr (kCluster > 1) mbar_arrive_remote(empty_bar(peer.base, b));
}

// Runs wait(); in the diagnostic instantiation (kDiag, only when the caller
// asked for AttnParams::debug_clock) `timer` (one thread of the warpgroup)
// adds the nanoseconds it took to debug slot k. A separate instantiation, so
// that normal calls carry no timer code.
template <bool kDiag, typename Wait>
__device__ __forceinline__ void timed(const AttnParams& p, bool timer, int k, Wait&& wait) {
  if constexpr (kDiag) {
    const uint64_t t0 = global_timer_ns();
    wait();
    if (timer) p.debug_clock[blockIdx.x * kDebugSlots + k] += global_timer_ns() - t0;
  } else {
    wait();
  }
}

// ----------------------------------------------------------------------------
// Producer. Thread tp (0..127) serves entry e = tp / 4 of each tile and its
// record quarter q = tp % 4 (Quarter, sparse_mla_common.cuh).
// ----------------------------------------------------------------------------
// In a pair: a producer warp's 8 K rows e0 .. e0 + 7 of buffer kb (1 KB of
// every plane) and their mask group to the same places in the peer, by the
// copy engine; the peer's "remote" mbarrier counts the bytes. Lane i < 8
// copies plane i, lane 8 the mask group. (16-byte st.async from every
// thread instead kept the producer busy about 3.4 us per tile: run 46.)
__device__ __forceinline__ void copy_rows_to_peer(uint32_t sbase, const PeerCta& peer, int kb, int e0, int lane) {
  const uint32_t bar = remote_bar(peer.base, kb);
  if (lane < 8) {
    const uint32_t off = kOffK0 + kb * kKBytes + lane * kPlane + e0 * 128;
    bulk_copy_to_cta(peer.base + off, sbase + off, 8 * 128, bar);
  } else if (lane == 8) {
    bulk_copy_to_cta(peer.base + mask_off(kb, e0), sbase + mask_off(kb, e0), 16, bar);
  }
}

// In a pair, rank r serves entries 32 r + tp / 4 and copies each warp's
// rows and mask group to the peer.
template <int kCluster, bool kDiag>
__device__ __forceinline__ void produce(const AttnParams& p, uint8_t* smem, const PeerCta& peer, int a, int b,
                                        const UnitWalker& first) {
  const int tp = threadIdx.x - 256, q = tp & 3;
  const int e = kCluster > 1 ? kHalf * int(peer.rank) + (tp >> 2) : tp >> 2;
  const uint32_t sbase = smem_u32(smem);
  const int n = b - a;
  UnitWalker w = first;
  // The walker only moves forward: tiles in increasing order.
  auto ref = [&](int k) { return k < n ? fetch_ref(p, w, a + k, e) : EntryRef{-1, -1}; };
  // Records two tiles ahead in registers (x0: even tiles, x1: odd), indices
  // four tiles ahead.
  Quarter x0, x1;
  load_quarter(p, ref(0), q, x0);
  load_quarter(p, ref(1), q, x1);
  EntryRef r2 = ref(2), r3 = ref(3);
  auto step = [&](int s, Quarter& x) {
    const int kb = s & 1;
    const EntryRef r4 = ref(s + 4);
    if (s >= 2)  // tile s - 2 consumed (in a pair: by both CTAs)
      timed<kDiag>(p, tp == 0, kDebugProducerWait, [&] { mbar_wait(empty_bar(sbase, kb), ((s >> 1) + 1) & 1); });
    store_quarter(smem + kOffK0 + kb * kKBytes, chunk_off, e, q, x);  // before the row is copied to the peer
    if (q == 0) smem[mask_off(kb, e)] = x.valid ? 1 : 0;
    fence_proxy_async();  // the K stores are read by wgmma (and the copy engine)
    if constexpr (kCluster > 1) {
      __syncwarp();
      copy_rows_to_peer(sbase, peer, kb, e & ~7, tp & 31);
    }
    mbar_arrive(full_bar(sbase, kb));
    if constexpr (kDiag)
      if (s == 0) stamp(p, kDebugProducerFull, 256);
    load_quarter(p, r2, q, x);  // tile s + 2
    r2 = r3;
    r3 = r4;
  };
  for (int s = 0; s < n; s += 2) {
    step(s, x0);
    if (s + 1 < n) step(s + 1, x1);
  }
}

// ----------------------------------------------------------------------------
// V's gathers and dequantization. Thread tv (0..127) serves entry 32 + tv / 4
// and the record chunks of a producer thread (record_chunk(tv % 4, step)),
// with its own copy of the entry's scale bytes: each thread dequantizes
// exactly the bytes it gathered, so its own cp.async wait suffices.
// ----------------------------------------------------------------------------
__device__ __forceinline__ void issue_stage(const AttnParams& p, EntryRef r, uint8_t* smem, int kb, int tv) {
  const int e = tv >> 2, q = tv & 3;
  const bool valid = stage_quarter(p, r, q, smem_u32(smem + kOffStage) + e * 576,
                                   smem_u32(smem + kOffStage + kStageData) + tv * 8);
  if (q == 0) smem[mask_off(kb, kHalf + e)] = valid ? 1 : 0;
}

__device__ __forceinline__ void dequantize_stage(uint8_t* smem, int kb, int tv) {
  const int e = tv >> 2, q = tv & 3;
  store_staged_quarter(smem + kOffK0 + kb * kKBytes, chunk_off, kHalf + e, q, smem + kOffStage + e * 576,
                       smem + kOffStage + kStageData + tv * 8);
}

// ----------------------------------------------------------------------------
// Fragment layouts (wgmma accumulators): warp w4 = warp % 4 of a warpgroup
// owns rows r0 = 16 w4 + g and r0 + 8 (g = lane / 4); n8 tile j holds
// columns 8 j + 2 c4 and + 1 (c4 = lane % 4). S: 8 n8 tiles (entries); O:
// acc[4 j + e] is row r0 + 8 (e / 2), dim 256 wg + 8 j + 2 c4 + e % 2.
// ----------------------------------------------------------------------------
struct UnitEnd {
  int tok, hb, heff, pslot;
  bool whole;
};

template <int kCluster>
__device__ __forceinline__ UnitEnd unit_end(const AttnParams& p, const UnitWalker& w, const PeerCta& peer, int a, int b,
                                            int u0) {
  UnitEnd u;
  u.tok = w.tok;
  u.hb = w.hb * kCluster + int(peer.rank);
  u.heff = min(kHeadBlock, p.num_heads - u.hb * kHeadBlock);  // heads of this CTA's block (the last one may be partial)
  u.whole = w.begin() >= a && w.end() <= b;
  u.pslot = w.u == u0 ? 0 : 1;
  return u;
}

// Writes warpgroup wg's 256 dims of a finished unit (rotated where the
// params ask for the output rotation): bf16 output staged
// through its own planes of K buffer kb (rows of 512 bytes, 16-byte chunk c
// of row r at c ^ (r % 8); its P V is done and the other warpgroup reads
// other planes), or an fp32 partial for the combine. m, l: this thread's
// rows' maximum (log2 units) and sum. bar: the warpgroup's named barrier.
__device__ __forceinline__ void finish_half(const AttnParams& p, uint8_t* smem, const float (&acc)[128], int wg,
                                            int kb, const UnitEnd& u, const float (&m)[2], const float (&l)[2],
                                            uint32_t bar) {
  const int t = threadIdx.x & 127, lane = t & 31, g = lane >> 2, c4 = lane & 3, r0 = 16 * (t >> 5) + g;
  if (u.whole) {
    uint8_t* stage = smem + kOffK0 + kb * kKBytes + 4 * wg * kPlane;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int r = r0 + 8 * ri;
      if (r >= u.heff) continue;
      // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
      const float inv = 1.0f / (l[ri] + fast_exp2(p.sink[u.hb * kHeadBlock + r] * kLog2e - m[ri]));
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<uint32_t*>(stage + r * 512 + ((j ^ (r & 7)) << 4) + 4 * c4) =
            pack_bf16(acc[4 * j + 2 * ri] * inv, acc[4 * j + 2 * ri + 1] * inv);
      if (wg == 0 && c4 == 0 && p.lse != nullptr)
        p.lse[int64_t(u.tok) * p.num_heads + u.hb * kHeadBlock + r] = l[ri] > 0.0f ? m[ri] * kLn2 + logf(l[ri]) : -INFINITY;
    }
    // The output rotation (AttnParams::rope_cs). This thread copies
    // chunk column t % 32 of every row it copies (the stride, 128, is a
    // multiple of 32); chunks 24..31 of warpgroup 1 are dims 448..511, pairs
    // 4 (c - 24) + 0..3.
    const int cc = t & 31;
    const bool rotate = p.rope_cs != nullptr && wg == 1 && cc >= 24;
    float2 cs[4];
    if (rotate) {
      const float4* f = reinterpret_cast<const float4*>(p.rope_cs + int64_t(u.tok) * 32 + 4 * (cc - 24));
      const float4 c0 = __ldg(f), c1 = __ldg(f + 1);
      cs[0] = make_float2(c0.x, c0.y), cs[1] = make_float2(c0.z, c0.w);
      cs[2] = make_float2(c1.x, c1.y), cs[3] = make_float2(c1.z, c1.w);
    }
    bar_sync(bar, 128);
    uint16_t* out = p.out + (int64_t(u.tok) * p.num_heads + u.hb * kHeadBlock) * 512 + 256 * wg;
#pragma unroll 4
    for (int i = t; i < u.heff * 32; i += 128) {
      const int row = i >> 5, c = i & 31;
      uint4 v = *reinterpret_cast<const uint4*>(stage + row * 512 + ((c ^ (row & 7)) << 4));
      if (rotate)
        v = make_uint4(rope_rotate_bf16x2(v.x, cs[0]), rope_rotate_bf16x2(v.y, cs[1]), rope_rotate_bf16x2(v.z, cs[2]),
                       rope_rotate_bf16x2(v.w, cs[3]));
      *reinterpret_cast<uint4*>(out + row * 512 + c * 8) = v;
    }
  } else {
    const int part = blockIdx.x * 2 + u.pslot;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int r = r0 + 8 * ri;
      if (r >= u.heff) continue;
      float* ob = p.partial_o + (int64_t(part) * 64 + r) * 512 + 256 * wg + 2 * c4;
#pragma unroll
      for (int j = 0; j < 32; ++j) *reinterpret_cast<float2*>(ob + 8 * j) = make_float2(acc[4 * j + 2 * ri], acc[4 * j + 2 * ri + 1]);
      if (wg == 0 && c4 == 0) p.partial_ml[part * 64 + r] = make_float2(m[ri], l[ri]);
    }
  }
}

// O = alpha O + P V over warpgroup wg's dims (A = P from shared memory; B = V:
// entries are K, 8-row groups 1024 bytes apart = SBO, dims are N, contiguous
// inside a 64-dim plane with the next 64 dims one plane (LBO) further:
// MN-major). A unit's first tile overwrites O (scale-d 0). Issued, not waited.
__device__ __forceinline__ void issue_pv(float (&acc)[128], uint32_t sbase, int kb, int wg, bool unit_first, float alpha0,
                                         float alpha1) {
  if (!unit_first && __any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      acc[4 * j] *= alpha0;
      acc[4 * j + 1] *= alpha0;
      acc[4 * j + 2] *= alpha1;
      acc[4 * j + 3] *= alpha1;
    }
  }
  const uint64_t dp = sw128_desc(sbase + kOffP, 16, 1024);
  const uint64_t dv = sw128_desc(sbase + kOffK0 + kb * kKBytes + 4 * wg * kPlane, kPlane, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_tb(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4), kk > 0 || !unit_first);
  wgmma_commit();
}

// Q rows of this CTA's head block of one unit, by S's 128 threads.
template <int kCluster>
__device__ __forceinline__ void load_q(const AttnParams& p, uint8_t* smem, const PeerCta& peer, int unit) {
  const int t = unit / p.plan_head_blocks, hb = (unit - t * p.plan_head_blocks) * kCluster + int(peer.rank);
  const uint32_t qs = smem_u32(smem + kOffQ);
#pragma unroll 4
  for (int i = threadIdx.x; i < kHeadBlock * 64; i += 128) {
    const int row = i >> 6, c = i & 63;
    const int head = hb * kHeadBlock + row;
    const bool valid = head < p.num_heads;  // padded heads read as zeros
    const uint16_t* src = p.q + (int64_t(t) * p.num_heads + (valid ? head : 0)) * 512 + c * 8;
    cp_async_16(qs + chunk_off(row, c), src, valid ? 16 : 0);
  }
}

// ---- S (warpgroup 0) ---------------------------------------------------------
template <int kCluster, bool kDiag>
__device__ __forceinline__ void consume_s(const AttnParams& p, uint8_t* smem, const PeerCta& peer, int a, int b,
                                          const UnitWalker& first) {
  const int u0 = first.u;
  const int t = threadIdx.x, lane = t & 31, g = lane >> 2, c4 = lane & 3, r0 = 16 * (t >> 5) + g;
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);
  float* alpha_buf = reinterpret_cast<float*>(smem + kOffAlpha);
  float* stats = reinterpret_cast<float*>(smem + kOffStats);
  load_q<kCluster>(p, smem, peer, u0);
  cp_async_commit();
  float acc[128];
  float m_run[2], l_run[2];
  UnitWalker w = first;
  for (int s = 0; s < n; ++s) {
    const int kb = s & 1;
    const auto [unit_first, unit_last] = w.place(a, s, n);
    if (unit_first) {  // acc: overwritten by the unit's first P V
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
      cp_async_wait_group<0>();
      fence_proxy_async();  // Q came through cp.async, wgmma reads it
      bar_sync(kBarS, 128);
      if constexpr (kDiag)
        if (s == 0) stamp(p, kDebugQReady);
    }
    timed<kDiag>(p, t == 0, kDebugConsumerWait, [&] {
      mbar_wait(full_bar(sbase, kb), (s >> 1) & 1);  // the producer's rows (and the mask)
      if constexpr (kCluster == 1) {
        mbar_wait(half_bar(sbase, kb), (s >> 1) & 1);  // V's rows 32..63
      } else {  // the peer's 32 rows and mask groups: kPeerBytes from its copy engine
        if (t == 0) mbar_arrive_expect_tx(remote_bar(sbase, kb), kPeerBytes);
        mbar_wait(remote_bar(sbase, kb), (s >> 1) & 1);
      }
    });
    if constexpr (kDiag)
      if (s == 0) stamp(p, kDebugFirstK);

    // ---- S = Q K^T, 64 heads x 64 entries ---------------------------------------
    float sc[32];
    {
      // Two accumulation chains (even and odd k-steps) of 16 steps: the
      // tensor cores' fp32 accumulation loses precision along a chain
      // (docs/perf-notes.md, numerics).
      float sd[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) sc[i] = sd[i] = 0.0f;  // overwritten (scale-d 0) by each chain's first step
      const uint64_t dq = sw128_desc(sbase + kOffQ, 16, 1024);
      const uint64_t dk = sw128_desc(sbase + kOffK0 + kb * kKBytes, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 32; ++ks) {  // k16 step: plane ks / 4, 32-byte column (ks % 4)
        const uint32_t o = ((ks >> 2) * kPlane + (ks & 3) * 32) >> 4;
        if (ks & 1)
          wgmma_m64n64k16(sd, dq + o, dk + o, ks > 1);
        else
          wgmma_m64n64k16(sc, dq + o, dk + o, ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      fence_regs(sd);
#pragma unroll
      for (int i = 0; i < 32; ++i) sc[i] += sd[i];
    }
    if constexpr (kDiag)
      if (s == 0) stamp(p, kDebugFirstS);
    if (unit_last && s + 1 < n) {  // Q is free: the next unit's
      load_q<kCluster>(p, smem, peer, w.u + 1);
      cp_async_commit();
    }

    // ---- online softmax with the sink, whole rows --------------------------------
    const uint8_t* mask = smem + mask_off(kb, 0);
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool v0 = mask[16 * j + 2 * c4] != 0, v1 = mask[16 * j + 2 * c4 + 1] != 0;  // entries 8 j + 2 c4, + 1
      sc[4 * j] = v0 ? sc[4 * j] * p.scale_log2 : -INFINITY;
      sc[4 * j + 1] = v1 ? sc[4 * j + 1] * p.scale_log2 : -INFINITY;
      sc[4 * j + 2] = v0 ? sc[4 * j + 2] * p.scale_log2 : -INFINITY;
      sc[4 * j + 3] = v1 ? sc[4 * j + 3] * p.scale_log2 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(sc[4 * j], sc[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
    }
    const float mn0 = fmaxf(m_run[0], quad_max(mx0)), mn1 = fmaxf(m_run[1], quad_max(mx1));
    // Rows with nothing attended yet keep max -inf: use 0 as the exponent base.
    const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float alpha0 = fast_exp2(m_run[0] - base0), alpha1 = fast_exp2(m_run[1] - base1);
    m_run[0] = mn0;
    m_run[1] = mn1;
    if (s > 0) timed<kDiag>(p, t == 0, kDebugSPFree, [] { bar_sync(kBarPFree, 256); });  // V is done with the previous P, alpha and statistics
    float sum0 = 0.0f, sum1 = 0.0f;
    uint8_t* prow0 = smem + kOffP + r0 * 128 + 4 * c4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p0 = fast_exp2(sc[4 * j] - base0), p1 = fast_exp2(sc[4 * j + 1] - base0);
      const float p2 = fast_exp2(sc[4 * j + 2] - base1), p3 = fast_exp2(sc[4 * j + 3] - base1);
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      const int chunk = (j ^ g) << 4;  // rows r0, r0 + 8 both have row & 7 == g
      *reinterpret_cast<uint32_t*>(prow0 + chunk) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(prow0 + 8 * 128 + chunk) = pack_bf16(p2, p3);
    }
    l_run[0] = l_run[0] * alpha0 + sum0;
    l_run[1] = l_run[1] * alpha1 + sum1;
    float l_row[2] = {0.0f, 0.0f};
    if (unit_last) {
      l_row[0] = quad_sum(l_run[0]);
      l_row[1] = quad_sum(l_run[1]);
    }
    if (c4 == 0) {
      alpha_buf[r0] = alpha0;
      alpha_buf[r0 + 8] = alpha1;
      if (unit_last) {
        stats[r0] = m_run[0];
        stats[r0 + 8] = m_run[1];
        stats[64 + r0] = l_row[0];
        stats[64 + r0 + 8] = l_row[1];
      }
    }
    fence_proxy_async();  // P is read by wgmma
    bar_sync(kBarS, 128);  // all of P is written (S's own P V reads it)
    named_arrive(kBarPReady, 256);
    if constexpr (kDiag)
      if (s == 0) stamp(p, kDebugFirstP);

    // (Left running into the next tile, this P V made ptxas serialize S's
    // wgmma: its accumulators and Q K^T's do not fit S's registers together.)
    issue_pv(acc, sbase, kb, 0, unit_first, alpha0, alpha1);
    wgmma_wait<0>();
    fence_regs(acc);
    if constexpr (kDiag)
      if (s == 0) stamp(p, kDebugFirstPV);
    if (unit_last) {
      finish_half(p, smem, acc, 0, kb, unit_end<kCluster>(p, w, peer, a, b, u0), m_run, l_row, kBarS);
      if constexpr (kDiag) stamp(p, kDebugFinish);
    }
    release_buffer<kCluster>(sbase, peer, kb, lane);
  }
  cp_async_wait_group<0>();  // nothing may land in shared memory after we return
}

// ---- V (warpgroup 1) ---------------------------------------------------------
// Alone (kCluster = 1), V also gathers and dequantizes entries 32..63; in a
// pair the producers do all the dequantization and V only its P V.
template <int kCluster, bool kDiag>
__device__ __forceinline__ void consume_v(const AttnParams& p, uint8_t* smem, const PeerCta& peer, int a, int b,
                                          const UnitWalker& first) {
  const int u0 = first.u;
  constexpr bool kStages = kCluster == 1;
  const int t = threadIdx.x - 128, lane = t & 31, g = lane >> 2, r0 = 16 * (t >> 5) + g;
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);
  const float* alpha_buf = reinterpret_cast<const float*>(smem + kOffAlpha);
  const float* stats = reinterpret_cast<const float*>(smem + kOffStats);
  const int e = kHalf + (t >> 2);
  UnitWalker gw = first;  // the staging cursor
  EntryRef pending{-1, -1};
  if constexpr (kStages) {  // tile a's half now, tile a + 1's staged
    issue_stage(p, fetch_ref(p, gw, a, e), smem, 0, t);
    cp_async_commit();
    cp_async_wait_group<0>();
    dequantize_stage(smem, 0, t);
    fence_proxy_async();
    mbar_arrive(half_bar(sbase, 0));
    if (n > 1) issue_stage(p, fetch_ref(p, gw, a + 1, e), smem, 1, t);
    cp_async_commit();
    if (n > 2) pending = fetch_ref(p, gw, a + 2, e);
  }

  float acc[128];
  UnitWalker w = first;
  for (int s = 0; s < n; ++s) {
    const int kb = s & 1;
    const auto [unit_first, unit_last] = w.place(a, s, n);
    timed<kDiag>(p, t == 0, kDebugVPReady, [] { bar_sync(kBarPReady, 256); });  // P, alpha (and at a unit end the statistics) of tile s
    issue_pv(acc, sbase, kb, 1, unit_first, alpha_buf[r0], alpha_buf[r0 + 8]);
    // While P V runs: tile s + 1's half into the other K buffer (free once
    // both warpgroups released it after tile s - 1), then tile s + 2's gathers.
    if (kStages && s + 1 < n) {
      timed<kDiag>(p, t == 0, kDebugVStage, [] { cp_async_wait_group<0>(); });
      if (s >= 1) timed<kDiag>(p, t == 0, kDebugVEmpty, [&] { mbar_wait(empty_bar(sbase, kb ^ 1), (((s + 1) >> 1) + 1) & 1); });
      dequantize_stage(smem, kb ^ 1, t);
      fence_proxy_async();  // the K stores are read by wgmma
      mbar_arrive(half_bar(sbase, kb ^ 1));
      if (s + 2 < n) issue_stage(p, pending, smem, kb, t);
      cp_async_commit();
      if (s + 3 < n) pending = fetch_ref(p, gw, a + s + 3, e);
    }
    wgmma_wait<0>();
    fence_regs(acc);
    if (unit_last) {
      const float m[2] = {stats[r0], stats[r0 + 8]}, l[2] = {stats[64 + r0], stats[64 + r0 + 8]};
      finish_half(p, smem, acc, 1, kb, unit_end<kCluster>(p, w, peer, a, b, u0), m, l, kBarV);
    }
    release_buffer<kCluster>(sbase, peer, kb, lane);
    if (s + 1 < n) named_arrive(kBarPFree, 256);
  }
  cp_async_wait_group<0>();
}

// The whole CTA: barriers, then the roles. In a pair the peer's writers and
// releases target our barriers and buffers, so both CTAs initialise theirs
// before either starts, and neither exits while the other may still arrive.
template <int kCluster, bool kDiag>
__device__ __forceinline__ void attention_tiles(const AttnParams& p, uint8_t* smem, int a, int b, const UnitWalker& first) {
  const uint32_t sbase = smem_u32(smem);
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_bar(sbase, i), 128);
      mbar_init(half_bar(sbase, i), 128);
      mbar_init(empty_bar(sbase, i), 8 * kCluster);  // the warps of S and V (of both CTAs)
      mbar_init(remote_bar(sbase, i), 1);            // S's expect_tx; the bytes come from the peer
    }
  }
  for (int i = threadIdx.x; i < 2 * 8 * 16; i += kAttnThreads) smem[kOffMask + i] = 0;  // the groups' unused bytes
  PeerCta peer;
  if constexpr (kCluster > 1) {
    if (threadIdx.x == 0) fence_mbar_init_cluster();
    peer.rank = cluster_ctarank();
    peer.base = map_to_cta(sbase, peer.rank ^ 1u);
    cluster_sync();
  } else {
    __syncthreads();
  }
  // Nothing above reads what an earlier kernel writes (pdl.cuh): the set-up
  // overlaps its tail.
  wait_for_prior_grids();
  if (!p.late_trigger) launch_dependents();
  if constexpr (kDiag) stamp(p, kDebugStart);
  // Warp-uniform role (a shuffle from lane 0), so that the wgmma are not
  // treated as divergent.
  const int role = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (role == 0) {
    set_regs<kRegsS>();
    consume_s<kCluster, kDiag>(p, smem, peer, a, b, first);
  } else if (role == 1) {
    set_regs<kRegsV>();
    consume_v<kCluster, kDiag>(p, smem, peer, a, b, first);
  } else {
    set_regs<kRegsProducer>();
    produce<kCluster, kDiag>(p, smem, peer, a, b, first);
  }
  if (p.late_trigger) launch_dependents();  // AttnParams::late_trigger
  if constexpr (kCluster > 1) cluster_sync();
}

}  // namespace dsv4::cuda::mla
