/* attention.c: causal grouped-query attention on the CPU, the eager path of
 * HF Mixtral (fp32 softmax, scale 1/sqrt(hd)). Plain loops over the causal
 * triangle, parallel over (batch, head). One OpenBLAS GEMM per head would be
 * faster alone (B=4, T=256, Hq=8, hd=64, one thread: forward 12.7 ms against
 * 17 ms here; backward here 21.5 ms), but it also computes the masked half,
 * and the pthread OpenBLAS that the build links spawns its own threads when
 * called inside an OpenMP region: with two threads it took 60 ms against
 * 27 ms here. */
#include <math.h>

#include "kernels/cpu/dense.h"
#include "kernels/moe_math.h"

/* s[r] = a . x_r for four rows x_r = x + r * stride: four independent
 * chains instead of one, and one load of a for four uses. */
static inline void dot4(float *s, const float *a, const float *x, int64_t stride, int64_t n) {
    const float *x0 = x, *x1 = x + stride, *x2 = x + 2 * stride, *x3 = x + 3 * stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < n; i++) {
        s0 += a[i] * x0[i];
        s1 += a[i] * x1[i];
        s2 += a[i] * x2[i];
        s3 += a[i] * x3[i];
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += c0 x0 + c1 x1 + c2 x2 + c3 x3 (x_r = x + r * stride): y is loaded
 * and stored once for four rows. */
static inline void axpy4(float *y, float c0, float c1, float c2, float c3, const float *x,
                         int64_t stride, int64_t n) {
    const float *x0 = x, *x1 = x + stride, *x2 = x + 2 * stride, *x3 = x + 3 * stride;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += c0 * x0[i] + c1 * x1[i] + c2 * x2[i] + c3 * x3[i];
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

void moe_cpu_attention_forward(float *out, float *att, const float *q, const float *k,
                               const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                               int64_t hd) {
    const int64_t group = Hq / Hkv, ks = Hkv * hd; /* ks: row stride of k and v */
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            const float *kb = k + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            const float *vb = v + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            for (int64_t t = 0; t < T; t++) {
                const float *qt = q + ((b * T + t) * Hq + h) * hd; /* [hd] */
                float *p = att + ((b * Hq + h) * T + t) * T;       /* [T] */
                float *o = out + ((b * T + t) * Hq + h) * hd;      /* [hd] */
                int64_t j = 0;
                for (; j + 4 <= t + 1; j += 4) dot4(p + j, qt, kb + j * ks, ks, hd);
                for (; j <= t; j++) p[j] = dot(qt, kb + j * ks, hd);
                float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                for (j = 0; j <= t; j++) {
                    p[j] *= scale;
                    mx = p[j] > mx ? p[j] : mx; /* fmaxf is a libm call */
                }
                /* Lanes of partial sums in a fixed order, and moe_expf, which
                 * vectorises where libm's expf is a call per element. */
                double sum = 0.0;
#pragma omp simd reduction(+ : sum)
                for (j = 0; j <= t; j++) {
                    p[j] = moe_expf(p[j] - mx);
                    sum += p[j];
                }
                const float inv = (float)(1.0 / sum);
                for (j = 0; j <= t; j++) p[j] *= inv;
                for (j = t + 1; j < T; j++) p[j] = 0.0f;
                for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
                for (j = 0; j + 4 <= t + 1; j += 4)
                    axpy4(o, p[j], p[j + 1], p[j + 2], p[j + 3], vb + j * ks, ks, hd);
                for (; j <= t; j++) axpy(o, p[j], vb + j * ks, hd);
            }
        }
}

/* With P the probabilities and dP = dO V^T:
 *   dS = P * (dP - rowsum(P * dP)),  dQ += scale dS K,
 *   dK += scale dS^T Q,  dV += P^T dO.
 * The first pass runs per query head and keeps dS in datt (zero above the
 * diagonal, like P); the second runs per kv head, so the query heads that
 * share one add into dk and dv in a fixed order, without races. */
void moe_cpu_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                                const float *q, const float *k, const float *v, const float *att,
                                int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd) {
    const int64_t group = Hq / Hkv, ks = Hkv * hd, qs = Hq * hd; /* row strides */
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            const float *kb = k + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            const float *vb = v + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            for (int64_t t = 0; t < T; t++) {
                const float *p = att + ((b * Hq + h) * T + t) * T;     /* [T] */
                float *ds = datt + ((b * Hq + h) * T + t) * T;         /* [T] */
                const float *dyt = dout + ((b * T + t) * Hq + h) * hd; /* [hd] */
                float *dqt = dq + ((b * T + t) * Hq + h) * hd;         /* [hd] */
                int64_t j = 0;
                for (; j + 4 <= t + 1; j += 4) dot4(ds + j, dyt, vb + j * ks, ks, hd);
                for (; j <= t; j++) ds[j] = dot(dyt, vb + j * ks, hd);
                double pd = 0.0;
                for (j = 0; j <= t; j++) pd += (double)(p[j] * ds[j]);
                for (j = 0; j <= t; j++) ds[j] = scale * (p[j] * (ds[j] - (float)pd));
                for (j = t + 1; j < T; j++) ds[j] = 0.0f;
                for (j = 0; j + 4 <= t + 1; j += 4)
                    axpy4(dqt, ds[j], ds[j + 1], ds[j + 2], ds[j + 3], kb + j * ks, ks, hd);
                for (; j <= t; j++) axpy(dqt, ds[j], kb + j * ks, hd);
            }
        }
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            float *dkb = dk + (b * T * Hkv + kvh) * hd; /* [T, hd], stride ks */
            float *dvb = dv + (b * T * Hkv + kvh) * hd; /* [T, hd], stride ks */
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                const float *P = att + (b * Hq + h) * T * T;  /* [T, T] */
                const float *dS = datt + (b * Hq + h) * T * T; /* [T, T], holds scale * dS */
                const float *qb = q + (b * T * Hq + h) * hd;   /* [T, hd], stride qs */
                const float *dyb = dout + (b * T * Hq + h) * hd; /* [T, hd], stride qs */
                /* Four query rows t..t+3 at a time; the zeros above the
                 * diagonal of P and dS let their blocks run to j <= t + 3. */
                int64_t t = 0;
                for (; t + 4 <= T; t += 4) {
                    const float *s0 = dS + t * T, *p0 = P + t * T;
                    for (int64_t j = 0; j <= t + 3; j++) {
                        axpy4(dkb + j * ks, s0[j], s0[T + j], s0[2 * T + j], s0[3 * T + j],
                              qb + t * qs, qs, hd);
                        axpy4(dvb + j * ks, p0[j], p0[T + j], p0[2 * T + j], p0[3 * T + j],
                              dyb + t * qs, qs, hd);
                    }
                }
                for (; t < T; t++)
                    for (int64_t j = 0; j <= t; j++) {
                        axpy(dkb + j * ks, dS[t * T + j], qb + t * qs, hd);
                        axpy(dvb + j * ks, P[t * T + j], dyb + t * qs, hd);
                    }
            }
        }
}
