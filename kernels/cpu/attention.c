/* attention.c: causal grouped-query attention on the CPU, the eager path of
 * HF Mixtral (fp32 softmax, scale 1/sqrt(hd)), with Mistral's sliding
 * window as an option. Plain loops over the causal triangle, parallel over
 * (batch, head), in one of two layouts:
 *
 * - hd <= KEYS_MAX_HD: vectors run along the keys. K and V are read
 *   transposed (a tile of keys at a time, on the stack), query rows go
 *   ROWS at a time, and every reduction is a sum of whole vectors. Against
 *   the other layout (one thread, B 1, T 256, Hq 4, Hkv 2) it is 4.2-5.1x
 *   faster forward and 1.3-5.0x backward at every hd from 8 to 384; at
 *   hd 512 it is 2.2x forward and 0.95x backward.
 * - larger hd: vectors run along the head dimension (dot4, axpy4), where a
 *   row of q or k is many vectors long.
 *
 * A GEMM per head would also compute the masked half, and the pthread
 * OpenBLAS that the build links spawns its own threads when called inside
 * an OpenMP region: at B=4, T=256, Hq=8, hd=64 it took 60 ms with two
 * threads, where the loops here take 11 ms forward and backward together.
 *
 * A sliding window masks the keys before it (probability zero, so every
 * gradient through them is zero too); on the key-vectorised layout the
 * passes skip the key tiles and blocks wholly before a row block's window,
 * so their work grows with T x window rather than T^2 / 2. */
#include <math.h>
#include <stdbool.h>

#include "kernels/cpu/dense.h"
#include "kernels/moe_math.h"

/* ------------------------------------------------- large heads: hd in lanes */

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

/* ------------------------------------------------ small heads: keys in lanes */

enum {
    KEYS_MAX_HD = 256,  /* the largest hd on this path, short of the crossover (448-512) */
    TILE_FLOATS = 4096, /* a transposed tile of K or V on the stack: 16 KiB */
    LANES = 8,          /* keys or head channels per vector (one AVX2 register) */
    ROWS = 4,           /* query rows per block */
};
_Static_assert(TILE_FLOATS / KEYS_MAX_HD >= LANES, "a tile holds a block of keys at every hd of the path");

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The first key query t sees: window keys end at t (0: every key). */
static inline int64_t window_start(int64_t t, int64_t window) {
    return window > 0 && t >= window ? t - window + 1 : 0;
}

/* The first key of the vector blocks a row block from t0 on reads: its
 * first row's window start, rounded down to a block of LANES. */
static inline int64_t block_start(int64_t t0, int64_t window) { return window_start(t0, window) / LANES * LANES; }

/* The end of the rows that see any of keys .. last: a window's rows stop
 * window - 1 past it. */
static inline int64_t rows_end(int64_t last, int64_t window, int64_t T) {
    return window > 0 ? min64(T, last + window) : T;
}

/* The keys of row t that its vector blocks cover: t + 1 rounded up to
 * LANES, within T. The ROWS rows of a block (t0 % ROWS == 0) share it. */
static inline int64_t row_span(int64_t t, int64_t T) { return min64((t + LANES) / LANES * LANES, T); }

/* xt[i][j] = x[j][i] for n rows of x (row stride ld). */
static inline void transpose_tile(float *restrict xt, /* [hd][ldt] */
                                  int64_t ldt, const float *restrict x, int64_t ld, int64_t n, int64_t hd) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < hd; i++) xt[i * ldt + j] = x[j * ld + i];
}

/* s_r[j] = a_r . x_j for nr <= ROWS rows a_r = a + r * lda, s_r = s + r *
 * lds, and n keys x_j of a transposed tile. */
