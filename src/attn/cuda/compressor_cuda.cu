// The compressor's kernels (compressor_cuda.h): here the rows, entries and
// span kernels and the rule that picks a kernel; C4A's quad kernel in
// compressor_quad.cu, C128A's cluster kernels in compressor_wide.cu, what
// they share in compressor_internal.cuh.
//  rows:    one CTA per token; float4 copies of a and of g + ape.
//  entries: CTAs of c threads, each over a span of tokens (about one wave
//           of CTAs in all), pooling the entries its tokens complete one
//           after another. Thread e pools channel e over the slot's rows (row
//           pointers looked up once in shared memory; a row of this step
//           from its projection, compressor_params.h); then c/4 threads, 4
//           consecutive channels each, finish the entry: bf16, RMSNorm (one
//           block reduction), bf16, RoPE (pairs are inside a thread), bf16,
//           Hadamard for the indexer keys (one warp: butterflies of stride
//           1 and 2 inside a thread, 4..64 across lanes), and the record
//           (kv_record.cuh).
//  rows + entries (one token per run): the entries kernel writes the token's
//           own row first and pools it from shared memory; every other row
//           of its window is from an earlier step. C128A's main entries
//           (128 rows of 512 channels) run on a cluster of 8 CTAs of 64
//           channels each instead (rows_entries_wide_kernel; in a kRuns
//           step span_wide_kernel).
//  span (a kRuns step): one kernel, CTAs over spans of tokens as the
//           entries kernel's, each writing its tokens' rows (every thread a
//           few float4 pairs in flight) and then pooling their entries, the
//           rows of this step from the projection (step_row). At m = 4 in
//           a long step the quad kernel instead: groups of c/4 threads over
//           4 tokens, thread i holding channels 4i .. 4i+3 from the pool's
//           loads to the record.
// Each kernel looks its rows, slots and pages up in the step metadata before
// it waits for the kernel before it (compressor_cuda.h says why it may); at
// decode these dependent loads were most of a 1-CTA kernel's time.
#include "attn/cuda/compressor_cuda.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "attn/cuda/compressor_internal.cuh"
#include "attn/cuda/device_info.h"
#include "attn/cuda/pdl.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kRowThreads = 128;

__global__ void __launch_bounds__(kRowThreads) state_rows_kernel(const CompressorParams p) {
  const int t = blockIdx.x;
  float* row = state_row(p, __ldg(p.row_slot + t));  // metadata: before the wait
  const float* ape = ape_row(p, t);
  pdl_start();  // pdl.cuh: launched with pdl_launch (every CTA waits, even one with nothing to do)
  if (row) write_row(p, t, ape, row, nullptr, kRowThreads);
}

// Pools and finishes entry e (rows_s, and apes_s if any, ready; CTA of kDim threads).
template <int kDim, int kBatch>
__device__ __forceinline__ void pool_and_finish(const CompressorParams& p, const EntryArgs& args, const EntryPlan& e,
                                                const float* const* rows_s, const float* const* apes_s = nullptr) {
  __shared__ __align__(16) float v_s[kDim];
  const int m = p.ratio;
  auto rows = [rows_s](int i) { return rows_s[i]; };
  auto apes = [apes_s](int i) { return apes_s ? apes_s[i] : nullptr; };
  v_s[threadIdx.x] = pool::pool_channel<kBatch>(rows, apes, e.n, e.own_from(m), m == 4 ? kDim : 0, p.kc(),
                                                int(threadIdx.x));
  __syncthreads();
  finish_entry<kDim>(p, args, e, e.cs, v_s);  // e.cs: plan_entry's factors for these dims
}

// kDim = c threads; kBatch rows loaded at a time per thread (m = 128 pools
// 128 rows: 4 batches of 32 rather than 128 dependent loads). A CTA takes
// the tokens [span * b, span * (b + 1)) and pools the entries they complete
// one after another: in a prefill chunk one token in m completes one, and
// with a CTA a token most CTAs only read metadata and left (8,192 CTAs of
// 512 threads at 8,192 tokens), while C128A's few entries started only as
// the grid reached them (fused_bench at 8,192 tokens, BK2 on an H100: C4A
// 123 -> 93 us, C128A 131 -> 59, the C4A indexer's 33.8 -> 32.5).
template <int kDim, int kBatch>
__global__ void __launch_bounds__(kDim)
    entries_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args, int span) {
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ const float* apes_s[kMaxPooledRows];
  __shared__ int list_s[kDim];  // the span's tokens that complete an entry (span <= kDim)
  // The metadata, before the wait: the list, and the first entry's plan.
  const int t0 = int(blockIdx.x) * span;
  const int count = span_entry_list<kDim>(p, t0, min(span, p.num_tokens - t0), list_s);
  EntryPlan e;
  const int tid = int(threadIdx.x);
  if (count > 0) e = plan_entry(p, args.rope.inv_freq, list_s[0], tid, kDim, rows_s, nullptr, kDim, apes_s);
  pdl_start();  // pdl.cuh: launched with pdl_launch
  for (int k = 0; k < count; ++k) {
    // rows_s, apes_s: every thread read the last entry's before pool_and_finish's barrier.
    if (k > 0) e = plan_entry(p, args.rope.inv_freq, list_s[k], tid, kDim, rows_s, nullptr, kDim, apes_s);
    __syncthreads();
    pool_and_finish<kDim, kBatch>(p, args, e, rows_s, apes_s);
  }
}

