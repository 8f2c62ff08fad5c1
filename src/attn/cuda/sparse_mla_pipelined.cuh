#pragma once
// The tile loop of kernel variant 2 (pipelined wgmma): double-buffered K,
// gathers staged in registers, dequantization of the next tile overlapping
// the asynchronous S = Q K^T. Included by sparse_mla_kernel.cu only.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla {

// ----------------------------------------------------------------------------
// Variant 2, pipelined (the default). Same roles as the wgmma path above, but
// K is double-buffered (the second buffer takes the raw slots' space) and the
// gathers are staged in registers: thread t holds the 9 chunks of entry t / 4
// that it will dequantize (chunks t % 4 + 4 j) plus the entry's scale bytes.
// Per tile s:
//   issue S = Q K_s^T (async)  |  dequantize tile s + 1 from registers into
//                              |  the other K buffer, load tile s + 2
//   wait S; row maxima (barrier); softmax, P (barrier)
//   O += P V_s (wgmma); end-of-tile barrier: K_s free, K_{s+1} ready.
// ----------------------------------------------------------------------------
struct Staged {
  uint4 d[9];
  uint2 sc;
  const uint8_t* data;  // null: nothing to read (empty or out-of-range slot)
};

__device__ __forceinline__ void stage_load(const AttnParams& p, EntryRef r, Staged& st) {
  st.data = nullptr;
  if (r.list >= 0 && r.slot >= 0) {
    const CacheView& c = r.list == 0 ? p.swa_cache : p.extra_cache;
    if (int64_t(r.slot) < c.capacity) {
      const uint32_t page = uint32_t(r.slot) / c.entries_per_page;
      const uint32_t off = uint32_t(r.slot) - page * c.entries_per_page;
      const uint8_t* base = c.base + int64_t(page) * c.page_stride;  // 64-bit: pages * stride passes 2^31
      st.data = base + size_t(576) * off;
      if (!(p.debug_flags & kDebugNoLoads)) {
        const int q = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < 9; ++j) st.d[j] = ldg_stream_16(st.data + 16 * (q + 4 * j));
        st.sc = ldg_stream_8(base + size_t(576) * c.entries_per_page + size_t(8) * off);
      }
    }
  }
}

__device__ __noinline__ void patch_nan_codes_global(const uint8_t* data, uint8_t* kbuf, int e, int k) {
  for (int byte = 0; byte < 16; ++byte) {
    if ((data[16 * k + byte] & 0x7f) == 0x7f) {
      const int dim = 16 * k + byte;
      *reinterpret_cast<uint16_t*>(kbuf + chunk_off(e, dim >> 3) + 2 * (dim & 7)) = 0x7fc0;
    }
  }
}

