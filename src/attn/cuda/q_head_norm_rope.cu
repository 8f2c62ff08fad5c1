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

// kTable: the factors from out_rope_table_cuda's (cos, -sin) table (one
// entry per token and pair), else computed per row. Without the sincos the
// kernel fits 32 registers (ptxas, no spills): 8 CTAs an SM, so the 1,024
// CTAs of 128 decode tokens at 64 heads run in one wave.
template <bool kTable>
__global__ void __launch_bounds__(kQHeadThreads, kTable ? 8 : 0)
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
  auto cs_of = [&](int i, int pair) {
    const int t = (r0 + i) / H;
    if constexpr (kTable) {
      const float2 cs = __ldg(reinterpret_cast<const float2*>(p.rope_table) + int64_t(t) * (kRopeDim / 2) + pair);
      return make_float2(cs.x, -cs.y);
    } else {
      return rope_cos_sin(int64_t(__ldg(p.positions + t)), rf.inv_freq[pair]);
    }
  };
  q_head_rows(nrows, row_ptr, cs_of, p.eps, sm);
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
  DSV4_REQUIRE(p.rope_table == nullptr || aligned(p.rope_table, 16), what + ": rope_table must be 16-byte aligned");
  DSV4_REQUIRE(int64_t(p.num_tokens) * p.num_heads + kQHeadRows < (int64_t(1) << 31),
          what + ": too many (token, head) rows for one launch (2^31)");
}

void q_head_norm_rope_cuda(const QHeadNormRopeParams& p, CUstream_st* stream) {
  check_q_head_norm_rope_params(p);
  if (p.num_tokens == 0) return;
  const int64_t blocks = (int64_t(p.num_tokens) * p.num_heads + kQHeadRows - 1) / kQHeadRows;
  if (p.rope_table)
    pdl_launch(q_head_kernel<true>, unsigned(blocks), kQHeadThreads, 0, stream, p, p.rope->freqs());
  else
    pdl_launch(q_head_kernel<false>, unsigned(blocks), kQHeadThreads, 0, stream, p, p.rope->freqs());
  cuda_check(cudaGetLastError(), "q_head_norm_rope (cuda): launch");
}

}  // namespace dsv4::cuda
