// Fp8Linear and the FP8 product it shares with wo_a's fp8_input mode.
#include <algorithm>
#include <string>
#include <vector>

#include "attn/cuda/linear.h"
#include "attn/cuda/linear_fp8_product.h"
#include "attn/cuda/q_head_norm_rope.h"
#include "attn/cuda/residual_norm.h"
#include "common/error.h"
#include "model/weights.h"
#include "numerics/rope.h"

namespace dsv4::cuda {
namespace detail {

bool wants_cublas(const LinearOptions& opt, int m) {
  if (opt.path != LinearPath::kAuto) return opt.path == LinearPath::kCublas;
  return m > opt.small_m_max || (opt.cublas_from > 0 && m >= opt.cublas_from && m % 8 == 0);
}

bool wants_gemm(const LinearOptions& opt, int m) {
  if (opt.path != LinearPath::kAuto) return opt.path == LinearPath::kGemm;
  return opt.gemm_from > 0 && m >= opt.gemm_from && m <= std::min(opt.gemm_max, kGemmMaxRows);
}

int Fp8Product::cublas_rows(const Fp8Act& x, const uint16_t* y, int64_t ldy, const LinearWorkspace& ws,
                            LinearRoute& route, LtMatmul*& plan) {
  const int rows = x.rows & ~7;
  const int64_t group_out = w_->rows / groups_;
  if (rows == 0) {
    route.note = "cuBLASLt takes block-scaled FP8 rows in multiples of 8";
    return 0;
  }
  if (group_out % 8 != 0 || ldy % 8 != 0 || !aligned(y, 16)) {
    route.note = "cuBLASLt needs 8 | output columns, 8 | ldy and a 16-byte aligned output";
    return 0;
  }
  LtProblem p;
  p.kind = LtKind::kFp8BlockScaled;
  p.m = group_out, p.n = rows, p.k = w_->cols;
  p.lda = w_->cols, p.ldb = x.ld, p.ldd = ldy;
  p.workspace_bytes = ws.cublas_bytes();
  plan = &plans_.get(p);
  if (!plan->supported()) {
    route.note = plan->reason();
    return 0;
  }
  if (rows < x.rows) route.note = "the last " + std::to_string(x.rows - rows) + " rows: cuBLASLt takes multiples of 8";
  return rows;
}

void Fp8Product::forward(const Fp8Act& x, uint16_t* y, int64_t ldy, const LinearOptions& opt,
                         const LinearWorkspace& ws, float* repack, CUstream_st* stream, LinearRoute& route,
                         const GemvQHeadTail* q_head, const GemvResidualTail* residual) {
  route = LinearRoute{};
  route.rows = x.rows;
  if (x.rows == 0) return;
  const int64_t group_out = w_->rows / groups_, kb = w_->cols / 128;
  GemvArgs a;
  a.kind = GemvWeight::kFp8;
  a.w = w_->codes(), a.w_scales = w_->block_scales(), a.w_scale_ld = w_->scale_ld;
  a.n = w_->rows, a.k = w_->cols, a.group_rows = group_out;
  a.x = x.data, a.ldx = x.ld;
  a.x_scales = x.scales, a.x_scale_ld = x.scale_ld;
  a.y = y, a.ldy = ldy;
  a.forced_splits = opt.splits;
  if (q_head) a.q_head = *q_head;
  if (residual) a.residual = *residual;
  if (wants_gemm(opt, x.rows)) {
    run_gemm(a, x.rows, ws, stream, route);
    return;
  }
  int lt_rows = 0;
  LtMatmul* plan = nullptr;
  if (wants_cublas(opt, x.rows)) lt_rows = cublas_rows(x, y, ldy, ws, route, plan);
  if (lt_rows > 0) {
    // cuBLASLt reads scale(m, kb) at [kb * rows + m]: repack unless x already is so.
    const float* scales = x.scales;
    if (x.scale_ld != lt_rows || !aligned(x.scales, 16)) {
      launch_repack_scales(x.scales, x.scale_ld, repack, lt_rows, int(groups_ * kb), stream);
      scales = repack;
    }
    for (int g = 0; g < groups_; ++g)
      plan->run(w_->codes() + g * group_out * w_->cols, w_->block_scales() + g * (group_out / 128) * w_->scale_ld,
                x.data + g * w_->cols, scales + g * kb * lt_rows, y + g * group_out, ws.cublas(), stream);
    route.cublas_rows = lt_rows;
    route.cublas_splits = plan->splits();
  }
  if (lt_rows == x.rows) return;
  a.x = x.data + int64_t(lt_rows) * x.ld;
  a.x_scales = x.scales + lt_rows;
  a.y = y + int64_t(lt_rows) * ldy;
  run_gemv(a, x.rows - lt_rows, ws, stream, route);
}

LinearNeeds Fp8Product::needs(int max_m, int forced_splits) const {
  LinearNeeds n = gemv_needs(GemvWeight::kFp8, w_->rows, w_->cols, max_m, forced_splits);
  n.scratch_bytes = size_t(repack_floats(max_m)) * sizeof(float);
  return n;
}

}  // namespace detail

struct Fp8Linear::Impl {
  detail::Fp8Weight w;
  std::unique_ptr<detail::Fp8Product> product;
  LinearOptions options;
  LinearRoute route;
};

Fp8Linear::Fp8Linear(std::span<const WeightMatrix* const> parts, const LinearOptions& options)
    : impl_(std::make_unique<Impl>()) {
  const std::string who = "Fp8Linear";
  impl_->w = detail::upload_fp8(parts, who);
  impl_->product = std::make_unique<detail::Fp8Product>(&impl_->w, 1, who);
  impl_->options = options;
  detail::gemv_prepare();
}

Fp8Linear::Fp8Linear(const WeightMatrix& w, const LinearOptions& options)
    : Fp8Linear(std::span<const WeightMatrix* const>(std::vector<const WeightMatrix*>{&w}), options) {}

Fp8Linear::~Fp8Linear() = default;
Fp8Linear::Fp8Linear(Fp8Linear&&) noexcept = default;
Fp8Linear& Fp8Linear::operator=(Fp8Linear&&) noexcept = default;

bool Fp8Linear::forward(const Fp8Act& x, uint16_t* y, int64_t ldy, LinearWorkspace& ws, CUstream_st* stream,
                        const LinearTail& then) {
  const std::string who = "Fp8Linear";
  check_fp8_act(x, who);
  DSV4_REQUIRE(!(then.q_head && then.residual), who + ": one tail at a time");
  if (x.rows == 0) {
    impl_->route = LinearRoute{};
    return false;
  }
  DSV4_REQUIRE(x.cols == in_features(), who + ": activation has " + std::to_string(x.cols) + " columns, the weight " +
                                       std::to_string(in_features()));
  DSV4_REQUIRE(y != nullptr && detail::aligned(y, 2), who + ": output is null or misaligned");
  DSV4_REQUIRE(ldy >= out_features(), who + ": output row stride smaller than the output columns");
  ws.check_covers(needs(x.rows), who);
  const bool fuse = fuses(then, x.rows);
  detail::GemvQHeadTail q_head;
  if (fuse && then.q_head) {
    const QHeadNormRopeParams& q = *then.q_head;
    check_q_head_norm_rope_params(q);
    DSV4_REQUIRE(q.q == y && q.q_ld == ldy && q.num_tokens == x.rows && int64_t(q.num_heads) * 512 == out_features(),
                 who + ": the q-head tail must run on this output: its rows, stride and heads");
    q_head.counters = ws.counters() + detail::gemv_counters(out_features());
    q_head.positions = q.positions;
    q_head.eps = q.eps;
    q_head.rope = q.rope->freqs();
  }
  detail::GemvResidualTail residual;
  if (fuse && then.residual) {
    const ResidualNormParams& r = *then.residual;
    check_residual_norm_params(r);
    DSV4_REQUIRE(r.mode == ResidualMode::kAddNorm && r.y == y && r.y_ld == ldy && r.num_tokens == x.rows &&
                     r.dim == out_features(),
                 who + ": the residual tail must add this output: kAddNorm with its rows, stride and columns");
    residual.counter = ws.counters() + detail::gemv_residual_counter(out_features());
    residual.generation = static_cast<unsigned*>(ws.tail());
    residual.sums = reinterpret_cast<double*>(static_cast<char*>(ws.tail()) + detail::kGemvTailSumsAt);
    residual.norm = r;
  }
  impl_->product->forward(x, y, ldy, impl_->options, ws, static_cast<float*>(ws.scratch()), stream, impl_->route,
                          fuse && then.q_head ? &q_head : nullptr, fuse && then.residual ? &residual : nullptr);
  return fuse;
}

// The GEMM and the small-M kernel both have the tails; cuBLASLt has not
// (forward tries the GEMM first).
bool Fp8Linear::fuses(const LinearTail& then, int rows) const {
  const LinearOptions& o = impl_->options;
  const int64_t n = out_features();
  const bool shape = then.q_head ? detail::gemv_head_counters(n) > 0
                                 : then.residual != nullptr && detail::gemv_residual_tail_fits(n);
  if (!shape || rows < 1 || rows > detail::kGemvTailRows) return false;
  if (!detail::wants_gemm(o, rows)) return !detail::wants_cublas(o, rows);
  // The residual tail's barrier needs every CTA that writes outputs resident
  // at once; a forced split's clusters may not all fit (the small-M kernel
  // and the GEMM's own choices only cluster what fits).
  if (then.q_head) return true;
  const detail::GemmSplit s = detail::gemm_choose_splits(detail::GemvWeight::kFp8, n, in_features(), rows, o.splits);
  return s.global_sum || s.splits == 1 || n / detail::kGemvCtaRows <= detail::gemm_resident_clusters(rows, s.splits);
}

int64_t Fp8Linear::in_features() const { return impl_->w.cols; }
int64_t Fp8Linear::out_features() const { return impl_->w.rows; }
LinearNeeds Fp8Linear::needs(int max_m) const { return impl_->product->needs(max_m, impl_->options.splits); }
const LinearOptions& Fp8Linear::options() const { return impl_->options; }
void Fp8Linear::set_options(const LinearOptions& options) { impl_->options = options; }
const LinearRoute& Fp8Linear::last_route() const { return impl_->route; }
size_t Fp8Linear::device_bytes() const { return impl_->w.data.size() + impl_->w.scales.size(); }

}  // namespace dsv4::cuda
