#pragma once
// The linears of the attention layer on Hopper (sm_90a), CUDA twin of
// attn/cpu/linear.h with the precisions of SPEC §5:
//
//   Fp8Linear           FP8 weight x FP8 activation (Fp8Act: 1x128 blocks),
//                       fp32 accumulation, bf16 output. wq_a + wkv (fused by
//                       stacking rows), wq_b, wo_b, indexer.wq_b.
//   W8A16GroupedLinear  wo_a: G groups [N_g, K_g] of an FP8 weight applied to
//                       the G column groups of a bf16 input: the bf16 product
//                       on the dequantized weight (exact in bf16), fp32
//                       accumulation, bf16 output, plus optionally the
//                       output's FP8 quantization that wo_b reads.
//   Bf16Linear          bf16 weights stacked by rows, bf16 input, fp32 output
//                       (compressor and indexer-compressor wkv / wgate,
//                       indexer.weights_proj: all read the layer input).
//   quantize_act        bf16 [M, K] -> Fp8Act, bit for bit the CPU quantizer.
//
// Every pointer is a device pointer; calls are stream-ordered and only launch
// kernels or cuBLASLt (no allocation, no synchronisation), so they can be
// captured in a CUDA graph. Results are deterministic (same inputs and path,
// same bits). Host-side problems (bad shapes, strides, alignment, a workspace
// too small) throw Error before anything is launched; CUDA and cuBLAS errors
// after a launch also throw Error.
//
// Paths. FP8 products of gemm_from .. gemm_max (at most 128) rows, where the
// options ask for it, run the own wgmma GEMM (split-K, weight tiles in flight
// before the programmatic-launch wait; Hopper's FP8 MMA accumulation, the
// error class of cuBLASLt's FP8 product; linear_gemm.cu); so do wo_a's
// FP8 x bf16 products (the weight decoded exactly to bf16 in registers,
// launches of up to 32 rows, the FP8 output quantized in the same kernel). Otherwise, up to
// small_m_max rows a linear runs its own small-M kernel: split-K over
// the weight (16-byte loads, block scales applied in registers, tensor-core
// MMAs on operands decoded exactly), partial sums combined in a fixed order
// by the last CTA of each row block. Above (and from cublas_from rows in
// multiples of 8, where a shape wants it earlier), cuBLASLt: block-scaled FP8
// (VEC128 activation scales, BLK128x128 weight scales; k split where its tiles
// would fill few SMs, see cublaslt_matmul.h), bf16 strided-batched
// for wo_a, bf16 -> fp32 for Bf16Linear. cuBLASLt's FP8 kernels take only row
// counts that are multiples of 8: the remaining rows (and any shape or
// alignment cuBLASLt rejects) run the own kernel; last_route() says which
// rows went where and why.
//
// One LinearWorkspace serves every linear of a model; calls sharing it must
// be ordered on one stream.
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include "attn/cuda/fp8_act.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4 {
struct WeightMatrix;
}