static inline void dots_rows(float *restrict s, int64_t lds, const float *restrict a, int64_t lda,
                             const float *restrict xt, /* [hd][ldt] */
                             int64_t ldt, int64_t n, int64_t hd, int64_t nr) {
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        float acc[2][ROWS][LANES] = {{{0}}}; /* even and odd i */
        int64_t i = 0;
        for (; i + 2 <= hd; i += 2)
            for (int64_t u = 0; u < 2; u++) {
                const float *x = xt + (i + u) * ldt + j;
                for (int64_t r = 0; r < nr; r++) {
                    const float c = a[r * lda + i + u];
#pragma omp simd
                    for (int64_t l = 0; l < LANES; l++) acc[u][r][l] += c * x[l];
                }
            }
        if (i < hd) {
            const float *x = xt + i * ldt + j;
            for (int64_t r = 0; r < nr; r++) {
                const float c = a[r * lda + i];
#pragma omp simd
                for (int64_t l = 0; l < LANES; l++) acc[0][r][l] += c * x[l];
            }
        }
        for (int64_t r = 0; r < nr; r++)
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) s[r * lds + j + l] = acc[0][r][l] + acc[1][r][l];
    }
    for (; j < n; j++)
        for (int64_t r = 0; r < nr; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < hd; i++) acc += a[r * lda + i] * xt[i * ldt + j];
            s[r * lds + j] = acc;
        }
}

/* dots_rows for query rows t0 .. t0 + nr - 1 of s [T, T] (rows of a, stride
 * lda) against the tile of nk keys from j0: the keys the rows' span covers. */
static inline void dots_block(float *restrict s, const float *restrict a, int64_t lda, const float *restrict xt,
                              int64_t ldt, int64_t t0, int64_t nr, int64_t j0, int64_t nk, int64_t T, int64_t hd) {
    dots_rows(s + t0 * T + j0, T, a + t0 * lda, lda, xt, ldt, min64(row_span(t0 + nr - 1, T) - j0, nk), hd, nr);
}

/* y_r (+)= sum_{j < n} p_r[j] x_j over ni <= LANES channels, for nr <= ROWS
 * rows p_r = p + r * ldp, y_r = y + r * ldy, with x_j = x + j * ldx. Four
 * terms are summed before they join the accumulator, as axpy4 does. */
static inline void combine_chunk(float *restrict y, int64_t ldy, const float *restrict p, int64_t ldp,
                                 const float *restrict x, int64_t ldx, int64_t n, int64_t ni, int64_t nr,
                                 bool add) {
    float acc[ROWS][LANES] = {{0}};
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *x0 = x + j * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        for (int64_t r = 0; r < nr; r++) {
            const float *pr = p + r * ldp + j, c0 = pr[0], c1 = pr[1], c2 = pr[2], c3 = pr[3];
#pragma omp simd
            for (int64_t i = 0; i < ni; i++) acc[r][i] += c0 * x0[i] + c1 * x1[i] + c2 * x2[i] + c3 * x3[i];
        }
    }
    for (; j < n; j++)
        for (int64_t r = 0; r < nr; r++) {
            const float c = p[r * ldp + j], *xj = x + j * ldx;
#pragma omp simd
            for (int64_t i = 0; i < ni; i++) acc[r][i] += c * xj[i];
        }
    for (int64_t r = 0; r < nr; r++)
#pragma omp simd
        for (int64_t i = 0; i < ni; i++) y[r * ldy + i] = (add ? y[r * ldy + i] : 0.0f) + acc[r][i];
}

/* combine_chunk over all hd channels, LANES at a time. */
static inline void combine_rows(float *restrict y, int64_t ldy, const float *restrict p, int64_t ldp,
                                const float *restrict x, int64_t ldx, int64_t n, int64_t hd, int64_t nr,
                                bool add) {
    int64_t i0 = 0;
    for (; i0 + LANES <= hd; i0 += LANES) combine_chunk(y + i0, ldy, p, ldp, x + i0, ldx, n, LANES, nr, add);
    if (i0 < hd) combine_chunk(y + i0, ldy, p, ldp, x + i0, ldx, n, hd - i0, nr, add);
}

/* Rows t0 + r (r < nr) of p [T, T] hold their scores over [0, n), n =
 * row_span(t0 + nr - 1): each becomes its softmax over its window [lo,
 * t0 + r], zeros elsewhere. The keys past the diagonal and before the
 * window are set to -inf first, so that every pass runs over whole
 * vectors; moe_expf clamps them to exp(-87) = 1.6e-38, below what the
 * row's double sum (the maximum's term is 1) can register, and their zeros
 * are written last, in place of the scaling. */
