// The combine of split units: a unit cut by CTA-range boundaries (see
// sparse_mla_internal.cuh) left one fp32 partial {O_i, m_i, l_i} per
// participating CTA, with O_i and l_i relative to 2^m_i (log2 units). Per head
// row the combine forms M = max m_i, w_i = 2^(m_i - M), L = sum w_i l_i and
//   o = sum w_i O_i / (L + 2^(sink log2 e - M)),   lse = M ln 2 + ln L,
// in one pass over the partials (rescaling the running sums when the maximum
// grows, as the attention kernel does over tiles) in a fixed order, so the
// result does not depend on timing (SPEC §4.6). With an output rotation
// (AttnParams::rope_cs) the rotary dims of o are rotated after the
// bf16 rounding, as out_rope.cu would do after this kernel.
//
// One to eight threads merge one float4 of one head row of one split unit
// (each thread at most about 8 of its partials, loaded together), so the work
// spreads over the whole GPU whether there are many split units with few
// partials each (large batches) or one unit with many (batch 1, long rows;
// the plan caps the partials per unit at kMaxPartials). It is launched with programmatic
// dependent launch right behind the attention kernel, so its CTAs are set up
// and find their first item in the plan while that kernel runs (on rows of
// more than 1,024 entries; on shorter ones the attention kernel lets it start
// only as its CTAs finish: AttnParams::late_trigger); they wait
// for it (always: completing this grid must mean the attention kernel
// completed too) and exit at once when the plan listed no split unit.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda {
namespace {

using namespace mla;

constexpr int kCombineThreads = 256;
constexpr int kCombineCtasPerSm = 8;

// The running merge state of some partials of one float4 of a row: o and l
// relative to 2^m.
struct MergeState {
  float m = -INFINITY, l = 0.0f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);

  // Adds a state {m2, l2, o2}, rescaling whichever has the smaller maximum.
  __device__ __forceinline__ void add(float m2, float l2, float4 o2) {
    const float mn = fmaxf(m, m2);
    const float base = mn == -INFINITY ? 0.0f : mn;  // nothing attended so far: every weight is 0
    const float a = fast_exp2(m - base), w = fast_exp2(m2 - base);
    l = l * a + l2 * w;
    o = make_float4(o.x * a + w * o2.x, o.y * a + w * o2.y, o.z * a + w * o2.z, o.w * a + w * o2.w);
    m = mn;
  }
};

// One item of the merge: a float4 of a head row of a split unit, its token,
// head block and partial slots. From the plan alone, so the thread's first
// item is found before the kernel's wait.
struct CombineItem {
  int h, f, t, hb, r, lane, n_part, first_partial, first_slot;
  bool padded;  // a padded head: no output (whole warps)

  // The partial slot of the unit's i-th partial: work slot s's CTA for head
  // block r is s * cluster + r, and the first slot's partial is its slot 1
  // when the unit starts inside that slot's range.
  __device__ __forceinline__ int partial(int i, int cluster) const {
    return ((first_partial + i) * cluster + r) * 2 + (i == 0 ? first_slot : 0);
  }
  // Where this item's float4 of partial i is.
  __device__ __forceinline__ const float* o_of(const AttnParams& p, int i) const {
    return p.partial_o + (int64_t(partial(i, p.cluster)) * 64 + h) * 512 + 4 * f;
  }
};

__device__ __forceinline__ CombineItem combine_item(const AttnParams& p, int idx, int lg, int per) {
  constexpr int kRowF4 = 128;  // float4 per 512-dim row
  CombineItem c;
  const int item = idx >> lg;
  c.lane = idx & ((1 << lg) - 1);
  c.h = (item / kRowF4) % kHeadBlock, c.f = item % kRowF4;
  const int ku = item / (kHeadBlock * kRowF4), k = ku >> (p.cluster - 1);  // cluster: 1 or 2
  c.r = ku & (p.cluster - 1);
  const int u = __ldg(p.plan.split_units + k);
  c.t = u / p.plan_head_blocks, c.hb = (u - c.t * p.plan_head_blocks) * p.cluster + c.r;
  c.padded = c.h >= min(kHeadBlock, p.num_heads - c.hb * kHeadBlock);
  const int start = __ldg(&p.plan.unit_info[u]).x, end = __ldg(&p.plan.unit_info[u + 1]).x;
  const int c_first = start / per;
  c.n_part = (end - 1) / per - c_first + 1;
  c.first_partial = c_first;
  c.first_slot = c_first * per >= start ? 0 : 1;  // the first slot's partial is its partial slot 1 when the unit starts inside its range
  return c;
}

