#pragma once
// Internal interface between the linears' host code (linear_*.cu) and their
// kernels (linear_gemv*.cu, linear_quant.cu). No CUDA headers: the host files
// are plain C++.
#include <cstddef>
#include <cstdint>

#include "attn/cuda/device_info.h"
#include "attn/cuda/fp8_act.h"
#include "attn/cuda/residual_norm.h"
#include "numerics/rope.h"

struct CUstream_st;

namespace dsv4::cuda::detail {

// Operand kinds of the small-M kernel.
enum class GemvWeight {
  kFp8,    // FP8 weight x FP8 activation: both decoded to f16 (exactly, times 2^-8), f16 MMA
  kW8A16,  // FP8 weight x bf16 activation: weight decoded to bf16 exactly, bf16 MMA
  kBf16,   // bf16 weight x bf16 activation, bf16 MMA
};

inline constexpr int kGemvCtaRows = 128;  // weight rows per CTA: one 128-row block of scales
inline constexpr int kGemvMaxRows = 64;   // activation rows per launch (larger M: several launches)

// The fused tail of q's projection (Fp8Linear::forward with a
// QHeadNormRopeParams): when the four 128-row blocks of a 512-column head
// have written their outputs, the last of them runs q_head_norm_rope on that
// head of every row (q_head_norm_rope.cuh). Off while counters is null.
inline constexpr int kGemvQHeadRows = 8;  // rows of a launch with the tail (one CTA's q-head rows)
struct GemvQHeadTail {
  unsigned* counters = nullptr;        // [n / 512] zeroed arrival counters, reset by their last CTA
  const int32_t* positions = nullptr;  // [m]: row r's position
  float eps = 0.0f;
  RopeFreqs rope;                      // the layer's RoPE frequencies
};

// The fused tail of wo_b (Fp8Linear::forward with a ResidualNormParams):
// residual_norm (kAddNorm, its y this launch's output: h += y, then the next
// layer's input x = RMSNorm(h)) run by the CTAs that wrote the output, each
// on its own rows and 128 columns. They add y to h and leave each row's sum
// of squares over their columns in `sums`, wait for one another (a barrier
// among them: they are all resident, gemv_residual_tail_fits), then scale
// their columns by the norm from the sums of the row's blocks in order
// (residual_rows.cuh: the bits of residual_norm_cuda). Off while counter is
// null. Up to kGemvTailRows rows.
inline constexpr int kGemvTailRows = kGemvQHeadRows;  // both tails: one CTA's rows
struct GemvResidualTail {
  unsigned* counter = nullptr;     // zeroed arrival counter, reset by the last to arrive
  unsigned* generation = nullptr;  // the barrier's generation (the workspace's, never reset)
  double* sums = nullptr;          // [kGemvTailRows][n / 128] row sums of squares by column block
  ResidualNormParams norm{};       // norm.y == the launch's y
};

// Where splits of 1, 2, 4 and 8 CTAs sit in per-cluster-size tables (0 .. 3;
// -1 for any other split).
constexpr int cluster_size_index(int splits) {
  return splits == 1 ? 0 : splits == 2 ? 1 : splits == 4 ? 2 : splits == 8 ? 3 : -1;
}

// One launch of the small-M kernel: y[r, c] = sum_k x[r, g * k + kk] w[c, kk]
// for r < m, c < n, where g = c / group_rows (one group unless grouped).
struct GemvArgs {
  GemvWeight kind = GemvWeight::kFp8;
  const void* w = nullptr;           // [n, k] row-major, e4m3 bytes or bf16
  const float* w_scales = nullptr;   // FP8 weights: [ceil(n / 128), w_scale_ld] row-major
  int64_t w_scale_ld = 0;
  int64_t n = 0, k = 0;              // k a multiple of 128
  int64_t group_rows = 0;            // a multiple of 128 when < n
  const void* x = nullptr;           // row r at x + r * ldx elements (bytes for FP8)
  int64_t ldx = 0;
  const float* x_scales = nullptr;   // kFp8: scale(r, kb) at x_scales[kb * x_scale_ld + r]
  int64_t x_scale_ld = 0;
  int m = 0;                         // 1 .. kGemvMaxRows
  void* y = nullptr;                 // bf16, or fp32 when y_f32
  int64_t ldy = 0;
  bool y_f32 = false;
  Fp8ActOut q{};                     // kW8A16 with quantize: y's FP8 quantization (rows of this launch)
  bool quantize = false;
  int splits = 1;                    // CTAs along k; k / splits a multiple of 128
  int forced_splits = 0;             // LinearOptions::splits (0: chosen here)
  float* partials = nullptr;         // splits > 1: gemv_partial_floats(n, m, splits) floats
  unsigned* counters = nullptr;      // splits > 1: gemv_counters(n) zeroed counters
  GemvQHeadTail q_head{};            // kFp8, bf16 y of whole heads, m <= kGemvQHeadRows
  GemvResidualTail residual{};       // kFp8, bf16 y, m <= kGemvTailRows (not with q_head)
  bool global_sum = false;           // GEMM: splits summed through partials and counters, not in a cluster
  bool cluster_sum = false;          // small-M kernel: splits summed in a cluster (set at its launch)
  unsigned long long* stamps = nullptr;  // small-M kernel's diagnostics (set_small_m_stamps; set at its launch)
};

// Tokens per MMA tile column set: 8, 16, 32 or 64 (>= m).
int gemv_tile_rows(int m);
// Largest k one CTA may cover for tile_rows (its activation slice lives in shared memory).
int64_t gemv_max_cta_k(int tile_rows);
// Split of k over CTAs for this problem (see linear_gemv.cu); `sms` multiprocessors.
int gemv_choose_splits(GemvWeight kind, int64_t n, int64_t k, int m, int sms, int forced = 0);
size_t gemv_partial_floats(int64_t n, int m, int splits);
int gemv_counters(int64_t n);
// Counters of the q-head tail (one per 512 columns), after gemv_counters(n).
int gemv_head_counters(int64_t n);
// Whether an FP8 output of n columns can take the residual tail (at most
// 128 row blocks: unsplit, every CTA waits at the tail's barrier, and 128
// fit at once at the 2-3 CTAs an SM of up to 8 rows), and where its counter
// is (after the q-head tail's).
bool gemv_residual_tail_fits(int64_t n);
int gemv_residual_counter(int64_t n);
// Workspace tail bytes it needs: the generation word, then the sums.
inline constexpr size_t kGemvTailSumsAt = 256;
size_t gemv_residual_tail_bytes(int64_t n);
// Allows the kernels' shared memory (once per process; call before any
// stream capture).
void gemv_prepare();
// Launches one small-M kernel (m <= kGemvMaxRows); throws Error on a launch
// error. Returns whether its splits are summed in a cluster (else through
// the workspace, or not split).
bool gemv_launch(const GemvArgs& a, CUstream_st* stream);

// The wgmma GEMM (linear_gemm.cu): the same arguments (kind kFp8, bf16 y,
// no quantize, a q-head tail only up to kGemvQHeadRows rows; or kind kW8A16,
// bf16 y and optionally its quantization, no tail; partials and counters
// only with global_sum), 1 .. kGemmMaxRows activation rows per launch.
inline constexpr int kGemmMaxRows = 128;
inline constexpr int kGemmGlobalSumRows = 8;  // FP8 launches of up to this many rows may take global_sum
// Tokens per wgmma tile: 8, 16, 32, 64 or 128 (>= m).
int gemm_tile_rows(int m);
// Split of k: 1, 2, 4 or 8 CTAs, summed in a cluster (as many as keep one
// wave on the current device) or, for FP8 launches of up to
// kGemmGlobalSumRows rows where that gives more CTAs, through the
// workspace's partials (global_sum); forced (a cluster) when it is one of
// those and divides k / 128.
struct GemmSplit {
  int splits = 1;
  bool global_sum = false;
};
GemmSplit gemm_choose_splits(GemvWeight kind, int64_t n, int64_t k, int m, int forced = 0);
// Clusters of `splits` CTAs (1, 2, 4 or 8) of the FP8 tile for m rows that
// the current device holds resident at once: what the choice above weighs.
int gemm_resident_clusters(int m, int splits);
// Launches one GEMM (m <= kGemmMaxRows); throws Error on a launch error.
void gemm_launch(const GemvArgs& a, CUstream_st* stream);

// bf16 [rows, cols] (row stride ldx elements) -> out (rows, cols from out).
void launch_quantize_bf16(const uint16_t* x, int64_t ldx, const Fp8ActOut& out, CUstream_st* stream);
// Activation scales with row stride ld_in -> row stride `rows` (cuBLASLt's VEC128 layout).
void launch_repack_scales(const float* in, int64_t ld_in, float* out, int rows, int kblocks, CUstream_st* stream);

// Throws Error("what: <cuda error>") when e is not cudaSuccess (e is a cudaError_t).
void check_cuda(int e, const char* what);

}  // namespace dsv4::cuda::detail