namespace dsv4::cuda {

struct QHeadNormRopeParams;  // q_head_norm_rope.h
struct ResidualNormParams;   // residual_norm.h

// An op that Fp8Linear::forward can run on its output in its own kernel, so
// that no launch (and no wait for one) comes between them. At most one.
struct LinearTail {
  // q's projection (wq_b): q_head_norm_rope_cuda(*q_head) on y, which must
  // be its q (the rows, stride and heads).
  const QHeadNormRopeParams* q_head = nullptr;
  // The layer's last projection (wo_b): residual_norm_cuda(*residual) with y
  // as its y (kAddNorm; the rows and dim of y): the residual add and the
  // next layer's input norm.
  const ResidualNormParams* residual = nullptr;
};

enum class LinearPath {
  kAuto,    // own kernel up to small_m_max rows, cuBLASLt above
  kSmallM,  // own kernel for every row count (in launches of up to 64 rows)
  kCublas,  // cuBLASLt wherever it takes the rows (tests, benchmarks)
  kGemm,    // FP8 and FP8 x bf16 (wo_a) products: the own wgmma GEMM for every row count (in
            // launches of up to 128 and 32 rows); bf16 weights run the small-M kernel
};

struct LinearOptions {
  LinearPath path = LinearPath::kAuto;
  int small_m_max = 32;
  // The own kernels' split of k (benchmarks, tests): used when it divides
  // k / 128 and fits (the GEMM: at most 8, one cluster); 0 chooses
  // automatically.
  int splits = 0;
  // From this many rows, when they are a multiple of 8 (cuBLASLt's FP8 rows,
  // so none are left for a second pass over the weight), cuBLASLt even at
  // or below small_m_max; 0: never. For shapes whose split-K kernel loses to
  // cuBLASLt before small_m_max (the layer's choices: cuda_layer.cu).
  int cublas_from = 0;
  // FP8 products (and wo_a's FP8 x bf16 ones) of gemm_from .. gemm_max rows (at most 128) run the own
  // wgmma GEMM (before small_m_max and cublas_from); gemm_from 0: never.
  // The layer's choices: cuda_layer.cu.
  int gemm_from = 0;
  int gemm_max = 128;
};

struct W8A16Options : LinearOptions {
  // Keep a bf16 copy of the dequantized weight for the cuBLASLt path (2x the
  // FP8 bytes). Without it every row count runs the own kernel.
  bool bf16_copy = true;
  // vLLM's variant, off by default: quantize the input to FP8 (1x128 blocks)
  // and run the FP8 product (Fp8Linear's kernels) per group.
  bool fp8_input = false;
};

// Where the rows of the last forward() went.
struct LinearRoute {
  int rows = 0;
  int cublas_rows = 0;      // through cuBLASLt
  int kernel_rows = 0;      // through the own small-M kernel
  int gemm_rows = 0;        // through the own wgmma GEMM (FP8)
  int kernel_launches = 0;  // own-kernel launches (small-M: one per 64 rows, GEMM: per 128)
  int splits = 0;           // the own kernels' split of k (last launch)
  bool gemm_global_sum = false;  // the GEMM's splits were summed through the workspace, not a cluster (last launch)
  bool kernel_cluster_sum = false;  // the small-M kernel's splits were summed in a cluster, not the workspace (last launch)
  int cublas_splits = 0;    // cuBLASLt's split of k (0: no rows went there)
  bool quantize_kernel = false;  // the separate bf16 -> FP8 kernel ran
  std::string note;         // why rows that the path wanted on cuBLASLt did not go there
};

// What one linear needs from the shared workspace for calls of up to max_m rows.
struct LinearNeeds {
  int max_m = 0;
  size_t partial_bytes = 0;  // split-K partial sums of the own kernel
  int counters = 0;          // arrival counters: split-K (one per 128 weight rows), the q-head tail's (one per 512), the residual tail's
  size_t scratch_bytes = 0;  // activation scales repacked for cuBLASLt, the FP8 input of fp8_input mode
  size_t tail_bytes = 0;     // the residual tail's row sums and its barrier's generation word
};

class LinearWorkspace {
 public:
  static constexpr size_t kDefaultCublasBytes = size_t(32) << 20;

  // Sized for the largest of `needs` (a linear's needs(max_m)), plus
  // cublas_bytes for cuBLASLt. On the current CUDA device.
  explicit LinearWorkspace(std::span<const LinearNeeds> needs, size_t cublas_bytes = kDefaultCublasBytes);
  LinearWorkspace(std::initializer_list<LinearNeeds> needs, size_t cublas_bytes = kDefaultCublasBytes)
      : LinearWorkspace(std::span<const LinearNeeds>(needs.begin(), needs.size()), cublas_bytes) {}
  ~LinearWorkspace();
  LinearWorkspace(const LinearWorkspace&) = delete;
  LinearWorkspace& operator=(const LinearWorkspace&) = delete;

  size_t bytes() const;  // device memory owned
  int max_m() const;

  // Used by the linears: throws Error unless this workspace covers `need`.
  void check_covers(const LinearNeeds& need, const std::string& who) const;
  float* partials() const;
  unsigned* counters() const;
  void* tail() const;  // tail_bytes, zeroed at construction
  void* scratch() const;
  void* cublas() const;
  size_t cublas_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// FP8 weight: the rows of `parts` stacked in order (all FP8 with 128x128
// block scales and the same cols, a multiple of 128; every part but the last
// has a multiple of 128 rows). Uploads data and scales once.
class Fp8Linear {
 public:
  Fp8Linear(std::span<const WeightMatrix* const> parts, const LinearOptions& options = {});
  explicit Fp8Linear(const WeightMatrix& w, const LinearOptions& options = {});
  ~Fp8Linear();
  Fp8Linear(Fp8Linear&&) noexcept;
  Fp8Linear& operator=(Fp8Linear&&) noexcept;

  // y[r, c] (row stride ldy elements) = bf16(sum over 128-blocks kb of
  // (x8 . w8)_kb * sx(r, kb) * sw(c / 128, kb)), r < x.rows, c < out_features().
  // x.rows == 0 is a no-op.
  // then: when fuses(then, x.rows), the same kernel then runs that op on y
  // and forward() returns true; else it returns false and the caller runs it.
  bool forward(const Fp8Act& x, uint16_t* y, int64_t ldy, LinearWorkspace& ws, CUstream_st* stream,
               const LinearTail& then = {});
  // Whether forward() fuses `then` for `rows` rows: the own GEMM or small-M
  // kernel takes them all, at most 8, and the output is whole 512-column
  // heads (q-head) or whole 128-column blocks of at most 16384 (residual; a
  // forced split's clusters must all fit at once).
  bool fuses(const LinearTail& then, int rows) const;

