// The compressor's kernels (compressor_cuda.h).
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
//           channels each instead (rows_entries_wide_kernel).
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

#include "attn/compressor_math.h"
#include "attn/cuda/block_scan.cuh"
#include "attn/cuda/device_info.h"
#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/hadamard.cuh"
#include "attn/cuda/kv_record.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kRowThreads = 128;
constexpr int kMaxPooledRows = 128;

struct EntryArgs {
  RopeFreqs rope;
  float hadamard_scale;  // float(1 / sqrt(c)), as numerics/hadamard.cpp computes it
};

// Row of state slot `slot`, nullptr when the slot is outside the cache.
__device__ __forceinline__ float* state_row(const CompressorParams& p, int64_t slot) {
  if (slot < 0 || slot >= p.state.capacity()) return nullptr;
  const int B = p.state.entries_per_page;
  return reinterpret_cast<float*>(p.state.page(slot / B) + sizeof(float) * size_t(p.row_floats()) * size_t(slot % B));
}

// a + b channel by channel, each sum rounded to nearest as the CPU twin's
// (no contraction into a neighbouring multiply can change its bits).
__device__ __forceinline__ float4 add_rn(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

// Token t's row, [a | g + ape[pos % m]], written to `row` (nullptr: none);
// nthreads threads from thread 0. Only the float4s k0 .. k1 - 1 of a and of
// g (default: all). A whole row (the default slice) may also be kept in
// `keep`, laid out as the row; a caller that writes a slice passes keep =
// nullptr.
__device__ __forceinline__ void write_row(const CompressorParams& p, int t, const float* ape, float* row, float* keep,
                                          int nthreads, int k0 = 0, int k1 = -1) {
  const int kc = p.kc();
  if (k1 < 0) k1 = kc / 4;
  const float* x = p.proj + int64_t(t) * p.proj_ld;
  for (int k = k0 + int(threadIdx.x); k < k1; k += nthreads) {
    const float4 a = *reinterpret_cast<const float4*>(x + p.a_col + 4 * k);
    const float4 g = *reinterpret_cast<const float4*>(x + p.g_col() + 4 * k);
    const float4 e = __ldg(reinterpret_cast<const float4*>(ape) + k);
    const float4 ge = add_rn(g, e);
    if (row) {
      reinterpret_cast<float4*>(row)[k] = a;
      reinterpret_cast<float4*>(row + kc)[k] = ge;
    }
    if (keep) {
      reinterpret_cast<float4*>(keep)[k] = a;
      reinterpret_cast<float4*>(keep + kc)[k] = ge;
    }
  }
}

__device__ __forceinline__ const float* ape_row(const CompressorParams& p, int t) {
  return p.ape + (__ldg(p.positions + t) % p.ratio) * p.kc();
}

__global__ void __launch_bounds__(kRowThreads) state_rows_kernel(const CompressorParams p) {
  const int t = blockIdx.x;
  float* row = state_row(p, __ldg(p.row_slot + t));  // metadata: before the wait
  const float* ape = ape_row(p, t);
  pdl_start();  // pdl.cuh: launched with pdl_launch (every CTA waits, even one with nothing to do)
  if (row) write_row(p, t, ape, row, nullptr, kRowThreads);
}

// The first finishing thread with rotary dims: a CTA of `threads` threads
// (one per channel) finishes with threads / 4 of them, channels 4i .. 4i + 3,
// and the last kRopeDim / 4 of those hold the rotary pairs 2(i - first), +1.
__device__ constexpr int rope_thread0(int threads) { return threads / 4 - kRopeDim / 4; }

// The entry token t completes: its record, its pooled rows (rows_s[i],
// position first + i: plan_entry says which) and the RoPE factors of the
// calling thread.
struct EntryPlan {
  uint8_t* page = nullptr;  // nullptr: the token completes no entry
  int te = 0, n = 0;
  int64_t j = 0, first = 0;
  float2 cs[2] = {};  // this thread's RoPE factors at j*m (a finishing thread with rotary dims)
  // The first pooled row of block j itself (at m = 4 the rows before it are
  // block j - 1's, which pool their A half).
  __device__ int own_from(int m) const { return int(j * m - first); }
};
// Token t's record and entry (page nullptr: it completes none).
__device__ __forceinline__ EntryPlan entry_of(const CompressorParams& p, int t) {
  EntryPlan e;
  e.page = record_page(p.out, __ldg(p.entry_slot + t), e.te);
  e.j = pool::slot_of_position(__ldg(p.positions + t), p.ratio);
  if (e.j < 0) e.page = nullptr;
  return e;
}
// The tokens t0 .. t0 + n - 1 that complete an entry, in token order, into
// list_s (at least n ints); returns their count. Every thread of the CTA
// (kThreads >= n) calls it; it ends with a barrier.
template <int kThreads>
__device__ __forceinline__ int span_entry_list(const CompressorParams& p, int t0, int n, int* list_s) {
  const int u = int(threadIdx.x);
  const bool completes = u < n && entry_of(p, t0 + u).page;
  int count = 0;
  const int at = block_exclusive_scan<kThreads>(int(completes), &count);
  if (completes) list_s[at] = t0 + u;
  __syncthreads();
  return count;
}

// Pooled position P of token t's run (t at position pos): when this step's
// token pool::step_token holds it, that token's projection row, whose gates
// want ape[P % m] added (*ape); otherwise `r`, the state row the table maps
// (written by an earlier step, or nullptr).
__device__ __forceinline__ const float* step_row(const CompressorParams& p, int t, int64_t pos, int run,
                                                 int64_t P, const float* r, const float** ape) {
  *ape = nullptr;
  const int64_t u = pool::step_token(t, pos, P);
  if (u < 0 || __ldg(p.token_run + u) != run || __ldg(p.positions + u) != P) return r;
  *ape = p.ape + (P % p.ratio) * p.kc();
  return p.proj + u * p.proj_ld + p.a_col;  // [a | g]: g_col() = a_col + kc
}

// finish_dim: the entry's channels when this CTA finishes it (finish_entry's
// threads get their factors), 0 when it does not. The rows of this step
// (compressor_params.h): with apes_s, taken from the projection (step_row)
// and apes_s[i] gets row i's ape row; else with own_s (one token a run: t's
// own row, at t's position, is the only one) own_s, t's row as write_row
// keeps it; else (the wide kernel, which stages t's row itself) the state
// row the table maps.
// Threads tid of nthreads (from 0) share the rows.
__device__ __forceinline__ EntryPlan plan_entry(const CompressorParams& p, const float* inv_freq, int t, int tid,
                                                int nthreads, const float** rows_s, const float* own_s,
                                                int finish_dim, const float** apes_s = nullptr) {
  EntryPlan e = entry_of(p, t);
  if (!e.page) return e;
  const int m = p.ratio;
  e.first = pool::pool_first(e.j, m);
  e.n = pool::pool_count(e.j, m);
  const int run = __ldg(p.token_run + t);
  const int64_t pos = __ldg(p.positions + t);  // >= every pooled position
  for (int i = tid; i < e.n; i += nthreads) {
    const float* r = state_row(p, block_table_slot(p.state_table, run, e.first + i));
    if (apes_s)
      rows_s[i] = step_row(p, t, pos, run, e.first + i, r, &apes_s[i]);
    else
      rows_s[i] = own_s && e.first + i == pos ? own_s : r;
  }
  const int rope0 = rope_thread0(finish_dim);
  if (tid >= rope0 && tid < finish_dim / 4) rope_quad_factors(e.cs, e.j * m, inv_freq, tid - rope0);
  return e;
}

// The pooled channels 4i .. 4i + 3 rounded to bf16, the finish's first step.
__device__ __forceinline__ void round_pooled(float4 x, float (&y)[4]) {
  y[0] = bf16_round(x.x), y[1] = bf16_round(x.y), y[2] = bf16_round(x.z), y[3] = bf16_round(x.w);
}

// The rest of the finish on finishing thread i's channels 4i .. 4i + 3 (y,
// from round_pooled): the RMSNorm by `inv` (rms_inv of the entry's sum of
// squares), RoPE (cs: the thread's factors when it holds rotary dims),
// Hadamard and the record. The i of a record's 16 (fp8_ds_mla), 8 (MXFP4)
// or 32 (FP8 key, Hadamard) consecutive channels' threads are consecutive
// lanes of one warp: those steps shuffle.
template <int kDim>
__device__ __forceinline__ void store_entry(const CompressorParams& p, const EntryArgs& args, const EntryPlan& e,
                                            int i, float inv, const float2 (&cs)[2], float (&y)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = bf16_round(__fmul_rn(__fmul_rn(y[k], inv), __ldg(p.norm + 4 * i + k)));
  if (i >= rope_thread0(kDim)) rope_rotate_quad_bf16(y, cs);
  const int B = p.out.entries_per_page;
  if constexpr (kDim == kKvDim) {
    store_fp8_ds_mla(e.page, B, e.te, i, y);
  } else {
    if (p.hadamard) {
      hadamard128(y, args.hadamard_scale);
#pragma unroll
      for (int k = 0; k < 4; ++k) y[k] = bf16_round(y[k]);
    }
    if (p.record == EntryFormat::kIndexFp8)
      store_index_key_fp8(e.page, B, e.te, i, y);
    else
      store_index_key_mxfp4(e.page, B, e.te, i, y);
  }
}

// Finishes entry e from its pooled channels v_s (shared, all kDim of them,
// visible to the CTA): called by every thread of a CTA of at least kDim / 4
// threads (it has a barrier); cs: the calling thread's RoPE factors when it
// holds rotary dims (plan_entry's for a CTA of kDim threads).
template <int kDim>
__device__ __forceinline__ void finish_entry(const CompressorParams& p, const EntryArgs& args, const EntryPlan& e,
                                             const float2 (&cs)[2], const float* v_s) {
  constexpr int kFinish = kDim / 4;  // threads of the finishing phase (whole warps)
  __shared__ double red[kFinish / 32];
  const int i = int(threadIdx.x);  // finishing: channels 4i .. 4i+3
  float y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (i < kFinish) {
    round_pooled(reinterpret_cast<const float4*>(v_s)[i], y);
    warp_partial(sum_squares4(y), red);
  }
  __syncthreads();
  if (i >= kFinish) return;
  store_entry<kDim>(p, args, e, i, rms_inv(red_sum(red, 0, kFinish / 32), kDim, p.eps), cs, y);
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

// Rows of tokens t0 .. t0 + n - 1 into their state rows dst_s[u] (nullptr:
// none), their ape rows tape_s[u], by threads tid of kThreads. Each thread loads
// kRowBatch float4 pairs before it stores any: a store may alias the next
// load, so a loop of load-then-store would wait a round trip per pair.
// Only float4s k0 .. k0 + kq - 1 of a and of g (default: all). A dead row's
// loads are made all the same: skipping them made span_kernel slower at
// every size (BP1 on an H100, C4A at 8,192 tokens 84.9 us, 91.8 with the
// skip; the indexer's at 1,024 7.9, 9.2).
template <int kThreads>
__device__ __forceinline__ void write_span_rows(const CompressorParams& p, int tid, int t0, int n,
                                                float* const* dst_s, const float* const* tape_s, int k0 = 0,
                                                int kq = 0) {
  constexpr int kRowBatch = 2;
  if (kq == 0) kq = p.kc() / 4;
  const int items = n * kq;  // float4s of a (and of g) the span's rows
  for (int i0 = tid; i0 < items; i0 += kRowBatch * kThreads) {
    float4 a[kRowBatch], ge[kRowBatch];
#pragma unroll
    for (int b = 0; b < kRowBatch; ++b) {
      const int i = i0 + b * kThreads, u = i / kq, k = k0 + i % kq;
      if (i >= items) break;
      const float* x = p.proj + int64_t(t0 + u) * p.proj_ld;
      a[b] = *reinterpret_cast<const float4*>(x + p.a_col + 4 * k);
      const float4 g = *reinterpret_cast<const float4*>(x + p.g_col() + 4 * k);
      const float4 e = __ldg(reinterpret_cast<const float4*>(tape_s[u]) + k);
      ge[b] = add_rn(g, e);
    }
#pragma unroll
    for (int b = 0; b < kRowBatch; ++b) {
      const int i = i0 + b * kThreads, u = i / kq, k = k0 + i % kq;
      if (i >= items) break;
      if (float* row = dst_s[u]) {
        reinterpret_cast<float4*>(row)[k] = a[b];
        reinterpret_cast<float4*>(row + p.kc())[k] = ge[b];
      }
    }
  }
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

// C4A's compressors in a kRuns step (m = 4) on groups of kDim / 4 threads
// (the main compressor's 128 a CTA, the indexer's 32, four a CTA), each over
// kQuadTokens tokens: the group writes their rows (those a later token
// reads) and pools the entries they complete (one; up to four where runs
// meet) one after another. Thread i holds channels 4i .. 4i + 3 from the
// pool's loads to the record, so no channel goes through another thread,
// and the indexer's group syncs as a warp. The pool's loads are cp.async
// copies into the thread's own stage in shared memory, all in flight at
// once: held in registers (125 of them) they allowed 4 CTAs an SM, and the
// compiler serialized the ape rows' loads. (span_kernel's CTA of c threads,
// one channel a thread, pooled through shared memory at two CTAs an SM.)
constexpr int kQuadThreads = 128, kQuadTokens = 4, kQuadRows = 8;  // m = 4 pools two blocks
// Groups a CTA of the quad kernel for c = dim: 1 (main), 4 (indexer).
__host__ __device__ constexpr int quad_groups(int dim) { return kQuadThreads / (dim / 4); }
constexpr int kQuadCtas = 6;  // an SM: the stages' 32 KB a CTA

// A thread's stage: float4 (row b, half h: 0 a, 1 g) at [b][h][threadIdx.x],
// so a warp's 16-byte accesses are consecutive.
using QuadStage = float4[kQuadRows][2][kQuadThreads];

// Thread i's channels col .. col + 3 of entry e's rows (rows_s, apes_s as
// plan_entry sets them; rows of block j at b_off further) into its stage;
// returns the rows present (bit b). The caller waits for the copies.
__device__ __forceinline__ unsigned stage_quad(QuadStage& stage, const float* const* rows_s, const EntryPlan& e,
                                               int b_off, int kc, int col) {
  const int b_from = e.own_from(4);
  unsigned present = 0;
#pragma unroll
  for (int b = 0; b < kQuadRows; ++b) {
    const float* r = b < e.n ? rows_s[b] : nullptr;
    if (r == nullptr) continue;
    present |= 1u << b;
    const float* x = r + pool::half_offset(b, b_from, b_off) + col;
    cp_async_16(smem_u32(&stage[b][0][threadIdx.x]), x, 16);
    cp_async_16(smem_u32(&stage[b][1][threadIdx.x]), x + kc, 16);
  }
  cp_async_commit();
  return present;
}

// Row b's gates from the stage, with its ape row added where it has one (the
// state row's sum: the same bits).
__device__ __forceinline__ float4 staged_gates(const QuadStage& stage, const float* const* apes_s, int b,
                                               int b_from, int b_off, int col) {
  const float4 g = stage[b][1][threadIdx.x];
  const float* ape = apes_s[b];
  return ape ? add_rn(g, __ldg(reinterpret_cast<const float4*>(ape + pool::half_offset(b, b_from, b_off) + col))) : g;
}

// pool_channel's operations (compressor_math.h) on entry e's staged
// channels: each channel's maximum over the present rows, then its weights
// and sums in row order.
__device__ __forceinline__ float4 pool_quad(const QuadStage& stage, const float* const* apes_s, const EntryPlan& e,
                                            unsigned present, int b_off, int col) {
  const int b_from = e.own_from(4);
  const float kNegInf = -__int_as_float(0x7f800000);
  float mx[4] = {kNegInf, kNegInf, kNegInf, kNegInf}, den[4] = {}, num[4] = {};
#pragma unroll
  for (int b = 0; b < kQuadRows; ++b) {
    if (!(present >> b & 1)) continue;
    const float4 g4 = staged_gates(stage, apes_s, b, b_from, b_off, col);
    const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) mx[c] = mx[c] < g[c] ? g[c] : mx[c];
  }
#pragma unroll
  for (int b = 0; b < kQuadRows; ++b) {
    if (!(present >> b & 1)) continue;
    const float4 g4 = staged_gates(stage, apes_s, b, b_from, b_off, col), a4 = stage[b][0][threadIdx.x];
    const float g[4] = {g4.x, g4.y, g4.z, g4.w}, a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float w = pool::exp_f32(pool::fsub(g[c], mx[c]));
      den[c] = pool::fadd(den[c], w);
      num[c] = pool::fadd(num[c], pool::fmul(w, a[c]));
    }
  }
  return make_float4(pool::fdiv(num[0], den[0]), pool::fdiv(num[1], den[1]), pool::fdiv(num[2], den[2]),
                     pool::fdiv(num[3], den[3]));
}

// A barrier of one quad group: a warp, or the whole CTA.
template <int kGroup>
__device__ __forceinline__ void group_sync() {
  if constexpr (kGroup == 32)
    __syncwarp();
  else
    __syncthreads();
}

template <int kDim>
__global__ void __launch_bounds__(kQuadThreads, kQuadCtas)
    quad_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args) {
  constexpr int kGroup = kDim / 4, kGroups = quad_groups(kDim);
  static_assert(kGroup == 32 || kGroup == kQuadThreads, "a group is a warp or the CTA");
  __shared__ QuadStage stage;
  __shared__ const float* rows_s[kGroups][kQuadRows];
  __shared__ const float* apes_s[kGroups][kQuadRows];
  __shared__ float* dst_s[kGroups][kQuadTokens];
  __shared__ const float* tape_s[kGroups][kQuadTokens];
  __shared__ unsigned ends_s[kGroups], lives_s[kGroups];
  __shared__ double red_s[kQuadThreads / 32];
  const int g = int(threadIdx.x) / kGroup, i = int(threadIdx.x) % kGroup, col = 4 * i;
  const int t0 = (int(blockIdx.x) * kGroups + g) * kQuadTokens, n = max(0, min(kQuadTokens, p.num_tokens - t0));
  // The metadata, before the wait: the rows (and which the group writes),
  // the tokens that complete an entry, the first entry's plan.
  if (i < 32) {  // the group's first warp
    float* dst = i < n ? state_row(p, __ldg(p.row_slot + t0 + i)) : nullptr;
    if (i < n) dst_s[g][i] = dst, tape_s[g][i] = ape_row(p, t0 + i);
    const unsigned lives = __ballot_sync(0xffffffffu, dst != nullptr);
    const unsigned ends = __ballot_sync(0xffffffffu, i < n && entry_of(p, t0 + i).page != nullptr);
    if (i == 0) ends_s[g] = ends, lives_s[g] = lives;
  }
  group_sync<kGroup>();
  unsigned ends = ends_s[g];
  const int b_off = kDim, kc = p.kc();  // m = 4: rows of block j pool their B half
  EntryPlan e;
  if (ends) {
    e = plan_entry(p, args.rope.inv_freq, t0 + __ffs(ends) - 1, i, kGroup, rows_s[g], nullptr, kDim, apes_s[g]);
    group_sync<kGroup>();  // rows_s, apes_s
  }
  pdl_start();  // pdl.cuh: launched with pdl_launch
  unsigned present = ends ? stage_quad(stage, rows_s[g], e, b_off, kc, col) : 0;
  if (lives_s[g]) write_span_rows<kGroup>(p, i, t0, n, dst_s[g], tape_s[g]);  // while the copies fly
  while (ends) {
    cp_async_wait_group<0>();  // the thread's own stage: no barrier
    float y[4];
    round_pooled(pool_quad(stage, apes_s[g], e, present, b_off, col), y);
    double ss = sum_squares4(y);
    if constexpr (kGroup == 32) {
      ss = group_sum<32>(ss);  // red_sum of the warp's one partial: the same bits
    } else {
      warp_partial(ss, red_s);
      __syncthreads();
      ss = red_sum(red_s, 0, kGroup / 32);
    }
    store_entry<kDim>(p, args, e, i, rms_inv(ss, kDim, p.eps), e.cs, y);
    ends &= ends - 1;
    if (!ends) break;
    group_sync<kGroup>();  // every thread has read rows_s, apes_s and red_s
    e = plan_entry(p, args.rope.inv_freq, t0 + __ffs(ends) - 1, i, kGroup, rows_s[g], nullptr, kDim, apes_s[g]);
    group_sync<kGroup>();  // rows_s, apes_s
    present = stage_quad(stage, rows_s[g], e, b_off, kc, col);
  }
}

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

