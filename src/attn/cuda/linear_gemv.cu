// Host side of the small-M kernel: the split of k, workspace sizes, launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "attn/cuda/linear.h"
#include "attn/cuda/linear_gemv.cuh"
#include "common/error.h"

namespace dsv4::cuda {

namespace detail {

void check_cuda(int e, const char* what) {
  if (e != int(cudaSuccess))
    throw Error(std::string("linear (cuda): ") + what + ": " + cudaGetErrorString(cudaError_t(e)));
}

int gemv_tile_rows(int m) { return m <= 8 ? 8 : (m <= 16 ? 16 : (m <= 32 ? 32 : 64)); }

// The activation slice [tile rows, k] as 16-bit values stays within 64 KB.
int64_t gemv_max_cta_k(int tile_rows) { return 32768 / tile_rows; }

// Smallest divisor of kb that is >= lo (kb itself when none is smaller).
static int64_t divisor_at_least(int64_t kb, int64_t lo) {
  for (int64_t d = lo < 1 ? 1 : lo; d < kb; ++d)
    if (kb % d == 0) return d;
  return kb;
}

// Largest divisor of kb that is < hi.
static int64_t divisor_below(int64_t kb, int64_t hi) {
  for (int64_t d = hi - 1; d > 1; --d)
    if (kb % d == 0) return d;
  return 1;
}

// Enough CTAs to keep every multiprocessor streaming (about 1.5 waves of
// row blocks x splits, two CTAs fit per SM), while the partial sums
// (written and read once, fp32) stay below the weight's own bytes.
int gemv_choose_splits(GemvWeight kind, int64_t n, int64_t k, int m, int sms, int forced) {
  const int64_t kb = k / 128;
  const int64_t nrb = (n + kGemvCtaRows - 1) / kGemvCtaRows;
  const int64_t min_splits = divisor_at_least(kb, (k + gemv_max_cta_k(gemv_tile_rows(m)) - 1) /
                                                      gemv_max_cta_k(gemv_tile_rows(m)));
  if (forced > 0 && kb % forced == 0 && forced >= min_splits) return forced;
  const int64_t weight_bytes = kind == GemvWeight::kBf16 ? 2 : 1;
  const int64_t cap = k * weight_bytes / (8 * int64_t(m));
  // Never fewer splits than the activation slice's shared memory allows.
  int64_t s = std::max(min_splits, divisor_at_least(kb, (3 * int64_t(sms) / 2 + nrb - 1) / nrb));
  while (s > min_splits && s > cap) s = divisor_below(kb, s) < min_splits ? min_splits : divisor_below(kb, s);
  return int(s);
}

size_t gemv_partial_floats(int64_t n, int m, int splits) {
  if (splits <= 1) return 0;
  const int64_t nrb = (n + kGemvCtaRows - 1) / kGemvCtaRows;
  return size_t(splits) * size_t(nrb) * size_t(m) * kGemvCtaRows;
}

int gemv_counters(int64_t n) { return int((n + kGemvCtaRows - 1) / kGemvCtaRows); }
int gemv_head_counters(int64_t n) { return n % 512 == 0 ? int(n / 512) : 0; }
bool gemv_residual_tail_fits(int64_t n) { return n % kGemvCtaRows == 0 && n <= kResidualMaxDim; }
int gemv_residual_counter(int64_t n) { return gemv_counters(n) + gemv_head_counters(n); }
size_t gemv_residual_tail_bytes(int64_t n) {
  return kGemvTailSumsAt + size_t(kGemvTailRows) * size_t(n / kGemvCtaRows) * sizeof(double);
}

unsigned long long* g_small_m_stamps = nullptr;

void gemv_prepare() {
  static std::once_flag once;
  static cudaError_t status = cudaSuccess;
  std::call_once(once, [] {
    status = gemv_configure_fp8();
    if (status == cudaSuccess) status = gemv_configure_w8a16();
    if (status == cudaSuccess) status = gemv_configure_bf16();
    if (status == cudaSuccess) status = gemm_configure();
  });
  check_cuda(status, "configuring the small-M kernels and the FP8 GEMM");
}

bool gemv_launch(const GemvArgs& a, CUstream_st* stream) {
  gemv_prepare();
  DSV4_REQUIRE(!(a.q_head.counters && a.residual.counter), "linear (cuda): one tail per launch");
  DSV4_REQUIRE(!a.residual.counter || (a.kind == GemvWeight::kFp8 && !a.y_f32 && a.m <= kGemvTailRows &&
                                       gemv_residual_tail_fits(a.n)),
               "linear (cuda): the residual tail takes FP8 products of up to 8 rows to bf16 whole 128-column blocks "
               "of at most " + std::to_string(kResidualMaxDim) + " columns");
  bool in_cluster = false;
  switch (a.kind) {
    case GemvWeight::kFp8: in_cluster = gemv_launch_fp8(a, stream); break;
    case GemvWeight::kW8A16: in_cluster = gemv_launch_w8a16(a, stream); break;
    case GemvWeight::kBf16: in_cluster = gemv_launch_bf16(a, stream); break;
  }
  check_cuda(cudaGetLastError(), "small-M kernel launch");
  return in_cluster;
}

}  // namespace detail

void set_small_m_stamps(unsigned long long* stamps) { detail::g_small_m_stamps = stamps; }

}  // namespace dsv4::cuda