static inline void softmax_rows(float *restrict p, int64_t t0, int64_t nr, int64_t T, int64_t window,
                                float scale) {
    const int64_t n = row_span(t0 + nr - 1, T), j0 = block_start(t0, window);
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t j = j0; j < window_start(t0 + r, window); j++) p[r * T + j] = -INFINITY;
        for (int64_t j = t0 + r + 1; j < n; j++) p[r * T + j] = -INFINITY;
    }
    float mxl[ROWS][LANES];
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t l = 0; l < LANES; l++) mxl[r][l] = -INFINITY;
    int64_t j = j0;
    for (; j + LANES <= n; j += LANES)
        for (int64_t r = 0; r < nr; r++)
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) {
                const float x = p[r * T + j + l] * scale;
                p[r * T + j + l] = x;
                mxl[r][l] = x > mxl[r][l] ? x : mxl[r][l]; /* fmaxf is a libm call */
            }
    for (; j < n; j++)
        for (int64_t r = 0; r < nr; r++) {
            const float x = p[r * T + j] * scale;
            p[r * T + j] = x;
            mxl[r][0] = x > mxl[r][0] ? x : mxl[r][0];
        }
    for (int64_t r = 0; r < nr; r++) {
        float mx = mxl[r][0], *pr = p + r * T;
        for (int64_t l = 1; l < LANES; l++) mx = mxl[r][l] > mx ? mxl[r][l] : mx;
#pragma omp simd
        for (j = j0; j < n; j++) pr[j] = moe_expf(pr[j] - mx);
    }
    /* The sum in a pass of its own: inside the exp loop its double lanes
     * spilled registers (12% slower at hd 8). */
    double suml[ROWS][LANES] = {{0}};
    for (j = j0; j + LANES <= n; j += LANES)
        for (int64_t r = 0; r < nr; r++)
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) suml[r][l] += p[r * T + j + l];
    for (; j < n; j++)
        for (int64_t r = 0; r < nr; r++) suml[r][0] += p[r * T + j];
    for (int64_t r = 0; r < nr; r++) {
        double sum = 0.0;
        for (int64_t l = 0; l < LANES; l++) sum += suml[r][l];
        const float inv = (float)(1.0 / sum);
        float *pr = p + r * T;
        const int64_t lo = window_start(t0 + r, window);
        /* Only the window: 1.6e-38 * inv is subnormal, a microcode assist
         * per vector (a third of the softmax's time at T 256). */
#pragma omp simd
        for (j = lo; j <= t0 + r; j++) pr[j] *= inv;
        for (j = 0; j < lo; j++) pr[j] = 0.0f;
        for (j = t0 + r + 1; j < T; j++) pr[j] = 0.0f;
    }
}

/* Rows t0 + r (r < nr) of d [T, T] hold dP = dO V^T over [j0, n), j0 =
 * block_start(t0), n = row_span(t0 + nr - 1), and those of p the
 * probabilities (zero outside the window): d becomes scale * P * (dP -
 * rowsum(P * dP)) over [j0, n), so zero outside the window too. d outside
 * [j0, n) is left as it was. */
static inline void dsoftmax_rows(float *restrict d, const float *restrict p, int64_t t0, int64_t nr, int64_t T,
                                 int64_t window, float scale) {
    const int64_t n = row_span(t0 + nr - 1, T), j0 = block_start(t0, window);
    double suml[ROWS][LANES] = {{0}};
    int64_t j = j0;
    for (; j + LANES <= n; j += LANES)
        for (int64_t r = 0; r < nr; r++)
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) suml[r][l] += (double)(p[r * T + j + l] * d[r * T + j + l]);
    for (; j < n; j++)
        for (int64_t r = 0; r < nr; r++) suml[r][0] += (double)(p[r * T + j] * d[r * T + j]);
    for (int64_t r = 0; r < nr; r++) {
        double pd = 0.0;
        for (int64_t l = 0; l < LANES; l++) pd += suml[r][l];
        const float pdf = (float)pd, *pr = p + r * T;
        float *dr = d + r * T;
#pragma omp simd
        for (j = j0; j < n; j++) dr[j] = scale * (pr[j] * (dr[j] - pdf));
    }
}

