/* dense.c: the dense ops of the transformer around the MoE layers:
 * embedding, RMSNorm, bias-free linear layers, RoPE, cross-entropy,
 * residual adds, the shared expert's sigmoid gate, AdamW and the gradient
 * norm (attention is in attention.c).
 * Reductions over rows run column-parallel or in fixed parts, never as
 * per-thread partials, so the bits do not depend on the thread count. */
#include <math.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/dense.h"
#include "kernels/moe_math.h"

/* Columns per task in the column-parallel reductions: 16 floats, one
 * 64-byte cache line when the array is aligned, so threads do not write
 * into each other's lines. */
#define COL_BLOCK 16

/* ---------------------------------------------------------------- embedding */

void moe_cpu_embedding_forward(float *out, const int32_t *tokens, const float *wte, int64_t N,
                               int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= MOE_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *row = wte + (int64_t)tokens[n] * C; /* [C] */
        float *o = out + n * C;                          /* [C] */
        for (int64_t c = 0; c < C; c++) o[c] = row[c];
    }
}

/* Tokens repeat, so rows of dwte collide: each thread owns a block of
 * columns and walks all rows in order, which needs no atomics and fixes the
 * summation order. */
void moe_cpu_embedding_backward(float *dwte, const float *dout, const int32_t *tokens, int64_t N,
                                int64_t C) {
    const int64_t n_blocks = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (N * C >= MOE_CPU_PAR_MIN)
    for (int64_t cb = 0; cb < n_blocks; cb++) {
        const int64_t c0 = cb * COL_BLOCK;
        const int64_t c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
        for (int64_t n = 0; n < N; n++) {
            float *dw = dwte + (int64_t)tokens[n] * C; /* [C] */
            const float *d = dout + n * C;             /* [C] */
            for (int64_t c = c0; c < c1; c++) dw[c] += d[c];
        }
    }
}

/* ------------------------------------------------------------------ RMSNorm */

/* Rows go RMS_ROWS at a time so that their double sums, each one chain in
 * column order as a row alone would have it (the same bits), run side by
 * side instead of waiting on one add's latency per element. A last group
 * short of RMS_ROWS repeats its last row rather than taking a second loop. */
#define RMS_ROWS 8

/* The row that lane r of the group starting at row n0 reads, of N rows. */
static int64_t group_row(int64_t n0, int64_t r, int64_t N) { return n0 + r < N ? n0 + r : N - 1; }

void moe_cpu_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                             float eps, int64_t N, int64_t C) {
    const int64_t n_groups = (N + RMS_ROWS - 1) / RMS_ROWS;
#pragma omp parallel for schedule(static) if (N * C >= MOE_CPU_PAR_MIN)
    for (int64_t gi = 0; gi < n_groups; gi++) {
        const int64_t n0 = gi * RMS_ROWS;
        const float *x[RMS_ROWS]; /* [C] each */
        for (int64_t r = 0; r < RMS_ROWS; r++) x[r] = inp + group_row(n0, r, N) * C;
        double ss[RMS_ROWS] = {0};
        for (int64_t c = 0; c < C; c++)
            for (int64_t r = 0; r < RMS_ROWS; r++) ss[r] += (double)x[r][c] * x[r][c];
        for (int64_t r = 0; r < RMS_ROWS && n0 + r < N; r++) {
            float *y = out + (n0 + r) * C; /* [C] */
            const float rs = (float)(1.0 / sqrt(ss[r] / (double)C + (double)eps));
            rstd[n0 + r] = rs;
            for (int64_t c = 0; c < C; c++) y[c] = weight[c] * (x[r][c] * rs);
        }
    }
}

/* With xhat = x * rstd and g = dout * weight:
 *   dx = rstd * (g - xhat * mean(g * xhat)),  dweight += sum_n dout * xhat. */
