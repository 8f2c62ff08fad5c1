#pragma once
// Variant 2 of the sparse-attention kernel: warp-specialized and pipelined.
// Included by sparse_mla_kernel.cu only.
//
// Three warpgroups share one CTA per SM and walk the same tile range:
//  * the producer (warpgroup 2) reads the entry indices four tiles ahead,
//    prefetches records into L2 two tiles ahead and loads them into
//    registers one tile ahead; it dequantizes a tile into one of two bf16 K
//    buffers once the consumers have released it and signals "full" on that
//    buffer's mbarrier;
//  * the two consumer groups (warpgroups 0 and 1) run S = Q K^T, the online
//    softmax with the sink and O += P V on the full buffer, exactly as the
//    two groups of variant 1 do, and release it on its "empty" mbarrier.
// So the gathers and dequantization of the next tile overlap the tensor work
// of this one, and the consumers' barriers (named, 256 threads) never wait
// for the producer. Shared memory: Q 64 KB, two K buffers 128 KB, P 8 KB.
// The numerics are those of variant 1.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla::ws {

constexpr int kThreadsWs = 384;
// Registers per thread by role (setmaxnreg). The launch gives every thread
// 168 (65,536 / 384, rounded down to a multiple of 8); the producer hands 48
// to the consumers, whose accumulators and fragments need more.
constexpr int kRegsConsumer = 192, kRegsProducer = 120;
static_assert(2 * kRegsConsumer + kRegsProducer <= 3 * 168, "register file");

constexpr int kOffK0 = kOffQ + kQBytes;              // K buffer b at kOffK0 + b * kKBytes
constexpr int kOffPw = kOffK0 + 2 * kKBytes;         // P: 64 heads x 64 entries bf16
constexpr int kOffMaskW = kOffPw + kPBytes;          // [2][64] bytes: entry valid, per K buffer
constexpr int kOffMxW = kOffMaskW + 2 * 64;          // [2][64] floats: tile row max per group
constexpr int kOffStatW = kOffMxW + 2 * 64 * 4;      // m[64], l0[64], l1[64] floats at a unit end
constexpr int kOffBarW = kOffStatW + 3 * 64 * 4;     // mbarriers: full[2], empty[2]
constexpr int kSmemBytesWs = kOffBarW + 64 + 1024;   // + room to align the base to 1024
static_assert(kOffPw % 1024 == 0 && kOffBarW % 8 == 0, "alignment");
static_assert(kSmemBytesWs <= 227 * 1024, "shared memory per CTA");

// Named barriers (kBarConsumers = 1 is the consumers' common barrier).
// Named barriers of the two consumer groups (256 threads; kBarConsumers = 1 too).
constexpr uint32_t kBarQ = 2;       // a unit's Q landed
constexpr uint32_t kBarMax = 3;     // tile row maxima written
constexpr uint32_t kBarPReady = 4;  // P written
constexpr uint32_t kBarStats = 5;   // a unit's row max and sums written

__device__ __forceinline__ uint32_t full_bar(uint32_t sbase, int b) { return sbase + kOffBarW + 8 * b; }
__device__ __forceinline__ uint32_t empty_bar(uint32_t sbase, int b) { return sbase + kOffBarW + 16 + 8 * b; }

// An mbarrier wait; with diagnostics on, the first thread of the warpgroup
// adds the time it waited to stamp slot k.
__device__ __forceinline__ void timed_wait(const AttnParams& p, uint32_t bar, uint32_t parity, int k) {
  if (p.debug_clock == nullptr) return mbar_wait(bar, parity);
  const uint64_t t0 = global_timer_ns();
  mbar_wait(bar, parity);
  if ((threadIdx.x & 127) == 0) p.debug_clock[blockIdx.x * kDebugSlots + k] += global_timer_ns() - t0;
}

// ----------------------------------------------------------------------------
// Producer (warpgroup 2). Thread tp (0..127) serves entries e = tp / 4 and
// e + 32 of each tile ("rounds" 0 and 1) and their 16-byte record chunks
// q + 4 j (q = tp % 4): fp8 chunks q + 4 j for j < 7 (dims 16 (q + 4 j) ..,
// scale block j) and the RoPE chunks 28 + q + 4 j for j < 2. A quad reads 64
// contiguous bytes per load, and the 8 threads of a 16-byte store phase (2
// entries x 4 quarters) hit 8 distinct bank groups of the swizzled K rows.
//
// The two rounds' registers are software-pipelined: round 0 of tile s + 1 is
// loaded while round 1 of tile s is dequantized, and round 1 of s + 1 while
// round 0 of s + 1 waits and is dequantized. Indices are read four tiles
// ahead and records prefetched into L2 two tiles ahead.
// ----------------------------------------------------------------------------
constexpr int kProducerThreads = 128;