// Rows and entries in one kernel, for steps with one token per run: the
// token's own row is the only row of its window written in this step.
template <int kDim, int kBatch>
__global__ void __launch_bounds__(kDim)
    rows_entries_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args) {
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ __align__(16) float own_s[2 * 2 * kDim];  // the own row: 2 kc floats, kc <= 2 c
  const int t = blockIdx.x;
  float* own = state_row(p, __ldg(p.row_slot + t));  // metadata: before the wait
  const float* ape = ape_row(p, t);
  const EntryPlan e = plan_entry(p, args.rope.inv_freq, t, int(threadIdx.x), kDim, rows_s, own_s, kDim);
  pdl_start();  // pdl.cuh: launched with pdl_launch
  if (own || e.page) write_row(p, t, ape, own, e.page ? own_s : nullptr, kDim);
  if (!e.page) return;
  __syncthreads();  // rows_s and own_s
  pool_and_finish<kDim, kBatch>(p, args, e, rows_s);
}

// Rows and entries in one kernel for a kRuns step (compressor_cuda.h): CTA
// b writes the rows of tokens [span b, span (b + 1)) and pools the entries
// they complete, reading every pooled row of the step from the projection
// (step_row), so no CTA waits for another's rows and the rows are pooled
// while a CTA of the span or the one before has just loaded them (kAny's
// entries kernel reads them again after the rows kernel, from HBM once they
// left L2).
// (m = 4: at least 1,024 threads an SM, 64 registers a thread; m = 128's
// batches of 32 rows want more.)
template <int kDim, int kBatch>
__global__ void __launch_bounds__(kDim, kBatch <= 8 ? 1024 / kDim : 1)
    span_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args, int span) {
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ const float* apes_s[kMaxPooledRows];
  __shared__ float* dst_s[kDim];         // the span's state rows (span <= kDim)
  __shared__ const float* tape_s[kDim];  // and their ape rows
  __shared__ int list_s[kDim];           // the span's tokens that complete an entry
  // The metadata, before the wait: rows, the list, the first entry's plan.
  const int t0 = int(blockIdx.x) * span, n = min(span, p.num_tokens - t0), tid = int(threadIdx.x);
  if (tid < n) {
    dst_s[tid] = state_row(p, __ldg(p.row_slot + t0 + tid));
    tape_s[tid] = ape_row(p, t0 + tid);
  }
  const int count = span_entry_list<kDim>(p, t0, n, list_s);  // its barrier: dst_s, tape_s
  EntryPlan e;
  if (count > 0) e = plan_entry(p, args.rope.inv_freq, list_s[0], tid, kDim, rows_s, nullptr, kDim, apes_s);
  pdl_start();  // pdl.cuh: launched with pdl_launch
  write_span_rows<kDim>(p, tid, t0, n, dst_s, tape_s);
  for (int k = 0; k < count; ++k) {
    // rows_s, apes_s: every thread read the last entry's before pool_and_finish's barrier.
    if (k > 0) e = plan_entry(p, args.rope.inv_freq, list_s[k], tid, kDim, rows_s, nullptr, kDim, apes_s);
    __syncthreads();
    pool_and_finish<kDim, kBatch>(p, args, e, rows_s, apes_s);
  }
}

// CTAs of `threads` threads of `kernel` the current device holds at once.
template <typename Kernel>
int resident_ctas(Kernel kernel, int threads) {
  int per_sm = 0;
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0),
             "compressor (cuda): occupancy");
  return std::max(1, device_sm_count() * per_sm);
}

