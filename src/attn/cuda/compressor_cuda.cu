// The compressor's kernels (compressor_cuda.h).
//  rows:    one CTA per token; float4 copies of a and of g + ape.
//  entries: one CTA of c threads per token (tokens without an entry leave at
//           once). Thread e pools channel e over the slot's rows (row
//           pointers looked up once in shared memory); then c/4 threads, 4
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
// Each kernel looks its rows, slots and pages up in the step metadata before
// it waits for the kernel before it (compressor_cuda.h says why it may); at
// decode these dependent loads were most of a 1-CTA kernel's time.
#include "attn/cuda/compressor_cuda.h"

#include <cmath>
#include <string>

#include "attn/compressor_math.h"
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

// Token t's row, [a | g + ape[pos % m]], written to `row` and, when `keep`
// is not null, to keep as well; nthreads threads from thread 0.
__device__ __forceinline__ void write_row(const CompressorParams& p, int t, const float* ape, float* row, float* keep,
                                          int nthreads) {
  const int kc = p.kc();
  const float* x = p.proj + int64_t(t) * p.proj_ld;
  for (int k = threadIdx.x; k < kc / 4; k += nthreads) {
    const float4 a = *reinterpret_cast<const float4*>(x + p.a_col + 4 * k);
    const float4 g = *reinterpret_cast<const float4*>(x + p.g_col + 4 * k);
    const float4 e = __ldg(reinterpret_cast<const float4*>(ape) + k);
    const float4 ge = make_float4(__fadd_rn(g.x, e.x), __fadd_rn(g.y, e.y), __fadd_rn(g.z, e.z), __fadd_rn(g.w, e.w));
    reinterpret_cast<float4*>(row)[k] = a;
    reinterpret_cast<float4*>(row + kc)[k] = ge;
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
// position first + i; the row at `own`, if any, replaced by own_s) and the
// RoPE factors of the calling thread.
struct EntryPlan {
  uint8_t* page = nullptr;  // nullptr: the token completes no entry
  int te = 0, n = 0;
  int64_t j = 0, first = 0;
  float2 cs[2] = {};  // this thread's RoPE factors at j*m (a finishing thread with rotary dims)
};
__device__ __forceinline__ EntryPlan plan_entry(const CompressorParams& p, const float* inv_freq, int t,
                                                const float** rows_s, const float* own, const float* own_s) {
  EntryPlan e;
  e.page = record_page(p.out, __ldg(p.entry_slot + t), e.te);
  const int m = p.ratio;
  e.j = pool::slot_of_position(__ldg(p.positions + t), m);
  if (!e.page || e.j < 0) {
    e.page = nullptr;
    return e;
  }
  e.first = pool::pool_first(e.j, m);
  e.n = pool::pool_count(e.j, m);
  const int run = __ldg(p.token_run + t);
  for (int i = threadIdx.x; i < e.n; i += blockDim.x) {
    const float* r = state_row(p, block_table_slot(p.state_table, run, e.first + i));
    rows_s[i] = r != nullptr && r == own ? own_s : r;
  }
  const int i = int(threadIdx.x), rope0 = rope_thread0(int(blockDim.x));
  if (i >= rope0 && i < int(blockDim.x) / 4) rope_quad_factors(e.cs, e.j * m, inv_freq, i - rope0);
  return e;
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
    const float4 x = reinterpret_cast<const float4*>(v_s)[i];
    y[0] = bf16_round(x.x), y[1] = bf16_round(x.y), y[2] = bf16_round(x.z), y[3] = bf16_round(x.w);
    warp_partial(sum_squares4(y), red);
  }
  __syncthreads();
  if (i >= kFinish) return;
  const float inv = rms_inv(red_sum(red, 0, kFinish / 32), kDim, p.eps);
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

// Pools and finishes entry e (rows_s ready, CTA of kDim threads).
template <int kDim, int kBatch>
__device__ __forceinline__ void pool_and_finish(const CompressorParams& p, const EntryArgs& args, const EntryPlan& e,
                                                const float* const* rows_s) {
  __shared__ __align__(16) float v_s[kDim];
  const int m = p.ratio;
  auto rows = [rows_s](int i) { return rows_s[i]; };
  v_s[threadIdx.x] =
      pool::pool_channel<kBatch>(rows, e.n, int(e.j * m - e.first), m == 4 ? kDim : 0, p.kc(), int(threadIdx.x));
  __syncthreads();
  finish_entry<kDim>(p, args, e, e.cs, v_s);  // e.cs: plan_entry's factors for these dims
}

// kDim = c threads; kBatch rows loaded at a time per thread (m = 128 pools
// 128 rows: 4 batches of 32 rather than 128 dependent loads).
template <int kDim, int kBatch>
__global__ void __launch_bounds__(kDim)
    entries_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args) {
  __shared__ const float* rows_s[kMaxPooledRows];
  // The metadata, before the wait.
  const EntryPlan e = plan_entry(p, args.rope.inv_freq, int(blockIdx.x), rows_s, nullptr, nullptr);
  pdl_start();  // pdl.cuh: launched with pdl_launch
  if (!e.page) return;  // the same for the whole CTA
  __syncthreads();
  pool_and_finish<kDim, kBatch>(p, args, e, rows_s);
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
  const EntryPlan e = plan_entry(p, args.rope.inv_freq, t, rows_s, own, own_s);
  pdl_start();  // pdl.cuh: launched with pdl_launch
  if (own) write_row(p, t, ape, own, e.page ? own_s : nullptr, kDim);
  if (!e.page) return;
  __syncthreads();  // rows_s and own_s
  pool_and_finish<kDim, kBatch>(p, args, e, rows_s);
}

// C128A's main entry at decode on a cluster of kWideSplit CTAs. One CTA of
// 512 threads pooling 128 rows took about 35 us (fused_bench, compressor
// c128a: 768 KB of state reads and 65,536 exp_f32 on one SM), and at a block
// end the attention waits for it. Here CTA `rank` of token t's cluster
// takes channels rank * 64 .. + 63: it writes that slice of the token's own
// row, stages the slice of every pooled row in shared memory (all loads in
// flight at once), takes each channel's maximum and its weights
// exp(g - max) on all threads, then one thread per channel sums them in row
// order: pool_channel's operations in its order, so the same bits. Rank 0
// gathers the 512 channels through distributed shared memory and finishes
// the entry as the one-CTA kernel does.
constexpr int kWideSplit = 8;                     // CTAs a token (the portable cluster size)
constexpr int kWideCh = kKvDim / kWideSplit;      // channels a CTA
constexpr int kWideThreads = 256;                 // >= kKvDim / 4, the finishing threads
constexpr int kWideRowFloats = 2 * kWideCh;       // a staged row: a, then g + ape (then the weights)
constexpr size_t kWideSmemBytes = sizeof(float) * kMaxPooledRows * kWideRowFloats;
static_assert(kWideThreads >= kKvDim / 4 && kWideCh % 4 == 0 && kWideThreads >= 2 * kWideCh / 4);

__global__ void __launch_bounds__(kWideThreads)
    rows_entries_wide_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args) {
  extern __shared__ __align__(16) float stage[];  // [row][kWideRowFloats]
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ __align__(16) float own_s[kWideRowFloats];  // this CTA's slice of the own row
  __shared__ __align__(16) float v_s[kKvDim];            // rank 0: the pooled channels of every CTA
  __shared__ float mx_s[kWideCh];
  const int tid = int(threadIdx.x), rank = int(blockIdx.x) % kWideSplit, t = int(blockIdx.x) / kWideSplit;
  const int c0 = rank * kWideCh;  // this CTA's first channel
  float* own = state_row(p, __ldg(p.row_slot + t));  // metadata: before the wait
  const float* ape = ape_row(p, t);
  const EntryPlan e = plan_entry(p, args.rope.inv_freq, t, rows_s, own, own);  // the own row stays `own`
  float2 cs[2] = {};
  const int rope0 = rope_thread0(kKvDim);
  if (rank == 0 && e.page && tid >= rope0 && tid < kKvDim / 4)
    rope_quad_factors(cs, e.j * p.ratio, args.rope.inv_freq, tid - rope0);
  pdl_start();  // pdl.cuh: launched with pdl_launch_clustered
  // The own row's slice: a at c0.., g + ape at kc + c0.. (write_row's values).
  if (tid < kWideRowFloats / 4) {
    const int q = tid % (kWideCh / 4), half = tid / (kWideCh / 4), k = c0 / 4 + q;
    const float* x = p.proj + int64_t(t) * p.proj_ld;
    float4 v = *reinterpret_cast<const float4*>(x + (half ? p.g_col : p.a_col) + 4 * k);
    if (half) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(ape) + k);
      v = make_float4(__fadd_rn(v.x, a.x), __fadd_rn(v.y, a.y), __fadd_rn(v.z, a.z), __fadd_rn(v.w, a.w));
    }
    if (own) reinterpret_cast<float4*>(own + half * p.kc())[k] = v;
    reinterpret_cast<float4*>(own_s)[tid] = v;
  }
  if (!e.page) return;  // the same for the whole cluster
  cluster_arrive_relaxed();  // this CTA has started: rank 0 waits for all before its v_s is written
  __syncthreads();           // own_s
  // Every pooled row's slice into the stage, all loads in flight before any
  // store (absent rows: rows_s null, not read).
  constexpr int kQuads = kWideRowFloats / 4, kPer = kMaxPooledRows * kQuads / kWideThreads;
  static_assert(kMaxPooledRows * kQuads % kWideThreads == 0);
  float4 v[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int k = tid + u * kWideThreads, i = k / kQuads, q = k % kQuads, half = q / (kWideCh / 4);
    const float* r = i < e.n ? rows_s[i] : nullptr;
    if (r != nullptr)
      v[u] = r == own ? reinterpret_cast<const float4*>(own_s)[q]
                      : *reinterpret_cast<const float4*>(r + half * p.kc() + c0 + 4 * (q % (kWideCh / 4)));
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int k = tid + u * kWideThreads, i = k / kQuads;
    if (i < e.n && rows_s[i] != nullptr) reinterpret_cast<float4*>(stage + i * kWideRowFloats)[k % kQuads] = v[u];
  }
  __syncthreads();
  const float kNegInf = -__int_as_float(0x7f800000);
  if (tid < kWideCh) {  // pool_channel's maximum, in its order
    float mx = kNegInf;
#pragma unroll 8
    for (int i = 0; i < e.n; ++i)
      if (rows_s[i]) mx = mx < stage[i * kWideRowFloats + kWideCh + tid] ? stage[i * kWideRowFloats + kWideCh + tid] : mx;
    mx_s[tid] = mx;
  }
  __syncthreads();
  for (int k = tid; k < e.n * kWideCh; k += kWideThreads) {  // the weights, in place of g
    const int i = k / kWideCh, c = k % kWideCh;
    float& g = stage[i * kWideRowFloats + kWideCh + c];
    if (rows_s[i]) g = pool::exp_f32(pool::fsub(g, mx_s[c]));
  }
  __syncthreads();
  cluster_wait();  // every CTA of the cluster has started
  if (tid < kWideCh) {  // pool_channel's sums, in row order
    float den = 0.0f, num = 0.0f;
#pragma unroll 8
    for (int i = 0; i < e.n; ++i) {
      if (!rows_s[i]) continue;
      const float w = stage[i * kWideRowFloats + kWideCh + tid];
      den = pool::fadd(den, w);
      num = pool::fadd(num, pool::fmul(w, stage[i * kWideRowFloats + tid]));
    }
    st_cluster_f32(map_to_cta(smem_u32(&v_s[c0 + tid]), 0), pool::fdiv(num, den));
  }
  cluster_sync();  // rank 0's v_s is whole (release / acquire at cluster scope)
  if (rank != 0) return;
  finish_entry<kKvDim>(p, args, e, cs, v_s);
}

