// C128A's main entries on clusters of kWideSplit CTAs (compressor_internal.cuh,
// compressor_cuda.cu's rule).
#include <algorithm>

#include "attn/cuda/compressor_internal.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"

namespace dsv4::cuda {
namespace {

// C128A's main entry at decode on a cluster of kWideSplit CTAs. One CTA of
// 512 threads pooling 128 rows took about 35 us (fused_bench, compressor
// c128a: 768 KB of state reads and 65,536 exp_f32 on one SM), and at a block
// end the attention waits for it. Here CTA `rank` of token t's cluster
// takes channels rank * 64 .. + 63: it stages the slice of every pooled row
// in shared memory (all loads in flight at once, the token's own row from
// the projection, while it writes that slice to the state cache), takes
// each channel's maximum in 4 parts of 32 rows (a maximum does not depend
// on its order, see below) and the weights exp(g - max) on all threads, then
// one thread per channel sums them in row order: pool_channel's operations,
// so the same bits. Rank 0 gathers the 512 channels through distributed
// shared memory and finishes the entry as the one-CTA kernel does. (With
// the own row stored before the other loads and the maximum on 2 warps it
// took 17.0 us on an H100, this way 8.3: fused_bench --stamps has the
// phases.)
constexpr int kWideCh = kKvDim / kWideSplit;      // channels a CTA
constexpr int kWideThreads = 256;                 // >= kKvDim / 4, the finishing threads
constexpr int kWideRowFloats = 2 * kWideCh;       // a staged row: a, then g + ape (then the weights)
constexpr int kWideParts = kWideThreads / kWideCh;          // threads a channel in the maximum and weights
constexpr int kWidePartRows = kMaxPooledRows / kWideParts;  // rows a part
constexpr size_t kWideSmemBytes = sizeof(float) * kMaxPooledRows * kWideRowFloats;
static_assert(kWideThreads >= kKvDim / 4 && kWideCh % 4 == 0 && kWideThreads % kWideCh == 0);
static_assert(kWideMaxSpan == kWideThreads, "a span's tokens are the list's threads");

// The maximum as pool_channel takes it: NaN never replaces m. In any order
// the result is the largest non-NaN value, except that a tie of +0 and -0
// may keep either zero, and then g - m and so every weight is the same.
__device__ __forceinline__ float max_step(float m, float g) { return m < g ? g : m; }

// The maximum and the weights of each channel of a staged slice (its rows'
// gates replaced by exp(g - max)): thread (part, c) takes channel c of rows
// part * kWidePartRows .., its gates kept in registers between the two.
// Every thread of the CTA calls it; it ends with a barrier.
template <typename Stamp>
__device__ __forceinline__ void wide_weights(float* stage, float (&mx_s)[kWideParts][kWideCh], const Stamp& stamp) {
  const float kNegInf = -__int_as_float(0x7f800000);
  const int tid = int(threadIdx.x), c = tid % kWideCh, part = tid / kWideCh;
  float* g_at = stage + part * kWidePartRows * kWideRowFloats + kWideCh + c;
  float g[kWidePartRows], m[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
#pragma unroll
  for (int u = 0; u < kWidePartRows; ++u) {
    g[u] = g_at[u * kWideRowFloats];
    m[u % 4] = max_step(m[u % 4], g[u]);
  }
  mx_s[part][c] = max_step(max_step(m[0], m[1]), max_step(m[2], m[3]));
  __syncthreads();
  stamp(3);
  float mx = kNegInf;
#pragma unroll
  for (int k = 0; k < kWideParts; ++k) mx = max_step(mx, mx_s[k][c]);
#pragma unroll
  for (int u = 0; u < kWidePartRows; ++u) g_at[u * kWideRowFloats] = pool::exp_f32(pool::fsub(g[u], mx));
  __syncthreads();
  stamp(4);
}

// pool_channel's sums of the slice's channels, in row order, into rank 0's
// v_s (threads 0 .. kWideCh - 1; the cluster's CTAs must have started).
__device__ __forceinline__ void wide_sums_to_rank0(const float* stage, float* v_s, int c0) {
  const int tid = int(threadIdx.x);
  if (tid >= kWideCh) return;
  float den = 0.0f, num = 0.0f;
#pragma unroll 16
  for (int i = 0; i < kMaxPooledRows; ++i) {
    const float w = stage[i * kWideRowFloats + kWideCh + tid];
    den = pool::fadd(den, w);
    num = pool::fadd(num, pool::fmul(w, stage[i * kWideRowFloats + tid]));
  }
  st_cluster_f32(map_to_cta(smem_u32(&v_s[c0 + tid]), 0), pool::fdiv(num, den));
}

// Entry e's pooled rows, channels c0 .. c0 + kWideCh - 1 of a and of g, into
// the stage (all loads in flight before any store): rows_s[i] a state row,
// or with apes_s[i] a projection row whose gates get the ape row added. An
// absent row is staged as a = 0, g = -inf (see rows_entries_wide_kernel).
__device__ __forceinline__ void stage_slices(const CompressorParams& p, const EntryPlan& e,
                                             const float* const* rows_s, const float* const* apes_s, float* stage,
                                             int c0) {
  constexpr int kQuads = kWideRowFloats / 4, kPer = kMaxPooledRows * kQuads / kWideThreads;
  const float kNegInf = -__int_as_float(0x7f800000);
  const int tid = int(threadIdx.x), q = tid % kQuads, half = q / (kWideCh / 4), col = c0 + 4 * (q % (kWideCh / 4));
  float4 v[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = tid / kQuads + u * (kWideThreads / kQuads);
    const float* r = i < e.n ? rows_s[i] : nullptr;
    if (r == nullptr) {
      v[u] = half ? make_float4(kNegInf, kNegInf, kNegInf, kNegInf) : make_float4(0.f, 0.f, 0.f, 0.f);
      continue;
    }
    v[u] = *reinterpret_cast<const float4*>(r + half * p.kc() + col);
    const float* ape = apes_s[i];
    if (half && ape) {
      const float4 a4 = __ldg(reinterpret_cast<const float4*>(ape + col));
      v[u] = add_rn(v[u], a4);
    }
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u)
    reinterpret_cast<float4*>(stage + (tid / kQuads + u * (kWideThreads / kQuads)) * kWideRowFloats)[q] = v[u];
}

// The cluster kernels' diagnostics (set_compressor_wide_stamps): with kOn,
// thread 0 of each CTA writes %globaltimer at a point to
// at[blockIdx.x * kWideStampCount + point]; without, nothing.
template <bool kOn>
struct CtaStamps {
  unsigned long long* at;
  __device__ __forceinline__ void operator()(int point) const {
    if constexpr (kOn)
      if (threadIdx.x == 0) at[size_t(blockIdx.x) * kWideStampCount + point] = global_timer_ns();
  }
};

// kStamps: the diagnostics instantiation (set_compressor_wide_stamps).
template <bool kStamps>
__global__ void __launch_bounds__(kWideThreads)
    rows_entries_wide_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args,
                             unsigned long long* stamps) {
  const CtaStamps<kStamps> stamp{stamps};
  stamp(0);
  extern __shared__ __align__(16) float stage[];  // [row][kWideRowFloats]
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ __align__(16) float v_s[kKvDim];  // rank 0: the pooled channels of every CTA
  __shared__ float mx_s[kWideParts][kWideCh];
  const int tid = int(threadIdx.x), rank = int(blockIdx.x) % kWideSplit, t = int(blockIdx.x) / kWideSplit;
  const int c0 = rank * kWideCh;  // this CTA's first channel
  float* own = state_row(p, __ldg(p.row_slot + t));  // metadata: before the wait
  const float* ape = ape_row(p, t);
  // rank 0 finishes (its factors). The own row, at t's position, is staged
  // from the projection (its slot in rows_s not read).
  const EntryPlan e = plan_entry(p, args.rope.inv_freq, t, tid, kWideThreads, rows_s, nullptr, rank == 0 ? kKvDim : 0);
  const int64_t own_i = __ldg(p.positions + t) - e.first;  // the own row's place in the window
  __syncthreads();  // rows_s
  pdl_start();      // pdl.cuh: launched with pdl_launch_clustered
  stamp(1);
  // The own row's slice goes to the state cache from the stage's registers
  // below where the window holds it (always, with consistent metadata);
  // otherwise here, as the one-CTA kernel writes it.
  const bool own_staged = e.page && own_i >= 0 && own_i < e.n;
  if (own && !own_staged) write_row(p, t, ape, own, nullptr, kWideThreads, c0 / 4, (c0 + kWideCh) / 4);
  const int mine = own_staged ? int(own_i) : -1;  // the staged row that is t's
  if (!e.page) return;  // the same for the whole cluster
  cluster_arrive_relaxed();  // this CTA has started: rank 0 waits for all before its v_s is written
  // Every pooled row's slice into the stage, all loads in flight before any
  // store. A thread's column is the same in every row: quad q of [a | g].
  // The own row comes from the projection (write_row's values: a, and g +
  // ape), not from the state row it writes; an absent row is staged as
  // a = 0, g = -inf, which leaves the maximum alone and gets the weight
  // exp(-inf) = 0, and adding its zeros to the sums is exact (they never
  // hold -0), so the sums skip nothing, as pool_channel skips it.
  constexpr int kQuads = kWideRowFloats / 4, kPer = kMaxPooledRows * kQuads / kWideThreads;
  static_assert(kMaxPooledRows * kQuads % kWideThreads == 0 && kWideThreads % kQuads == 0);
  const float kNegInf = -__int_as_float(0x7f800000);
  const int q = tid % kQuads, half = q / (kWideCh / 4), col = c0 + 4 * (q % (kWideCh / 4));
  const float* x = p.proj + int64_t(t) * p.proj_ld + (half ? p.g_col() : p.a_col) + col;
  const float4 ape4 = half ? __ldg(reinterpret_cast<const float4*>(ape + col)) : make_float4(0.f, 0.f, 0.f, 0.f);
  float4 v[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = tid / kQuads + u * (kWideThreads / kQuads);
    const float* r = i < e.n ? rows_s[i] : nullptr;
    if (i == mine)
      v[u] = *reinterpret_cast<const float4*>(x);
    else if (r == nullptr)
      v[u] = half ? make_float4(kNegInf, kNegInf, kNegInf, kNegInf) : make_float4(0.f, 0.f, 0.f, 0.f);
    else
      v[u] = *reinterpret_cast<const float4*>(r + half * p.kc() + col);
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = tid / kQuads + u * (kWideThreads / kQuads);
    if (i == mine) {
      if (half) v[u] = add_rn(v[u], ape4);
      if (own) reinterpret_cast<float4*>(own + half * p.kc() + col)[0] = v[u];
    }
    reinterpret_cast<float4*>(stage + i * kWideRowFloats)[q] = v[u];
  }
  __syncthreads();
  stamp(2);
  wide_weights(stage, mx_s, stamp);
  cluster_wait();  // every CTA of the cluster has started
  stamp(5);
  wide_sums_to_rank0(stage, v_s, c0);
  stamp(6);
  cluster_sync();  // rank 0's v_s is whole (release / acquire at cluster scope)
  stamp(7);
  if (rank == 0) finish_entry<kKvDim>(p, args, e, e.cs, v_s);
  stamp(8);
}

// C128A's main entries of a kRuns step (a prefill chunk: 64 entries in
// 8,192 tokens, each 128 rows of 512 channels, which one CTA pools in about
// 35 us) on clusters as the decode kernel's: cluster b writes the rows of
// tokens [span b, span (b + 1)) (CTA `rank` channels rank * 64 .. + 63 of
// each), then pools the entries they complete one after another, in token
// order (every CTA of the cluster builds the same list), each row of this
// step from the projection (step_row). kStamps: the diagnostics
// instantiation (set_compressor_wide_stamps; kSpanWideStampNames).
template <bool kStamps>
__global__ void __launch_bounds__(kWideThreads)
    span_wide_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args, int span,
                     unsigned long long* stamps) {
  const CtaStamps<kStamps> stamp{stamps};
  stamp(0);
  extern __shared__ __align__(16) float stage[];  // [row][kWideRowFloats]
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ const float* apes_s[kMaxPooledRows];
  __shared__ float* dst_s[kWideThreads];  // the span's state rows (span <= kWideThreads)
  __shared__ const float* tape_s[kWideThreads];
  __shared__ int list_s[kWideThreads];  // the span's tokens that complete an entry, in order
  __shared__ __align__(16) float v_s[kKvDim];
  __shared__ float mx_s[kWideParts][kWideCh];
  const int tid = int(threadIdx.x), rank = int(blockIdx.x) % kWideSplit;
  const int t0 = int(blockIdx.x) / kWideSplit * span, n = min(span, p.num_tokens - t0), c0 = rank * kWideCh;
  // The metadata, before the wait: rows, the list (the same on every CTA of
  // the cluster), the first entry's plan.
  if (tid < n) {
    dst_s[tid] = state_row(p, __ldg(p.row_slot + t0 + tid));
    tape_s[tid] = ape_row(p, t0 + tid);
  }
  const int count = span_entry_list<kWideThreads>(p, t0, n, list_s);  // its barrier: dst_s, tape_s
  EntryPlan e;
  const int finish_dim = rank == 0 ? kKvDim : 0;  // rank 0 finishes
  if (count > 0)
    e = plan_entry(p, args.rope.inv_freq, list_s[0], tid, kWideThreads, rows_s, nullptr, finish_dim, apes_s);
  __syncthreads();  // rows_s, apes_s
  pdl_start();      // pdl.cuh: launched with pdl_launch_clustered
  stamp(1);
  write_span_rows<kWideThreads, 4>(p, tid, t0, n, dst_s, tape_s, c0 / 4, kWideCh / 4);
  stamp(2);
  if (count == 0) {
    stamp(8);
    return;  // the same for the whole cluster
  }
  cluster_arrive_relaxed();  // this CTA has started: rank 0 waits for all before its v_s is written
  for (int k = 0; k < count; ++k) {
    if (k > 0) {
      cluster_sync();  // the last entry is done on every CTA: stage, rows_s and rank 0's v_s are free
      e = plan_entry(p, args.rope.inv_freq, list_s[k], tid, kWideThreads, rows_s, nullptr, finish_dim, apes_s);
      __syncthreads();
    }
    stage_slices(p, e, rows_s, apes_s, stage, c0);
    __syncthreads();
    if (k == 0) stamp(3);
    wide_weights(stage, mx_s, [&](int at) { if (k == 0 && at == 4) stamp(4); });
    if (k == 0) cluster_wait();  // every CTA of the cluster has started
    if (k == 0) stamp(5);
    wide_sums_to_rank0(stage, v_s, c0);
    if (k == 0) stamp(6);
    cluster_sync();  // rank 0's v_s is whole (release / acquire at cluster scope)
    if (k == 0) stamp(7);
    if (rank == 0) finish_entry<kKvDim>(p, args, e, e.cs, v_s);
  }
  stamp(8);
}

unsigned long long* g_wide_stamps = nullptr;  // set_compressor_wide_stamps

}  // namespace

