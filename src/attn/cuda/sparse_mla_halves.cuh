#pragma once
// Kernel variant 2: the two warpgroups split the 512 dims instead of the
// entries. Warpgroup w owns dims [256 w, +256): it gathers only its bytes of
// each record, dequantizes them, computes its half of S = Q K^T (k-split,
// m64n64), and owns the same dims of O (P V with P from registers). The only
// coupling is the sum of the two S halves, exchanged through shared memory
// once per tile; after it both warpgroups hold the same full S rows and run
// the same softmax, bit for bit, so row maxima, sums and P need no further
// exchange. Because wgmma is asynchronous, a warpgroup dequantizes plane
// p + 1 while the tensor cores multiply plane p. Included by
// sparse_mla_kernel.cu only.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla::halves {

// ---- shared memory -----------------------------------------------------------
// Q and K as in sparse_mla_common.cuh (planes of 64 dims, 128B swizzle);
// warpgroup w reads and writes planes [4 w, 4 w + 4) of both. A raw slot holds
// one tile's gathered bytes: part A (warpgroup 0: record bytes 0..255, fp8 dims
// 0..255, 256 bytes per entry), part B (warpgroup 1: record bytes 256..575,
// fp8 dims 256..447 then the bf16 dims 448..511, 320 bytes per entry) and one
// copy of the 8 scale bytes per warpgroup. Each warpgroup's 16 KB half of S
// is exchanged through its own part of the slot it has just dequantized.
constexpr int kPartA = kTileEntries * 256;
constexpr int kPartB = kTileEntries * 320;
constexpr int kSlotScales = kPartA + kPartB;  // [2 warpgroups][64 entries][8]
constexpr int kSlotBytes = kSlotScales + 2 * kTileEntries * 8;
constexpr int kSBytes = kHeadBlock * kTileEntries * 4;  // one half of S, fp32
static_assert(kPartA >= kSBytes && kPartB >= kSBytes, "the S exchange fits in each warpgroup's part");

constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kQBytes;
constexpr int kOffRaw = kOffK + kKBytes;  // two slots
constexpr int kOffMask = kOffRaw + 2 * kSlotBytes;  // [2 warpgroups][4 tiles][64]: entry valid
constexpr int kSmemBytes = kOffMask + 2 * 4 * kTileEntries + 1024;  // + room to align the base
static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM");

// Named barriers: 1 = the S exchange (all 256 threads); 2 / 3 = "the other
// warpgroup has read the S half in part A / B" (arrive by the reader, sync by
// the owner before it gathers into that part again); 4 + w = warpgroup w.
constexpr int kBarExchange = 1, kBarPartRead = 2, kBarGroup = 4;

__device__ __forceinline__ void group_sync(int wg) { named_sync(kBarGroup + wg, 128); }

// Byte offset of 16-byte chunk c of entry e in the warpgroup's part. The
// swizzles keep the 16-byte reads of the dequantization (8 consecutive
// threads = 8 consecutive entries, same chunk) conflict-free: rows of 256
// bytes permute chunks by e % 8, rows of 320 bytes (5 chunks mod 8 apart
// every other row) by (e / 2) % 4.
template <int kWg>
__device__ __forceinline__ uint32_t part_off(int e, int c) {
  if constexpr (kWg == 0) return uint32_t(e * 256 + ((c ^ (e & 7)) << 4));
  return uint32_t(kPartA + e * 320 + ((c ^ ((e >> 1) & 3)) << 4));
}

// ---- gathers: entry t / 2 of the warpgroup, chunks t % 2 + 2 j ---------------
template <int kWg>
__device__ __forceinline__ void issue_gather(const AttnParams& p, EntryRef r, uint8_t* smem, int slot, int mask_slot) {
  constexpr int kChunks = kWg == 0 ? 8 : 10;  // 16-byte chunks per thread
  const int t = threadIdx.x & 127, e = t >> 1, h = t & 1;
  auto [data, scales] = record_ptrs(p, r);
  const bool valid = data != nullptr;
  if (!valid) data = scales = reinterpret_cast<const uint8_t*>(p.q);  // any valid address: nothing is read
  const uint32_t n = valid && !(p.debug_flags & kDebugNoLoads) ? 16u : 0u;
  uint8_t* sl = smem + kOffRaw + slot * kSlotBytes;
  const uint8_t* src = data + 256 * kWg;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = h + 2 * j;
    cp_async_16(smem_u32(sl + part_off<kWg>(e, c)), src + 16 * c, n);
  }
  if (h == 0) {
    cp_async_8(smem_u32(sl + kSlotScales + (kWg * kTileEntries + e) * 8), scales, n / 2);
    smem[kOffMask + (kWg * 4 + mask_slot) * kTileEntries + e] = valid ? 1 : 0;
  }
}

