// wo_a: W8A16GroupedLinear.
#include <string>

#include "attn/cuda/linear.h"
#include "attn/cuda/linear_fp8_product.h"
#include "common/error.h"
#include "model/weights.h"

namespace dsv4::cuda {
namespace {

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

struct W8A16GroupedLinear::Impl {
  detail::Fp8Weight w;  // [G * N_g, K_g]
  detail::DeviceMem bf16;  // the dequantized weight for cuBLASLt (bf16_copy)
  int groups = 0;
  int64_t n_g = 0, k_g = 0;
  W8A16Options options;
  LinearRoute route;
  LtPlans plans;
  std::unique_ptr<detail::Fp8Product> fp8;  // fp8_input mode

  int64_t in_cols() const { return groups * k_g; }
  int64_t out_cols() const { return groups * n_g; }
  // fp8_input scratch: the quantized input, its scales, the cuBLASLt repack.
  size_t xq_bytes(int m) const { return align256(size_t(m) * size_t(in_cols())); }
  size_t xs_bytes(int m) const { return align256(size_t(in_cols() / 128) * size_t(m) * sizeof(float)); }

  void run_fp8_input(const uint16_t* x, int64_t ldx, int m, uint16_t* y, int64_t ldy, const LinearWorkspace& ws,
                     CUstream_st* stream);
  bool run_cublas(const uint16_t* x, int64_t ldx, int m, uint16_t* y, int64_t ldy, const LinearWorkspace& ws,
                  CUstream_st* stream);
};

void W8A16GroupedLinear::Impl::run_fp8_input(const uint16_t* x, int64_t ldx, int m, uint16_t* y, int64_t ldy,
                                             const LinearWorkspace& ws, CUstream_st* stream) {
  char* scratch = static_cast<char*>(ws.scratch());
  Fp8ActOut xq;
  xq.data = reinterpret_cast<uint8_t*>(scratch);
  xq.scales = reinterpret_cast<float*>(scratch + xq_bytes(m));
  xq.rows = m, xq.cols = int(in_cols()), xq.ld = in_cols(), xq.scale_ld = m;
  detail::launch_quantize_bf16(x, ldx, xq, stream);
  float* repack = reinterpret_cast<float*>(scratch + xq_bytes(m) + xs_bytes(m));
  fp8->forward(xq, y, ldy, options, ws, repack, stream, route);
}

bool W8A16GroupedLinear::Impl::run_cublas(const uint16_t* x, int64_t ldx, int m, uint16_t* y, int64_t ldy,
                                          const LinearWorkspace& ws, CUstream_st* stream) {
  if (!bf16.get()) {
    route.note = "no bf16 copy of the weight (bf16_copy = false)";
    return false;
  }
  if (ldy % 8 != 0 || !detail::aligned(y, 16)) {
    route.note = "cuBLASLt needs 8 | ldy and a 16-byte aligned output";
    return false;
  }
  LtProblem p;
  p.kind = LtKind::kBf16;
  p.m = n_g, p.n = m, p.k = k_g;
  p.lda = k_g, p.ldb = ldx, p.ldd = ldy;
  p.batch = groups, p.stride_a = n_g * k_g, p.stride_b = k_g, p.stride_d = n_g;
  p.workspace_bytes = ws.cublas_bytes();
  return detail::run_lt_bf16(plans, p, bf16.get(), x, y, ws, m, stream, route);
}

W8A16GroupedLinear::W8A16GroupedLinear(const WeightMatrix& w, int groups, const W8A16Options& options)
    : impl_(std::make_unique<Impl>()) {
  const std::string who = "W8A16GroupedLinear";
  Impl& im = *impl_;
  const WeightMatrix* parts[] = {&w};
  im.w = detail::upload_fp8(parts, who);
  DSV4_REQUIRE(groups >= 1 && im.w.rows % groups == 0,
          who + ": " + std::to_string(im.w.rows) + " rows do not split into " + std::to_string(groups) + " groups");
  im.groups = groups;
  im.n_g = im.w.rows / groups;
  im.k_g = im.w.cols;
  DSV4_REQUIRE(groups == 1 || im.n_g % 128 == 0,
               who + ": rows per group (" + std::to_string(im.n_g) + ") must be a multiple of 128");
  if (options.bf16_copy) im.bf16 = detail::upload_fp8_as_bf16(w);
  im.options = options;
  im.fp8 = std::make_unique<detail::Fp8Product>(&im.w, groups, who + " (fp8_input)");
  detail::gemv_prepare();
}

W8A16GroupedLinear::~W8A16GroupedLinear() = default;
W8A16GroupedLinear::W8A16GroupedLinear(W8A16GroupedLinear&&) noexcept = default;
W8A16GroupedLinear& W8A16GroupedLinear::operator=(W8A16GroupedLinear&&) noexcept = default;

void W8A16GroupedLinear::forward(const uint16_t* x, int64_t ldx, int m, uint16_t* y, int64_t ldy,
                                 const Fp8ActOut* y_fp8, LinearWorkspace& ws, CUstream_st* stream) {
  const std::string who = "W8A16GroupedLinear";
  Impl& im = *impl_;
  DSV4_REQUIRE(m >= 0, who + ": negative row count");
  im.route = LinearRoute{};
  im.route.rows = m;
  if (m == 0) return;
  detail::check_bf16_input(who, x, ldx, im.in_cols());
  DSV4_REQUIRE(y != nullptr && detail::aligned(y, 2), who + ": output is null or misaligned");
  DSV4_REQUIRE(ldy >= im.out_cols(), who + ": output row stride smaller than the output columns");
  if (y_fp8) {
    DSV4_REQUIRE(y_fp8->rows == m, who + ": the FP8 output must be [m, G * N_g]");  // its columns: check_fp8_out
    check_fp8_out(*y_fp8, m, im.out_cols(), who);
  }
  ws.check_covers(needs(m), who);

  const bool gemm = detail::wants_gemm(im.options, m);
  if (im.options.fp8_input) {
    im.run_fp8_input(x, ldx, m, y, ldy, ws, stream);
  } else if (gemm || !(detail::wants_cublas(im.options, m) && im.run_cublas(x, ldx, m, y, ldy, ws, stream))) {
    detail::GemvArgs a;
    a.kind = detail::GemvWeight::kW8A16;
    a.w = im.w.codes(), a.w_scales = im.w.block_scales(), a.w_scale_ld = im.w.scale_ld;
    a.n = im.w.rows, a.k = im.k_g, a.group_rows = im.n_g;
    a.x = x, a.ldx = ldx;
    a.y = y, a.ldy = ldy;
    if (y_fp8) a.q = *y_fp8, a.quantize = true;
    a.forced_splits = im.options.splits;
    if (gemm) detail::run_gemm(a, m, ws, stream, im.route);
    else detail::run_gemv(a, m, ws, stream, im.route);
    return;
  }
  if (y_fp8) {  // cuBLASLt or the FP8 variant wrote y: quantize it separately
    detail::launch_quantize_bf16(y, ldy, *y_fp8, stream);
    im.route.quantize_kernel = true;
  }
}

int W8A16GroupedLinear::groups() const { return impl_->groups; }
int64_t W8A16GroupedLinear::group_in() const { return impl_->k_g; }
int64_t W8A16GroupedLinear::group_out() const { return impl_->n_g; }

LinearNeeds W8A16GroupedLinear::needs(int max_m) const {
  const Impl& im = *impl_;
  LinearNeeds n = detail::gemv_needs(detail::GemvWeight::kW8A16, im.w.rows, im.k_g, max_m, im.options.splits);
  if (im.options.fp8_input) {
    LinearNeeds f = im.fp8->needs(max_m, im.options.splits);
    f.scratch_bytes += im.xq_bytes(max_m) + im.xs_bytes(max_m);
    n = detail::max_needs(n, f);
  }
  return n;
}

const W8A16Options& W8A16GroupedLinear::options() const { return impl_->options; }

void W8A16GroupedLinear::set_options(const W8A16Options& options) {
  impl_->options = options;
  impl_->options.bf16_copy = impl_->bf16.get() != nullptr;  // fixed at construction
}

const LinearRoute& W8A16GroupedLinear::last_route() const { return impl_->route; }

size_t W8A16GroupedLinear::device_bytes() const {
  return impl_->w.data.size() + impl_->w.scales.size() + impl_->bf16.size();
}

}  // namespace dsv4::cuda
