#pragma once
// The tile loop of kernel variants 1 (serial wgmma) and 0 (mma.sync):
// gathers staged in shared memory by cp.async two tiles ahead, then per tile
// dequantize, S = Q K^T, softmax, O += P V one after the other. Included by
// sparse_mla_kernel.cu only.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla {

// ----------------------------------------------------------------------------
// The tile loop. Fragment layouts follow mma.m16n8k16 and the wgmma
// accumulators (the same per 16-row, 8-column block): g = lane / 4 picks rows
// g and g + 8, c4 = lane % 4 picks columns 2 c4, 2 c4 + 1 of each n8 tile.
//
// kWgmma: warpgroup wg = warp / 4 computes S for entries [32 wg, +32) of all
// 64 heads (m64n32k16, 32 k-steps) and O for dims [256 wg, +256) (m64n256k16,
// A = P from shared memory, B = V read MN-major from the K planes). Warp w4 =
// warp % 4 of the group owns rows [16 w4, +16) of both S and O, so the softmax
// rescale of O needs no exchange; the two groups swap row maxima and sums.
//
// mma.sync: warp (hbk, eb, kh) computes heads [32 hbk, +32) x entries
// [32 eb, +32) over dims [256 kh, +256); the two kh halves swap 16-row halves
// through the raw slot just dequantized, so that warp (hbk, eb, kh) then owns
// rows [32 hbk + 16 kh, +16) x entries [32 eb, +32) of S. For O, warp cw owns
// all 64 heads x dims [64 cw, +64); the row rescales go through shared memory.
// ----------------------------------------------------------------------------
template <bool kWgmma>
__device__ __forceinline__ void attention_tiles(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tid = threadIdx.x, lane = tid & 31, cw = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int wg = cw >> 2, w4 = cw & 3;                      // wgmma roles
  const int hbk = cw & 1, kh = cw >> 2;                     // mma.sync roles
  const int eb = kWgmma ? wg : (cw >> 1) & 1;               // entry half of the softmax role
  const int r0 = kWgmma ? 16 * w4 + g : 32 * hbk + 16 * kh + g;  // softmax rows r0, r0 + 8
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);

  // mma.sync operand addressing. A operands (Q, P) use rows lane & 15 and
  // chunk lane / 16: the x4 matrices are (rows 0-7, chunk 0), (8-15, 0),
  // (0-7, 1), (8-15, 1) = a0..a3. V (ldmatrix.trans) uses the same matrix
  // order with rows brow = (lane & 7) + 8 ((lane >> 3) & 1), giving {b0, b1}
  // of n8 tile 0 then of tile 1. K for Q K^T (no .trans) uses rows
  // krow = (lane & 7) + 8 (lane / 16) and chunk (lane / 8) & 1: again {b0, b1}
  // of n8 tile 0 then tile 1. Every such row has row & 7 == lane & 7, so the
  // swizzled position within a plane is a per-lane constant.
  uint32_t off[4], off_k[4];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    off[jj] = uint32_t(((2 * jj) | (lane >> 4)) ^ (lane & 7)) << 4;
    off_k[jj] = uint32_t(((2 * jj) | ((lane >> 3) & 1)) ^ (lane & 7)) << 4;
  }
  const int brow = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int krow = (lane & 7) + ((lane >> 4) << 3);
  const uint32_t qk_a = sbase + kOffQ + (32 * hbk + (lane & 15)) * 128 + 4 * kh * kPlane;
  const uint32_t qk_b = sbase + kOffK + (32 * eb + krow) * 128 + 4 * kh * kPlane;
  const uint32_t pv_a = sbase + kOffP + (lane & 15) * 128;
  const uint32_t pv_b = sbase + kOffK + brow * 128 + cw * kPlane;

  float* mx_buf = reinterpret_cast<float*>(smem + kOffMx);
  float* alpha_buf = reinterpret_cast<float*>(smem + kOffAlpha);
  float* lp_buf = reinterpret_cast<float*>(smem + kOffLp);
  float* m_buf = reinterpret_cast<float*>(smem + kOffM);
  const bool compute = !(p.debug_flags & kDebugNoCompute);

  // Prologue: Q of the first unit, then the gathers of tiles a and a + 1, one
  // cp.async group each (an empty group when the tile does not exist), so
  // that "all but the newest group done" always means "this tile is in".
  UnitWalker gw;  // the gather cursor, two tiles ahead
  gw.start(p, u0);
  load_q_async(p, smem, u0);
  cp_async_commit();
  issue_gather(p, fetch_ref(p, gw, a, tid >> 2), smem, 0, a & 3);
  cp_async_commit();
  if (n > 1) issue_gather(p, fetch_ref(p, gw, a + 1, tid >> 2), smem, 1, (a + 1) & 3);
  cp_async_commit();
  EntryRef pending{-1, -1};
  if (n > 2) pending = fetch_ref(p, gw, a + 2, tid >> 2);

  // O accumulators. wgmma: acc[4 j + e] for n8 tile j of the group's 256 dims.
  // mma.sync: acc[(8 rb + j) * 4 + e] for row block rb and n8 tile j of the
  // warp's 64 dims.
  float acc[128];
  float m_run[2], l_run[2];
  UnitWalker w;
  w.start(p, u0);

  for (int s = 0; s < n; ++s) {
    const int tile = a + s;
    if (tile >= w.end()) w.advance();
    const bool unit_first = s == 0 || tile == w.begin();
    const bool unit_last = s + 1 == n || tile + 1 == w.end();
    const int slot = s & 1;
    if (unit_first) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
    }
    // B1: this tile's records (and, at a unit start, its Q) have landed for
    // every thread; all warps are done with the previous tile's K and P.
    // Groups are committed in the order of use, so all but the newest group
    // (tile s + 1) will do; except in the wgmma path at a unit switch, where
    // the next unit's Q was committed after tile s + 1's gathers.
    if (kWgmma && unit_first && s > 0)
      cp_async_wait_group<0>();
    else
      cp_async_wait_group<1>();
    if (kWgmma) fence_proxy_async();  // Q came through cp.async, wgmma reads it
    sync_all();
    if (s == 0) stamp(p, 1);
    if (!(p.debug_flags & kDebugNoStore)) dequantize(smem, slot);
    if (kWgmma) fence_proxy_async();
    sync_all();  // B2: K ready
    if (s == 0) stamp(p, 2);

    if (kWgmma) {
      // The raw slot is consumed: the gathers of tile s + 2 can start now.
      if (s + 2 < n) issue_gather(p, pending, smem, slot, (tile + 2) & 3);
      cp_async_commit();
      if (s + 3 < n) pending = fetch_ref(p, gw, tile + 3, tid >> 2);
    }

    float s_[4][4];  // S for rows r0, r0 + 8 x the 4 n8 tiles of this thread's entry half
    if (compute) {
      if constexpr (kWgmma) {
        // Two independent accumulation chains (even and odd k-steps) halve
        // the dependent wgmma sequence; they are added at the end.
        float sf[16], sg[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) sf[i] = sg[i] = 0.0f;  // overwritten (scale-d 0) by each chain's first step
        const uint64_t da = sw128_desc(sbase + kOffQ, 16, 1024);
        const uint64_t db = sw128_desc(sbase + kOffK + 32 * wg * 128, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 32; ++ks) {  // k16 step: plane ks / 4, 32-byte column (ks % 4)
          const uint32_t o = ((ks >> 2) * kPlane + (ks & 3) * 32) >> 4;
          if (ks & 1)
            wgmma_m64n32k16(sg, da + o, db + o, ks > 1);
          else
            wgmma_m64n32k16(sf, da + o, db + o, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sf);
        fence_regs(sg);
#pragma unroll
        for (int i = 0; i < 16; ++i) sf[i] += sg[i];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s_[j][e] = sf[4 * j + e];
      } else {
        float sacc[2][4][4];
#pragma unroll
        for (int rb = 0; rb < 2; ++rb)
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[rb][j][e] = 0.0f;
#pragma unroll
        for (int kq = 0; kq < 4; ++kq) {
          const uint32_t col = kq * kPlane;
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            uint32_t a0[4], a1[4], b0[4], b1[4];
            ldsm_x4(qk_a + col + off[jj], a0);
            ldsm_x4(qk_b + col + off_k[jj], b0);
            ldsm_x4(qk_b + 16 * 128 + col + off_k[jj], b1);
            ldsm_x4(qk_a + 16 * 128 + col + off[jj], a1);
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
        // Swap halves through the raw slot just dequantized: warp kh keeps
        // row block kh and sends the other to its partner (same hbk, eb;
        // other kh). Layout [pair][receiver kh][j][lane].
        float4* sx = reinterpret_cast<float4*>(smem + kOffRaw + slot * kRawBytes) + (hbk * 2 + eb) * 2 * 4 * 32;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (kh == 0)
            sx[(1 * 4 + j) * 32 + lane] = make_float4(sacc[1][j][0], sacc[1][j][1], sacc[1][j][2], sacc[1][j][3]);
          else
            sx[(0 * 4 + j) * 32 + lane] = make_float4(sacc[0][j][0], sacc[0][j][1], sacc[0][j][2], sacc[0][j][3]);
#pragma unroll
          for (int e = 0; e < 4; ++e) s_[j][e] = kh == 0 ? sacc[0][j][e] : sacc[1][j][e];
        }
        sync_all();  // B3 (mma.sync only)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float4 v = sx[(kh * 4 + j) * 32 + lane];
          s_[j][0] += v.x;
          s_[j][1] += v.y;
          s_[j][2] += v.z;
          s_[j][3] += v.w;
        }
      }
    }

    // ---- tile row maxima (softmax role) ---------------------------------
    float mx0 = -INFINITY, mx1 = -INFINITY;
    if (compute) {
      const uint8_t* mask = smem + kOffMask + (tile & 3) * kTileEntries;
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
    }
    sync_all();  // B4: row maxima exchanged; every warp is past Q K^T (Q is free at a unit end)

    // The next unit's Q (its own group, committed before the next gathers so
    // that the B1 wait of the next tile covers it).
    if (unit_last && s + 1 < n) {
      load_q_async(p, smem, w.u + 1);
      cp_async_commit();
    }
    if (!kWgmma) {  // mma.sync: the raw slot held the S exchange until B4
      if (s + 2 < n) issue_gather(p, pending, smem, slot, (tile + 2) & 3);
      cp_async_commit();
      if (s + 3 < n) pending = fetch_ref(p, gw, tile + 3, tid >> 2);
    }

    float alpha0 = 1.0f, alpha1 = 1.0f;
    if (compute) {
      // ---- online softmax (softmax role) --------------------------------
      const float mn0 = fmaxf(m_run[0], fmaxf(mx0, mx_buf[(1 - eb) * 64 + r0]));
      const float mn1 = fmaxf(m_run[1], fmaxf(mx1, mx_buf[(1 - eb) * 64 + r0 + 8]));
      // Rows with nothing attended yet keep max -inf: use 0 as the exponent base.
      const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
      alpha0 = fast_exp2(m_run[0] - base0);
      alpha1 = fast_exp2(m_run[1] - base1);
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
      if (!kWgmma && eb == 0 && c4 == 0) {
        alpha_buf[r0] = alpha0;
        alpha_buf[r0 + 8] = alpha1;
      }
    }
    if (kWgmma) fence_proxy_async();
    sync_all();  // B5: P (and alpha) ready

    if (compute) {
      if constexpr (kWgmma) {
        // ---- O = alpha O + P V: rows r0, r0 + 8, dims [256 wg, +256) ------
        if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            acc[4 * j] *= alpha0;
            acc[4 * j + 1] *= alpha0;
            acc[4 * j + 2] *= alpha1;
            acc[4 * j + 3] *= alpha1;
          }
        }
        // A = P (K-major, one plane); B = V: entries are K (8-row groups 1024
        // bytes apart = SBO), dims are N, contiguous inside a 64-dim plane
        // with the next 64 dims one plane (LBO) further: MN-major.
        const uint64_t da = sw128_desc(sbase + kOffP, 16, 1024);
        const uint64_t db = sw128_desc(sbase + kOffK + 4 * wg * kPlane, kPlane, 1024);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) wgmma_m64n256k16_tb(acc, da + ((ks * 32) >> 4), db + ((ks * 16 * 128) >> 4));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc);
      } else {
        // ---- O = alpha O + P V (PV role: all rows, dims [64 cw, +64)) -----
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
              float* c = acc + (8 * rb + j) * 4;
              c[0] *= al[rb][0];
              c[1] *= al[rb][0];
              c[2] *= al[rb][1];
              c[3] *= al[rb][1];
            }
        }
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t pa[4][4];
#pragma unroll
          for (int rb = 0; rb < 4; ++rb) ldsm_x4(pv_a + rb * 16 * 128 + off[ks], pa[rb]);
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            uint32_t v[4];
            ldsm_x4_trans(pv_b + ks * 16 * 128 + off[jj], v);