  int64_t in_features() const;
  int64_t out_features() const;
  LinearNeeds needs(int max_m) const;
  const LinearOptions& options() const;
  void set_options(const LinearOptions& options);
  const LinearRoute& last_route() const;
  size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// wo_a: w is FP8 [G * N_g, K_g] with 128x128 block scales, K_g a multiple
// of 128, N_g too when G > 1 (a model whose N_g is not runs one linear per
// group on row slices). Uploads the FP8 weight (and its bf16 dequantization
// unless options.bf16_copy is false).
class W8A16GroupedLinear {
 public:
  W8A16GroupedLinear(const WeightMatrix& w, int groups, const W8A16Options& options = {});
  ~W8A16GroupedLinear();
  W8A16GroupedLinear(W8A16GroupedLinear&&) noexcept;
  W8A16GroupedLinear& operator=(W8A16GroupedLinear&&) noexcept;

  // x bf16 [m, G * K_g] (row stride ldx), y bf16 [m, G * N_g] (row stride
  // ldy): group g's outputs at columns g * N_g from x's columns g * K_g.
  // y_fp8 (optional): y quantized for wo_b (rows m, cols G * N_g), fused into
  // the own kernel's epilogue, else by the separate quantize kernel.
  void forward(const uint16_t* x, int64_t ldx, int m, uint16_t* y, int64_t ldy, const Fp8ActOut* y_fp8,
               LinearWorkspace& ws, CUstream_st* stream);

  int groups() const;
  int64_t group_in() const;   // K_g
  int64_t group_out() const;  // N_g
  LinearNeeds needs(int max_m) const;
  const W8A16Options& options() const;
  void set_options(const W8A16Options& options);  // bf16_copy stays what construction made it
  const LinearRoute& last_route() const;
  size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// bf16 weight: the rows of `parts` stacked in order (same cols, a multiple
// of 128; bf16, or FP8 / fp32 rounded to bf16 at upload: exact for FP8 with
// power-of-two scales).
class Bf16Linear {
 public:
  Bf16Linear(std::span<const WeightMatrix* const> parts, const LinearOptions& options = {});
  explicit Bf16Linear(const WeightMatrix& w, const LinearOptions& options = {});
  ~Bf16Linear();
  Bf16Linear(Bf16Linear&&) noexcept;
  Bf16Linear& operator=(Bf16Linear&&) noexcept;

  // x bf16 [m, in_features()] (row stride ldx), y fp32 [m, out_features()] (row stride ldy).
  void forward(const uint16_t* x, int64_t ldx, int m, float* y, int64_t ldy, LinearWorkspace& ws,
               CUstream_st* stream);

  int64_t in_features() const;
  int64_t out_features() const;
  LinearNeeds needs(int max_m) const;
  const LinearOptions& options() const;
  void set_options(const LinearOptions& options);
  const LinearRoute& last_route() const;
  size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// x bf16 [out.rows, out.cols] (row stride ldx elements) -> out: each row's
// 128-wide blocks quantized as SPEC §5 says (the codes and scales of
// numerics/quant.h, bit for bit). out.rows == 0 is a no-op.
void quantize_act(const uint16_t* x, int64_t ldx, const Fp8ActOut& out, CUstream_st* stream);

// Throws Error naming the problem unless `x` is a well-formed FP8 activation
// (the checks every FP8 consumer here runs).
void check_fp8_act(const Fp8Act& x, const std::string& who);

// Diagnostics for benchmarks, not for serving. While a buffer is set, every
// small-M launch of wo_a's FP8 x bf16 product of up to 8 rows runs an
// instantiation in which thread 0 of each CTA writes %globaltimer (ns) at the
// points below to stamps[cta * kSmallMStampCount + point], cta = blockIdx.y *
// gridDim.x + blockIdx.x (split-major); the buffer must hold every CTA of
// the largest such launch. Grids of more than two CTAs an SM run the
// three-CTA variant, which is not stamped. Read at launch: a graph captured
// while it is set keeps writing there. nullptr turns it off.
enum SmallMStamp {
  kStampEntry,    // the CTA's first instruction
  kStampWaited,   // its first weight loads issued and the programmatic-launch wait returned
  kStampStaged,   // the activation slice decoded into shared memory
  kStampLooped,   // every warp's weight stream and MMAs done
  kStampSummed,   // the splits summed (cluster or workspace; a CTA that only arrives: then)
  kStampWritten,  // the outputs (and the FP8 quantized copy) written
  kSmallMStampCount
};
void set_small_m_stamps(unsigned long long* stamps);


}  // namespace dsv4::cuda