void launch_wide(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  DSV4_REQUIRE(p.num_tokens <= (int64_t(1) << 31) / kWideSplit - 1,
               "compressor (cuda): too many one-token runs for one launch of the cluster kernel");
  static const cudaError_t raised[2] = {
      cudaFuncSetAttribute(rows_entries_wide_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kWideSmemBytes)),
      cudaFuncSetAttribute(rows_entries_wide_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kWideSmemBytes))};
  cuda_check(raised[0], "compressor (cuda): the wide entries kernel's shared memory");
  cuda_check(raised[1], "compressor (cuda): the wide entries kernel's shared memory (stamped)");
  pdl_launch_clustered(g_wide_stamps ? rows_entries_wide_kernel<true> : rows_entries_wide_kernel<false>,
                       dim3(unsigned(p.num_tokens) * kWideSplit), dim3(kWideThreads), kWideSmemBytes, stream,
                       dim3(kWideSplit), p, args, g_wide_stamps);
}

namespace {

// Raises both span_wide_kernel instantiations' dynamic shared-memory limit
// (once a process) for the launcher and the occupancy query alike.
void raise_span_wide_smem() {
  static const cudaError_t raised[2] = {
      cudaFuncSetAttribute(span_wide_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWideSmemBytes)),
      cudaFuncSetAttribute(span_wide_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWideSmemBytes))};
  cuda_check(raised[0], "compressor (cuda): the span cluster kernel's shared memory");
  cuda_check(raised[1], "compressor (cuda): the span cluster kernel's shared memory (stamped)");
}

}  // namespace

int span_wide_resident_clusters() {
  static const int clusters = [] {
    raise_span_wide_smem();
    int n = 0;
    cuda_check(max_active_clusters(span_wide_kernel<false>, dim3(kWideSplit), kWideThreads, kWideSmemBytes, &n),
               "compressor (cuda): the span cluster kernel's resident clusters");
    return n;
  }();
  return clusters;
}

// span_wide_kernel over spans of `span` tokens.
void launch_span_wide(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream, int span) {
  raise_span_wide_smem();
  span = std::min(kWideMaxSpan, span);
  pdl_launch_clustered(g_wide_stamps ? span_wide_kernel<true> : span_wide_kernel<false>,
                       dim3(unsigned((p.num_tokens + span - 1) / span) * kWideSplit), dim3(kWideThreads),
                       kWideSmemBytes, stream, dim3(kWideSplit), p, args, span, g_wide_stamps);
}

void set_compressor_wide_stamps(unsigned long long* stamps) { g_wide_stamps = stamps; }

}  // namespace dsv4::cuda