// The record and scale addresses of a slot, or false for an empty or
// out-of-range slot (nothing may be read then).
__device__ __forceinline__ bool resolve(const AttnParams& p, EntryRef r, const uint8_t*& data,
                                        const uint8_t*& scales) {
  if (r.list < 0 || r.slot < 0) return false;
  const CacheView& c = r.list == 0 ? p.swa_cache : p.extra_cache;
  if (int64_t(r.slot) >= c.capacity) return false;
  const uint32_t page = uint32_t(r.slot) / c.entries_per_page;
  const uint32_t off = uint32_t(r.slot) - page * c.entries_per_page;
  const uint8_t* base = c.base + int64_t(page) * c.page_stride;  // 64-bit: pages * stride passes 2^31
  data = base + size_t(576) * off;
  scales = base + size_t(576) * c.entries_per_page + size_t(8) * off;
  return true;
}

// One entry's share of a thread: step i < 7 is fp8 chunk q + 4 i, step 7 + r
// is record chunk 28 + q + 4 r.
struct Quarter {
  uint4 c[9];
  uint2 scales;
  bool valid;
};
__host__ __device__ constexpr int record_chunk(int q, int step) { return step < 7 ? q + 4 * step : 28 + q + 4 * (step - 7); }

// Cached loads (a quad's 64 bytes are two whole sectors); nothing is read
// for an empty slot (zeros, valid = false) or with loads switched off.
__device__ __forceinline__ void load_quarter(const AttnParams& p, EntryRef r, int q, Quarter& x) {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  x.valid = resolve(p, r, data, scales);
  const bool read = x.valid && !(p.debug_flags & kDebugNoLoads);
  const uint4* d = reinterpret_cast<const uint4*>(data);
#pragma unroll
  for (int i = 0; i < 9; ++i) x.c[i] = read ? __ldg(d + record_chunk(q, i)) : make_uint4(0, 0, 0, 0);
  x.scales = read ? __ldg(reinterpret_cast<const uint2*>(scales)) : make_uint2(0, 0);
}

__device__ __forceinline__ void prefetch_entry(const AttnParams& p, EntryRef r, int q) {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  if (!resolve(p, r, data, scales)) return;
  if (q < 3)
    prefetch_l2_bulk(data + 192 * q, 192);
  else
    prefetch_l2(scales);
}

// NaN codes (never written by the quantizer) must decode to NaN, as on the CPU.
__device__ __forceinline__ void patch_nan_halves(const uint32_t (&w)[4], uint32_t (&o)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int byte = 0; byte < 4; ++byte)
      if (((w[i] >> (8 * byte)) & 0x7fu) == 0x7fu) {
        uint32_t& h = o[2 * i + (byte >> 1)];
        h = (byte & 1) ? ((h & 0x0000ffffu) | 0x7fc00000u) : ((h & 0xffff0000u) | 0x7fc0u);
      }
}

// Dequantizes and stores one quarter into the K buffer at kbuf. fp8 chunk
// q + 4 step is K chunks 2 q + 8 step and + 1: plane step, positions 2 q and
// 2 q + 1, i.e. (chunk_off) plane + row and plane + (row ^ 16) with row =
// e * 128 + (((e & 7) ^ 2 q) << 4). RoPE record chunk 28 + q + 4 r is K chunk
// 56 + q + 4 r: plane 7, position q + 4 r, at rope_row ^ (4 r << 4) with
// rope_row = e * 128 + (((e & 7) ^ q) << 4).
__device__ __forceinline__ void store_quarter(uint8_t* kbuf, uint32_t row, uint32_t rope_row, const Quarter& x) {
#pragma unroll
  for (int step = 0; step < 9; ++step) {
    if (step < 7) {
      const uint32_t w[4] = {x.c[step].x, x.c[step].y, x.c[step].z, x.c[step].w};
      const uint32_t sb = (step < 4 ? x.scales.x >> (8 * step) : x.scales.y >> (8 * (step - 4))) & 0xffu;
      const ScaleFactors f = scale_factors(sb);
      uint32_t o[8];
      dequant_chunk<false>(w, f, o);
      if (sb > 134u) {  // scales >= 2^8: never produced for real caches, exact second step
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = bf16x2_mul(o[k], f.f1);
      }
      if (e4m3_nan_flags(w[0]) | e4m3_nan_flags(w[1]) | e4m3_nan_flags(w[2]) | e4m3_nan_flags(w[3]))
        patch_nan_halves(w, o);
      uint8_t* plane = kbuf + step * kPlane;
      *reinterpret_cast<uint4*>(plane + row) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(plane + (row ^ 16u)) = make_uint4(o[4], o[5], o[6], o[7]);
    } else {
      *reinterpret_cast<uint4*>(kbuf + 7 * kPlane + (rope_row ^ uint32_t((4 * (step - 7)) << 4))) = x.c[step];
    }
  }
}