// Merges item c's partials and writes its output (lane 0 of its lanes).
__device__ __forceinline__ void combine_one(const AttnParams& p, const CombineItem& c, int lg) {
  constexpr int kRopeF4 = 448 / 4;  // the first float4 of the rotary dims
  // The output rotation's factors (pairs 2(f - kRopeF4), +1), loaded
  // before the partials so that the two loads overlap.
  float4 cs = make_float4(1.0f, 0.0f, 1.0f, 0.0f);
  const bool rotate = p.rope_cs != nullptr && c.f >= kRopeF4 && c.lane == 0;
  if (rotate) cs = __ldg(reinterpret_cast<const float4*>(p.rope_cs + int64_t(c.t) * 32 + 2 * (c.f - kRopeF4)));
  // This lane's partials lane, lane + 2^lg, ... in order, rescaling as the
  // maximum grows (the loads do not depend on the running state, so they
  // are all in flight together); then the lanes' states merge in a fixed
  // tree. Fixed orders: the result does not depend on timing. The row's
  // statistics are read by all its threads alike: cached loads.
  MergeState st;
#pragma unroll 8
  for (int i = c.lane; i < c.n_part; i += 1 << lg) {
    const float2 ml = __ldg(p.partial_ml + c.partial(i, p.cluster) * 64 + c.h);
    const float4 v = __ldcg(reinterpret_cast<const float4*>(c.o_of(p, i)));
    st.add(ml.x, ml.y, v);
  }
  for (int d = 1; d < (1 << lg); d <<= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, st.m, d), l2 = __shfl_xor_sync(0xffffffffu, st.l, d);
    const float4 o2 = make_float4(__shfl_xor_sync(0xffffffffu, st.o.x, d), __shfl_xor_sync(0xffffffffu, st.o.y, d),
                                  __shfl_xor_sync(0xffffffffu, st.o.z, d), __shfl_xor_sync(0xffffffffu, st.o.w, d));
    st.add(m2, l2, o2);
  }
  if (c.lane != 0) return;
  // m = -inf: exp2(+inf) = inf, inv = 0, o = 0.
  const float inv = 1.0f / (st.l + fast_exp2(p.sink[c.hb * kHeadBlock + c.h] * kLog2e - st.m));
  const int64_t row = int64_t(c.t) * p.num_heads + c.hb * kHeadBlock + c.h;
  uint2 w = make_uint2(pack_bf16(st.o.x * inv, st.o.y * inv), pack_bf16(st.o.z * inv, st.o.w * inv));
  if (rotate) w = make_uint2(rope_rotate_bf16x2(w.x, make_float2(cs.x, cs.y)), rope_rotate_bf16x2(w.y, make_float2(cs.z, cs.w)));
  *reinterpret_cast<uint2*>(p.out + row * 512 + 4 * c.f) = w;
  if (c.f == 0 && p.lse != nullptr) p.lse[row] = st.l > 0.0f ? st.m * kLn2 + logf(st.l) : -INFINITY;
}

// Drops the partial lines item c merged from L2, so that they are never
// written back to DRAM: a C128A layer at batch 1 and 1M context leaves 5.6
// MB of them, whose write-back lands in the next kernels' streams (BV1,
// H100: the 1 x 1M step 4.44-4.46 -> 4.32-4.36 ms, 8 x 1M 7.84 -> 7.68;
// 8-32 requests 3-5% faster in BV4-BV6). The thread of a line's first
// float4 (f % 8 == 0) drops that line of each partial it merged. The line's
// other seven float4 are items of the same CTA (its items are 256 >> lg
// consecutive float4 of one or two head rows), whose loads all precede the
// caller's barrier.
__device__ __forceinline__ void discard_partials(const AttnParams& p, const CombineItem& c, int lg) {
  if (c.padded || (c.f & 7) != 0) return;
  for (int i = c.lane; i < c.n_part; i += 1 << lg) discard_l2_line(c.o_of(p, i));
}

__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const __grid_constant__ AttnParams p) {
  launch_dependents();  // the next call's attention kernel may set up its CTAs meanwhile
  // The plan before the wait: its kernel lets nothing start before it ends
  // (sparse_mla_plan.cu). So the chain of loads that finds a thread's first
  // item (count, unit, unit records) overlaps the attention kernel, and only
  // the partials' loads follow the wait.
  const int count = __ldg(&p.plan.split_count[0]);
  const int per = __ldg(&p.plan.cta_work[0]).w;
  // 2^lg lanes per float4, so that no lane merges more than about 8 partials:
  // each lane's loads are then in flight together (one L2 round trip), where
  // one lane per float4 of a 44-partial row (batch 1, long rows) waited for 6.
  const int max_parts = __ldg(&p.plan.split_count[1]);
  const int lg = max_parts > 32 ? 3 : max_parts > 16 ? 2 : max_parts > 8 ? 1 : 0;
  // A multiple of 32, as is the grid stride: every lane of a warp runs the
  // same iterations, and a warp's items lie in one head row (the shuffles
  // below need the whole warp).
  // Items: (split unit, head block of the unit's cluster, head, float4).
  const int threads = (count * p.cluster * kHeadBlock * 128) << lg;
  int idx = blockIdx.x * kCombineThreads + threadIdx.x;
  CombineItem c{};
  if (idx < threads) c = combine_item(p, idx, lg, per);
  // Always wait, even with nothing to merge: this grid's completion must
  // imply the attention kernel's, for whatever follows in the stream.
  wait_for_prior_grids();
  for (bool first = true; idx < threads; idx += gridDim.x * kCombineThreads, first = false) {
    if (!first) c = combine_item(p, idx, lg, per);
    if (!c.padded) combine_one(p, c, lg);
    __syncthreads();  // the CTA's threads run the same trips: threads is a multiple of 8,192
    discard_partials(p, c, lg);
  }
}

}  // namespace

void launch_combine(const AttnParams& p, cudaStream_t stream) {
  pdl_launch(combine_kernel, dim3(kCombineCtasPerSm * p.grid), dim3(kCombineThreads), 0, stream, p);
}

}  // namespace dsv4::cuda
