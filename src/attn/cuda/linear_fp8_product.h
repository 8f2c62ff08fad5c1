#pragma once
// The FP8 x FP8 product over an uploaded weight, optionally in groups
// (internal; Fp8Linear and wo_a's fp8_input mode run it).
#include <cstdint>
#include <string>

#include "attn/cuda/cublaslt_matmul.h"
#include "attn/cuda/linear_host.h"

namespace dsv4::cuda::detail {

class Fp8Product {
 public:
  // The weight's rows split into `groups` equal groups (a multiple of 128 rows
  // each when groups > 1); group g reads the activation's columns
  // [g * w.cols, (g + 1) * w.cols).
  Fp8Product(const Fp8Weight* w, int groups, std::string who) : w_(w), groups_(groups), who_(std::move(who)) {}

  // y (bf16, row stride ldy) for rows [0, x.rows); x checked by the caller.
  // repack: scratch for the activation scales in cuBLASLt's layout
  // (repack_floats(x.rows) floats, 16-byte aligned). q_head, residual: a
  // tail of the GEMM or the small-M kernel (at most one; the caller checked
  // that every row takes one of them).
  void forward(const Fp8Act& x, uint16_t* y, int64_t ldy, const LinearOptions& opt, const LinearWorkspace& ws,
               float* repack, CUstream_st* stream, LinearRoute& route, const GemvQHeadTail* q_head = nullptr,
               const GemvResidualTail* residual = nullptr);

  LinearNeeds needs(int max_m, int forced_splits) const;  // scratch_bytes: the repack buffer
  int64_t repack_floats(int m) const { return int64_t(groups_) * (w_->cols / 128) * m; }

 private:
  // The rows cuBLASLt takes (0 when it takes none; route.note says why).
  int cublas_rows(const Fp8Act& x, const uint16_t* y, int64_t ldy, const LinearWorkspace& ws, LinearRoute& route,
                  LtMatmul*& plan);

  const Fp8Weight* w_;
  int groups_;
  std::string who_;
  LtPlans plans_;
};

}  // namespace dsv4::cuda::detail