/* y_j += sum_{t0 <= t < t1} s[t][j] x_t over ni <= LANES channels, for
 * nl <= LANES keys j (y_j = y + j * ldy), with s [T, T] from the keys'
 * column on and x_t = x + t * ldx: the channels in the lanes, one
 * accumulator per key, four terms summed before they join it. */
static inline void accumulate_chunk(float *restrict y, int64_t ldy, const float *restrict s,
                                    const float *restrict x, int64_t ldx, int64_t t0, int64_t t1, int64_t T,
                                    int64_t ni, int64_t nl) {
    float acc[LANES][LANES] = {{0}}; /* [key][channel] */
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) {
        const float *s0 = s + t * T, *s1 = s0 + T, *s2 = s1 + T, *s3 = s2 + T;
        const float *x0 = x + t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        /* Unrolled, GCC keeps the accumulators in registers (7% faster
         * backward at hd 8). */
#pragma GCC unroll 8
        for (int64_t l = 0; l < nl; l++) {
            const float c0 = s0[l], c1 = s1[l], c2 = s2[l], c3 = s3[l];
#pragma omp simd
            for (int64_t i = 0; i < ni; i++) acc[l][i] += c0 * x0[i] + c1 * x1[i] + c2 * x2[i] + c3 * x3[i];
        }
    }
    for (; t < t1; t++) {
        const float *st = s + t * T, *xt = x + t * ldx;
        for (int64_t l = 0; l < nl; l++) {
            const float c = st[l];
#pragma omp simd
            for (int64_t i = 0; i < ni; i++) acc[l][i] += c * xt[i];
        }
    }
    for (int64_t l = 0; l < nl; l++)
#pragma omp simd
        for (int64_t i = 0; i < ni; i++) y[l * ldy + i] += acc[l][i];
}

/* accumulate_chunk over all hd channels, LANES at a time. */
static inline void accumulate_keys(float *restrict y, int64_t ldy, const float *restrict s,
                                   const float *restrict x, int64_t ldx, int64_t t0, int64_t t1, int64_t T,
                                   int64_t hd, int64_t nl) {
    int64_t i0 = 0;
    for (; i0 + LANES <= hd; i0 += LANES) accumulate_chunk(y + i0, ldy, s, x + i0, ldx, t0, t1, T, LANES, nl);
    if (i0 < hd) accumulate_chunk(y + i0, ldy, s, x + i0, ldx, t0, t1, T, hd - i0, nl);
}

/* s[t][j] = a_t . x_j (rows of stride lda and ldx) for every t and the
 * keys j of t's span, x read transposed a tile of keys at a time. Under a
 * window a tile's rows end past the last that sees one of its keys by a
 * row block and a vector block: the passes over a row block read its keys
 * from block_start on, which may lie in the tile, and the backward's
 * products with P's zeros there must not meet unwritten (NaN) scores. */
static inline void causal_dots(float *restrict s, /* [T, T] */
                               const float *restrict a, int64_t lda, const float *restrict x, int64_t ldx,
                               int64_t T, int64_t hd, int64_t window) {
    float xt[TILE_FLOATS];
    const int64_t tk = TILE_FLOATS / hd / LANES * LANES; /* keys per tile */
    for (int64_t j0 = 0; j0 < T; j0 += tk) {
        const int64_t nk = min64(tk, T - j0), t1 = rows_end(j0 + nk - 1 + ROWS + LANES, window, T);
        transpose_tile(xt, tk, x + j0 * ldx, ldx, nk, hd);
        int64_t t = j0;
        for (; t + ROWS <= t1; t += ROWS) dots_block(s, a, lda, xt, tk, t, ROWS, j0, nk, T, hd);
        if (t < t1) dots_block(s, a, lda, xt, tk, t, t1 - t, j0, nk, T, hd);
    }
}

/* Rows t .. t + nr - 1 of the forward: their softmax, then out = P V over
 * the keys from their window's block on. Called with nr = ROWS, a
 * constant, for every whole block (and the tail apart), so that the row
 * loops unroll. */
static inline void forward_rows(float *restrict out, float *restrict att, const float *restrict v, int64_t T,
                                int64_t qs, int64_t ks, int64_t hd, int64_t window, float scale, int64_t t,
                                int64_t nr) {
    const int64_t j0 = block_start(t, window);
    softmax_rows(att + t * T, t, nr, T, window, scale);
    combine_rows(out + t * qs, qs, att + t * T + j0, T, v + j0 * ks, ks, t + nr - j0, hd, nr, false);
}

