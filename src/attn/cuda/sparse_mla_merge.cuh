#pragma once
// The fused combine of the sparse-attention kernel: participants of a unit
// that CTA-range boundaries cut merge their fp32 partials at the end of the
// kernel. Included by sparse_mla_kernel.cu only.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda::mla {

// ----------------------------------------------------------------------------
// Fused combine. The participants of split unit u are CTAs c_first..c_last;
// the unit's 64 x 512 outputs are cut into n = c_last - c_first + 1 shares and
// each participant merges one. A participant that finished its own work waits
// (bounded) for all partials; the participant whose arrival completed the set
// merges every share that nobody claimed, so the result never depends on CTAs
// being co-resident. Claims are atomicMax on a per-partial flag with the
// call's round number, so counters need no reset between calls of one plan.
// ----------------------------------------------------------------------------
__device__ __noinline__ void merge_share(const AttnParams& p, uint8_t* smem, int u, int k, int n_part, int c_first,
                                         int first_slot) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t = u / p.head_blocks, hb = u - t * p.head_blocks;
  const int heff = min(kHeadBlock, p.num_heads - hb * kHeadBlock);
  const int n4 = heff * 128;  // float4 per unit
  const int lo = k * n4 / n_part, hi = (k + 1) * n4 / n_part;
  if (lo >= hi) return;
  const int h_lo = lo >> 7, nh = ((hi - 1) >> 7) - h_lo + 1;
  // Scratch (all tile buffers are free by now): one weighted float4 per
  // (row chunk, partial) pair, then m, l and the weights per (head, partial).
  const int items = hi - lo, pairs = items * n_part;
  float4* pair_buf = reinterpret_cast<float4*>(smem);
  float* mm = reinterpret_cast<float*>(pair_buf + pairs);
  float* ll = mm + nh * n_part;
  float* wt = ll + nh * n_part;
  auto partial_index = [&](int i) { return (c_first + i) * 2 + (i == 0 ? first_slot : 0); };

  for (int idx = tid; idx < nh * n_part; idx += kThreads) {
    const int hl = idx / n_part, i = idx - hl * n_part;
    const float2 v = __ldcg(p.partial_ml + partial_index(i) * 64 + h_lo + hl);
    mm[idx] = v.x;
    ll[idx] = v.y;
  }
  sync_all();
  for (int hl = warp; hl < nh; hl += kThreads / 32) {
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
  sync_all();
  // Gather, partial-major: thread t takes the flat indices t + 256 k of
  // (partial i, item j), tracked incrementally (no division per element), 16
  // independent L2 loads in flight (the partials were written by other SMs:
  // .cg loads, never a stale L1 line).
  constexpr int kBatch = 16;
  const int step_i = kThreads / items, step_j = kThreads - step_i * items;
  int i = tid / items, j = tid - (tid / items) * items;
  for (int f0 = tid; f0 < pairs; f0 += kBatch * kThreads) {
    float4 v[kBatch];
    int ib[kBatch], jb[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      ib[q] = i;
      jb[q] = j;
      if (f0 + q * kThreads < pairs) {
        const int f = lo + j;
        v[q] = __ldcg(reinterpret_cast<const float4*>(p.partial_o + (int64_t(partial_index(i)) * 64 + (f >> 7)) * 512) +
                      (f & 127));
      }
      j += step_j;
      i += step_i;
      if (j >= items) {
        j -= items;
        ++i;
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      if (f0 + q * kThreads < pairs) {
        const float wq = wt[(((lo + jb[q]) >> 7) - h_lo) * n_part + ib[q]];
        pair_buf[jb[q] * n_part + ib[q]] = make_float4(wq * v[q].x, wq * v[q].y, wq * v[q].z, wq * v[q].w);
      }
    }
  }
  sync_all();
  // Sum over partials in a fixed order: the result does not depend on who merges.
  for (int j = tid; j < items; j += kThreads) {
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
  sync_all();  // scratch reuse by the next share
}

__device__ __noinline__ void merge_phase(const AttnParams& p, uint8_t* smem, int per) {
  const MergeSlot* merge = reinterpret_cast<const MergeSlot*>(smem + kOffMisc);
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
    auto claim_of = [&](int k) { return p.plan.claim + 2 * (c_first + k) + (k == 0 ? first_slot : 0); };
    if (threadIdx.x == 0) {
      bool ready = last;
      if (!ready) {
        const uint32_t* counter = p.plan.arrive + 2 * c_first + first_slot;
        const uint32_t target = (round + 1) * uint32_t(n_part);
        const uint64_t t0 = global_timer_ns();
        while (!(ready = ld_acquire_gpu(counter) >= target) && global_timer_ns() - t0 < kSpinTimeoutNs) __nanosleep(64);
        fence_acq_rel_gpu();
      }
      // Our own share first.
      *flag = ready ? (atomicMax(claim_of(cta - c_first), round + 1) < round + 1 ? 1 : 0) : -1;
    }
    sync_all();
    const int mine = *flag;
    sync_all();
    if (mine < 0) continue;  // timed out: the last arrival merges our share
    if (mine) merge_share(p, smem, u, cta - c_first, n_part, c_first, first_slot);
    if (!last) continue;
    // The last arrival makes sure that every share gets merged: each thread
    // watches one share until its owner claims it (owners claim right after
    // their own compute, about when we get here), bounded; shares still
    // unclaimed then (an owner not resident yet) are taken over.
    int* count = reinterpret_cast<int*>(smem + kOffMisc + 48);
    int* shares = reinterpret_cast<int*>(smem + kOffP);  // past the merge scratch
    for (int k0 = 0; k0 < n_part; k0 += kThreads) {
      if (threadIdx.x == 0) *count = 0;
      sync_all();
      const int k = k0 + threadIdx.x;
      if (k < n_part && k != cta - c_first) {
        const uint64_t t0 = global_timer_ns();
        while (ld_acquire_gpu(claim_of(k)) < round + 1 && global_timer_ns() - t0 < kSpinTimeoutNs) __nanosleep(128);
        if (atomicMax(claim_of(k), round + 1) < round + 1) shares[atomicAdd(count, 1)] = k;
      }
      sync_all();
      const int taken = *count;
      for (int i = 0; i < taken; ++i) merge_share(p, smem, u, shares[i], n_part, c_first, first_slot);
      sync_all();
    }
  }
}

}  // namespace dsv4::cuda::mla