__device__ __forceinline__ void stage_store(const Staged& st, uint8_t* kbuf, uint8_t* mask) {
  const int e = threadIdx.x >> 2, q = threadIdx.x & 3;
  const bool valid = st.data != nullptr;
  if (q == 0) mask[e] = valid ? 1 : 0;
#pragma unroll
  for (int j = 0; j < 7; ++j) {
    const int k = q + 4 * j;  // fp8 chunk: dims 16 k .. 16 k + 15 = K chunks 2 k, 2 k + 1
    uint32_t o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t nan = 0;
    if (valid) {
      const uint32_t w[4] = {st.d[j].x, st.d[j].y, st.d[j].z, st.d[j].w};
      const uint32_t sb = (j < 4 ? st.sc.x >> (8 * j) : st.sc.y >> (8 * (j - 4))) & 0xffu;
      const ScaleFactors f = scale_factors(sb);
      if (sb <= 134u)
        dequant_chunk<false>(w, f, o);
      else  // scales >= 2^8: never produced for real caches, exact two-step path
        dequant_chunk<true>(w, f, o);
      nan = e4m3_nan_flags(w[0]) | e4m3_nan_flags(w[1]) | e4m3_nan_flags(w[2]) | e4m3_nan_flags(w[3]);
    }
    *reinterpret_cast<uint4*>(kbuf + chunk_off(e, 2 * k)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(kbuf + chunk_off(e, 2 * k + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
    if (nan) patch_nan_codes_global(st.data, kbuf, e, k);  // NaN codes decode to NaN, as on the CPU
  }
#pragma unroll
  for (int j = 7; j < 9; ++j) {  // dims 448..511 are bf16 already: record chunk k is K chunk k + 28
    const int k = q + 4 * j;
    *reinterpret_cast<uint4*>(kbuf + chunk_off(e, k + 28)) = valid ? st.d[j] : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void attention_tiles_pipelined(const AttnParams& p, uint8_t* smem, int a, int b, int u0) {
  const int tid = threadIdx.x, lane = tid & 31, cw = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int wg = cw >> 2, w4 = cw & 3;
  const int eb = wg;           // entry half of S
  const int r0 = 16 * w4 + g;  // rows r0, r0 + 8 of S and O
  const int n = b - a;
  const uint32_t sbase = smem_u32(smem);
  constexpr int kOffK1 = kOffK + kKBytes;  // second K buffer (the raw slots' space)
  static_assert(kOffK1 + kKBytes <= kOffP, "two K buffers fit below P");
  auto kbuf_off = [&](int buf) { return buf == 0 ? kOffK : kOffK1; };

  float* mx_buf = reinterpret_cast<float*>(smem + kOffMx);
  float* lp_buf = reinterpret_cast<float*>(smem + kOffLp);
  float* m_buf = reinterpret_cast<float*>(smem + kOffM);
  MergeSlot* merge = reinterpret_cast<MergeSlot*>(smem + kOffMisc);
  const bool compute = !(p.debug_flags & kDebugNoCompute), stores = !(p.debug_flags & kDebugNoStore);

  // Prologue: tile a into K buffer 0 (exposed once), tile a + 1 in flight.
  UnitWalker gw;  // the gather cursor
  gw.start(p.plan.unit_info, u0);
  Staged st;
  stage_load(p, fetch_ref(p, gw, a, tid >> 2), st);
  load_q_async(p, smem, u0);
  cp_async_commit();
  EntryRef pending{-1, -1};
  if (n > 1) pending = fetch_ref(p, gw, a + 1, tid >> 2);
  if (stores) stage_store(st, smem + kOffK, smem + kOffMask);
  if (n > 1) stage_load(p, pending, st);
  if (n > 2) pending = fetch_ref(p, gw, a + 2, tid >> 2);
  cp_async_wait_group<0>();
  fence_proxy_async();
  sync_all();
  stamp(p, 1);

  float acc[128];  // O: acc[4 j + e], n8 tile j of the group's 256 dims
  float m_run[2], l_run[2];
  UnitWalker w;
  w.start(p.plan.unit_info, u0);

  for (int s = 0; s < n; ++s) {
    const int tile = a + s;
    if (tile >= w.end()) w.advance();
    const bool unit_first = s == 0 || tile == w.begin();
    const bool unit_last = s + 1 == n || tile + 1 == w.end();
    const int buf = s & 1;
    const uint32_t kb = sbase + kbuf_off(buf);
    if (unit_first) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.0f;
    }

    // ---- S = Q K_s^T, issued asynchronously ------------------------------
    // Two independent accumulation chains (even and odd k-steps), added
    // after the wait: half the dependent wgmma sequence.
    float sf[16], sg[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sf[i] = sg[i] = 0.0f;
    if (compute) {
      const uint64_t da = sw128_desc(sbase + kOffQ, 16, 1024);
      const uint64_t db = sw128_desc(kb + 32 * wg * 128, 16, 1024);
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
    }
    // ---- meanwhile: tile s + 1 into the other buffer, loads of tile s + 2 --
    if (s + 1 < n) {
      if (stores) stage_store(st, smem + kbuf_off(buf ^ 1), smem + kOffMask + (buf ^ 1) * kTileEntries);
      if (s + 2 < n) stage_load(p, pending, st);
      if (s + 3 < n) pending = fetch_ref(p, gw, tile + 3, tid >> 2);
      fence_proxy_async();  // the stores above are read by wgmma after the end-of-tile barrier
    }
    if (s == 0) stamp(p, 2);
    if (compute) {
      wgmma_wait<0>();
      fence_regs(sf);
      fence_regs(sg);
#pragma unroll
      for (int i = 0; i < 16; ++i) sf[i] += sg[i];
    }

    // ---- tile row maxima ----------------------------------------------------
    float s_[4][4];
    float mx0 = -INFINITY, mx1 = -INFINITY;
    if (compute) {
      const uint8_t* mask = smem + kOffMask + buf * kTileEntries;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = 32 * eb + 8 * j + 2 * c4;
        const bool v0 = mask[col] != 0, v1 = mask[col + 1] != 0;
        s_[j][0] = v0 ? sf[4 * j] * p.scale_log2 : -INFINITY;
        s_[j][1] = v1 ? sf[4 * j + 1] * p.scale_log2 : -INFINITY;
        s_[j][2] = v0 ? sf[4 * j + 2] * p.scale_log2 : -INFINITY;
        s_[j][3] = v1 ? sf[4 * j + 3] * p.scale_log2 : -INFINITY;
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
    sync_all();  // row maxima exchanged; every warp is past Q K^T (Q is free at a unit end)
    const bool next_q = unit_last && s + 1 < n;
    if (next_q) {
      load_q_async(p, smem, w.u + 1);
      cp_async_commit();
    }

    // ---- online softmax ---------------------------------------------------------
    float alpha0 = 1.0f, alpha1 = 1.0f;
    if (compute) {
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
      fence_proxy_async();
    }
    sync_all();  // P ready

    // ---- O = alpha O + P V_s: rows r0, r0 + 8, dims [256 wg, +256) ------------
    if (compute) {
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
      // bytes apart = SBO), dims are N, contiguous inside a 64-dim plane with
      // the next 64 dims one plane (LBO) further: MN-major.
      const uint64_t da = sw128_desc(sbase + kOffP, 16, 1024);
      const uint64_t db = sw128_desc(kb + 4 * wg * kPlane, kPlane, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_m64n256k16_tb(acc, da + ((ks * 32) >> 4), db + ((ks * 16 * 128) >> 4));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc);
    }

    if (unit_last) {
      // ---- end of this CTA's part of the unit ------------------------------
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
      const int u = w.u;
      const int t = u / p.head_blocks, hb = u - t * p.head_blocks;
      const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
      const bool whole = w.begin() >= a && w.end() <= b;
      const int pslot = u == u0 ? 0 : 1;
      const int cta = blockIdx.x;
      // This thread's outputs: rows r0, r0 + 8, columns 256 wg + 8 j + 2 c4.
      const int col_base = 256 * wg + 2 * c4;
      const bool writes_row_stats = c4 == 0 && wg == 0;
      if (whole) {
        uint16_t* ob = p.out + (int64_t(t) * p.num_heads + hb * kHeadBlock + r0) * 512 + col_base;
        const float* sk = p.sink + hb * kHeadBlock + r0;
        float* lse = p.lse == nullptr || !writes_row_stats ? nullptr : p.lse + int64_t(t) * p.num_heads + hb * kHeadBlock + r0;
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const int ro = 8 * ri;
          if (ro + r0 >= heff) continue;
          const float m = m_buf[ro + r0], l = lp_buf[ro + r0] + lp_buf[64 + ro + r0];
          // m = -inf (nothing attended): exp2(+inf) = inf, inv = 0, o = 0.
          const float inv = 1.0f / (l + fast_exp2(sk[ro] * kLog2e - m));
#pragma unroll
          for (int j = 0; j < 32; ++j)
            *reinterpret_cast<uint32_t*>(ob + ro * 512 + 8 * j) = pack_bf16(acc[4 * j + 2 * ri] * inv, acc[4 * j + 2 * ri + 1] * inv);
          if (lse != nullptr) lse[ro] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
        }
      } else {
        float* ob = p.partial_o + (int64_t(cta * 2 + pslot) * 64 + r0) * 512 + col_base;
        float2* ml = writes_row_stats ? p.partial_ml + (cta * 2 + pslot) * 64 + r0 : nullptr;
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const int ro = 8 * ri;
          if (ro + r0 >= heff) continue;
#pragma unroll
          for (int j = 0; j < 32; ++j)
            *reinterpret_cast<float2*>(ob + ro * 512 + 8 * j) = make_float2(acc[4 * j + 2 * ri], acc[4 * j + 2 * ri + 1]);
          if (ml != nullptr) ml[ro] = make_float2(m_buf[ro + r0], lp_buf[ro + r0] + lp_buf[64 + ro + r0]);
        }
        // All partial stores precede the barrier; thread 0's fence then
        // publishes them (cumulatively) before the arrival, the pattern of
        // cooperative groups' grid sync.
        sync_all();
        if (tid == 0) {
          const int per = __ldg(&p.plan.cta_work[cta]).w;
          const int start = w.begin(), end = w.end();
          const int c_first = start / per, n_part = (end - 1) / per - c_first + 1;
          const int first_slot = c_first * per >= start ? 0 : 1;
          fence_acq_rel_gpu();
          const uint32_t old = atomicAdd(p.plan.arrive + 2 * c_first + first_slot, 1u);
          fence_acq_rel_gpu();
          merge[pslot].unit = u;
          merge[pslot].round = old / uint32_t(n_part);
          merge[pslot].last = (old + 1) % uint32_t(n_part) == 0;
        }
      }
    }
    // End of tile: every warp is done with K_s and P, K_{s+1} is stored (and
    // fenced), the next unit's Q has landed.
    if (next_q) {
      cp_async_wait_group<0>();
      fence_proxy_async();
    }
    sync_all();
  }
}

}  // namespace dsv4::cuda::mla