/* One (batch, query head) of the forward. */
static inline void forward_head(float *restrict out,     /* [T, hd], stride qs */
                                float *restrict att,     /* [T, T] */
                                const float *restrict q, /* [T, hd], stride qs */
                                const float *restrict k, /* [T, hd], stride ks */
                                const float *restrict v, /* [T, hd], stride ks */
                                int64_t T, int64_t qs, int64_t ks, int64_t hd, int64_t window, float scale) {
    causal_dots(att, q, qs, k, ks, T, hd, window);
    int64_t t = 0;
    for (; t + ROWS <= T; t += ROWS) forward_rows(out, att, v, T, qs, ks, hd, window, scale, t, ROWS);
    if (t < T) forward_rows(out, att, v, T, qs, ks, hd, window, scale, t, T - t);
}

/* Rows t .. t + nr - 1 of the backward's first pass (forward_rows' way):
 * dS into ds, dq += scale dS K. */
static inline void backward_q_rows(float *restrict dq, float *restrict ds, const float *restrict k,
                                   const float *restrict att, int64_t T, int64_t qs, int64_t ks, int64_t hd,
                                   int64_t window, float scale, int64_t t, int64_t nr) {
    const int64_t j0 = block_start(t, window);
    dsoftmax_rows(ds + t * T, att + t * T, t, nr, T, window, scale);
    combine_rows(dq + t * qs, qs, ds + t * T + j0, T, k + j0 * ks, ks, t + nr - j0, hd, nr, true);
}

/* One (batch, query head) of the backward's first pass: dS (times scale)
 * into ds over each row's span, and dq. */
static inline void backward_q_head(float *restrict dq,         /* [T, hd], stride qs */
                                   float *restrict ds,         /* [T, T] */
                                   const float *restrict dout, /* [T, hd], stride qs */
                                   const float *restrict k,    /* [T, hd], stride ks */
                                   const float *restrict v,    /* [T, hd], stride ks */
                                   const float *restrict att,  /* [T, T] */
                                   int64_t T, int64_t qs, int64_t ks, int64_t hd, int64_t window, float scale) {
    causal_dots(ds, dout, qs, v, ks, T, hd, window);
    int64_t t = 0;
    for (; t + ROWS <= T; t += ROWS) backward_q_rows(dq, ds, k, att, T, qs, ks, hd, window, scale, t, ROWS);
    if (t < T) backward_q_rows(dq, ds, k, att, T, qs, ks, hd, window, scale, t, T - t);
}

/* One query head's share of dk and dv. Key block j0 reads the rows of dS
 * and P from j0 down to the last that sees one of its keys, all inside
 * the columns their passes wrote (their blocks start at or before j0),
 * where both are zero outside the window. */
static inline void backward_kv_head(float *restrict dk,         /* [T, hd], stride ks */
                                    float *restrict dv,         /* [T, hd], stride ks */
                                    const float *restrict ds,   /* [T, T] */
                                    const float *restrict att,  /* [T, T] */
                                    const float *restrict q,    /* [T, hd], stride qs */
                                    const float *restrict dout, /* [T, hd], stride qs */
                                    int64_t T, int64_t qs, int64_t ks, int64_t hd, int64_t window) {
    int64_t j0 = 0;
    for (; j0 + LANES <= T; j0 += LANES) { /* LANES keys, a constant: the accumulators stay in registers */
        const int64_t t1 = rows_end(j0 + LANES - 1, window, T);
        accumulate_keys(dk + j0 * ks, ks, ds + j0, q, qs, j0, t1, T, hd, LANES);
        accumulate_keys(dv + j0 * ks, ks, att + j0, dout, qs, j0, t1, T, hd, LANES);
    }
    if (j0 < T) {
        accumulate_keys(dk + j0 * ks, ks, ds + j0, q, qs, j0, T, T, hd, T - j0);
        accumulate_keys(dv + j0 * ks, ks, att + j0, dout, qs, j0, T, T, hd, T - j0);
    }
}

