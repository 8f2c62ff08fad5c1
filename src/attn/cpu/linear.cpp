#include "attn/cpu/linear.h"

#include "attn/cpu/scratch.h"
#include "attn/cpu/sgemm.h"

#include <algorithm>
#include <cstring>

#include "common/huge_pages.h"
#include "numerics/bf16.h"
#include "numerics/quant.h"

namespace dsv4 {

Linear::Linear(const WeightMatrix* w, LinearMode mode, bool cache_weights, int64_t row0, int64_t rows)
    : w_(w), mode_(mode), row0_(row0), rows_(rows < 0 ? w->rows - row0 : rows) {
  // A checkpoint that ships this matrix dequantized runs it as a bf16 product,
  // as the reference does for non-FP8 weights.
  if (mode_ == LinearMode::kFp8 && !w->is_fp8()) mode_ = LinearMode::kBf16;
  if (!cache_weights) return;
  resize_on_huge_pages(dense_, size_t(rows_ * w->cols));
  w->dequantize_rows(row0_, rows_, dense_.data());
}

void Linear::gemm(const float* x, int ldx, int tokens, float* y, int ldy) const {
  const int64_t n = rows_, k = w_->cols;
  if (!dense_.empty()) {
    sgemm_nt(tokens, int(n), int(k), x, ldx, dense_.data(),
                int(k), y, ldy);
    return;
  }
  // Weight panels dequantized on the fly: memory stays bounded by one panel
  // while the weight is read once per call whatever the batch.
  constexpr int64_t kPanel = 256;
  std::vector<float> panel(size_t(kPanel * k));
  for (int64_t r0 = 0; r0 < n; r0 += kPanel) {
    const int64_t rows = std::min(kPanel, n - r0);
    w_->dequantize_rows(row0_ + r0, rows, panel.data());
    sgemm_nt(tokens, int(rows), int(k), x, ldx, panel.data(),
                int(k), y + r0, ldy);
  }
}

void Linear::forward(const float* x, int ldx, int tokens, float* y, int ldy, Profile p,
                     std::vector<float>* xq_buffer) const {
  if (tokens == 0) return;
  const size_t k = size_t(w_->cols), n = size_t(rows_);
  if (p == Profile::kExact || mode_ == LinearMode::kF32) {
    gemm(x, ldx, tokens, y, ldy);
    return;
  }
  if (mode_ == LinearMode::kFp8) {
    // The activation is quantized per token in 128-wide blocks (SPEC §5); the
    // quantized values times their scales are exact in float32.
    std::vector<float> own;
    float* xq = sized(xq_buffer ? *xq_buffer : own, size_t(tokens) * k);
#pragma omp parallel for
    for (int t = 0; t < tokens; ++t) {
      std::memcpy(xq + size_t(t) * k, x + size_t(t) * size_t(ldx), k * sizeof(float));
      fake_quant_e4m3(xq + size_t(t) * k, k, kGemmQuantBlock);
    }
    gemm(xq, int(k), tokens, y, ldy);
  } else {
    gemm(x, ldx, tokens, y, ldy);
  }
  for (int t = 0; t < tokens; ++t) round_bf16(y + size_t(t) * size_t(ldy), n);
}

}  // namespace dsv4