// The entries kernel for (c, m): kFused picks rows_entries_kernel.
template <bool kFused, int kDim, int kBatch>
void launch_entries(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  const int T = p.num_tokens;
  if constexpr (kFused) {
    pdl_launch(rows_entries_kernel<kDim, kBatch>, unsigned(T), kDim, 0, stream, p, args);
  } else {
    // Spans that give about one wave of resident CTAs.
    static const int wave = resident_ctas(entries_kernel<kDim, kBatch>, kDim);
    const int span = std::min(kDim, std::max(1, (T + wave - 1) / wave));
    pdl_launch(entries_kernel<kDim, kBatch>, unsigned((T + span - 1) / span), kDim, 0, stream, p, args, span);
  }
}

// Calls f.template operator()<kDim, kBatch>() for the call's c and m
// (m = 128 pools 128 rows: batches of 32 loads a thread; m = 4: 8).
template <typename F>
void with_shape(const CompressorParams& p, F&& f) {
  const bool wide = p.ratio == 128;
  if (p.dim == kKvDim)
    wide ? f.template operator()<kKvDim, 32>() : f.template operator()<kKvDim, 8>();
  else
    wide ? f.template operator()<kIndexDim, 32>() : f.template operator()<kIndexDim, 8>();
}

template <bool kFused>
void launch_entries_for(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  if (kFused && p.dim == kKvDim && p.ratio == 128 && p.kc() == kKvDim)  // 128 pooled rows of 512 channels
    launch_wide(p, args, stream);
  else
    with_shape(p, [&]<int kDim, int kBatch>() { launch_entries<kFused, kDim, kBatch>(p, args, stream); });
}

int g_span_tokens = 0;        // set_compressor_span_tokens
bool g_span_clusters = true;  // set_compressor_span_tokens
int g_quad_from = -1;         // set_compressor_quad_from

// The rule of kRuns steps: every compressor on one kernel. At m = 4
// quad_kernel from kQuadMainFrom tokens (the main compressor) or
// kQuadIndexFrom (the indexer's), below them span_kernel at kSpan4 tokens a
// CTA; C128A's main entries on clusters over spans of 16-128 tokens
// (wide_span_for).
// fused_bench on an H100, us (seventieth session, BP1, one build;
// span_kernel at 4 tokens a CTA in brackets): C4A main 8,192 tokens 53.6
// [84.9], 4,096 33.7 [43.2], 2,048 17.1 [22.5], 1,024 14.0 [11.7], 512 12.5
// [9.4], 128 11.8 [7.9]; its indexer 17.6 [24.2], 14.0 [13.2], 12.0 [8.6],
// 11.2 [7.9], 10.9 [7.6], 9.9 [6.4]. quad_kernel's groups pool an entry with
// four times the work a thread, which a short step's one wave does not
// hide. C128A (sixty-eighth session, BN2-BN3; two kernels in brackets): 53.4
// [142.5] at 8,192, 14.3 at 1,024 (span 16: 19.4), 11.3 at 128 (span 64:
// 12.6); two kernels lost once their entries read the step's rows from the
// projection instead of rows the rows kernel had just left in L2.
constexpr int kSpan4 = 4, kQuadMainFrom = 2048, kQuadIndexFrom = 8192;
constexpr int kWideMinSpan = 16, kWideBlockSpan = 128, kWideSpan = 64;

// C128A's clusters over the shortest spans, from kWideMinSpan tokens to a
// block's kWideBlockSpan, whose clusters are fewer than a wave of resident
// ones; past kWideBlockSpan's wave, spans of kWideSpan. An H100 holds 30
// clusters (8 CTAs of 64 KB each) and one that pools an entry takes about
// 16 us, a chain of its metadata, loads, weights and sums (fused_bench
// --span-stamps), so a second wave costs about as much as the first:
// spans of 16 took 16.0-17.5 us at 512-960 tokens, the rule's 32 or 64
// 12.4-13.9; 1,920-3,840 tokens 17.6-29.7 on spans of 64, 16.3-26.6 on
// 128 (3,072: 24.0 against 18.8). A grid of exactly a wave was slower than
// half as many clusters (960 tokens: 14.3 on spans of 32, 13.9 on 64; 1,920:
// 17.6 on 64, 16.3 on 128), the PDL predecessor holding some slots as it
// starts; at 3,840 tokens 30 clusters of 128 still beat 60 of 64 (26.6
// against 29.7). From 4,096 tokens every span takes several waves and spans
// of 64, half of them without an entry, were the fastest (30.3 against 33.6
// us on 128 at 4,096, 51.6 against 54.0 at 8,192). H100, runs BT3, BT6, BT8.
int wide_span_for(int tokens) {
  if (g_span_tokens > 0) return g_span_tokens;
  const int wave = span_wide_resident_clusters();
  const auto clusters = [tokens](int span) { return (tokens + span - 1) / span; };
  for (int span = kWideMinSpan; span <= kWideBlockSpan; span *= 2)
    if (clusters(span) < wave) return span;
  return clusters(kWideBlockSpan) <= wave ? kWideBlockSpan : kWideSpan;
}