/* The heads above with hd a constant at the common sizes, so that their
 * loops over hd unroll: 15-20% faster at hd 8, 7-10% at 32 and 64. */
static void forward_keys(float *out, float *att, const float *q, const float *k, const float *v, int64_t T,
                         int64_t qs, int64_t ks, int64_t hd, int64_t window, float scale) {
    switch (hd) {
    case 8: forward_head(out, att, q, k, v, T, qs, ks, 8, window, scale); break;
    case 16: forward_head(out, att, q, k, v, T, qs, ks, 16, window, scale); break;
    case 32: forward_head(out, att, q, k, v, T, qs, ks, 32, window, scale); break;
    case 64: forward_head(out, att, q, k, v, T, qs, ks, 64, window, scale); break;
    default: forward_head(out, att, q, k, v, T, qs, ks, hd, window, scale);
    }
}

static void backward_q_keys(float *dq, float *ds, const float *dout, const float *k, const float *v,
                            const float *att, int64_t T, int64_t qs, int64_t ks, int64_t hd, int64_t window,
                            float scale) {
    switch (hd) {
    case 8: backward_q_head(dq, ds, dout, k, v, att, T, qs, ks, 8, window, scale); break;
    case 16: backward_q_head(dq, ds, dout, k, v, att, T, qs, ks, 16, window, scale); break;
    case 32: backward_q_head(dq, ds, dout, k, v, att, T, qs, ks, 32, window, scale); break;
    case 64: backward_q_head(dq, ds, dout, k, v, att, T, qs, ks, 64, window, scale); break;
    default: backward_q_head(dq, ds, dout, k, v, att, T, qs, ks, hd, window, scale);
    }
}

static void backward_kv_keys(float *dk, float *dv, const float *ds, const float *att, const float *q,
                             const float *dout, int64_t T, int64_t qs, int64_t ks, int64_t hd, int64_t window) {
    switch (hd) {
    case 8: backward_kv_head(dk, dv, ds, att, q, dout, T, qs, ks, 8, window); break;
    case 16: backward_kv_head(dk, dv, ds, att, q, dout, T, qs, ks, 16, window); break;
    case 32: backward_kv_head(dk, dv, ds, att, q, dout, T, qs, ks, 32, window); break;
    case 64: backward_kv_head(dk, dv, ds, att, q, dout, T, qs, ks, 64, window); break;
    default: backward_kv_head(dk, dv, ds, att, q, dout, T, qs, ks, hd, window);
    }
}

/* One query row qt at position t against keys and values kb, vb (row
 * stride ks): the probabilities into p [t + 1], the output into o [hd]. */
static void attend_row(float *o, float *p, const float *qt, const float *kb, const float *vb, int64_t t, int64_t ks,
                       int64_t hd, float scale) {
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
    for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
    for (j = 0; j + 4 <= t + 1; j += 4) axpy4(o, p[j], p[j + 1], p[j + 2], p[j + 3], vb + j * ks, ks, hd);
    for (; j <= t; j++) axpy(o, p[j], vb + j * ks, hd);
}

/* ------------------------------------------------------------------ ops */

void moe_cpu_attention_forward(float *out, float *att, const float *q, const float *k,
                               const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                               int64_t hd, int64_t window) {
    const int64_t group = Hq / Hkv, ks = Hkv * hd, qs = Hq * hd; /* row strides */
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            const float *kb = k + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            const float *vb = v + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            if (hd <= KEYS_MAX_HD) {
                forward_keys(out + (b * T * Hq + h) * hd, att + (b * Hq + h) * T * T, q + (b * T * Hq + h) * hd,
                             kb, vb, T, qs, ks, hd, window, scale);
                continue;
            }
            for (int64_t t = 0; t < T; t++) {
                float *p = att + ((b * Hq + h) * T + t) * T; /* [T] */
                const int64_t lo = window_start(t, window);
                attend_row(out + ((b * T + t) * Hq + h) * hd, p + lo, q + ((b * T + t) * Hq + h) * hd, kb + lo * ks,
                           vb + lo * ks, t - lo, ks, hd, scale);
                for (int64_t j = 0; j < lo; j++) p[j] = 0.0f;
                for (int64_t j = t + 1; j < T; j++) p[j] = 0.0f;
            }
        }
}