// kStamps: the diagnostics instantiation (set_compressor_wide_stamps).
template <bool kStamps>
__global__ void __launch_bounds__(kWideThreads)
    rows_entries_wide_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args,
                             unsigned long long* stamps) {
  auto stamp = [&](int at) {
    if constexpr (kStamps)
      if (threadIdx.x == 0) stamps[size_t(blockIdx.x) * kWideStampCount + at] = global_timer_ns();
  };
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
// step from the projection (step_row).
__global__ void __launch_bounds__(kWideThreads)
    span_wide_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args, int span) {
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
  write_span_rows<kWideThreads>(p, tid, t0, n, dst_s, tape_s, c0 / 4, kWideCh / 4);
  if (count == 0) return;  // the same for the whole cluster
  cluster_arrive_relaxed();  // this CTA has started: rank 0 waits for all before its v_s is written
  for (int k = 0; k < count; ++k) {
    if (k > 0) {
      cluster_sync();  // the last entry is done on every CTA: stage, rows_s and rank 0's v_s are free
      e = plan_entry(p, args.rope.inv_freq, list_s[k], tid, kWideThreads, rows_s, nullptr, finish_dim, apes_s);
      __syncthreads();
    }
    stage_slices(p, e, rows_s, apes_s, stage, c0);
    __syncthreads();
    wide_weights(stage, mx_s, [](int) {});
    if (k == 0) cluster_wait();  // every CTA of the cluster has started
    wide_sums_to_rank0(stage, v_s, c0);
    cluster_sync();  // rank 0's v_s is whole (release / acquire at cluster scope)
    if (rank == 0) finish_entry<kKvDim>(p, args, e, e.cs, v_s);
  }
}