void moe_cpu_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                              const float *weight, const float *rstd, int64_t N, int64_t C) {
    const int64_t n_groups = (N + RMS_ROWS - 1) / RMS_ROWS;
#pragma omp parallel for schedule(static) if (N * C >= MOE_CPU_PAR_MIN)
    for (int64_t gi = 0; gi < n_groups; gi++) {
        const int64_t n0 = gi * RMS_ROWS;
        const float *x[RMS_ROWS], *dy[RMS_ROWS]; /* [C] each */
        float rs[RMS_ROWS];
        for (int64_t r = 0; r < RMS_ROWS; r++) {
            const int64_t n = group_row(n0, r, N);
            x[r] = inp + n * C;
            dy[r] = dout + n * C;
            rs[r] = rstd[n];
        }
        double dot[RMS_ROWS] = {0};
        for (int64_t c = 0; c < C; c++)
            for (int64_t r = 0; r < RMS_ROWS; r++) dot[r] += (double)(dy[r][c] * weight[c]) * (x[r][c] * rs[r]);
        for (int64_t r = 0; r < RMS_ROWS && n0 + r < N; r++) {
            float *dx = dinp + (n0 + r) * C; /* [C] */
            const float mean_gx = (float)(dot[r] / (double)C);
            for (int64_t c = 0; c < C; c++)
                dx[c] += rs[r] * (dy[r][c] * weight[c] - (x[r][c] * rs[r]) * mean_gx);
        }
    }
    const int64_t n_blocks = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (N * C >= MOE_CPU_PAR_MIN)
    for (int64_t cb = 0; cb < n_blocks; cb++) {
        const int64_t c0 = cb * COL_BLOCK;
        const int64_t c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
        double acc[COL_BLOCK] = {0};
        for (int64_t n = 0; n < N; n++) {
            const float r = rstd[n];
            const float *x = inp + n * C, *dy = dout + n * C;
            for (int64_t c = c0; c < c1; c++) acc[c - c0] += (double)(dy[c] * (x[c] * r));
        }
        for (int64_t c = c0; c < c1; c++) dweight[c] += (float)acc[c - c0];
    }
}

/* ------------------------------------------------------------------- matmul */

void moe_cpu_matmul_forward(float *out, const float *inp, const float *weight, int64_t N,
                            int64_t C, int64_t OC) {
    moe_cpu_gemm_split(out, inp, weight, N, OC, C, C, C, OC, false, true, 1.0f, 0.0f);
}

void moe_cpu_matmul_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                             const float *weight, int64_t N, int64_t C, int64_t OC) {
    moe_cpu_gemm_split(dinp, dout, weight, N, C, OC, OC, C, C, false, false, 1.0f, 1.0f);
    moe_cpu_gemm_split(dweight, dout, inp, OC, C, N, OC, C, C, true, false, 1.0f, 1.0f);
}

/* --------------------------------------------------------------------- RoPE */

/* Rotates every (i, i + hd/2) pair by +angle (sign = 1) or -angle (-1). */
static void rope_rotate(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                        int64_t H, int64_t hd, float sign) {
    const int64_t half = hd / 2;
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * hd >= MOE_CPU_PAR_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float *cs = cos_t + t * half, *sn = sin_t + t * half; /* [hd/2] */
            for (int64_t h = 0; h < H; h++) {
                float *x1 = x + ((b * T + t) * H + h) * hd; /* [hd/2] */
                float *x2 = x1 + half;                      /* [hd/2] */
                for (int64_t i = 0; i < half; i++) {
                    const float c = cs[i], s = sign * sn[i];
                    const float a = x1[i], bb = x2[i];
                    x1[i] = a * c - bb * s;
                    x2[i] = bb * c + a * s;
                }
            }
        }
}

void moe_cpu_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                          int64_t H, int64_t hd) {
    rope_rotate(x, cos_t, sin_t, B, T, H, hd, 1.0f);
}

void moe_cpu_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B,
                           int64_t T, int64_t H, int64_t hd) {
    rope_rotate(dx, cos_t, sin_t, B, T, H, hd, -1.0f);
}

/* ------------------------------------------------------------ cross-entropy */

void moe_cpu_crossentropy_forward(float *losses, double *lse, const float *logits,
                                  const int32_t *targets, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= MOE_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *z = logits + n * V; /* [V] */
        float mx = -INFINITY;
        /* Not fmaxf, which stays a libm call per element; a NaN logit makes
         * the loss NaN through the sum either way. */
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < V; j++) mx = z[j] > mx ? z[j] : mx;
        /* Lanes of partial sums in a fixed order, and moe_expf, which
         * vectorises where libm's expf is a call per element. */
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < V; j++) sum += moe_expf(z[j] - mx);
        const double l = (double)mx + log(sum);
        lse[n] = l;
        losses[n] = targets[n] < 0 ? 0.0f : (float)(l - (double)z[targets[n]]);
    }
}

/* No restrict: dlogits may be logits, and each element is read once, just
 * before it is overwritten. */
void moe_cpu_crossentropy_backward(float *dlogits, const float *logits, const double *lse,
                                   const int32_t *targets, const float *dloss, float z_coef, int64_t N,
                                   int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= MOE_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *z = logits + n * V; /* [V] */
        float *dz = dlogits + n * V;     /* [V] */
        const int32_t tgt = targets[n];
        const float w = tgt < 0 ? 0.0f : dloss[n];
        const double l = lse[n];
        const float wp = w * (1.0f + 2.0f * z_coef * (float)l); /* the probabilities' weight */
        for (int64_t j = 0; j < V; j++) dz[j] = wp * moe_expf((float)((double)z[j] - l));
        if (tgt >= 0) dz[tgt] -= w;
    }
}

