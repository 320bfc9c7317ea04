/* gemm.c: every CPU GEMM goes through OpenBLAS. */
#include <cblas.h>

#include "kernels/cpu/cpu_ops.h"

/* Up to this many multiply-adds moe_cpu_gemm_split cuts a GEMM into blocks
 * of C's rows, each a single-threaded OpenBLAS call (the OpenMP build runs
 * on the calling thread inside a parallel region; the pthread build would
 * start its own threads in each, and is left whole), taken by the cores in
 * turn: OpenBLAS's own threads cost more than they split at these
 * sizes. Measured on two cores: [1024, 64] x [64, 64] forward and backward
 * run in 0.6-0.7 of the time, [16384, 64] x [64, 64] in 0.7-0.8, while at
 * [2048, 256] x [256, 256] (2^27 multiply-adds) the cut is 4-10% slower. */
#define GEMM_SPLIT_MAX_MACS ((int64_t)1 << 25)
#define GEMM_SPLIT_ROWS_MIN 32

/* Blocks from the row count alone, so that the result does not depend on
 * the number of threads: about four, which keep OpenBLAS's packing of B
 * (redone per call) a small share. */
static int64_t split_rows(int64_t m) {
    const int64_t rows = (m / 4 + 15) / 16 * 16;
    return rows < GEMM_SPLIT_ROWS_MIN ? GEMM_SPLIT_ROWS_MIN : rows;
}

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
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)m,
                (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

void moe_cpu_gemm_split(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k, int64_t lda,
                        int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha, float beta) {
    const int64_t rows = split_rows(m), blocks = (m + rows - 1) / rows;
    if (blocks < 2 || k == 0 || m * n * k > GEMM_SPLIT_MAX_MACS || openblas_get_parallel() == OPENBLAS_THREAD) {
        moe_cpu_gemm(c, a, b, m, n, k, lda, ldb, ldc, trans_a, trans_b, alpha, beta);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t r0 = i * rows, nr = m - r0 < rows ? m - r0 : rows;
        moe_cpu_gemm(c + r0 * ldc, trans_a ? a + r0 : a + r0 * lda, b, nr, n, k, lda, ldb, ldc, trans_a, trans_b,
                     alpha, beta);
    }
}
