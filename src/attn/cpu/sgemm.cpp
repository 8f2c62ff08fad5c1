#include "attn/cpu/sgemm.h"

#include <algorithm>
#include <cstddef>

#if DSV4_HAVE_CBLAS
#include <cblas.h>
#endif

namespace dsv4 {

#if DSV4_HAVE_CBLAS

void sgemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

void sgemm_nn(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

#else

// Rows of C in parallel; within a row, dot products over k (nt) or axpy over
// rows of B (nn), both reading memory contiguously.
void sgemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
#pragma omp parallel for collapse(2) schedule(static) if (int64_t(m) * n * k > 100000)
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      const float* ai = a + size_t(i) * size_t(lda);
      const float* bj = b + size_t(j) * size_t(ldb);
      float s = 0.0f;
      for (int p = 0; p < k; ++p) s += ai[p] * bj[p];
      c[size_t(i) * size_t(ldc) + size_t(j)] = s;
    }
}

void sgemm_nn(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
#pragma omp parallel for schedule(static) if (int64_t(m) * n * k > 100000)
  for (int i = 0; i < m; ++i) {
    float* ci = c + size_t(i) * size_t(ldc);
    std::fill(ci, ci + n, 0.0f);
    for (int p = 0; p < k; ++p) {
      const float aip = a[size_t(i) * size_t(lda) + size_t(p)];
      const float* bp = b + size_t(p) * size_t(ldb);
      for (int j = 0; j < n; ++j) ci[j] += aip * bp[j];
    }
  }
}

#endif

}  // namespace dsv4