#pragma unroll
            for (int rb = 0; rb < 4; ++rb) {
              mma_bf16(*reinterpret_cast<float(*)[4]>(acc + (8 * rb + 2 * jj) * 4), pa[rb], v[0], v[1]);
              mma_bf16(*reinterpret_cast<float(*)[4]>(acc + (8 * rb + 2 * jj + 1) * 4), pa[rb], v[2], v[3]);
            }
          }
        }
      }
    }

    if (!unit_last) continue;
    // ---- end of this CTA's part of the unit --------------------------------
    const float l0 = quad_sum(l_run[0]), l1 = quad_sum(l_run[1]);
    if (c4 == 0) {
      lp_buf[eb * 64 + r0] = l0;
      lp_buf[eb * 64 + r0 + 8] = l1;
      if (eb == 0) {
        m_buf[r0] = m_run[0];
        m_buf[r0 + 8] = m_run[1];
      }
    }
    sync_all();
    const int u = w.u, t = w.tok, hb = w.hb;
    const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
    const bool whole = w.begin() >= a && w.end() <= b;
    const int pslot = u == u0 ? 0 : 1;
    const int cta = blockIdx.x;
    // This thread's output rows and columns. wgmma: rows r0, r0 + 8 and
    // columns 256 wg + 8 j + 2 c4 (j < 32). mma.sync: rows 16 rb + 8 hf + g
    // and columns 64 cw + 8 j + 2 c4 (j < 8). Only g, c4 and the warp are
    // run-time, so every address is one base plus an immediate.
    constexpr int kRows = kWgmma ? 2 : 8, kCols = kWgmma ? 32 : 8;
    const int row_base = kWgmma ? 16 * w4 + g : g;
    const int col_base = kWgmma ? 256 * wg + 2 * c4 : 64 * cw + 2 * c4;
    const bool writes_row_stats = c4 == 0 && (kWgmma ? wg == 0 : cw == 0);
    if (whole) {
      // Through the K buffer, free now: both groups are past this tile's P V
      // (the barrier above) and the next tile's dequantization is behind B1.
      uint8_t* stage = smem + kOffK;
      const float* sk = p.sink + hb * kHeadBlock + row_base;
      float* lse = p.lse == nullptr || !writes_row_stats ? nullptr : p.lse + int64_t(t) * p.num_heads + hb * kHeadBlock + row_base;
#pragma unroll
      for (int ri = 0; ri < kRows; ++ri) {
        const int ro = kWgmma ? 8 * ri : 16 * (ri >> 1) + 8 * (ri & 1);
        if (ro + row_base >= heff) continue;
        const float m = m_buf[ro + row_base], l = lp_buf[ro + row_base] + lp_buf[64 + ro + row_base];
        // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
        const float inv = 1.0f / (l + fast_exp2(sk[ro] * kLog2e - m));
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const float* c = kWgmma ? acc + 4 * j + 2 * ri : acc + (8 * (ri >> 1) + j) * 4 + 2 * (ri & 1);
          stage_pair(stage, row_base + ro, col_base + 8 * j, pack_bf16(c[0] * inv, c[1] * inv));
        }
        if (lse != nullptr) lse[ro] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
      }
      sync_all();
      copy_out_stage(stage, p.out + (int64_t(t) * p.num_heads + hb * kHeadBlock) * 512, heff);
    } else {
      float* ob = p.partial_o + (int64_t(cta * 2 + pslot) * 64 + row_base) * 512 + col_base;
      float2* ml = writes_row_stats ? p.partial_ml + (cta * 2 + pslot) * 64 + row_base : nullptr;
#pragma unroll
      for (int ri = 0; ri < kRows; ++ri) {
        const int ro = kWgmma ? 8 * ri : 16 * (ri >> 1) + 8 * (ri & 1);
        if (ro + row_base >= heff) continue;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const float* c = kWgmma ? acc + 4 * j + 2 * ri : acc + (8 * (ri >> 1) + j) * 4 + 2 * (ri & 1);
          *reinterpret_cast<float2*>(ob + ro * 512 + 8 * j) = make_float2(c[0], c[1]);
        }
        if (ml != nullptr) ml[ro] = make_float2(m_buf[ro + row_base], lp_buf[ro + row_base] + lp_buf[64 + ro + row_base]);
      }
    }
  }
  cp_async_wait_group<0>();  // nothing may land in shared memory after we reuse it
}

}  // namespace dsv4::cuda::mla
