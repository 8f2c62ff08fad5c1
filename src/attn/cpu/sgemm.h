#pragma once
// Row-major float32 matrix products for the CPU ops: OpenBLAS where the build
// found it, else a blocked, OpenMP-parallel loop (the lent GPU machine has no
// cblas.h; the fallback computes the same function, more slowly).
namespace dsv4 {

// C[m, n] = A[m, k] . B[n, k]^T (beta = 0).
void sgemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc);
// C[m, n] = A[m, k] . B[k, n] (beta = 0).
void sgemm_nn(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc);

}  // namespace dsv4