__device__ __forceinline__ void produce(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tp = threadIdx.x - 256, e = tp >> 2, q = tp & 3;
  const uint32_t sbase = smem_u32(smem);
  const int n = b - a;
  const EntryRef none{-1, -1};
  UnitWalker w;
  w.start(p.plan.unit_info, u0);
  // Index refs of entries e (ra*) and e + 32 (rb*) for tiles s + 1 .. s + 3
  // at the top of iteration s.
  auto ref = [&](int k, int entry) { return k < n ? fetch_ref(p, w, a + k, entry) : none; };
  const EntryRef ra0 = ref(0, e), rb0 = ref(0, e + 32);
  EntryRef ra1 = ref(1, e), rb1 = ref(1, e + 32);
  EntryRef ra2 = ref(2, e), rb2 = ref(2, e + 32);
  EntryRef ra3 = ref(3, e), rb3 = ref(3, e + 32);
  Quarter x0, x1;
  load_quarter(p, ra0, q, x0);
  load_quarter(p, rb0, q, x1);
  prefetch_entry(p, ra1, q);
  prefetch_entry(p, rb1, q);
  prefetch_entry(p, ra2, q);
  prefetch_entry(p, rb2, q);
  const uint32_t row0 = uint32_t(e) * 128 + ((uint32_t(e & 7) ^ uint32_t(2 * q)) << 4);
  const uint32_t rope_row0 = uint32_t(e) * 128 + ((uint32_t(e & 7) ^ uint32_t(q)) << 4);
  for (int s = 0; s < n; ++s) {
    const int kb = s & 1;
    const EntryRef ra4 = ref(s + 4, e), rb4 = ref(s + 4, e + 32);  // index loads in flight
    if (s >= 2) mbar_wait(empty_bar(sbase, kb), ((s >> 1) + 1) & 1);  // tile s - 2 consumed
    uint32_t row = row0, rope_row = rope_row0;
    asm volatile("" : "+r"(row), "+r"(rope_row));  // recompute the store addresses each tile instead of keeping them live
    uint8_t* kbuf = smem + kOffK0 + kb * kKBytes;
    const bool store = !(p.debug_flags & kDebugNoStore);
    if (store) store_quarter(kbuf, row, rope_row, x0);
    if (q == 0) smem[kOffMaskW + kb * 64 + e] = x0.valid ? 1 : 0;
    load_quarter(p, ra1, q, x0);
    if (store) store_quarter(kbuf, row + 32 * 128, rope_row + 32 * 128, x1);  // entry e + 32: same swizzle
    if (q == 0) smem[kOffMaskW + kb * 64 + e + 32] = x1.valid ? 1 : 0;
    fence_proxy_async();  // the K stores are read by wgmma
    mbar_arrive(full_bar(sbase, kb));
    load_quarter(p, rb1, q, x1);
    prefetch_entry(p, ra3, q);
    prefetch_entry(p, rb3, q);
    ra1 = ra2, ra2 = ra3, ra3 = ra4;
    rb1 = rb2, rb2 = rb3, rb3 = rb4;
  }
  if (p.debug_clock != nullptr && tp == 0) p.debug_clock[blockIdx.x * kDebugSlots + 5] = global_timer_ns();
}

// ----------------------------------------------------------------------------
// Consumers. Warpgroup wg computes S for entries [32 wg, +32) of all 64 heads
// (m64n32k16, two accumulation chains over the even and odd k-steps: a chain
// of dependent wgmma steps is latency-bound) and O for dims [256 wg, +256)
// (m64n256k16, A = P from shared memory). Warp w4 of a group owns rows
// r0 = 16 w4 + g and r0 + 8 of both: acc[4 j + e] is row r0 + 8 (e / 2),
// dim 256 wg + 8 j + 2 c4 + e % 2. The groups swap row maxima (and, at the
// end of a unit, row sums) through shared memory.
// ----------------------------------------------------------------------------
__device__ __forceinline__ void rescale(float (&acc)[128], float alpha0, float alpha1) {
  if (!__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) return;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    acc[4 * j] *= alpha0;
    acc[4 * j + 1] *= alpha0;
    acc[4 * j + 2] *= alpha1;
    acc[4 * j + 3] *= alpha1;
  }
}

