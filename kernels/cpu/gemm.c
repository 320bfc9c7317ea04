/* gemm.c: every CPU GEMM goes through OpenBLAS. */
#include <cblas.h>

#include "kernels/cpu/cpu_ops.h"

void moe_cpu_gemm(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k,
                  int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha,
                  float beta) {
    if (m == 0 || n == 0) return;
    if (k == 0) { /* BLAS may skip the beta scaling when k is 0 */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
        return;
    }
    /* The layer validates every size against INT_MAX before it calls here:
     * OpenBLAS takes 32-bit ints. */
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, alpha, a, (int)lda, b,
                (int)ldb, beta, c, (int)ldc);
}