// Q rows of one unit, this warpgroup's planes only.
template <int kWg>
__device__ __forceinline__ void load_q_half(const AttnParams& p, uint8_t* smem, int unit) {
  const int t = unit / p.head_blocks, hb = unit - t * p.head_blocks;
  const uint32_t qs = smem_u32(smem + kOffQ);
#pragma unroll 4
  for (int i = threadIdx.x & 127; i < kHeadBlock * 32; i += 128) {
    const int row = i >> 5, c = 32 * kWg + (i & 31);
    const int head = hb * kHeadBlock + row;
    const bool valid = head < p.num_heads;  // padded heads read as zeros
    const uint16_t* src = p.q + (int64_t(t) * p.num_heads + (valid ? head : 0)) * 512 + c * 8;
    cp_async_16(qs + chunk_off(row, c), src, valid ? 16 : 0);
  }
}

// ---- dequantization of one 64-dim plane of the tile into K -------------------
// Thread t: entry (t % 8) + 8 (t / 16), chunk half (t / 8) % 2.
template <int kWg>
__device__ __forceinline__ void dequant_plane(uint8_t* smem, int slot, int plane) {
  const int t = threadIdx.x & 127, e = (t & 7) + 8 * (t >> 4), h = (t >> 3) & 1;
  const uint8_t* sl = smem + kOffRaw + slot * kSlotBytes;
  uint8_t* kbuf = smem + kOffK;
  if (plane == 7) {  // dims 448..511 are bf16 already: part B chunks 12..19
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * h + i;
      *reinterpret_cast<uint4*>(kbuf + chunk_off(e, 56 + k)) = *reinterpret_cast<const uint4*>(sl + part_off<1>(e, 12 + k));
    }
    return;
  }
  const uint32_t sb = sl[kSlotScales + (kWg * kTileEntries + e) * 8 + plane];
  const ScaleFactors f = scale_factors(sb);
  const int pl = plane - 4 * kWg;  // plane within the part
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = 4 * pl + 2 * h + i;   // 16 fp8 dims: 64 plane + 16 (2 h + i)
    const int kc = 8 * plane + 2 * (2 * h + i);  // their two bf16 K chunks
    const uint4 v = *reinterpret_cast<const uint4*>(sl + part_off<kWg>(e, c));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[8];
    if (sb <= 134u)
      dequant_chunk<false>(w, f, o);
    else  // scales >= 2^8: never produced for real caches, exact two-step path
      dequant_chunk<true>(w, f, o);
    *reinterpret_cast<uint4*>(kbuf + chunk_off(e, kc)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(kbuf + chunk_off(e, kc + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
    if (has_nan_codes(v)) patch_nan_codes_inline(v, kbuf, e, 8 * kc);  // no call: wgmma are in flight
  }
}

template <int N>
__device__ __forceinline__ void fence_regs_u32(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// ---- the tile loop of warpgroup kWg -----------------------------------------
// Fragment layouts (wgmma accumulators): warp w4 = warp % 4 of the group owns
// rows 16 w4 + g and + 8 (g = lane / 4); n8 tile j holds columns 8 j + 2 c4
// and + 1 (c4 = lane % 4). S: 8 n8 tiles (entries); O: 32 n8 tiles (dims
// 256 kWg + ...).
template <int kWg>
__device__ __forceinline__ void attention_tiles(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int t = threadIdx.x & 127, lane = t & 31, w4 = t >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int r0 = 16 * w4 + g;  // rows r0, r0 + 8
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);
  const bool compute = !(p.debug_flags & kDebugNoCompute);

  UnitWalker gw;  // the gather cursor, two tiles ahead
  gw.start(p.plan.unit_info, u0);
  load_q_half<kWg>(p, smem, u0);
  cp_async_commit();
  issue_gather<kWg>(p, fetch_ref(p, gw, a, t >> 1), smem, 0, a & 3);
  cp_async_commit();
  if (n > 1) issue_gather<kWg>(p, fetch_ref(p, gw, a + 1, t >> 1), smem, 1, (a + 1) & 3);
  cp_async_commit();
  EntryRef pending{-1, -1};
  if (n > 2) pending = fetch_ref(p, gw, a + 2, t >> 1);

  float acc[128];  // O rows r0, r0 + 8 x this warpgroup's 256 dims
  float m_run[2], l_run[2];
  UnitWalker w;
  w.start(p.plan.unit_info, u0);

  for (int s = 0; s < n; ++s) {
    const int tile = a + s;
    if (tile >= w.end()) w.advance();
    const bool unit_first = s == 0 || tile == w.begin();
    const bool unit_last = s + 1 == n || tile + 1 == w.end();
    const int slot = s & 1;
    uint8_t* sl = smem + kOffRaw + slot * kSlotBytes;
    if (unit_first) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
    }
    // This tile's bytes (and at a unit start its Q) have landed for the whole
    // warpgroup: all groups but the newest (tile s + 1's gathers; the next
    // unit's Q is committed before those).
    cp_async_wait_group<1>();
    fence_proxy_async();  // Q came through cp.async, wgmma reads it
    group_sync(kWg);
    if (s == 0 && kWg == 0) stamp(p, 1);

    // ---- dequantize plane by plane; multiply each while the next converts --
    float sacc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) sacc[i] = 0.0f;  // overwritten (scale-d 0) by the first step
    const uint64_t dq = sw128_desc(sbase + kOffQ, 16, 1024);
    const uint64_t dk = sw128_desc(sbase + kOffK, 16, 1024);
    const bool one_fence = p.debug_flags & 8, skip_fence = p.debug_flags & 16;  // EXPERIMENT
#pragma unroll
    for (int pl = 0; pl < 4; ++pl) {
      const int plane = 4 * kWg + pl;
      if (!(p.debug_flags & kDebugNoStore)) dequant_plane<kWg>(smem, slot, plane);
      if (one_fence && pl < 3) continue;
      if (!skip_fence || pl == 3) fence_proxy_async();
      group_sync(kWg);
      if (one_fence) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const uint32_t o = ((4 * kWg + k / 4) * kPlane + (k % 4) * 32) >> 4;
          wgmma_m64n64k16(sacc, dq + o, dk + o, k > 0);
        }
        wgmma_commit();
      } else if (compute) {
        if (pl == 0) wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {  // k16 step: 32-byte column kk of the plane
          const uint32_t o = (plane * kPlane + kk * 32) >> 4;
          wgmma_m64n64k16(sacc, dq + o, dk + o, pl > 0 || kk > 0);
        }
        wgmma_commit();
      }
    }
    if (s == 0 && kWg == 0) stamp(p, 2);
    wgmma_wait<0>();  // unconditional: ptxas must see every path wait before the registers are used
    fence_regs(sacc);
    // Q is free at a unit end: the next unit's Q (committed before the next gathers).
    if (unit_last && s + 1 < n) {
      load_q_half<kWg>(p, smem, w.u + 1);
      cp_async_commit();
    }

    // ---- S = own half + other half ------------------------------------------
    // Both halves use the same fragment layout, so thread t of one warpgroup
    // holds exactly the elements of thread t of the other. Each adds the
    // other's half to its own: fp32 addition commutes, so both get the same S.
    float4* mine = reinterpret_cast<float4*>(sl + (kWg == 0 ? 0 : kPartA));
    const float4* other = reinterpret_cast<const float4*>(sl + (kWg == 0 ? kPartA : 0));