// Writes this warpgroup's half of a finished unit: bf16 output and lse when
// the CTA holds the whole unit, else an fp32 partial for the combine. stats: m[64],
// then the row sums of the two groups' entries, l0[64], l1[64].
// stage: the tile's K buffer, which the producer does not touch before this
// tile's "empty" arrival.
__device__ __forceinline__ void finish_unit(const AttnParams& p, uint8_t* smem, const float (&acc)[128], int wg,
                                            const UnitWalker& w, int a, int b, int u0, const float* stats,
                                            uint8_t* stage) {
  const int tid = threadIdx.x & 127, lane = tid & 31, w4 = tid >> 5, g = lane >> 2, c4 = lane & 3;
  const int u = w.u;
  const int t = u / p.head_blocks, hb = u - t * p.head_blocks;
  const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
  const bool whole = w.begin() >= a && w.end() <= b;
  const int pslot = u == u0 ? 0 : 1;
  const int row_base = 16 * w4 + g, col_base = 256 * wg + 2 * c4;
  const bool writes_row_stats = c4 == 0 && wg == 0;
  if (whole) {
    float* lse = p.lse == nullptr || !writes_row_stats ? nullptr : p.lse + int64_t(t) * p.num_heads + hb * kHeadBlock + row_base;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int r = row_base + 8 * ri;
      if (r >= heff) continue;
      const float m = stats[r], l = stats[64 + r] + stats[128 + r];
      // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
      const float inv = 1.0f / (l + fast_exp2(p.sink[hb * kHeadBlock + r] * kLog2e - m));
#pragma unroll
      for (int j = 0; j < 32; ++j)
        stage_pair(stage, r, col_base + 8 * j, pack_bf16(acc[4 * j + 2 * ri] * inv, acc[4 * j + 2 * ri + 1] * inv));
      if (lse != nullptr) lse[8 * ri] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
    }
    bar_sync(kBarConsumers, kConsumerThreads);
    copy_out_stage<256>(stage, p.out + (int64_t(t) * p.num_heads + hb * kHeadBlock) * 512, heff, threadIdx.x);
    return;
  }
  const int cta = blockIdx.x;
  float* ob = p.partial_o + (int64_t(cta * 2 + pslot) * 64 + row_base) * 512 + col_base;
  float2* ml = writes_row_stats ? p.partial_ml + (cta * 2 + pslot) * 64 + row_base : nullptr;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int r = row_base + 8 * ri;
    if (r >= heff) continue;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<float2*>(ob + 8 * ri * 512 + 8 * j) = make_float2(acc[4 * j + 2 * ri], acc[4 * j + 2 * ri + 1]);
    if (ml != nullptr) ml[8 * ri] = make_float2(stats[r], stats[64 + r] + stats[128 + r]);
  }
}

