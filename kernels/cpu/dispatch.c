/* dispatch.c: moving rows between token order and expert order. Every loop
 * runs over destination rows, so no two threads write the same row and the
 * slot order of each sum is fixed: results are deterministic. */
#include <stdbool.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

/* One expert cursor [E] of scratch. */
size_t moe_cpu_plan_scratch_bytes(int64_t T, int64_t k, int64_t E) {
    (void)T, (void)k;
    return (size_t)E * sizeof(int64_t);
}

/* Serial: one pass over T*k pairs is cheap next to the rows it moves, and a
 * counting sort's ranks would otherwise need a scan per thread. */
void moe_cpu_plan_build(int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets, const int32_t *topk_idx,
                        const int64_t *keep, void *scratch, int64_t T, int64_t k, int64_t E) {
    expert_offsets[0] = 0;
    for (int64_t e = 0; e < E; e++) expert_offsets[e + 1] = expert_offsets[e] + keep[e];
    /* The cursor of expert e runs through its rows and then past them: a pair
     * that finds it at or beyond the next expert's first row is dropped. */
    int64_t *cursor = scratch; /* [E] */
    for (int64_t e = 0; e < E; e++) cursor[e] = expert_offsets[e];
    for (int64_t p = 0; p < T * k; p++) {
        const int32_t e = topk_idx[p];
        const int64_t r = cursor[e]++;
        if (r < expert_offsets[e + 1]) {
            pair_row[p] = r;
            row_token[r] = p / k;
        } else {
            pair_row[p] = -1;
        }
    }
}

void moe_cpu_permute(float *xp, const float *x, const int64_t *row_token, int64_t n_rows,
                     int64_t d) {
#pragma omp parallel for schedule(static) if (n_rows * d >= MOE_CPU_PAR_MIN)
    for (int64_t r = 0; r < n_rows; r++)
        memcpy(xp + r * d, x + row_token[r] * d, (size_t)d * sizeof(float));
}

void moe_cpu_combine(float *y, const float *yp, const float *topk_w, const int64_t *pair_row,
                     const float *shared, int64_t T, int64_t k, int64_t d) {
#pragma omp parallel for schedule(static) if (T * k * d >= MOE_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *out = y + t * d;
        /* The first term is written, not added to zeros: one pass fewer. */
        bool started = shared != NULL;
        if (shared) memcpy(out, shared + t * d, (size_t)d * sizeof(float));
        for (int64_t j = 0; j < k; j++) {
            int64_t r = pair_row[t * k + j];
            if (r < 0) continue;
            const float *src = yp + r * d;
            float w = topk_w[t * k + j];
            if (started) {
#pragma omp simd
                for (int64_t i = 0; i < d; i++) out[i] += w * src[i];
            } else {
#pragma omp simd
                for (int64_t i = 0; i < d; i++) out[i] = w * src[i];
            }
            started = true;
        }
        if (!started) memset(out, 0, (size_t)d * sizeof(float));
    }
}

void moe_cpu_combine_backward(float *dyp, float *dweights, const float *dy, const float *yp,
                              const float *topk_w, const int64_t *pair_row, int64_t T, int64_t k,
                              int64_t d) {
#pragma omp parallel for schedule(static) if (T * k * d >= MOE_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = dy + t * d;
        for (int64_t j = 0; j < k; j++) {
            int64_t r = pair_row[t * k + j];
            if (r < 0) {
                dweights[t * k + j] = 0.0f;
                continue;
            }
            const float *src = yp + r * d;
            float *dst = dyp + r * d;
            float w = topk_w[t * k + j], dot = 0.0f;
            /* A vector of partial sums in a fixed order, not one serial chain. */
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++) {
                dot += g[i] * src[i];
                dst[i] = w * g[i];
            }
            dweights[t * k + j] = dot;
        }
    }
}

void moe_cpu_unpermute_add(float *dx, const float *dxp, const int64_t *pair_row, int64_t T,
                           int64_t k, int64_t d) {
#pragma omp parallel for schedule(static) if (T * k * d >= MOE_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *out = dx + t * d;
        for (int64_t j = 0; j < k; j++) {
            int64_t r = pair_row[t * k + j];
            if (r < 0) continue;
            const float *src = dxp + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) out[i] += src[i];
        }
    }
}
