// The combine of split units: a unit cut by CTA-range boundaries (see
// sparse_mla_internal.cuh) left one fp32 partial {O_i, m_i, l_i} per
// participating CTA, with O_i and l_i relative to 2^m_i (log2 units). Per head
// row the combine forms M = max m_i, w_i = 2^(m_i - M), L = sum w_i l_i and
//   o = sum w_i O_i / (L + 2^(sink log2 e - M)),   lse = M ln 2 + ln L,
// in one pass over the partials in a fixed order (rescaling the running sums
// when the maximum grows, as the attention kernel does over tiles), so the
// result does not depend on timing (SPEC §4.6).
//
// Each thread merges one float4 of one head row of one split unit (all
// partials of that float4, loaded together), so the work spreads over the
// whole GPU whether there are many split units with few partials each (large
// batches) or one unit with many (batch 1, long rows; the plan caps the
// partials per unit at kMaxPartials). It is launched with programmatic
// dependent launch right behind the attention kernel, so its CTAs are set up
// while that kernel runs; they wait for it (always: completing this grid
// must mean the attention kernel completed too) and exit at once when the
// plan listed no split unit.
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda {
namespace {

using namespace mla;

constexpr int kCombineThreads = 256;
constexpr int kCombineCtasPerSm = 8;

__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const __grid_constant__ AttnParams p) {
  launch_dependents();  // the next call's attention kernel may set up its CTAs meanwhile
  // Always wait, even with nothing to merge: this grid's completion must
  // imply the attention kernel's, for whatever follows in the stream.
  wait_for_prior_grids();
  const int count = *p.plan.split_count;
  if (count == 0) return;
  const int per = __ldg(&p.plan.cta_work[0]).w;
  constexpr int kRowF4 = 128;  // float4 per 512-dim row
  const int items = count * kHeadBlock * kRowF4;
  for (int idx = blockIdx.x * kCombineThreads + threadIdx.x; idx < items; idx += gridDim.x * kCombineThreads) {
    const int k = idx / (kHeadBlock * kRowF4), h = (idx / kRowF4) % kHeadBlock, f = idx % kRowF4;
    const int u = __ldg(p.plan.split_units + k);
    const int t = u / p.head_blocks, hb = u - t * p.head_blocks;
    if (h >= min(kHeadBlock, p.num_heads - hb * kHeadBlock)) continue;  // padded head: no output
    const int start = __ldg(&p.plan.unit_info[u]).x, end = __ldg(&p.plan.unit_info[u + 1]).x;
    const int c_first = start / per, n_part = (end - 1) / per - c_first + 1;
    const int first_slot = c_first * per >= start ? 0 : 1;  // the first CTA's partial is its slot 1 when the unit starts inside its range
    auto partial = [&](int i) { return (c_first + i) * 2 + (i == 0 ? first_slot : 0); };
    // One pass, partials in a fixed order, rescaling as the maximum grows
    // (the loads do not depend on the running state, so they are all in
    // flight together). The row's statistics are read by its 128 threads
    // alike: cached loads.
    float m = -INFINITY, l = 0.0f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int i = 0; i < n_part; ++i) {
      const float2 ml = __ldg(p.partial_ml + partial(i) * 64 + h);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(p.partial_o + (int64_t(partial(i)) * 64 + h) * 512) + f);
      const float mn = fmaxf(m, ml.x);
      const float base = mn == -INFINITY ? 0.0f : mn;  // nothing attended so far: every weight is 0
      const float a = fast_exp2(m - base), w = fast_exp2(ml.x - base);
      l = l * a + ml.y * w;
      o = make_float4(o.x * a + w * v.x, o.y * a + w * v.y, o.z * a + w * v.z, o.w * a + w * v.w);
      m = mn;
    }
    // m = -inf: exp2(+inf) = inf, inv = 0, o = 0.
    const float inv = 1.0f / (l + fast_exp2(p.sink[hb * kHeadBlock + h] * kLog2e - m));
    const int64_t row = int64_t(t) * p.num_heads + hb * kHeadBlock + h;
    *reinterpret_cast<uint2*>(p.out + row * 512 + 4 * f) =
        make_uint2(pack_bf16(o.x * inv, o.y * inv), pack_bf16(o.z * inv, o.w * inv));
    if (f == 0 && p.lse != nullptr) p.lse[row] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
  }
}

}  // namespace

void launch_combine(const AttnParams& p, cudaStream_t stream) {
  launch_overlapped(combine_kernel, kCombineCtasPerSm * p.grid, kCombineThreads, 0, stream, p);
}

}  // namespace dsv4::cuda