__device__ __forceinline__ void consume(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, w4 = (tid >> 5) & 3, g = lane >> 2, c4 = lane & 3;
  const int r0 = 16 * w4 + g;
  const uint32_t sbase = smem_u32(smem);
  const int n = b - a;
  float* mx_buf = reinterpret_cast<float*>(smem + kOffMxW);  // [2 groups][64 rows]
  float* stats = reinterpret_cast<float*>(smem + kOffStatW);
  float acc[128];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  UnitWalker w;
  w.start(p.plan.unit_info, u0);
  load_q_async<256>(p, smem, u0, tid);
  cp_async_commit();
  for (int s = 0; s < n; ++s) {
    const int tile = a + s, kb = s & 1;
    if (tile >= w.end()) w.advance();
    const bool unit_first = s == 0 || tile == w.begin();
    const bool unit_last = s + 1 == n || tile + 1 == w.end();
    if (unit_first) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
      cp_async_wait_group<0>();
      fence_proxy_async();  // Q came through cp.async, wgmma reads it
      bar_sync(kBarQ, 256);
    }
    timed_wait(p, full_bar(sbase, kb), (s >> 1) & 1, 6);
    if (s == 0) stamp(p, 1);

    // ---- S = Q K^T for entries [32 wg, +32) ------------------------------------
    float sc[16];
    {
      float sd[16];
      const uint64_t dq = sw128_desc(sbase + kOffQ, 16, 1024);
      const uint64_t dk = sw128_desc(sbase + kOffK0 + kb * kKBytes + 32 * wg * 128, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 32; ++ks) {  // k16 step: plane ks / 4, 32-byte column ks % 4
        const uint32_t o = ((ks >> 2) * kPlane + (ks & 3) * 32) >> 4;
        if (ks & 1)
          wgmma_m64n32k16(sd, dq + o, dk + o, ks > 1);
        else
          wgmma_m64n32k16(sc, dq + o, dk + o, ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      fence_regs(sd);
#pragma unroll
      for (int i = 0; i < 16; ++i) sc[i] += sd[i];
    }
    if (s == 0) stamp(p, 2);

    // ---- row maxima of this group's entries, exchanged -------------------------
    const uint8_t* mask = smem + kOffMaskW + kb * 64 + 32 * wg;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = 8 * j + 2 * c4;
      const bool v0 = mask[col] != 0, v1 = mask[col + 1] != 0;
      sc[4 * j] = v0 ? sc[4 * j] * p.scale_log2 : -INFINITY;
      sc[4 * j + 1] = v1 ? sc[4 * j + 1] * p.scale_log2 : -INFINITY;
      sc[4 * j + 2] = v0 ? sc[4 * j + 2] * p.scale_log2 : -INFINITY;
      sc[4 * j + 3] = v1 ? sc[4 * j + 3] * p.scale_log2 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(sc[4 * j], sc[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    if (c4 == 0) {
      mx_buf[wg * 64 + r0] = mx0;
      mx_buf[wg * 64 + r0 + 8] = mx1;
    }
    // Both groups are past Q K^T (Q is free at a unit end) and past P V of
    // the previous tile (P is free).
    bar_sync(kBarMax, 256);
    if (unit_last && s + 1 < n) {
      load_q_async<256>(p, smem, w.u + 1, tid);
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
    uint8_t* prow0 = smem + kOffPw + r0 * 128 + 4 * c4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = fast_exp2(sc[4 * j] - base0), p1 = fast_exp2(sc[4 * j + 1] - base0);
      const float p2 = fast_exp2(sc[4 * j + 2] - base1), p3 = fast_exp2(sc[4 * j + 3] - base1);
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      const int chunk = ((4 * wg + j) ^ g) << 4;  // rows r0, r0 + 8 both have row & 7 == g
      *reinterpret_cast<uint32_t*>(prow0 + chunk) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(prow0 + 8 * 128 + chunk) = pack_bf16(p2, p3);
    }
    l_run[0] = l_run[0] * alpha0 + sum0;
    l_run[1] = l_run[1] * alpha1 + sum1;
    fence_proxy_async();
    bar_sync(kBarPReady, 256);

    // ---- O[:, 256 wg + 0:256) = alpha O + P V ----------------------------------
    rescale(acc, alpha0, alpha1);
    if (!(p.debug_flags & kDebugNoCompute)) {  // (diagnostics: Q K^T always runs)
      // A = P (K-major, one plane); B = V: entries are K (8-row groups 1024
      // bytes apart = SBO), dims are N, contiguous inside a 64-dim plane with
      // the next 64 dims one plane (LBO) further: MN-major.
      const uint64_t dp = sw128_desc(sbase + kOffPw, 16, 1024);
      const uint64_t dv = sw128_desc(sbase + kOffK0 + kb * kKBytes + 4 * wg * kPlane, kPlane, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_tb(acc, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc);
    }
    if (!unit_last) {
      if (lane == 0) mbar_arrive(empty_bar(sbase, kb));
      continue;
    }
    const float l0 = quad_sum(l_run[0]), l1 = quad_sum(l_run[1]);
    if (c4 == 0) {
      stats[64 + 64 * wg + r0] = l0;
      stats[64 + 64 * wg + r0 + 8] = l1;
      if (wg == 0) {
        stats[r0] = m_run[0];
        stats[r0 + 8] = m_run[1];
      }
    }
    bar_sync(kBarStats, 256);
    finish_unit(p, smem, acc, wg, w, a, b, u0, stats, smem + kOffK0 + kb * kKBytes);
    if (lane == 0) mbar_arrive(empty_bar(sbase, kb));  // the output stage is read out
  }
  cp_async_wait_group<0>();
}

}  // namespace dsv4::cuda::mla::ws
