// The per-head q norm and RoPE (q_head_norm_rope.h). The (token, head) rows
// are numbered r = t * H + h; a CTA takes kQHeadRows consecutive rows (a
// decode token's 64 heads take 8 CTAs: the sum of squares is a chain of 512
// dependent adds per row, so rows are spread over many CTAs) and runs the
// body shared with the wq_b kernel's fused tail (q_head_norm_rope.cuh).
#include "attn/cuda/q_head_norm_rope.h"

#include <string>

#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/q_head_norm_rope.cuh"

namespace dsv4::cuda {
namespace {

__global__ void __launch_bounds__(kQHeadThreads)
    q_head_kernel(const QHeadNormRopeParams p, const __grid_constant__ RopeFreqs rf) {
  pdl_start();  // pdl.cuh: launched with pdl_launch
  __shared__ QHeadSmem sm;
  const int H = p.num_heads;
  const int r0 = int(blockIdx.x) * kQHeadRows;  // rows < 2^31 (checked on the host)
  const int nrows = min(kQHeadRows, p.num_tokens * H - r0);
  auto row_ptr = [&](int i) {
    const int t = (r0 + i) / H, h = (r0 + i) - t * H;
    return p.q + int64_t(t) * p.q_ld + h * 512;
  };
  auto pos_of = [&](int i) { return int64_t(__ldg(p.positions + (r0 + i) / H)); };
  q_head_rows(nrows, row_ptr, pos_of, rf.inv_freq, p.eps, sm);
}

}  // namespace

void check_q_head_norm_rope_params(const QHeadNormRopeParams& p) {
  const std::string what = "q_head_norm_rope (cuda)";
  DSV4_REQUIRE(p.num_tokens >= 0, what + ": negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.num_heads > 0, what + ": num_heads must be positive");
  DSV4_REQUIRE(p.q && p.positions && p.rope, what + ": q, positions and rope are required");
  DSV4_REQUIRE(p.q_ld >= int64_t(p.num_heads) * 512 && p.q_ld % 8 == 0 && aligned(p.q, 16),
          what + ": q must be 16-byte aligned with a row stride >= num_heads * 512, a multiple of 8");
  DSV4_REQUIRE(p.eps >= 0.0f && p.eps < 1.0f, what + ": eps out of range");
  DSV4_REQUIRE(int64_t(p.num_tokens) * p.num_heads + kQHeadRows < (int64_t(1) << 31),
          what + ": too many (token, head) rows for one launch (2^31)");
}

void q_head_norm_rope_cuda(const QHeadNormRopeParams& p, CUstream_st* stream) {
  check_q_head_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const int64_t blocks = (int64_t(p.num_tokens) * p.num_heads + kQHeadRows - 1) / kQHeadRows;
  pdl_launch(q_head_kernel, unsigned(blocks), kQHeadThreads, 0, stream, p, p.rope->freqs());
  cuda_check(cudaGetLastError(), "q_head_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