// The entries kernel for (c, m): kFused picks rows_entries_kernel.
template <bool kFused, int kDim, int kBatch>
void launch_entries(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  const unsigned T = unsigned(p.num_tokens);
  if constexpr (kFused)
    pdl_launch(rows_entries_kernel<kDim, kBatch>, T, kDim, 0, stream, p, args);
  else
    pdl_launch(entries_kernel<kDim, kBatch>, T, kDim, 0, stream, p, args);
}

void launch_wide(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  DSV4_REQUIRE(p.num_tokens <= (int64_t(1) << 31) / kWideSplit - 1,
               "compressor (cuda): too many one-token runs for one launch of the cluster kernel");
  static const cudaError_t raised = cudaFuncSetAttribute(
      rows_entries_wide_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWideSmemBytes));
  cuda_check(raised, "compressor (cuda): the wide entries kernel's shared memory");
  pdl_launch_clustered(rows_entries_wide_kernel, dim3(unsigned(p.num_tokens) * kWideSplit), dim3(kWideThreads),
                       kWideSmemBytes, stream, dim3(kWideSplit), p, args);
}

template <bool kFused>
void launch_entries_for(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  const bool wide = p.ratio == 128;  // 128 pooled rows
  if (kFused && p.dim == kKvDim && wide && p.kc() == kKvDim)
    launch_wide(p, args, stream);
  else if (p.dim == kKvDim && wide)
    launch_entries<kFused, kKvDim, 32>(p, args, stream);
  else if (p.dim == kKvDim)
    launch_entries<kFused, kKvDim, 8>(p, args, stream);
  else if (wide)
    launch_entries<kFused, kIndexDim, 32>(p, args, stream);
  else
    launch_entries<kFused, kIndexDim, 8>(p, args, stream);
}

}  // namespace

void check_compressor_cuda_params(const CompressorParams& p) {
  check_compressor_params(p);
  if (p.num_tokens == 0) return;
  const std::string what = "compressor (cuda)";
  DSV4_REQUIRE(p.record != EntryFormat::kF32, what + ": f32 records are CPU only");
  DSV4_REQUIRE(p.bf16_rounding, what + ": production numerics only (bf16_rounding)");
  DSV4_REQUIRE(!p.hadamard || p.dim == kIndexDim, what + ": the Hadamard rotation runs on 128-dim entries only");
  DSV4_REQUIRE(aligned(p.proj, 16) && p.proj_ld % 4 == 0 && p.a_col % 4 == 0 && p.g_col % 4 == 0,
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
  pdl_launch(state_rows_kernel, unsigned(p.num_tokens), kRowThreads, 0, stream, p);
  cuda_check(cudaGetLastError(), "compressor (cuda): state rows launch");
  launch_entries_for<false>(p, args, stream);
  cuda_check(cudaGetLastError(), "compressor (cuda): entries launch");
}

}  // namespace dsv4::cuda
