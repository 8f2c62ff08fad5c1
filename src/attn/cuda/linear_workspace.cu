// The shared workspace of the linears, the own kernel's row chunks, and the
// checks and launcher of the activation quantization.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "attn/cuda/linear_host.h"
#include "common/error.h"

namespace dsv4::cuda {

namespace {
size_t align256(size_t v) { return (v + 255) / 256 * 256; }
}  // namespace

struct LinearWorkspace::Impl {
  detail::DeviceMem mem;
  LinearNeeds have;
  size_t cublas_bytes = 0;
  size_t counters_at = 0, tail_at = 0, partials_at = 0, scratch_at = 0, cublas_at = 0;
  char* at(size_t offset) const { return static_cast<char*>(mem.get()) + offset; }
};

LinearWorkspace::LinearWorkspace(std::span<const LinearNeeds> needs, size_t cublas_bytes)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  for (const LinearNeeds& n : needs) im.have = detail::max_needs(im.have, n);
  im.cublas_bytes = cublas_bytes;
  im.counters_at = 0;
  im.tail_at = align256(size_t(im.have.counters) * sizeof(unsigned));
  im.partials_at = im.tail_at + align256(im.have.tail_bytes);
  im.scratch_at = im.partials_at + align256(im.have.partial_bytes);
  im.cublas_at = im.scratch_at + align256(im.have.scratch_bytes);
  const size_t total = im.cublas_at + align256(cublas_bytes);
  im.mem = detail::DeviceMem(total);
  if (im.partials_at > 0)  // the counters and the tail's words start at zero
    detail::check_cuda(cudaMemset(im.mem.get(), 0, im.partials_at), "clearing the split-K counters and the residual tail's words");
}

LinearWorkspace::~LinearWorkspace() = default;

size_t LinearWorkspace::bytes() const { return impl_->mem.size(); }
int LinearWorkspace::max_m() const { return impl_->have.max_m; }

void LinearWorkspace::check_covers(const LinearNeeds& need, const std::string& who) const {
  const LinearNeeds& h = impl_->have;
  DSV4_REQUIRE(need.max_m <= h.max_m, who + ": " + std::to_string(need.max_m) +
                                           " rows exceed the workspace's max_m of " + std::to_string(h.max_m));
  DSV4_REQUIRE(need.partial_bytes <= h.partial_bytes && need.counters <= h.counters &&
                    need.scratch_bytes <= h.scratch_bytes && need.tail_bytes <= h.tail_bytes,
                who + ": the workspace was not sized for this linear (build it from this linear's needs())");
}

float* LinearWorkspace::partials() const { return reinterpret_cast<float*>(impl_->at(impl_->partials_at)); }
unsigned* LinearWorkspace::counters() const { return reinterpret_cast<unsigned*>(impl_->at(impl_->counters_at)); }
void* LinearWorkspace::tail() const { return impl_->at(impl_->tail_at); }
void* LinearWorkspace::scratch() const { return impl_->at(impl_->scratch_at); }
void* LinearWorkspace::cublas() const { return impl_->at(impl_->cublas_at); }
size_t LinearWorkspace::cublas_bytes() const { return impl_->cublas_bytes; }

void check_fp8_act(const Fp8Act& x, const std::string& who) {
  DSV4_REQUIRE(x.rows >= 0, who + ": negative row count");
  if (x.rows == 0) return;
  DSV4_REQUIRE(x.data != nullptr && x.scales != nullptr, who + ": activation data or scales are null");
  DSV4_REQUIRE(x.cols > 0 && x.cols % kActBlock == 0, who + ": activation columns must be a positive multiple of 128");
  DSV4_REQUIRE(x.ld >= x.cols, who + ": activation row stride smaller than its columns");
  DSV4_REQUIRE(x.scale_ld >= x.rows, who + ": activation scale_ld smaller than its rows");
  DSV4_REQUIRE(detail::aligned(x.data, 16) && x.ld % 16 == 0,
          who + ": activation data and row stride must be 16-byte aligned");
  DSV4_REQUIRE(detail::aligned(x.scales, 4), who + ": activation scales must be 4-byte aligned");
}

void check_fp8_out(const Fp8ActOut& o, int rows, int cols, const std::string& what) {
  DSV4_REQUIRE(o.data != nullptr && o.scales != nullptr, what + ": FP8 output without data or scales");
  DSV4_REQUIRE(o.cols == cols, what + ": FP8 output has " + std::to_string(o.cols) + " columns, expected " +
                                   std::to_string(cols));
  DSV4_REQUIRE(cols > 0 && cols % kActBlock == 0,
               what + ": the FP8 output needs a positive multiple of 128 columns, not " + std::to_string(cols));
  DSV4_REQUIRE(o.rows >= rows, what + ": FP8 output has " + std::to_string(o.rows) + " rows, fewer than " +
                                   std::to_string(rows));
  DSV4_REQUIRE(o.ld >= cols && o.ld % 4 == 0, what + ": FP8 output row stride must cover the columns, a multiple of 4");
  DSV4_REQUIRE(o.scale_ld >= o.rows, what + ": FP8 output scale_ld must be >= its rows");
  DSV4_REQUIRE(detail::aligned(o.data, 4) && detail::aligned(o.scales, 4),
               what + ": FP8 output data and scales must be 4-byte aligned");
}

