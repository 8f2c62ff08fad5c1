// Device memory and weight upload of the linears.
#include "attn/cuda/linear_host.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attn/cuda/cublaslt_matmul.h"
#include "common/error.h"
#include "model/weights.h"
#include "numerics/bf16.h"
#include "numerics/e4m3.h"

namespace dsv4::cuda::detail {

DeviceMem::DeviceMem(size_t bytes) : n_(bytes) {
  if (bytes > 0) check_cuda(cudaMalloc(&p_, bytes), "cudaMalloc");
}

DeviceMem::~DeviceMem() {
  if (p_) cudaFree(p_);
}

DeviceMem& DeviceMem::operator=(DeviceMem&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = o.p_, n_ = o.n_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}

void DeviceMem::upload(const void* src, size_t bytes) {
  DSV4_REQUIRE(bytes <= n_, "linear (cuda): upload larger than its buffer");
  if (bytes > 0) check_cuda(cudaMemcpy(p_, src, bytes, cudaMemcpyHostToDevice), "weight upload");
}

namespace {

int64_t blocks128(int64_t v) { return (v + 127) / 128; }

// The checks every stacked part passes; `last` may have any row count.
void check_part(const WeightMatrix* w, int64_t cols, bool last, const std::string& who) {
  DSV4_REQUIRE(w != nullptr, who + ": a weight part is null");
  const std::string name = who + " (" + w->name + ")";
  DSV4_REQUIRE(w->rows > 0 && w->cols > 0, name + ": empty matrix");
  DSV4_REQUIRE(w->cols == cols, name + ": " + std::to_string(w->cols) + " columns where the first part has " +
                               std::to_string(cols));
  DSV4_REQUIRE(cols % 128 == 0, name + ": columns (" + std::to_string(cols) + ") must be a multiple of 128");
  DSV4_REQUIRE(last || w->rows % 128 == 0, name + ": every part but the last must have a multiple of 128 rows, not " +
                                          std::to_string(w->rows));
}

void check_fp8_part(const WeightMatrix* w, const std::string& who) {
  const std::string name = who + " (" + w->name + ")";
  DSV4_REQUIRE(w->dtype == DType::kF8E4M3, name + ": the weight is not FP8 (e4m3 with 128x128 block scales)");
  DSV4_REQUIRE(w->data.size() == size_t(w->rows * w->cols), name + ": data size does not match the shape");
  DSV4_REQUIRE(w->block_scales.size() == size_t(blocks128(w->rows) * blocks128(w->cols)),
          name + ": block scale count does not match the shape");
  for (float s : w->block_scales) DSV4_REQUIRE(std::isfinite(s) && s >= 0.0f, name + ": a block scale is not finite or negative");
}

}  // namespace

Fp8Weight upload_fp8(std::span<const WeightMatrix* const> parts, const std::string& who) {
  DSV4_REQUIRE(!parts.empty(), who + ": no weight parts");
  DSV4_REQUIRE(parts[0] != nullptr, who + ": a weight part is null");
  const int64_t cols = parts[0]->cols;
  int64_t rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_part(parts[i], cols, i + 1 == parts.size(), who);
    check_fp8_part(parts[i], who);
    rows += parts[i]->rows;
  }
  Fp8Weight w;
  w.rows = rows, w.cols = cols, w.scale_ld = lt_weight_scale_ld(cols);
  const int64_t kb = blocks128(cols);
  std::vector<uint8_t> data(size_t(rows * cols));
  std::vector<float> scales(size_t(blocks128(rows) * w.scale_ld), 0.0f);
  int64_t r0 = 0;
  for (const WeightMatrix* p : parts) {
    std::memcpy(data.data() + r0 * cols, p->data.data(), size_t(p->rows * cols));
    for (int64_t sr = 0; sr < blocks128(p->rows); ++sr)
      for (int64_t b = 0; b < kb; ++b) scales[size_t((r0 / 128 + sr) * w.scale_ld + b)] = p->block_scales[size_t(sr * kb + b)];
    r0 += p->rows;
  }
  w.data = DeviceMem(data.size());
  w.data.upload(data.data(), data.size());
  w.scales = DeviceMem(scales.size() * sizeof(float));
  w.scales.upload(scales.data(), scales.size() * sizeof(float));
  return w;
}