/* A head a thread: one row's heads are too few to split further, and the
 * keys of a cache of thousands of positions are read once a head. */
void moe_cpu_attention_decode(float *out, float *att, const float *q, const float *k, const float *v, int64_t T,
                              int64_t Hq, int64_t Hkv, int64_t hd) {
    const int64_t group = Hq / Hkv, ks = Hkv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for schedule(static) if (T * hd >= 4096)
    for (int64_t h = 0; h < Hq; h++)
        attend_row(out + h * hd, att + h * T, q + h * hd, k + h / group * hd, v + h / group * hd, T - 1, ks, hd, scale);
}

/* With P the probabilities and dP = dO V^T:
 *   dS = P * (dP - rowsum(P * dP)),  dQ += scale dS K,
 *   dK += scale dS^T Q,  dV += P^T dO.
 * The first pass runs per query head and keeps scale * dS in datt (zero
 * above the diagonal, like P, as far as the second pass reads it); the
 * second runs per kv head, so the query heads that share one add into dk
 * and dv in a fixed order, without races. P is zero outside the window, so
 * dS is: the window only shortens the loops. */
void moe_cpu_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                                const float *q, const float *k, const float *v, const float *att,
                                int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window) {
    const int64_t group = Hq / Hkv, ks = Hkv * hd, qs = Hq * hd; /* row strides */
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            const float *kb = k + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            const float *vb = v + (b * T * Hkv + h / group) * hd; /* [T, hd], stride ks */
            if (hd <= KEYS_MAX_HD) {
                backward_q_keys(dq + (b * T * Hq + h) * hd, datt + (b * Hq + h) * T * T,
                                dout + (b * T * Hq + h) * hd, kb, vb, att + (b * Hq + h) * T * T, T, qs, ks, hd,
                                window, scale);
                continue;
            }
            for (int64_t t = 0; t < T; t++) {
                const float *p = att + ((b * Hq + h) * T + t) * T;     /* [T] */
                float *ds = datt + ((b * Hq + h) * T + t) * T;         /* [T] */
                const float *dyt = dout + ((b * T + t) * Hq + h) * hd; /* [hd] */
                float *dqt = dq + ((b * T + t) * Hq + h) * hd;         /* [hd] */
                const int64_t lo = window_start(t, window);
                int64_t j = lo;
                for (; j + 4 <= t + 1; j += 4) dot4(ds + j, dyt, vb + j * ks, ks, hd);
                for (; j <= t; j++) ds[j] = dot(dyt, vb + j * ks, hd);
                double pd = 0.0;
                for (j = lo; j <= t; j++) pd += (double)(p[j] * ds[j]);
                for (j = lo; j <= t; j++) ds[j] = scale * (p[j] * (ds[j] - (float)pd));
                for (j = 0; j < lo; j++) ds[j] = 0.0f;
                for (j = t + 1; j < T; j++) ds[j] = 0.0f;
                for (j = lo; j + 4 <= t + 1; j += 4)
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
                if (hd <= KEYS_MAX_HD) {
                    backward_kv_keys(dkb, dvb, dS, P, qb, dyb, T, qs, ks, hd, window);
                    continue;
                }
                /* Four query rows t..t+3 at a time; the zeros of P and dS
                 * outside each row's keys let their blocks run over the
                 * keys of any of the four. */
                int64_t t = 0;
                for (; t + 4 <= T; t += 4) {
                    const float *s0 = dS + t * T, *p0 = P + t * T;
                    for (int64_t j = window_start(t, window); j <= t + 3; j++) {
                        axpy4(dkb + j * ks, s0[j], s0[T + j], s0[2 * T + j], s0[3 * T + j],
                              qb + t * qs, qs, hd);
                        axpy4(dvb + j * ks, p0[j], p0[T + j], p0[2 * T + j], p0[3 * T + j],
                              dyb + t * qs, qs, hd);
                    }
                }
                for (; t < T; t++)
                    for (int64_t j = window_start(t, window); j <= t; j++) {
                        axpy(dkb + j * ks, dS[t * T + j], qb + t * qs, hd);
                        axpy(dvb + j * ks, P[t * T + j], dyb + t * qs, hd);
                    }
            }
        }
}
