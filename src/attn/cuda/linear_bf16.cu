// Bf16Linear: bf16 weights stacked by rows, fp32 output.
#include <string>
#include <vector>

#include "attn/cuda/cublaslt_matmul.h"
#include "attn/cuda/linear.h"
#include "attn/cuda/linear_host.h"
#include "common/error.h"
#include "model/weights.h"

namespace dsv4::cuda {

struct Bf16Linear::Impl {
  detail::DeviceMem w;  // [rows, cols] bf16
  int64_t rows = 0, cols = 0;
  LinearOptions options;
  LinearRoute route;
  LtPlans plans;

  bool run_cublas(const uint16_t* x, int64_t ldx, int m, float* y, int64_t ldy, const LinearWorkspace& ws,
                  CUstream_st* stream);
};

bool Bf16Linear::Impl::run_cublas(const uint16_t* x, int64_t ldx, int m, float* y, int64_t ldy,
                                  const LinearWorkspace& ws, CUstream_st* stream) {
  if (ldy % 4 != 0 || !detail::aligned(y, 16)) {
    route.note = "cuBLASLt needs 4 | ldy and a 16-byte aligned output";
    return false;
  }
  LtProblem p;
  p.kind = LtKind::kBf16ToF32;
  p.m = rows, p.n = m, p.k = cols;
  p.lda = cols, p.ldb = ldx, p.ldd = ldy;
  p.workspace_bytes = ws.cublas_bytes();
  return detail::run_lt_bf16(plans, p, w.get(), x, y, ws, m, stream, route);
}

Bf16Linear::Bf16Linear(std::span<const WeightMatrix* const> parts, const LinearOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->w = detail::upload_bf16(parts, "Bf16Linear", impl_->rows, impl_->cols);
  impl_->options = options;
  detail::gemv_prepare();
}

Bf16Linear::Bf16Linear(const WeightMatrix& w, const LinearOptions& options)
    : Bf16Linear(std::span<const WeightMatrix* const>(std::vector<const WeightMatrix*>{&w}), options) {}

Bf16Linear::~Bf16Linear() = default;
Bf16Linear::Bf16Linear(Bf16Linear&&) noexcept = default;
Bf16Linear& Bf16Linear::operator=(Bf16Linear&&) noexcept = default;

void Bf16Linear::forward(const uint16_t* x, int64_t ldx, int m, float* y, int64_t ldy, LinearWorkspace& ws,
                         CUstream_st* stream) {
  const std::string who = "Bf16Linear";
  Impl& im = *impl_;
  DSV4_REQUIRE(m >= 0, who + ": negative row count");
  im.route = LinearRoute{};
  im.route.rows = m;
  if (m == 0) return;
  detail::check_bf16_input(who, x, ldx, im.cols);
  DSV4_REQUIRE(y != nullptr && detail::aligned(y, 4), who + ": output is null or misaligned");
  DSV4_REQUIRE(ldy >= im.rows, who + ": output row stride smaller than the output columns");
  ws.check_covers(needs(m), who);
  if (detail::wants_cublas(im.options, m) && im.run_cublas(x, ldx, m, y, ldy, ws, stream)) return;
  detail::GemvArgs a;
  a.kind = detail::GemvWeight::kBf16;
  a.w = im.w.get();
  a.n = im.rows, a.k = im.cols, a.group_rows = im.rows;
  a.x = x, a.ldx = ldx;
  a.y = y, a.ldy = ldy, a.y_f32 = true;
  a.forced_splits = im.options.splits;
  detail::run_gemv(a, m, ws, stream, im.route);
}

int64_t Bf16Linear::in_features() const { return impl_->cols; }
int64_t Bf16Linear::out_features() const { return impl_->rows; }
LinearNeeds Bf16Linear::needs(int max_m) const {
  return detail::gemv_needs(detail::GemvWeight::kBf16, impl_->rows, impl_->cols, max_m, impl_->options.splits);
}
const LinearOptions& Bf16Linear::options() const { return impl_->options; }
void Bf16Linear::set_options(const LinearOptions& options) { impl_->options = options; }
const LinearRoute& Bf16Linear::last_route() const { return impl_->route; }
size_t Bf16Linear::device_bytes() const { return impl_->w.size(); }

}  // namespace dsv4::cuda
