// The compressor's two kernels (compressor_cuda.h).
//  rows:    one CTA per token; float4 copies of a and of g + ape.
//  entries: one CTA of c threads per token (tokens without an entry leave at
//           once). Thread e pools channel e over the slot's rows (row
//           pointers looked up once in shared memory); then c/4 threads, 4
//           consecutive channels each, finish the entry: bf16, RMSNorm (one
//           block reduction), bf16, RoPE (pairs are inside a thread), bf16,
//           Hadamard for the indexer keys (one warp: butterflies of stride
//           1 and 2 inside a thread, 4..64 across lanes), and the record
//           (kv_record.cuh).
#include "attn/cuda/compressor_cuda.h"

#include <cmath>
#include <string>

#include "attn/compressor_math.h"
#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/hadamard.cuh"
#include "attn/cuda/kv_record.cuh"
#include "attn/cuda/pdl.cuh"

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

__global__ void __launch_bounds__(kRowThreads) state_rows_kernel(const CompressorParams p) {
  pdl_start();  // pdl.cuh: launched with pdl_launch
  const int t = blockIdx.x;
  float* row = state_row(p, __ldg(p.row_slot + t));
  if (!row) return;
  const int kc = p.kc();
  const float* x = p.proj + int64_t(t) * p.proj_ld;
  const float* ape = p.ape + (__ldg(p.positions + t) % p.ratio) * kc;
  for (int k = threadIdx.x; k < kc / 4; k += kRowThreads) {
    const float4 a = *reinterpret_cast<const float4*>(x + p.a_col + 4 * k);
    const float4 g = *reinterpret_cast<const float4*>(x + p.g_col + 4 * k);
    const float4 e = __ldg(reinterpret_cast<const float4*>(ape) + k);
    reinterpret_cast<float4*>(row)[k] = a;
    reinterpret_cast<float4*>(row + kc)[k] =
        make_float4(__fadd_rn(g.x, e.x), __fadd_rn(g.y, e.y), __fadd_rn(g.z, e.z), __fadd_rn(g.w, e.w));
  }
}

// kDim = c threads; kBatch rows loaded at a time per thread (m = 128 pools
// 128 rows: 4 batches of 32 rather than 128 dependent loads).
template <int kDim, int kBatch>
__global__ void __launch_bounds__(kDim)
    entries_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args) {
  pdl_start();  // pdl.cuh: launched with pdl_launch
  constexpr int kFinish = kDim / 4;  // threads of the finishing phase (whole warps)
  __shared__ const float* rows_s[kMaxPooledRows];
  __shared__ __align__(16) float v_s[kDim];
  __shared__ double red[kFinish / 32];
  const int t = blockIdx.x;
  int te = 0;
  uint8_t* page = record_page(p.out, __ldg(p.entry_slot + t), te);
  if (!page) return;  // the same for the whole CTA
  const int m = p.ratio;
  const int64_t j = pool::slot_of_position(__ldg(p.positions + t), m);
  if (j < 0) return;
  const int64_t first = pool::pool_first(j, m);
  const int n = pool::pool_count(j, m), run = __ldg(p.token_run + t);
  for (int i = threadIdx.x; i < n; i += kDim) rows_s[i] = state_row(p, block_table_slot(p.state_table, run, first + i));
  __syncthreads();

  const float* const* rows_ptr = rows_s;
  auto rows = [rows_ptr](int i) { return rows_ptr[i]; };
  v_s[threadIdx.x] =
      pool::pool_channel<kBatch>(rows, n, int(j * m - first), m == 4 ? kDim : 0, p.kc(), int(threadIdx.x));
  __syncthreads();

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
  constexpr int kRopeThread0 = kFinish - kRopeDim / 4;  // holds the first rotary dims
  if (i >= kRopeThread0) {
    const int q0 = 2 * (i - kRopeThread0);
    rope_rotate(y[0], y[1], rope_cos_sin(j * m, args.rope.inv_freq[q0]));
    rope_rotate(y[2], y[3], rope_cos_sin(j * m, args.rope.inv_freq[q0 + 1]));
#pragma unroll
    for (int k = 0; k < 4; ++k) y[k] = bf16_round(y[k]);
  }
  const int B = p.out.entries_per_page;
  if constexpr (kDim == kKvDim) {
    store_fp8_ds_mla(page, B, te, i, y);
  } else {
    if (p.hadamard) {
      hadamard128(y, args.hadamard_scale);
#pragma unroll
      for (int k = 0; k < 4; ++k) y[k] = bf16_round(y[k]);
    }
    if (p.record == EntryFormat::kIndexFp8)
      store_index_key_fp8(page, B, te, i, y);
    else
      store_index_key_mxfp4(page, B, te, i, y);
  }
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

void compressor_cuda(const CompressorParams& p, CUstream_st* stream) {
  check_compressor_cuda_params(p);
  if (p.num_tokens == 0) return;
  const unsigned T = unsigned(p.num_tokens);
  pdl_launch(state_rows_kernel, T, kRowThreads, 0, stream, p);
  cuda_check(cudaGetLastError(), "compressor (cuda): state rows launch");
  const EntryArgs args{rope_freqs(*p.rope), float(1.0 / std::sqrt(double(p.dim)))};
  const bool wide = p.ratio == 128;  // 128 pooled rows
  if (p.dim == kKvDim && wide)
    pdl_launch(entries_kernel<kKvDim, 32>, T, kKvDim, 0, stream, p, args);
  else if (p.dim == kKvDim)
    pdl_launch(entries_kernel<kKvDim, 8>, T, kKvDim, 0, stream, p, args);
  else if (wide)
    pdl_launch(entries_kernel<kIndexDim, 32>, T, kIndexDim, 0, stream, p, args);
  else
    pdl_launch(entries_kernel<kIndexDim, 8>, T, kIndexDim, 0, stream, p, args);
  cuda_check(cudaGetLastError(), "compressor (cuda): entries launch");
}

}  // namespace dsv4::cuda
