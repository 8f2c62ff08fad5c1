#pragma once
// Host helpers shared by the linears (internal): device memory, weight
// upload, argument checks.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "attn/cuda/cublaslt_matmul.h"
#include "attn/cuda/linear.h"
#include "attn/cuda/linear_internal.h"

namespace dsv4::cuda::detail {

// cudaMalloc'd bytes, freed on destruction.
class DeviceMem {
 public:
  DeviceMem() = default;
  explicit DeviceMem(size_t bytes);
  ~DeviceMem();
  DeviceMem(DeviceMem&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceMem& operator=(DeviceMem&& o) noexcept;
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;

  void* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const void* src, size_t bytes);  // synchronous, at construction time

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// An FP8 weight on the device: data [rows, cols] e4m3, scales
// [ceil(rows / 128), scale_ld] row-major (scale_ld = lt_weight_scale_ld(cols):
// the layout cuBLASLt's BLK128x128 mode reads, which the own kernel reads too).
struct Fp8Weight {
  DeviceMem data, scales;
  int64_t rows = 0, cols = 0, scale_ld = 0;
  const uint8_t* codes() const { return static_cast<const uint8_t*>(data.get()); }
  const float* block_scales() const { return static_cast<const float*>(scales.get()); }
};

// Stacks the rows of FP8 parts (checks them; throws Error naming `who`).
Fp8Weight upload_fp8(std::span<const WeightMatrix* const> parts, const std::string& who);
// The same weight dequantized and rounded to bf16 (exact for power-of-two scales).
DeviceMem upload_fp8_as_bf16(const WeightMatrix& w);
// Stacks the rows of bf16 / FP8 / fp32 parts as bf16; rows and cols out.
DeviceMem upload_bf16(std::span<const WeightMatrix* const> parts, const std::string& who, int64_t& rows,
                      int64_t& cols);

inline bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Throws Error naming `who` unless x (bf16, row stride ldx elements) is a
// 16-byte aligned operand with rows of at least `cols` elements.
void check_bf16_input(const std::string& who, const void* x, int64_t ldx, int64_t cols);

// Enqueues a product of bf16 operands through the plan cached for p and
// records it in route; false (route.note says why) when cuBLASLt does not
// support p: the caller then runs the own kernel.
bool run_lt_bf16(LtPlans& plans, const LtProblem& p, const void* w, const void* x, void* y,
                 const LinearWorkspace& ws, int m, CUstream_st* stream, LinearRoute& route);

// Whether the options send m rows to cuBLASLt; to the FP8 GEMM (checked first).
bool wants_cublas(const LinearOptions& opt, int m);
bool wants_gemm(const LinearOptions& opt, int m);

// Runs the own kernel over rows [0, m) of `a` (a.m, splits, partials and
// counters are filled here) in launches of up to kGemvMaxRows rows, each
// with its own split of k; records them in route.
void run_gemv(GemvArgs a, int m, const LinearWorkspace& ws, CUstream_st* stream, LinearRoute& route);
// Runs the wgmma GEMM over rows [0, m) of `a` in launches of up to
// kGemmMaxRows rows, each with its own split of k; records them in route.
// Split-K sums stay in the cluster's shared memory, or (global_sum) use ws's
// partials and counters, which gemv_needs sizes.
void run_gemm(GemvArgs a, int m, const LinearWorkspace& ws, CUstream_st* stream, LinearRoute& route);
// Workspace the own kernels (small-M kernel, FP8 GEMM) need for calls of up to max_m rows.
LinearNeeds gemv_needs(GemvWeight kind, int64_t n, int64_t k, int max_m, int forced_splits = 0);
// The larger of two needs, field by field.
LinearNeeds max_needs(const LinearNeeds& a, const LinearNeeds& b);

}  // namespace dsv4::cuda::detail