DeviceMem upload_fp8_as_bf16(const WeightMatrix& w) {
  const int64_t kb = blocks128(w.cols);
  std::vector<uint16_t> out(size_t(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t c = 0; c < w.cols; ++c) {
      const float s = w.block_scales[size_t((r / 128) * kb + c / 128)];
      out[size_t(r * w.cols + c)] = bf16_bits(e4m3_to_float(w.data[size_t(r * w.cols + c)]) * s);
    }
  DeviceMem d(out.size() * 2);
  d.upload(out.data(), out.size() * 2);
  return d;
}

DeviceMem upload_bf16(std::span<const WeightMatrix* const> parts, const std::string& who, int64_t& rows,
                      int64_t& cols) {
  DSV4_REQUIRE(!parts.empty(), who + ": no weight parts");
  DSV4_REQUIRE(parts[0] != nullptr, who + ": a weight part is null");
  cols = parts[0]->cols;
  rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const WeightMatrix* w = parts[i];
    // Any part count of rows: the bf16 kernel has no row blocks of scales.
    check_part(w, cols, true, who);
    const std::string name = who + " (" + w->name + ")";
    if (w->dtype == DType::kF8E4M3) {
      check_fp8_part(w, who);
    } else {
      DSV4_REQUIRE(w->dtype == DType::kBF16 || w->dtype == DType::kF32, name + ": weights must be BF16, F32 or F8_E4M3");
      const size_t elem = w->dtype == DType::kBF16 ? 2 : 4;
      DSV4_REQUIRE(w->data.size() == size_t(w->rows * w->cols) * elem, name + ": data size does not match the shape");
    }
    rows += w->rows;
  }
  std::vector<uint16_t> out(size_t(rows * cols));
  uint16_t* dst = out.data();
  for (const WeightMatrix* w : parts) {
    const size_t n = size_t(w->rows * cols);
    if (w->dtype == DType::kBF16) {
      std::memcpy(dst, w->data.data(), n * 2);
    } else if (w->dtype == DType::kF32) {
      for (size_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, w->data.data() + 4 * i, 4);
        dst[i] = bf16_bits(f);
      }
    } else {
      const int64_t kb = blocks128(cols);
      for (int64_t r = 0; r < w->rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          dst[r * cols + c] = bf16_bits(e4m3_to_float(w->data[size_t(r * cols + c)]) *
                                        w->block_scales[size_t((r / 128) * kb + c / 128)]);
    }
    dst += n;
  }
  DeviceMem d(out.size() * 2);
  d.upload(out.data(), out.size() * 2);
  return d;
}

void check_bf16_input(const std::string& who, const void* x, int64_t ldx, int64_t cols) {
  DSV4_REQUIRE(x != nullptr && aligned(x, 16) && ldx % 8 == 0,
               who + ": input must be 16-byte aligned with a row stride of a multiple of 8 elements");
  DSV4_REQUIRE(ldx >= cols, who + ": input row stride smaller than the input columns");
}

bool run_lt_bf16(LtPlans& plans, const LtProblem& p, const void* w, const void* x, void* y,
                 const LinearWorkspace& ws, int m, CUstream_st* stream, LinearRoute& route) {
  LtMatmul& plan = plans.get(p);
  if (!plan.supported()) {
    route.note = plan.reason();
    return false;
  }
  plan.run(w, nullptr, x, nullptr, y, ws.cublas(), stream);
  route.cublas_rows = m;
  route.cublas_splits = plan.splits();
  return true;
}

}  // namespace dsv4::cuda::detail
