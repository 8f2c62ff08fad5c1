// The inverse RoPE of the attention output (out_rope.h). One CTA per token:
// the 32 (cos, -sin) of its position once in shared memory, then every head's
// rotary tail (8 chunks of 16 bytes) read, rotated and written back.
#include "attn/cuda/out_rope.h"

#include <string>

#include "attn/cuda/fused_common.cuh"
#include "attn/cuda/pdl.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kTailChunks = kRopeDim / 8;  // 16-byte chunks of a head's dims 448..511

__global__ void __launch_bounds__(kThreads)
    out_rope_kernel(const OutInverseRopeParams p, const __grid_constant__ RopeFreqs rf) {
  pdl_start();  // pdl.cuh: launched with pdl_launch
  __shared__ float2 cs_s[kRopeDim / 2];
  const int t = blockIdx.x;
  if (threadIdx.x < kRopeDim / 2)
    cs_s[threadIdx.x] = rope_cos_sin(__ldg(p.positions + t), rf.inv_freq[threadIdx.x], /*inverse=*/true);
  __syncthreads();
  uint16_t* row = p.o + int64_t(t) * p.o_ld + kNopeDim;
  for (int k = threadIdx.x; k < p.num_heads * kTailChunks; k += kThreads) {
    const int h = k / kTailChunks, c = k % kTailChunks;
    uint4* ptr = reinterpret_cast<uint4*>(row + int64_t(h) * 512 + 8 * c);
    const uint4 x = *ptr;
    const float2* cs = cs_s + 4 * c;  // pairs 4c .. 4c + 3
    *ptr = make_uint4(rope_rotate_bf16x2(x.x, cs[0]), rope_rotate_bf16x2(x.y, cs[1]), rope_rotate_bf16x2(x.z, cs[2]),
                      rope_rotate_bf16x2(x.w, cs[3]));
  }
}

// One warp per token: pair i's (cos, -sin) by lane i.
__global__ void __launch_bounds__(kRopeDim / 2)
    out_rope_table_kernel(const int32_t* positions, float2* table, const __grid_constant__ RopeFreqs rf) {
  pdl_start();  // pdl.cuh: launched with pdl_launch
  const int t = blockIdx.x;
  table[int64_t(t) * (kRopeDim / 2) + threadIdx.x] =
      rope_cos_sin(__ldg(positions + t), rf.inv_freq[threadIdx.x], /*inverse=*/true);
}

}  // namespace

void out_rope_table_cuda(const int32_t* positions, int num_tokens, const Rope& rope, float* table,
                         CUstream_st* stream) {
  const std::string what = "out_rope_table (cuda)";
  DSV4_REQUIRE(num_tokens >= 0, what + ": negative token count");
  if (num_tokens == 0) return;
  DSV4_REQUIRE(positions && table && aligned(positions, 4) && aligned(table, 16),
               what + ": positions (4-byte aligned) and table (16-byte aligned) are required");
  pdl_launch(out_rope_table_kernel, unsigned(num_tokens), kRopeDim / 2, 0, stream, positions,
             reinterpret_cast<float2*>(table), rope.freqs());
  cuda_check(cudaGetLastError(), "out_rope_table (cuda): launch");
}

void check_out_inverse_rope_params(const OutInverseRopeParams& p) {
  const std::string what = "out_inverse_rope (cuda)";
  DSV4_REQUIRE(p.num_tokens >= 0, what + ": negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.num_heads > 0, what + ": num_heads must be positive");
  DSV4_REQUIRE(p.o && p.positions && p.rope, what + ": o, positions and rope are required");
  DSV4_REQUIRE(p.o_ld >= int64_t(p.num_heads) * 512 && p.o_ld % 8 == 0 && aligned(p.o, 16),
          what + ": o must be 16-byte aligned with a row stride >= num_heads * 512, a multiple of 8");
}

void out_inverse_rope_cuda(const OutInverseRopeParams& p, CUstream_st* stream) {
  check_out_inverse_rope_params(p);
  if (p.num_tokens == 0) return;
  pdl_launch(out_rope_kernel, unsigned(p.num_tokens), kThreads, 0, stream, p, p.rope->freqs());
  cuda_check(cudaGetLastError(), "out_inverse_rope (cuda): launch");
}

}  // namespace dsv4::cuda
