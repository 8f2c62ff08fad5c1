#pragma once
// y[T, out] = x[T, in] . W^T on the CPU with the numerics of SPEC §5.
#include <vector>

#include "attn/profile.h"
#include "model/weights.h"

namespace dsv4 {

// How the production profile runs a product (the exact profile always runs
// float32 on the dequantized weight).
enum class LinearMode {
  kFp8,   // input quantized to e4m3 in 128-wide blocks, fp32 accumulation, output rounded to bf16
  kBf16,  // bf16 input and weight, fp32 accumulation, output rounded to bf16
  kF32,   // float32 throughout (compressor projections)
};

class Linear {
 public:
  // Rows [row0, row0 + rows) of w (rows = -1: all), so a grouped projection
  // can run one group at a time. `cache_weights`: keep a float32 copy (fast,
  // 4 bytes per element); otherwise dequantize 256-row panels on every call.
  Linear(const WeightMatrix* w, LinearMode mode, bool cache_weights, int64_t row0 = 0, int64_t rows = -1);

  // `xq`: where the production FP8 product puts its quantized input (a
  // backend's reused buffer, CpuScratch::xq); null: a vector of its own.
  void forward(const float* x, int tokens, float* y, Profile p, std::vector<float>* xq = nullptr) const {
    forward(x, int(in_features()), tokens, y, int(out_features()), p, xq);
  }
  // Strided form: row t of x starts at x + t * ldx, row t of y at y + t * ldy.
  void forward(const float* x, int ldx, int tokens, float* y, int ldy, Profile p,
               std::vector<float>* xq = nullptr) const;
  int64_t in_features() const { return w_->cols; }
  int64_t copy_bytes() const { return int64_t(dense_.size() * sizeof(float)); }  // the float32 copy, if kept
  int64_t out_features() const { return rows_; }

 private:
  void gemm(const float* x, int ldx, int tokens, float* y, int ldy) const;

  const WeightMatrix* w_;
  LinearMode mode_;
  int64_t row0_, rows_;
  std::vector<float> dense_;  // float32 weight when cached
};

}  // namespace dsv4
