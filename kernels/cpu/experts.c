/* experts.c: the grouped SwiGLU experts. Each group is a few large GEMMs
 * (OpenBLAS spreads each over the cores) and one elementwise pass; w1 and w3
 * are adjacent in memory, so h = x [w1; w3]^T is a single GEMM. */
#include "kernels/cpu/cpu_ops.h"
#include "kernels/moe_math.h"

void moe_cpu_experts_forward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    for (int64_t gi = 0; gi < n_groups; gi++) {
        moe_expert_group *g = &groups[gi];
        const int64_t n = g->rows, f = g->d_ff;
        if (n == 0) continue;
        moe_cpu_gemm(g->h, g->x, g->w13, n, 2 * f, d, d, d, 2 * f, false, true, 1.0f, 0.0f);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const float *h = g->h + r * 2 * f; /* [2f]: a then b */
            float *out = g->g + r * f;         /* [f] */
            for (int64_t i = 0; i < f; i++) out[i] = moe_swiglu(h[i], h[f + i]);
        }
        moe_cpu_gemm(g->y, g->g, g->w2, n, d, f, f, f, d, false, true, 1.0f, 0.0f);
    }
}

void moe_cpu_experts_backward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    for (int64_t gi = 0; gi < n_groups; gi++) {
        moe_expert_group *g = &groups[gi];
        const int64_t n = g->rows, f = g->d_ff;
        if (n == 0) continue;
        /* dg = dy w2 lands in the first half of each dh row, then the
         * elementwise pass turns [dg | .] into [da | db] in place. */
        moe_cpu_gemm(g->dh, g->dy, g->w2, n, f, d, d, f, 2 * f, false, false, 1.0f, 0.0f);
        moe_cpu_gemm(g->dw2, g->dy, g->g, d, f, n, d, f, f, true, false, 1.0f, 1.0f);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const float *h = g->h + r * 2 * f;
            float *dh = g->dh + r * 2 * f;
            for (int64_t i = 0; i < f; i++) moe_swiglu_backward(&dh[i], &dh[f + i], dh[i], h[i], h[f + i]);
        }
        moe_cpu_gemm(g->dw13, g->dh, g->x, 2 * f, d, n, 2 * f, d, d, true, false, 1.0f, 1.0f);
        moe_cpu_gemm(g->dx, g->dh, g->w13, n, d, 2 * f, 2 * f, d, d, false, false, 1.0f, 0.0f);
    }
}
