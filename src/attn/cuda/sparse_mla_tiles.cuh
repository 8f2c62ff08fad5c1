#pragma once
// The tile loop of the sparse-attention kernel: a producer warpgroup
// prepares half of the tiles ahead while two consumer warpgroups compute.
// Included by sparse_mla_kernel.cu only.
//
// Three warpgroups, one CTA per SM, two bf16 K buffers (tile s in buffer
// s % 2):
//  * the producer (warpgroup 2) loads entries 0..31 of each tile into
//    registers two tiles ahead, dequantizes them into rows 0..31 of the
//    tile's K buffer once the consumers have released it ("empty" mbarrier)
//    and signals "full";
//  * the consumers (warpgroups 0 and 1) gather entries 32..63 of the next
//    tile with cp.async into a staging slot, dequantize them at the start of
//    that tile into rows 32..63, wait for "full", and then run Q K^T, the
//    online softmax and P V; a tile's P V runs on into the next tile.
// So half of the gathers and dequantization leave the consumers' serial
// path and overlap their tensor work. Shared memory: Q 64 KB, two K buffers
// 128 KB, P 8 KB, the staging slot 18.3 KB (a whole tile of raw records and
// two K buffers would not fit). Why this split: docs/perf-notes.md, runs
// 24-27 (the producer alone was too slow for whole tiles, runs 10-12).
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla {

static_assert(kAttnThreads == 3 * 128 && kConsumerThreads == 256, "two consumer warpgroups, one producer");
// Registers per thread by role (setmaxnreg): the launch gives 168 each
// (65,536 / 384, rounded down to a multiple of 8); the producer hands 48 to
// the consumers, whose accumulators and fragments need them.
constexpr int kRegsConsumer = 192, kRegsProducer = 120;
static_assert(2 * kRegsConsumer + kRegsProducer <= 3 * 168, "register file");

constexpr int kHalf = kTileEntries / 2;  // entries per producer / consumer half
constexpr int kStageData = kHalf * 576;
constexpr int kOffK0 = kQBytes;                       // K buffer b at kOffK0 + b * kKBytes
constexpr int kOffP = kOffK0 + 2 * kKBytes;          // P: 64 heads x 64 entries bf16
constexpr int kOffStage = kOffP + kPBytes;           // records of entries 32..63, then a copy of their scales per thread
constexpr int kOffMask = kOffStage + kStageData + kConsumerThreads * 8;  // [2 buffers][64]: entry valid
constexpr int kOffMx = kOffMask + 2 * kTileEntries;         // [2 groups][64] floats: tile row max
constexpr int kOffLp = kOffMx + 2 * 64 * 4;                 // [2 groups][64] floats: row sums
constexpr int kOffM = kOffLp + 2 * 64 * 4;                  // [64] floats: row max at unit end
constexpr int kOffBar = kOffM + 64 * 4;                     // mbarriers full[2], empty[2]
constexpr int kSmemBytes = kOffBar + 32 + 1024;              // + room to align the base
static_assert(kOffP % 1024 == 0 && kOffBar % 8 == 0, "alignment");
static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM");

constexpr uint32_t kBarConsumers = 1;  // named barrier of the 256 consumer threads

__device__ __forceinline__ uint32_t full_bar(uint32_t sbase, int b) { return sbase + kOffBar + 8 * b; }
__device__ __forceinline__ uint32_t empty_bar(uint32_t sbase, int b) { return sbase + kOffBar + 16 + 8 * b; }

// An mbarrier wait; with diagnostics on, `timer` (one thread of the
// warpgroup) adds the nanoseconds it waited to debug slot k.
__device__ __forceinline__ void timed_wait(const AttnParams& p, uint32_t bar, uint32_t parity, bool timer, int k) {
  if (p.debug_clock == nullptr) return mbar_wait(bar, parity);
  const uint64_t t0 = global_timer_ns();
  mbar_wait(bar, parity);
  if (timer) p.debug_clock[blockIdx.x * kDebugSlots + k] += global_timer_ns() - t0;
}

// ----------------------------------------------------------------------------
// Producer. Thread tp (0..127) serves entry e = tp / 4 of each tile and its
// record chunks q + 4 j (q = tp % 4): fp8 chunks q + 4 j for j < 7 (scale
// block j), then the bf16 chunks 28 + q + 4 j for j < 2. A quad reads 64
// contiguous bytes per load.
// ----------------------------------------------------------------------------
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

// Dequantizes one quarter into row e of the K buffer at kbuf.
__device__ __forceinline__ void store_quarter(uint8_t* kbuf, int e, int q, const Quarter& x) {
#pragma unroll
  for (int step = 0; step < 9; ++step) {
    const int k = record_chunk(q, step);
    if (step < 7) {
      const uint32_t w[4] = {x.c[step].x, x.c[step].y, x.c[step].z, x.c[step].w};
      const uint32_t sb = (step < 4 ? x.scales.x >> (8 * step) : x.scales.y >> (8 * (step - 4))) & 0xffu;
      const ScaleFactors f = scale_factors(sb);
      uint32_t o[8];
      if (sb <= 134u)
        dequant_chunk<false>(w, f, o);
      else  // scales >= 2^8: never produced for real caches, exact two-step path
        dequant_chunk<true>(w, f, o);
      *reinterpret_cast<uint4*>(kbuf + chunk_off(e, 2 * k)) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(kbuf + chunk_off(e, 2 * k + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
      if (has_nan_codes(x.c[step])) patch_nan_codes(x.c[step], kbuf, e, 16 * k);
    } else {  // dims 448..511 are bf16 already: record chunk k is K chunk k + 28
      *reinterpret_cast<uint4*>(kbuf + chunk_off(e, k + 28)) = x.c[step];
    }
  }
}

__device__ __forceinline__ void produce(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tp = threadIdx.x - kConsumerThreads, e = tp >> 2, q = tp & 3;
  const uint32_t sbase = smem_u32(smem);
  const int n = b - a;
  UnitWalker w;
  w.start(p, u0);
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
    if (s >= 2) timed_wait(p, empty_bar(sbase, kb), ((s >> 1) + 1) & 1, tp == 0, kDebugProducerWait);  // tile s - 2 consumed
    uint8_t* kbuf = smem + kOffK0 + kb * kKBytes;
    store_quarter(kbuf, e, q, x);
    if (q == 0) smem[kOffMask + kb * kTileEntries + e] = x.valid ? 1 : 0;
    fence_proxy_async();  // the K stores are read by wgmma
    mbar_arrive(full_bar(sbase, kb));
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
// Consumers' half of the gathers and dequantization. Thread t (0..255)
// serves entry 32 + t / 8 and its record chunks t % 8 + 8 j: the 8 threads of
// a 16-byte access phase read one entry's 128 contiguous bytes. Each thread
// dequantizes exactly the bytes it gathered (with its own copy of the
// entry's scale bytes), so its own cp.async wait suffices: no barrier
// between the staging and the dequantization.
// ----------------------------------------------------------------------------
__device__ __forceinline__ void issue_stage(const AttnParams& p, EntryRef r, uint8_t* smem, int kb) {
  const int e = threadIdx.x >> 3, q = threadIdx.x & 7;
  auto [data, scales] = record_ptrs(p, r);
  const bool valid = data != nullptr;
  if (!valid) data = scales = reinterpret_cast<const uint8_t*>(p.q);  // any valid address: nothing is read
  const uint32_t dst = smem_u32(smem + kOffStage) + e * 576;
  const uint32_t nb = valid ? 16u : 0u;
#pragma unroll
  for (int j = 0; j < 5; ++j)
    if (q + 8 * j < 36) cp_async_16(dst + 16 * (q + 8 * j), data + 16 * (q + 8 * j), nb);
  cp_async_8(smem_u32(smem + kOffStage + kStageData) + threadIdx.x * 8, scales, nb / 2);
  if (q == 0) smem[kOffMask + kb * kTileEntries + kHalf + e] = valid ? 1 : 0;
}

__device__ __forceinline__ void dequantize_stage(uint8_t* smem, int kb) {
  const int e = threadIdx.x >> 3, q = threadIdx.x & 7;
  const uint8_t* raw = smem + kOffStage + e * 576;
  const uint2 sc = *reinterpret_cast<const uint2*>(smem + kOffStage + kStageData + threadIdx.x * 8);
  uint8_t* kbuf = smem + kOffK0 + kb * kKBytes;
  const int row = kHalf + e;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int k = q + 8 * j;  // fp8 chunk: dims 16 k .. 16 k + 15, scale block k / 4
    if (k >= 28) break;
    const uint4 v = *reinterpret_cast<const uint4*>(raw + 16 * k);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    const int blk = k >> 2;
    const uint32_t sb = (blk < 4 ? sc.x >> (8 * blk) : sc.y >> (8 * (blk - 4))) & 0xffu;
    const ScaleFactors f = scale_factors(sb);
    uint32_t o[8];
    if (sb <= 134u)
      dequant_chunk<false>(w, f, o);
    else
      dequant_chunk<true>(w, f, o);
    *reinterpret_cast<uint4*>(kbuf + chunk_off(row, 2 * k)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(kbuf + chunk_off(row, 2 * k + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
    if (has_nan_codes(v)) patch_nan_codes(v, kbuf, row, 16 * k);
  }
  // dims 448..511 (record chunks 28..35 are K chunks 56..63): the one this
  // thread gathered, 28 + q' for q' = q + 4 (q < 4) or q - 4.
  const int kr = q < 4 ? 32 + q : 24 + q;
  *reinterpret_cast<uint4*>(kbuf + chunk_off(row, kr + 28)) = *reinterpret_cast<const uint4*>(raw + 16 * kr);
}

// ----------------------------------------------------------------------------
// Consumers. Warpgroup wg computes S for entries [32 wg, +32) of all 64
// heads (m64n32k16, two accumulation chains: a chain of dependent wgmma
// steps is latency-bound) and O for dims [256 wg, +256) (m64n256k16, A = P
// from shared memory). Warp w4 = warp % 4 of a group owns rows
// r0 = 16 w4 + g and r0 + 8 of both (g = lane / 4): acc[4 j + e] is row
// r0 + 8 (e / 2), dim 256 wg + 8 j + 2 c4 + e % 2 (c4 = lane % 4). The groups
// swap row maxima (and, at the end of a unit, row sums) through shared memory.
// ----------------------------------------------------------------------------
__device__ __forceinline__ void consume(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tid = threadIdx.x, lane = tid & 31, cw = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  // Warp-uniform in the compiler's eyes (a shuffle from lane 0): the wgmma
  // descriptors built from it stay in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, cw >> 2, 0), w4 = cw & 3;
  const int r0 = 16 * w4 + g;
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);
  float* mx_buf = reinterpret_cast<float*>(smem + kOffMx);
  float* lp_buf = reinterpret_cast<float*>(smem + kOffLp);
  float* m_buf = reinterpret_cast<float*>(smem + kOffM);

  UnitWalker gw;  // the staging cursor, one tile ahead
  gw.start(p, u0);
  load_q_async(p, smem, u0);
  issue_stage(p, fetch_ref(p, gw, a, kHalf + (tid >> 3)), smem, 0);
  cp_async_commit();
  EntryRef pending{-1, -1};
  if (n > 1) pending = fetch_ref(p, gw, a + 1, kHalf + (tid >> 3));

  float acc[128];
  float m_run[2], l_run[2];
  // P V of a tile that does not end a unit is left running into the next
  // tile (its staging, dequantization and Q K^T); the wait of that Q K^T
  // completes it too (wgmma groups complete in order), and only then is its
  // K buffer released to the producer.
  int release = -1;  // K buffer whose P V is still in flight
  UnitWalker w;
  w.start(p, u0);

  for (int s = 0; s < n; ++s) {
    const int tile = a + s, kb = s & 1;
    if (tile >= w.end()) w.advance();
    const bool unit_first = s == 0 || tile == w.begin();
    const bool unit_last = s + 1 == n || tile + 1 == w.end();
    if (unit_first) {  // acc: overwritten by the unit's first P V (scale-d 0)
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
    }
    // This thread's share of the staged half (and at a unit start of Q) has
    // landed. K buffer kb is free: the P V that last read it (tile s - 2)
    // completed before both groups passed B4 of tile s - 1.
    cp_async_wait_group<0>();
    dequantize_stage(smem, kb);
    fence_proxy_async();  // K rows 32..63 (and Q, through cp.async) are read by wgmma
    bar_sync(kBarConsumers, kConsumerThreads);  // B2: rows 32..63 and Q ready, the staging slot is free
    if (s + 1 < n) issue_stage(p, pending, smem, kb ^ 1);
    cp_async_commit();
    if (s + 2 < n) pending = fetch_ref(p, gw, tile + 2, kHalf + (tid >> 3));
    timed_wait(p, full_bar(sbase, kb), (s >> 1) & 1, tid == 0, kDebugConsumerWait);  // rows 0..31 from the producer

    // ---- S = Q K^T for entries [32 wg, +32): two chains (even, odd k-steps) ----
    float s_[16];
    {
      float sg[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) s_[i] = sg[i] = 0.0f;  // overwritten (scale-d 0) by each chain's first step
      const uint64_t dq = sw128_desc(sbase + kOffQ, 16, 1024);
      const uint64_t dk = sw128_desc(sbase + kOffK0 + kb * kKBytes + 32 * wg * 128, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 32; ++ks) {  // k16 step: plane ks / 4, 32-byte column (ks % 4)
        const uint32_t o = ((ks >> 2) * kPlane + (ks & 3) * 32) >> 4;
        if (ks & 1)
          wgmma_m64n32k16(sg, dq + o, dk + o, ks > 1);
        else
          wgmma_m64n32k16(s_, dq + o, dk + o, ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(s_);
      fence_regs(sg);
      fence_regs(acc);
      if (release >= 0 && lane == 0) mbar_arrive(empty_bar(sbase, release));  // the previous P V is done
      release = -1;
#pragma unroll
      for (int i = 0; i < 16; ++i) s_[i] += sg[i];
    }

    // ---- tile row maxima, exchanged between the groups ----------------------
    const uint8_t* mask = smem + kOffMask + kb * kTileEntries + 32 * wg;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = 8 * j + 2 * c4;
      const bool v0 = mask[col] != 0, v1 = mask[col + 1] != 0;
      s_[4 * j] = v0 ? s_[4 * j] * p.scale_log2 : -INFINITY;
      s_[4 * j + 1] = v1 ? s_[4 * j + 1] * p.scale_log2 : -INFINITY;
      s_[4 * j + 2] = v0 ? s_[4 * j + 2] * p.scale_log2 : -INFINITY;
      s_[4 * j + 3] = v1 ? s_[4 * j + 3] * p.scale_log2 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(s_[4 * j], s_[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s_[4 * j + 2], s_[4 * j + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    if (c4 == 0) {
      mx_buf[wg * 64 + r0] = mx0;
      mx_buf[wg * 64 + r0 + 8] = mx1;
    }
    bar_sync(kBarConsumers, kConsumerThreads);  // B4: maxima exchanged; Q is free at a unit end
    if (unit_last && s + 1 < n) {
      load_q_async(p, smem, w.u + 1);
      cp_async_commit();
    }

    // ---- online softmax with the sink ------------------------------------------
    const float mn0 = fmaxf(m_run[0], fmaxf(mx0, mx_buf[(1 - wg) * 64 + r0]));
    const float mn1 = fmaxf(m_run[1], fmaxf(mx1, mx_buf[(1 - wg) * 64 + r0 + 8]));
    // Rows with nothing attended yet keep max -inf: use 0 as the exponent base.
    const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float alpha0 = fast_exp2(m_run[0] - base0), alpha1 = fast_exp2(m_run[1] - base1);
    m_run[0] = mn0;
    m_run[1] = mn1;
    float sum0 = 0.0f, sum1 = 0.0f;
    uint8_t* prow0 = smem + kOffP + r0 * 128 + 4 * c4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = fast_exp2(s_[4 * j] - base0), p1 = fast_exp2(s_[4 * j + 1] - base0);
      const float p2 = fast_exp2(s_[4 * j + 2] - base1), p3 = fast_exp2(s_[4 * j + 3] - base1);
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      const int chunk = ((4 * wg + j) ^ g) << 4;  // rows r0, r0 + 8 both have row & 7 == g
      *reinterpret_cast<uint32_t*>(prow0 + chunk) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(prow0 + 8 * 128 + chunk) = pack_bf16(p2, p3);
    }
    l_run[0] = l_run[0] * alpha0 + sum0;
    l_run[1] = l_run[1] * alpha1 + sum1;
    fence_proxy_async();
    bar_sync(kBarConsumers, kConsumerThreads);  // B5: P ready

    // ---- O[:, 256 wg + 0:256) = alpha O + P V ----------------------------------
    if (!unit_first && __any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        acc[4 * j] *= alpha0;
        acc[4 * j + 1] *= alpha0;
        acc[4 * j + 2] *= alpha1;
        acc[4 * j + 3] *= alpha1;
      }
    }
    {
      // A = P (K-major, one plane); B = V: entries are K (8-row groups 1024
      // bytes apart = SBO), dims are N, contiguous inside a 64-dim plane with
      // the next 64 dims one plane (LBO) further: MN-major.
      const uint64_t dp = sw128_desc(sbase + kOffP, 16, 1024);
      const uint64_t dv = sw128_desc(sbase + kOffK0 + kb * kKBytes + 4 * wg * kPlane, kPlane, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n256k16_tb(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4), kk > 0 || !unit_first);
      wgmma_commit();
    }
    if (!unit_last) {
      release = kb;
      continue;
    }
    wgmma_wait<0>();
    fence_regs(acc);

    // ---- end of this CTA's part of the unit --------------------------------
    const float l0 = quad_sum(l_run[0]), l1 = quad_sum(l_run[1]);
    if (c4 == 0) {
      lp_buf[wg * 64 + r0] = l0;
      lp_buf[wg * 64 + r0 + 8] = l1;
      if (wg == 0) {
        m_buf[r0] = m_run[0];
        m_buf[r0 + 8] = m_run[1];
      }
    }
    bar_sync(kBarConsumers, kConsumerThreads);
    const int u = w.u, t = w.tok, hb = w.hb;
    const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
    const bool whole = w.begin() >= a && w.end() <= b;
    const int pslot = u == u0 ? 0 : 1;
    const int col_base = 256 * wg + 2 * c4;
    const bool writes_row_stats = c4 == 0 && wg == 0;
    if (whole) {
      // Through K buffer kb: every consumer is past its P V (the barrier
      // above), and the producer does not touch it before this tile's
      // "empty" arrival below.
      uint8_t* stage = smem + kOffK0 + kb * kKBytes;
      float* lse = p.lse == nullptr || !writes_row_stats ? nullptr : p.lse + int64_t(t) * p.num_heads + hb * kHeadBlock + r0;
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int r = r0 + 8 * ri;
        if (r >= heff) continue;
        const float m = m_buf[r], l = lp_buf[r] + lp_buf[64 + r];
        // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
        const float inv = 1.0f / (l + fast_exp2(p.sink[hb * kHeadBlock + r] * kLog2e - m));
#pragma unroll
        for (int j = 0; j < 32; ++j)
          stage_pair(stage, r, col_base + 8 * j, pack_bf16(acc[4 * j + 2 * ri] * inv, acc[4 * j + 2 * ri + 1] * inv));
        if (lse != nullptr) lse[8 * ri] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
      }
      bar_sync(kBarConsumers, kConsumerThreads);
      copy_out_stage(stage, p.out + (int64_t(t) * p.num_heads + hb * kHeadBlock) * 512, heff);
      bar_sync(kBarConsumers, kConsumerThreads);  // the stage is read out before the producer may reuse it
    } else {
      float* ob = p.partial_o + (int64_t(blockIdx.x * 2 + pslot) * 64 + r0) * 512 + col_base;
      float2* ml = writes_row_stats ? p.partial_ml + (blockIdx.x * 2 + pslot) * 64 + r0 : nullptr;
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int r = r0 + 8 * ri;
        if (r >= heff) continue;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<float2*>(ob + 8 * ri * 512 + 8 * j) = make_float2(acc[4 * j + 2 * ri], acc[4 * j + 2 * ri + 1]);
        if (ml != nullptr) ml[8 * ri] = make_float2(m_buf[r], lp_buf[r] + lp_buf[64 + r]);
      }
    }
    if (lane == 0) mbar_arrive(empty_bar(sbase, kb));
  }
  cp_async_wait_group<0>();  // nothing may land in shared memory after we return
}

// The whole CTA: barriers, then the roles.
__device__ __forceinline__ void attention_tiles(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const uint32_t sbase = smem_u32(smem);
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_bar(sbase, i), kAttnThreads - kConsumerThreads);
      mbar_init(empty_bar(sbase, i), kConsumerThreads / 32);
    }
  }
  __syncthreads();
  // Warp-uniform role (a shuffle from lane 0), so that the wgmma of the
  // consumers are not treated as divergent.
  if (__shfl_sync(0xffffffffu, threadIdx.x / 128, 0) == 2) {
    reg_dealloc<kRegsProducer>();
    produce(p, smem, a, b, u0);
  } else {
    reg_alloc<kRegsConsumer>();
    consume(p, smem, a, b, u0);
  }
}

}  // namespace dsv4::cuda::mla