unsigned long long* g_wide_stamps = nullptr;  // set_compressor_wide_stamps

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
// CTA; C128A's main entries on clusters of 64 tokens (16 below 1,024).
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
constexpr int kWideSpan = 64, kWideShortSpan = 16, kWideShortBelow = 1024;

// span_wide_kernel over spans of kWideSpan tokens (kWideShortSpan in a short step).
void launch_span_wide(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  static const cudaError_t raised = cudaFuncSetAttribute(
      span_wide_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWideSmemBytes));
  cuda_check(raised, "compressor (cuda): the span cluster kernel's shared memory");
  const int T = p.num_tokens;
  const int span = g_span_tokens > 0 ? std::min(kWideThreads, g_span_tokens)
                   : T < kWideShortBelow ? kWideShortSpan
                                         : kWideSpan;
  pdl_launch_clustered(span_wide_kernel, dim3(unsigned((T + span - 1) / span) * kWideSplit), dim3(kWideThreads),
                       kWideSmemBytes, stream, dim3(kWideSplit), p, args, span);
}

// quad_kernel: a group of kQuadTokens tokens, quad_groups(c) of them a CTA.
void launch_quad(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  const unsigned groups = unsigned((p.num_tokens + kQuadTokens - 1) / kQuadTokens);
  const unsigned per_cta = unsigned(quad_groups(p.dim)), ctas = (groups + per_cta - 1) / per_cta;
  if (p.dim == kKvDim)
    pdl_launch(quad_kernel<kKvDim>, ctas, kQuadThreads, 0, stream, p, args);
  else
    pdl_launch(quad_kernel<kIndexDim>, ctas, kQuadThreads, 0, stream, p, args);
}

// quad_kernel at m = 4 in a long step, else span_kernel over kSpan4 tokens
// a CTA (m = 4) or spans that give about one wave of resident CTAs (m = 128
// without clusters); C128A's main entries on clusters.
void launch_span(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  if (g_span_clusters && p.dim == kKvDim && p.ratio == 128) return launch_span_wide(p, args, stream);
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

void set_compressor_wide_stamps(unsigned long long* stamps) { g_wide_stamps = stamps; }
void set_compressor_span_tokens(int tokens, bool clusters) {
  g_span_tokens = tokens;
  g_span_clusters = clusters;
}
void set_compressor_quad_from(int tokens) { g_quad_from = tokens; }

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