void quantize_act(const uint16_t* x, int64_t ldx, const Fp8ActOut& out, CUstream_st* stream) {
  const std::string who = "quantize_act";
  DSV4_REQUIRE(out.rows >= 0, who + ": negative row count");
  if (out.rows == 0) return;
  DSV4_REQUIRE(x != nullptr && detail::aligned(x, 2), who + ": input is null or misaligned");
  check_fp8_out(out, out.rows, out.cols, who);
  DSV4_REQUIRE(ldx >= out.cols, who + ": input row stride smaller than the columns");
  detail::launch_quantize_bf16(x, ldx, out, stream);
}

namespace detail {

LinearNeeds max_needs(const LinearNeeds& a, const LinearNeeds& b) {
  LinearNeeds r;
  r.max_m = std::max(a.max_m, b.max_m);
  r.partial_bytes = std::max(a.partial_bytes, b.partial_bytes);
  r.counters = std::max(a.counters, b.counters);
  r.scratch_bytes = std::max(a.scratch_bytes, b.scratch_bytes);
  r.tail_bytes = std::max(a.tail_bytes, b.tail_bytes);
  return r;
}

LinearNeeds gemv_needs(GemvWeight kind, int64_t n, int64_t k, int max_m, int forced_splits) {
  LinearNeeds nd;
  nd.max_m = max_m;
  const int sms = device_sm_count();
  for (int m = 1; m <= std::min(max_m, kGemvMaxRows); ++m) {
    const int s = gemv_choose_splits(kind, n, k, m, sms, forced_splits);
    nd.partial_bytes = std::max(nd.partial_bytes, gemv_partial_floats(n, m, s) * sizeof(float));
    if (s > 1) nd.counters = std::max(nd.counters, gemv_counters(n));
  }
  const int gm = std::min(max_m, kGemmGlobalSumRows);  // the FP8 GEMM's splits summed here: one split for all m <= 8
  if (kind == GemvWeight::kFp8 && gm >= 1) {
    const GemmSplit g = gemm_choose_splits(kind, n, k, gm, forced_splits);
    if (g.global_sum) {
      nd.partial_bytes = std::max(nd.partial_bytes, gemv_partial_floats(n, gm, g.splits) * sizeof(float));
      nd.counters = std::max(nd.counters, gemv_counters(n));
    }
  }
  if (kind == GemvWeight::kFp8) {  // Fp8Linear's tails: the q-head one's counters, then the residual one's
    if (gemv_head_counters(n) > 0) nd.counters = std::max(nd.counters, gemv_counters(n) + gemv_head_counters(n));
    if (gemv_residual_tail_fits(n)) {
      nd.counters = std::max(nd.counters, gemv_residual_counter(n) + 1);
      nd.tail_bytes = gemv_residual_tail_bytes(n);
    }
  }
  return nd;
}

namespace {

// Rows [r0, r0 + rows) of a.
GemvArgs row_slice(const GemvArgs& a, int r0, int rows) {
  GemvArgs c = a;
  c.m = rows;
  c.x = static_cast<const char*>(a.x) + r0 * (a.kind == GemvWeight::kFp8 ? a.ldx : 2 * a.ldx);
  if (a.x_scales) c.x_scales = a.x_scales + r0;
  c.y = static_cast<char*>(a.y) + r0 * a.ldy * (a.y_f32 ? 4 : 2);
  if (a.quantize) {
    c.q.data = a.q.data + r0 * a.q.ld;
    c.q.scales = a.q.scales + r0;
    c.q.rows = rows;
  }
  return c;
}

}  // namespace

void run_gemv(GemvArgs a, int m, const LinearWorkspace& ws, CUstream_st* stream, LinearRoute& route) {
  const int sms = device_sm_count();
  for (int r0 = 0; r0 < m; r0 += kGemvMaxRows) {
    GemvArgs c = row_slice(a, r0, std::min(kGemvMaxRows, m - r0));
    c.splits = gemv_choose_splits(a.kind, a.n, a.k, c.m, sms, a.forced_splits);
    c.partials = ws.partials();
    c.counters = ws.counters();
    route.kernel_cluster_sum = gemv_launch(c, stream);
    route.kernel_rows += c.m;
    route.kernel_launches += 1;
    route.splits = c.splits;
  }
}

void run_gemm(GemvArgs a, int m, const LinearWorkspace& ws, CUstream_st* stream, LinearRoute& route) {
  for (int r0 = 0; r0 < m; r0 += kGemmMaxRows) {
    GemvArgs c = row_slice(a, r0, std::min(kGemmMaxRows, m - r0));
    const GemmSplit split = gemm_choose_splits(a.kind, a.n, a.k, c.m, a.forced_splits);
    c.splits = split.splits;
    c.global_sum = split.global_sum;
    if (c.global_sum) {
      c.partials = ws.partials();
      c.counters = ws.counters();
    }
    gemm_launch(c, stream);
    route.gemm_rows += c.m;
    route.kernel_launches += 1;
    route.splits = c.splits;
    route.gemm_global_sum = c.global_sum;
  }
}

}  // namespace detail
}  // namespace dsv4::cuda
