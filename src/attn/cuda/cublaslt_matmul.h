#pragma once
// cuBLASLt for the linears' large-M path: one cached plan (descriptors and
// the heuristic's algorithm) per problem shape. Host-only header.
//
// cuBLASLt is column-major. Our row-major y[M, N] = x[M, K] W[N, K]^T is the
// column-major D (N x M) = A^T B with A = W seen as K x N (lda = K, TRANSA =
// T) and B = x seen as K x M (ldb = x's row stride, TRANSB = N): the weight
// is "A", the activation "B", and D's leading dimension is y's row stride.
//
// Block-scaled FP8 (Hopper, cuBLAS >= 12.9): A with BLK128x128_32F scales,
// B with VEC128_32F scales, fp32 accumulation, bf16 D. Scale layouts, as
// TransformerEngine's GEMM-ready tensors lay them out for cuBLASLt:
//   A (the weight, N rows of K): scale(n / 128, k / 128) at
//     [(n / 128) * ld + k / 128] with ld = round_up(ceil(K / 128), 4)
//     (our row-major block grid, rows padded to 16 bytes);
//   B (the activation, M rows of K): scale(m, k / 128) at [(k / 128) * M + m]
//     (M-major: Fp8Act's layout with scale_ld == M).
// cuBLASLt takes FP8 block-scaled problems only with M a multiple of 8 (and
// N a multiple of 8, K of 16, 16-byte aligned pointers and strides); the
// heuristic query tells whether a shape runs.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct CUstream_st;

namespace dsv4::cuda {

enum class LtKind {
  kFp8BlockScaled,  // e4m3 A and B, bf16 D
  kBf16,            // bf16 A, B and D
  kBf16ToF32,       // bf16 A and B, fp32 D
};

// D (m x n, ldd) = A^T (A: k x m, lda) B (B: k x n, ldb), column-major;
// `batch` problems at element strides stride_a / stride_b / stride_d.
struct LtProblem {
  LtKind kind = LtKind::kBf16;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  int batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_d = 0;
  size_t workspace_bytes = 0;
  bool operator==(const LtProblem&) const = default;
};

// Rows of the A scale grid padded to 16 bytes (see above).
inline int64_t lt_weight_scale_ld(int64_t k) { return ((k + 127) / 128 + 3) / 4 * 4; }

class LtMatmul {
 public:
  // Builds the descriptors and asks the heuristic for an algorithm; never
  // throws for an unsupported problem: supported() is false and reason() says why.
  explicit LtMatmul(const LtProblem& p);
  ~LtMatmul();
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;

  const LtProblem& problem() const;
  bool supported() const;
  const std::string& reason() const;

  // The heuristic's algorithms for this problem, best first by its own
  // estimate (at most kMaxCandidates); run() uses candidate chosen(): 0, or
  // for a block-scaled FP8 problem that fills few SMs, candidate 0 with k
  // split (see fp8_k_splits in the .cu), unless choose() said otherwise.
  // describe() names an algorithm's configuration: tile, stages, split of k
  // and its reduction, swizzle; splits() is the chosen one's split of k.
  static constexpr int kMaxCandidates = 16;
  int candidates() const;
  int chosen() const;
  void choose(int candidate);
  std::string describe(int candidate) const;
  // Adds candidate 0's algorithm with k split `splits` ways, the parts summed
  // in fp32 (reduction scheme COMPUTE_TYPE), when cuBLASLt accepts that
  // configuration within the workspace; returns its index, or -1.
  int add_split_candidate(int splits);
  int splits() const;

  // Enqueues the product (scale pointers only for kFp8BlockScaled); throws
  // Error when cuBLASLt fails.
  void run(const void* a, const float* a_scales, const void* b, const float* b_scales, void* d, void* workspace,
           CUstream_st* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A linear's plans, built on first use of each problem (host work only, so
// it may happen while a CUDA graph is being captured).
class LtPlans {
 public:
  LtMatmul& get(const LtProblem& p);

 private:
  std::vector<std::unique_ptr<LtMatmul>> plans_;
};

}  // namespace dsv4::cuda