void launch_span_wide_rule(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  launch_span_wide(p, args, stream, wide_span_for(p.num_tokens));
}

// quad_kernel at m = 4 in a long step, else span_kernel over kSpan4 tokens
// a CTA (m = 4) or spans that give about one wave of resident CTAs (m = 128
// without clusters); C128A's main entries on clusters.
void launch_span(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  if (g_span_clusters && p.dim == kKvDim && p.ratio == 128) return launch_span_wide_rule(p, args, stream);
  const int quad_from = g_quad_from >= 0 ? g_quad_from : p.dim == kKvDim ? kQuadMainFrom : kQuadIndexFrom;
  if (p.ratio == 4 && g_span_tokens == 0 && p.num_tokens >= quad_from) return launch_quad(p, args, stream);
  with_shape(p, [&]<int kDim, int kBatch>() {
    static const int wave = resident_ctas(span_kernel<kDim, kBatch>, kDim);
    const int T = p.num_tokens;
    const int span = std::min(kDim, g_span_tokens > 0 ? g_span_tokens
                                    : kBatch == 8         ? kSpan4
                                                          : std::max(1, (T + wave - 1) / wave));
    pdl_launch(span_kernel<kDim, kBatch>, unsigned((T + span - 1) / span), kDim, 0, stream, p, args, span);
  });
}

}  // namespace

void set_compressor_span_tokens(int tokens, bool clusters) {
  g_span_tokens = tokens;
  g_span_clusters = clusters;
}
void set_compressor_quad_from(int tokens) { g_quad_from = tokens; }

int compressor_c128a_span(int tokens) { return std::min(wide_span_for(tokens), kWideMaxSpan); }
int compressor_c128a_resident_clusters() { return span_wide_resident_clusters(); }

int compressor_kernels(const CompressorParams& p, CompressorLaunch mode) {
  if (p.num_tokens == 0) return 0;
  if (mode == CompressorLaunch::kOneTokenPerRun) return 1;
  if (mode != CompressorLaunch::kRuns || g_span_tokens < 0) return 2;
  return 1;
}

void check_compressor_cuda_params(const CompressorParams& p) {
  check_compressor_params(p);
  if (p.num_tokens == 0) return;
  const std::string what = "compressor (cuda)";
  DSV4_REQUIRE(p.record != EntryFormat::kF32, what + ": f32 records are CPU only");
  DSV4_REQUIRE(p.bf16_rounding, what + ": production numerics only (bf16_rounding)");
  DSV4_REQUIRE(!p.hadamard || p.dim == kIndexDim, what + ": the Hadamard rotation runs on 128-dim entries only");
  DSV4_REQUIRE(aligned(p.proj, 16) && p.proj_ld % 4 == 0 && p.a_col % 4 == 0,
          what + ": proj must be 16-byte aligned, its row stride and the a/g columns multiples of 4");
  DSV4_REQUIRE(aligned(p.ape, 16), what + ": ape must be 16-byte aligned");
  DSV4_REQUIRE(aligned(p.state.base, 16) && p.state.page_stride % 16 == 0,
          what + ": state base and page stride must be 16-byte aligned");
  check_pages_out(p.out, entry_page_stride(p.record, p.out.entries_per_page, p.dim), what + " out");
}

void compressor_cuda(const CompressorParams& p, CUstream_st* stream, CompressorLaunch mode) {
  check_compressor_cuda_params(p);
  if (p.num_tokens == 0) return;
  const EntryArgs args{p.rope->freqs(), float(1.0 / std::sqrt(double(p.dim)))};
  if (mode == CompressorLaunch::kOneTokenPerRun) {
    launch_entries_for<true>(p, args, stream);
    cuda_check(cudaGetLastError(), "compressor (cuda): rows + entries launch");
    return;
  }
  if (compressor_kernels(p, mode) == 1) {
    launch_span(p, args, stream);
    cuda_check(cudaGetLastError(), "compressor (cuda): span launch");
    return;
  }
  pdl_launch(state_rows_kernel, unsigned(p.num_tokens), kRowThreads, 0, stream, p);
  cuda_check(cudaGetLastError(), "compressor (cuda): state rows launch");
  launch_entries_for<false>(p, args, stream);
  cuda_check(cudaGetLastError(), "compressor (cuda): entries launch");
}

}  // namespace dsv4::cuda
