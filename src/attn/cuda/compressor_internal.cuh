#pragma once
// What the compressor's kernels share (compressor_cuda.cu, compressor_quad.cu,
// compressor_wide.cu): a token's state row and the rows it writes, the plan
// of the entry it completes, and the finish of an entry from its pooled
// channels to its record. And the launchers of the C4A quad kernel and of
// C128A's cluster kernels, which compressor_cuda.cu's rule picks.
#include "attn/compressor_math.h"
#include "attn/cuda/block_scan.cuh"
#include "attn/cuda/compressor_cuda.h"
#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/hadamard.cuh"
#include "attn/cuda/kv_record.cuh"
#include "attn/cuda/ptx.cuh"

namespace dsv4::cuda {

constexpr int kMaxPooledRows = 128;

struct EntryArgs {
  RopeFreqs rope;
  float hadamard_scale;  // float(1 / sqrt(c)), as numerics/hadamard.cpp computes it
};

// Device helpers with internal linkage: each kernel file inlines its own
// copy, as when the kernels shared one file (their PTX did not change).
namespace {

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
// Each thread also asks L1 for its token's run id, which plan_entry reads
// next for the list's tokens: that load then hits L1 instead of making the
// plan's second round trip to L2, in a cluster's 3.8 us of metadata before
// its wait (fused_bench --span-stamps). BU1 (H100): C128A's kRuns kernel
// 0.5-0.9% faster at 2,048-8,192 tokens, level at 512-1,024.
template <int kThreads>
__device__ __forceinline__ int span_entry_list(const CompressorParams& p, int t0, int n, int* list_s) {
  const int u = int(threadIdx.x);
  if (u < n) prefetch_l1(p.token_run + t0 + u);
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

// Rows of tokens t0 .. t0 + n - 1 into their state rows dst_s[u] (nullptr:
// none), their ape rows tape_s[u], by threads tid of kThreads. Each thread loads
// kRowBatch float4 pairs before it stores any: a store may alias the next
// load, so a loop of load-then-store would wait a round trip per pair.
// C128A's cluster kernel takes 4 (its CTA's rows in one pass: BS1 on an H100,
// 2% faster at 8,192 tokens, 104 registers, still 2 CTAs an SM); the others 2.
// Only float4s k0 .. k0 + kq - 1 of a and of g (default: all). A dead row's
// loads are made all the same: skipping them made span_kernel slower at
// every size (BP1 on an H100, C4A at 8,192 tokens 84.9 us, 91.8 with the
// skip; the indexer's at 1,024 7.9, 9.2).
template <int kThreads, int kRowBatch = 2>
__device__ __forceinline__ void write_span_rows(const CompressorParams& p, int tid, int t0, int n,
                                                float* const* dst_s, const float* const* tape_s, int k0 = 0,
                                                int kq = 0) {
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

}  // namespace

// C4A's compressors in a long kRuns step (compressor_quad.cu).
void launch_quad(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream);
// C128A's main entries on clusters (compressor_wide.cu): one token per run
// (launch_wide), or a kRuns step over spans of `span` tokens (capped at 256).
void launch_wide(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream);
void launch_span_wide(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream, int span);
// The clusters of span_wide_kernel the current device holds at once.
int span_wide_resident_clusters();
inline constexpr int kWideMaxSpan = 256;  // span_wide_kernel's tokens a cluster at most (its threads)

}  // namespace dsv4::cuda