#pragma unroll
    for (int j = 0; j < 8; ++j) mine[j * 128 + t] = make_float4(sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3]);
    named_sync(kBarExchange, 256);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 v = other[j * 128 + t];
      sacc[4 * j] += v.x;
      sacc[4 * j + 1] += v.y;
      sacc[4 * j + 2] += v.z;
      sacc[4 * j + 3] += v.w;
    }
    named_arrive(kBarPartRead + (1 - kWg), 256);  // the other's part is free for its gathers

    // ---- online softmax over the full rows (same in both warpgroups) ------------
    uint32_t pa[4][4] = {};  // P as wgmma A fragments, one per k16 step
    float alpha0 = 1.0f, alpha1 = 1.0f;
    if (compute) {
      const uint8_t* mask = smem + kOffMask + (kWg * 4 + (tile & 3)) * kTileEntries;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * c4;
        const bool v0 = mask[col] != 0, v1 = mask[col + 1] != 0;
        sacc[4 * j] = v0 ? sacc[4 * j] * p.scale_log2 : -INFINITY;
        sacc[4 * j + 1] = v1 ? sacc[4 * j + 1] * p.scale_log2 : -INFINITY;
        sacc[4 * j + 2] = v0 ? sacc[4 * j + 2] * p.scale_log2 : -INFINITY;
        sacc[4 * j + 3] = v1 ? sacc[4 * j + 3] * p.scale_log2 : -INFINITY;
        mx0 = fmaxf(mx0, fmaxf(sacc[4 * j], sacc[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(sacc[4 * j + 2], sacc[4 * j + 3]));
      }
      const float mn0 = fmaxf(m_run[0], quad_max(mx0)), mn1 = fmaxf(m_run[1], quad_max(mx1));
      // Rows with nothing attended yet keep max -inf: use 0 as the exponent base.
      const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
      alpha0 = fast_exp2(m_run[0] - base0);
      alpha1 = fast_exp2(m_run[1] - base1);
      m_run[0] = mn0;
      m_run[1] = mn1;
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = fast_exp2(sacc[4 * j] - base0), p1 = fast_exp2(sacc[4 * j + 1] - base0);
        const float p2 = fast_exp2(sacc[4 * j + 2] - base1), p3 = fast_exp2(sacc[4 * j + 3] - base1);
        sum0 += p0 + p1;
        sum1 += p2 + p3;
        // k16 step j / 2: registers {row r0, row r0 + 8} x column halves j % 2.
        pa[j >> 1][2 * (j & 1)] = pack_bf16(p0, p1);
        pa[j >> 1][2 * (j & 1) + 1] = pack_bf16(p2, p3);
      }
      l_run[0] = l_run[0] * alpha0 + sum0;
      l_run[1] = l_run[1] * alpha1 + sum1;

      // ---- O = alpha O + P V over this warpgroup's dims -------------------------
      if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          acc[4 * j] *= alpha0;
          acc[4 * j + 1] *= alpha0;
          acc[4 * j + 2] *= alpha1;
          acc[4 * j + 3] *= alpha1;
        }
      }
      // B = V: entries are K (8-row groups 1024 bytes apart = SBO), dims are N,
      // contiguous inside a plane with the next 64 dims one plane (LBO) further.
      const uint64_t dv = sw128_desc(sbase + kOffK + 4 * kWg * kPlane, kPlane, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_m64n256k16_rs_tb(acc, pa[ks], dv + ((ks * 16 * 128) >> 4));
      wgmma_commit();
    }

    // While P V runs: the gathers of tile s + 2 into this warpgroup's part of
    // the slot, once the other warpgroup has read the S half stored there.
    named_sync(kBarPartRead + kWg, 256);
    if (s + 2 < n) issue_gather<kWg>(p, pending, smem, slot, (tile + 2) & 3);
    cp_async_commit();
    if (s + 3 < n) pending = fetch_ref(p, gw, tile + 3, t >> 1);

    wgmma_wait<0>();
    fence_regs(acc);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) fence_regs_u32(pa[ks]);  // P stays live until P V is done

    if (!unit_last) continue;
    // ---- end of this CTA's part of the unit: this warpgroup's 256 dims -------
    const float l0 = quad_sum(l_run[0]), l1 = quad_sum(l_run[1]);
    const int u = w.u;
    const int tok = u / p.head_blocks, hb = u - tok * p.head_blocks;
    const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
    const bool whole = w.begin() >= a && w.end() <= b;
    const int pslot = u == u0 ? 0 : 1;
    if (whole) {
      // Staged through this warpgroup's K planes (its P V is done; the next
      // tile's dequantization waits at the group barrier): rows of 512 bytes,
      // 16-byte chunk c of row r at c ^ (r % 8).
      uint8_t* stage = smem + kOffK + 4 * kWg * kPlane;
      float* lse = p.lse == nullptr || kWg != 0 || c4 != 0 ? nullptr : p.lse + int64_t(tok) * p.num_heads + hb * kHeadBlock;
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int r = r0 + 8 * ri;
        if (r >= heff) continue;
        const float m = m_run[ri], l = ri == 0 ? l0 : l1;
        // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
        const float inv = 1.0f / (l + fast_exp2(p.sink[hb * kHeadBlock + r] * kLog2e - m));
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<uint32_t*>(stage + r * 512 + ((j ^ (r & 7)) << 4) + 4 * c4) =
              pack_bf16(acc[4 * j + 2 * ri] * inv, acc[4 * j + 2 * ri + 1] * inv);
        if (lse != nullptr) lse[r] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
      }
      group_sync(kWg);
      uint16_t* out = p.out + (int64_t(tok) * p.num_heads + hb * kHeadBlock) * 512 + 256 * kWg;
#pragma unroll 4
      for (int i = t; i < heff * 32; i += 128) {
        const int row = i >> 5, c = i & 31;
        *reinterpret_cast<uint4*>(out + row * 512 + c * 8) =
            *reinterpret_cast<const uint4*>(stage + row * 512 + ((c ^ (row & 7)) << 4));
      }
    } else {
      const int part = blockIdx.x * 2 + pslot;
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int r = r0 + 8 * ri;
        if (r >= heff) continue;
        float* ob = p.partial_o + (int64_t(part) * 64 + r) * 512 + 256 * kWg + 2 * c4;
#pragma unroll
        for (int j = 0; j < 32; ++j) *reinterpret_cast<float2*>(ob + 8 * j) = make_float2(acc[4 * j + 2 * ri], acc[4 * j + 2 * ri + 1]);
        if (kWg == 0 && c4 == 0) p.partial_ml[part * 64 + r] = make_float2(m_run[ri], ri == 0 ? l0 : l1);
      }
    }
  }
  cp_async_wait_group<0>();  // nothing may land in shared memory after we reuse it
}

}  // namespace dsv4::cuda::mla::halves