/* ----------------------------------------------------------------- residual */

void moe_cpu_residual_forward(float *out, const float *a, const float *b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= MOE_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void moe_cpu_residual_backward(float *da, float *db, const float *dout, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= MOE_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        da[i] += dout[i];
        db[i] += dout[i];
    }
}

void moe_cpu_multiply(float *out, const float *a, const float *b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= MOE_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = a[i] * b[i];
}

void moe_cpu_uniform(float *out, uint64_t seed, uint64_t stream, uint64_t first, float lo, float span, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= MOE_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = moe_rng_uniform_in(seed, stream, first + (uint64_t)i, lo, span);
}

/* ------------------------------------------------------ shared expert gate */

/* Over rows only: each row's dot is one chain in column order, so the bits
 * do not depend on the thread count. No restrict: out may be in, din dout,
 * and each element is read just before it is written. */
void moe_cpu_sigmoid_gate_forward(float *out, float *gate, const float *in, const float *logits, int64_t T,
                                  int64_t d) {
#pragma omp parallel for schedule(static) if (T * d >= MOE_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float g = moe_sigmoidf(logits[t]);
        gate[t] = g;
        for (int64_t j = 0; j < d; j++) out[t * d + j] = g * in[t * d + j];
    }
}

void moe_cpu_sigmoid_gate_backward(float *din, float *dlogits, const float *dout, const float *out,
                                   const float *gate, int64_t T, int64_t d) {
#pragma omp parallel for schedule(static) if (T * d >= MOE_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float g = gate[t];
        double dot = 0.0;
        for (int64_t j = 0; j < d; j++) {
            const float dy = dout[t * d + j];
            dot += (double)dy * out[t * d + j];
            din[t * d + j] = g * dy;
        }
        dlogits[t] = (float)((1.0 - (double)g) * dot);
    }
}

/* ---------------------------------------------------------------- optimizer */

void moe_cpu_adamw(float *params, float *m, float *v, const float *grads, float grad_scale, int64_t n,
                   const moe_adamw_span *spans, int64_t n_spans, float lr, float beta1, float beta2,
                   float eps, float weight_decay, int64_t t) {
    const moe_adamw_step step = moe_adamw_step_at(lr, beta1, beta2, weight_decay, t);
    /* The four arrays are separate allocations: restrict lets the update
     * vectorise. One parallel region for all spans, and no barrier between
     * them (they are disjoint), instead of a fork and join per span. */
    float *restrict p = params, *restrict pm = m, *restrict pv = v;
    const float *restrict g = grads;
#pragma omp parallel if (n >= MOE_CPU_PAR_MIN)
    {
        int64_t begin = 0;
        for (int64_t s = 0; s < n_spans; s++) {
            const int64_t end = spans[s].end < n ? spans[s].end : n;
            const float d = spans[s].decays ? step.decay : 1.0f;
#pragma omp for simd schedule(static) nowait
            for (int64_t i = begin; i < end; i++)
                moe_adamw_update(&p[i], &pm[i], &pv[i], g[i] * grad_scale, beta1, beta2, eps, d, step.step_size,
                                 step.bc2_sqrt);
            begin = end;
        }
    }
}

/* ---------------------------------------------------------------- reduction */

/* The array is cut into this many equal parts whatever the thread count;
 * each part is summed alone and the parts are added in order. */
#define SUMSQ_PARTS 256

void moe_cpu_sumsq(double *out, const float *x, int64_t n) {
    double part[SUMSQ_PARTS];
#pragma omp parallel for schedule(static) if (n >= MOE_CPU_PAR_MIN)
    for (int64_t p = 0; p < SUMSQ_PARTS; p++) {
        const int64_t i0 = n * p / SUMSQ_PARTS, i1 = n * (p + 1) / SUMSQ_PARTS;
        double s = 0.0;
        /* simd reorders the sum into lanes, the same for every run of this
         * binary: what matters here is independence from the thread count. */
#pragma omp simd reduction(+ : s)
        for (int64_t i = i0; i < i1; i++) s += (double)x[i] * x[i];
        part[p] = s;
    }
    double total = 0.0;
    for (int64_t p = 0; p < SUMSQ_PARTS; p++) total += part[p];
    *out = total;
}
