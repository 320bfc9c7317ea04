/* test_dense_ops.c: the dense ops of kernels/cpu/dense.h against naive
 * double-precision references written here from the Hugging Face formulas,
 * and every backward against central finite differences of those
 * references.
 *
 * Tolerances
 *  - Forward: elementwise |got - ref| <= atol + rtol |ref|, with the values
 *    stated at each call (fp32 rounding of short sums: rtol 1e-5).
 *  - Backward: norm-wise ||analytic - fd|| <= GRAD_RTOL ||fd||, GRAD_RTOL =
 *    1e-4. The fp32 analytic gradient carries ~1e-6 of its norm in rounding;
 *    the central difference in double with h = 1e-5 is exact to ~1e-9; a
 *    wrong or missing term is O(1). Backwards accumulate, so each starts from
 *    random gradients and the increment is what is compared.
 *  - Shapes are small and odd (C = 13, hd = 6, T = 5, Hq = 4, Hkv = 2, B = 2,
 *    V = 11) so that no size lines up with a vector width or a block. */
#include <criterion/criterion.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/rope.h"
#include "kernels/cpu/dense.h"
#include "ref_model.h"

#define GRAD_RTOL 1e-4
#define FD_STEP 1e-5

/* ------------------------------------------------------------ helpers */

typedef struct rng {
    uint64_t s;
} rng;

/* splitmix64: a fixed stream per seed on every platform. */
static double uniform(rng *r, double lo, double hi) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) * 0x1.0p-53;
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    cr_assert(p != NULL, "test allocation of %zu x %zu bytes failed", n, size);
    return p;
}

static float *rand_floats(int64_t n, rng *r, double lo, double hi) {
    float *a = xcalloc((size_t)n, sizeof *a);
    for (int64_t i = 0; i < n; i++) a[i] = (float)uniform(r, lo, hi);
    return a;
}

static double *to_double(const float *a, int64_t n) {
    double *d = xcalloc((size_t)n, sizeof *d);
    for (int64_t i = 0; i < n; i++) d[i] = a[i];
    return d;
}

static float *copy_floats(const float *a, int64_t n) {
    float *c = xcalloc((size_t)n, sizeof *c);
    memcpy(c, a, (size_t)n * sizeof *c);
    return c;
}

/* Elementwise |got - ref| <= atol + rtol |ref|; NaN fails. */
static void expect_close(const char *what, const float *got, const double *ref, int64_t n,
                         double atol, double rtol) {
    int64_t bad = 0, worst = 0;
    double worst_ratio = -1.0;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - ref[i]), tol = atol + rtol * fabs(ref[i]);
        const double ratio = isnan(err) ? INFINITY : err / tol;
        if (!(err <= tol)) bad++;
        if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
    cr_expect(bad == 0, "%s: %lld of %lld elements off; worst [%lld] got %.9g ref %.9g (atol %g rtol %g)",
              what, (long long)bad, (long long)n, (long long)worst, (double)got[worst], ref[worst],
              atol, rtol);
}

/* ||got - ref|| <= GRAD_RTOL ||ref||, reporting the worst element too. */
static void expect_grad(const char *what, const double *got, const double *ref, int64_t n) {
    double num = 0.0, den = 0.0, worst_err = -1.0;
    int64_t worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const double e = got[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
        if (!(fabs(e) <= worst_err)) worst_err = fabs(e), worst = i;
    }
    cr_assert(den > 0.0, "%s: the finite-difference gradient is zero; the test cannot fail", what);
    const double rel = sqrt(num / den);
    cr_expect(rel <= GRAD_RTOL,
              "%s: ||analytic - fd|| / ||fd|| = %.3g > %g; worst [%lld] analytic %.9g fd %.9g", what,
              rel, GRAD_RTOL, (long long)worst, got[worst], ref[worst]);
}

/* The increment a backward added: after - before, in double. */
static double *increment(const float *after, const float *before, int64_t n) {
    double *d = xcalloc((size_t)n, sizeof *d);
    for (int64_t i = 0; i < n; i++) d[i] = (double)after[i] - (double)before[i];
    return d;
}

/* Central differences of loss(ctx) in each x[i]; x is part of ctx's state. */
typedef double (*loss_fn)(const void *ctx);

static double *fd_grad(double *x, int64_t n, loss_fn loss, const void *ctx) {
    double *g = xcalloc((size_t)n, sizeof *g);
    for (int64_t i = 0; i < n; i++) {
        const double x0 = x[i];
        x[i] = x0 + FD_STEP;
        const double lp = loss(ctx);
        x[i] = x0 - FD_STEP;
        const double lm = loss(ctx);
        x[i] = x0;
        g[i] = (lp - lm) / (2.0 * FD_STEP);
    }
    return g;
}

static double dot_d(const double *a, const double *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ------------------------------------------------- double references */

/* HF apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, with the angle
 * table given as cos/sin [T, hd/2] (the halves of HF's cat(freqs, freqs)). */
static void ref_rope_tables(double *y, const double *x, const double *cs, const double *sn, int64_t B,
                     int64_t T, int64_t H, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t o = ((b * T + t) * H + h) * hd;
                for (int64_t i = 0; i < hd; i++) {
                    const int64_t f = (i % half) + t * half;
                    const double rot = i < half ? -x[o + i + half] : x[o + i - half];
                    y[o + i] = x[o + i] * cs[f] + rot * sn[f];
                }
            }
}

static double ref_xent_row(const double *z, int64_t V, int32_t target, double *lse) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < V; j++) mx = fmax(mx, z[j]);
    for (int64_t j = 0; j < V; j++) sum += exp(z[j] - mx);
    *lse = mx + log(sum);
    return target < 0 ? 0.0 : *lse - z[target];
}

/* ---------------------------------------------------------- embedding */

typedef struct emb_ctx {
    const double *wte, *dout;
    const int32_t *tokens;
    int64_t N, C;
} emb_ctx;

static double emb_loss(const void *vctx) {
    const emb_ctx *c = vctx;
    double s = 0.0;
    for (int64_t n = 0; n < c->N; n++)
        s += dot_d(c->dout + n * c->C, c->wte + (int64_t)c->tokens[n] * c->C, c->C);
    return s;
}

Test(dense, embedding) {
    const int64_t N = 10, C = 13, V = 11;
    rng r = {1};
    int32_t tokens[10] = {3, 0, 10, 3, 7, 3, 1, 10, 5, 0}; /* repeats collide in dwte */
    float *wte = rand_floats(V * C, &r, -1, 1), *out = xcalloc(N * C, sizeof(float));
    moe_cpu_embedding_forward(out, tokens, wte, N, C);
    for (int64_t n = 0; n < N; n++)
        cr_expect(memcmp(out + n * C, wte + tokens[n] * C, C * sizeof(float)) == 0,
                  "embedding row %lld is not wte[%d]", (long long)n, tokens[n]);

    float *dout = rand_floats(N * C, &r, -1, 1), *dwte0 = rand_floats(V * C, &r, -1, 1);
    float *dwte = copy_floats(dwte0, V * C);
    moe_cpu_embedding_backward(dwte, dout, tokens, N, C);
    double *wte_d = to_double(wte, V * C), *dout_d = to_double(dout, N * C);
    emb_ctx ctx = {wte_d, dout_d, tokens, N, C};
    double *fd = fd_grad(wte_d, V * C, emb_loss, &ctx), *got = increment(dwte, dwte0, V * C);
    expect_grad("embedding dwte", got, fd, V * C);
    free(wte), free(out), free(dout), free(dwte0), free(dwte), free(wte_d), free(dout_d), free(fd),
        free(got);
}

/* ------------------------------------------------------------ RMSNorm */

typedef struct rms_ctx {
    const double *x, *w, *dout;
    double *y;
    int64_t N, C;
} rms_ctx;

static double rms_loss(const void *vctx) {
    const rms_ctx *c = vctx;
    ref_rmsnorm(c->y, c->x, c->w, 1e-5, c->N, c->C);
    return dot_d(c->dout, c->y, c->N * c->C);
}

Test(dense, rmsnorm) {
    const int64_t N = 10, C = 13;
    const float eps = 1e-5f;
    rng r = {2};
    float *x = rand_floats(N * C, &r, -2, 2), *w = rand_floats(C, &r, 0.5, 1.5);
    float *y = xcalloc(N * C, sizeof(float)), *rstd = xcalloc(N, sizeof(float));
    moe_cpu_rmsnorm_forward(y, rstd, x, w, eps, N, C);
    double *xd = to_double(x, N * C), *wd = to_double(w, C), *yd = xcalloc(N * C, sizeof(double));
    ref_rmsnorm(yd, xd, wd, eps, N, C);
    expect_close("rmsnorm out", y, yd, N * C, 1e-6, 1e-5);
    double rstd_ref[10];
    for (int64_t n = 0; n < N; n++) {
        double ms = 0.0;
        for (int64_t c = 0; c < C; c++) ms += xd[n * C + c] * xd[n * C + c];
        rstd_ref[n] = 1.0 / sqrt(ms / (double)C + eps);
    }
    expect_close("rmsnorm rstd", rstd, rstd_ref, N, 0.0, 1e-6);

    float *dout = rand_floats(N * C, &r, -1, 1);
    float *dx0 = rand_floats(N * C, &r, -1, 1), *dw0 = rand_floats(C, &r, -1, 1);
    float *dx = copy_floats(dx0, N * C), *dw = copy_floats(dw0, C);
    moe_cpu_rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
    double *doutd = to_double(dout, N * C);
    rms_ctx ctx = {xd, wd, doutd, yd, N, C};
    double *fdx = fd_grad(xd, N * C, rms_loss, &ctx), *fdw = fd_grad(wd, C, rms_loss, &ctx);
    double *gx = increment(dx, dx0, N * C), *gw = increment(dw, dw0, C);
    expect_grad("rmsnorm dinp", gx, fdx, N * C);
    expect_grad("rmsnorm dweight", gw, fdw, C);
    free(x), free(w), free(y), free(rstd), free(xd), free(wd), free(yd), free(dout), free(dx0),
        free(dw0), free(dx), free(dw), free(doutd), free(fdx), free(fdw), free(gx), free(gw);
}

/* ------------------------------------------------------------- matmul */

typedef struct mm_ctx {
    const double *x, *w, *dout;
    double *y;
    int64_t N, C, OC;
} mm_ctx;

static double mm_loss(const void *vctx) {
    const mm_ctx *c = vctx;
    ref_linear(c->y, c->x, c->w, c->N, c->C, c->OC);
    return dot_d(c->dout, c->y, c->N * c->OC);
}

Test(dense, matmul) {
    const int64_t N = 10, C = 13, OC = 7;
    rng r = {3};
    float *x = rand_floats(N * C, &r, -1, 1), *w = rand_floats(OC * C, &r, -1, 1);
    float *y = xcalloc(N * OC, sizeof(float));
    moe_cpu_matmul_forward(y, x, w, N, C, OC);
    double *xd = to_double(x, N * C), *wd = to_double(w, OC * C), *yd = xcalloc(N * OC, sizeof(double));
    ref_linear(yd, xd, wd, N, C, OC);
    expect_close("matmul out", y, yd, N * OC, 1e-6, 1e-5);

    float *dout = rand_floats(N * OC, &r, -1, 1);
    float *dx0 = rand_floats(N * C, &r, -1, 1), *dw0 = rand_floats(OC * C, &r, -1, 1);
    float *dx = copy_floats(dx0, N * C), *dw = copy_floats(dw0, OC * C);
    moe_cpu_matmul_backward(dx, dw, dout, x, w, N, C, OC);
    double *doutd = to_double(dout, N * OC);
    mm_ctx ctx = {xd, wd, doutd, yd, N, C, OC};
    double *fdx = fd_grad(xd, N * C, mm_loss, &ctx), *fdw = fd_grad(wd, OC * C, mm_loss, &ctx);
    double *gx = increment(dx, dx0, N * C), *gw = increment(dw, dw0, OC * C);
    expect_grad("matmul dinp", gx, fdx, N * C);
    expect_grad("matmul dweight", gw, fdw, OC * C);
    free(x), free(w), free(y), free(xd), free(wd), free(yd), free(dout), free(dx0), free(dw0),
        free(dx), free(dw), free(doutd), free(fdx), free(fdw), free(gx), free(gw);
}

/* Shapes moe_cpu_gemm_split cuts into row blocks (a last one short, for
 * dinp's 200 rows and dweight's 70): each block lands on its rows, against
 * the products in double, and the bits are the same on 1 and 2 threads. */
Test(dense, matmul_row_blocks) {
    const int64_t N = 200, C = 13, OC = 70;
    rng r = {31};
    float *x = rand_floats(N * C, &r, -1, 1), *w = rand_floats(OC * C, &r, -1, 1);
    float *dout = rand_floats(N * OC, &r, -1, 1), *dx0 = rand_floats(N * C, &r, -1, 1);
    float *dw0 = rand_floats(OC * C, &r, -1, 1);
    double *y_ref = xcalloc(N * OC, sizeof(double)), *dx_ref = xcalloc(N * C, sizeof(double));
    double *dw_ref = xcalloc(OC * C, sizeof(double));
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < OC; o++)
            for (int64_t c = 0; c < C; c++) {
                y_ref[n * OC + o] += (double)x[n * C + c] * w[o * C + c];
                dx_ref[n * C + c] += (double)dout[n * OC + o] * w[o * C + c];
                dw_ref[o * C + c] += (double)dout[n * OC + o] * x[n * C + c];
            }
    for (int64_t i = 0; i < N * C; i++) dx_ref[i] += dx0[i];
    for (int64_t i = 0; i < OC * C; i++) dw_ref[i] += dw0[i];
    float *y[2], *dx[2], *dw[2];
    for (int th = 0; th < 2; th++) {
        omp_set_num_threads(th + 1);
        y[th] = xcalloc(N * OC, sizeof(float));
        dx[th] = copy_floats(dx0, N * C);
        dw[th] = copy_floats(dw0, OC * C);
        moe_cpu_matmul_forward(y[th], x, w, N, C, OC);
        moe_cpu_matmul_backward(dx[th], dw[th], dout, x, w, N, C, OC);
    }
    expect_close("row-block matmul out", y[1], y_ref, N * OC, 1e-5, 1e-5);
    expect_close("row-block matmul dinp", dx[1], dx_ref, N * C, 1e-5, 1e-5);
    expect_close("row-block matmul dweight", dw[1], dw_ref, OC * C, 1e-4, 1e-5);
    cr_expect(memcmp(y[0], y[1], (size_t)(N * OC) * sizeof(float)) == 0 &&
                  memcmp(dx[0], dx[1], (size_t)(N * C) * sizeof(float)) == 0 &&
                  memcmp(dw[0], dw[1], (size_t)(OC * C) * sizeof(float)) == 0,
              "row-block matmul differs between 1 and 2 threads");
    free(x), free(w), free(dout), free(dx0), free(dw0), free(y_ref), free(dx_ref), free(dw_ref);
    for (int th = 0; th < 2; th++) free(y[th]), free(dx[th]), free(dw[th]);
}

/* --------------------------------------------------------------- RoPE */

/* The tables against the exact angle t * theta^(-2i/hd) in double. The
 * tables keep HF's fp32 rounding of inv_freq and of the angle, an error
 * below 3 * 2^-24 of the angle (<= t), hence the t-proportional tolerance.
 * Pair 0 has inv_freq = 1 exactly, so its angle is t without rounding. */
Test(dense, rope_tables) {
    const int64_t T = 4096, hd = 64, half = hd / 2;
    const float theta = 1e6f;
    float *cs = xcalloc(T * half, sizeof(float)), *sn = xcalloc(T * half, sizeof(float));
    moe_rope_tables(cs, sn, T, hd, theta, &(moe_rope_scaling){0});
    int64_t bad = 0, worst = 0;
    double worst_err = 0.0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            const double a = (double)t * pow((double)theta, -2.0 * (double)i / (double)hd);
            const double tol = 1e-7 + 2e-7 * a;
            const double err = fmax(fabs(cs[t * half + i] - cos(a)), fabs(sn[t * half + i] - sin(a)));
            if (!(err <= tol)) bad++;
            if (err > worst_err) worst_err = err, worst = t * half + i;
        }
    cr_expect(bad == 0, "rope tables: %lld entries off the exact angle; worst (t %lld, i %lld) err %.3g",
              (long long)bad, (long long)(worst / half), (long long)(worst % half), worst_err);
    for (int64_t t = 0; t < T; t++)
        cr_expect(cs[t * half] == (float)cos((double)t) && sn[t * half] == (float)sin((double)t),
                  "rope pair 0 at t=%lld: cos %.9g sin %.9g, want the rounded cos(t), sin(t)",
                  (long long)t, (double)cs[t * half], (double)sn[t * half]);
    free(cs), free(sn);
}

/* Scaled RoPE's tables against transformers' formulas in double
 * (ref_model.h), and against the frequencies transformers 5.24 computes
 * for Llama 3.1's llama3 scaling and Qwen2.5's yarn (hd 128): the tables
 * round each step in fp32, as torch does, so they stay within a few ulps
 * of the double formulas (2e-7 of the angle, plus the cosine's own
 * rounding). Each scaling's landmarks hold exactly: llama3 keeps the high
 * frequencies and divides the low ones by factor; yarn keeps the pairs
 * below its ramp, divides those above, and multiplies cos and sin by
 * 0.1 ln(factor) + 1. */
Test(dense, rope_scaled_tables) {
    const int64_t T = 2048, hd = 128, half = hd / 2;
    const struct {
        const char *name;
        double theta;
        moe_rope_scaling s;
        int64_t pairs[3];  /* where transformers' inv_freq is given */
        uint32_t want[3];  /* its fp32 bits there */
    } cases[] = {
        {"llama3", 5e5,
         {.type = MOE_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
          .original_max_position_embeddings = 8192},
         {10, 44, 60}, {0x3e03c6a0, 0x377d45c3, 0x351864a7}},
        {"yarn", 1e6,
         {.type = MOE_ROPE_YARN, .factor = 4, .original_max_position_embeddings = 32768, .beta_fast = 32,
          .beta_slow = 1, .truncate = true},
         {10, 30, 60}, {0x3dec7fd6, 0x3a8b8207, 0x351f23e4}},
        {"linear", 1e4, {.type = MOE_ROPE_LINEAR, .factor = 2}, {0, 20, 63}, {0x3f000000, 0x3ce655c2, 0x38722ce2}},
    };
    float *cs = xcalloc(T * half, sizeof(float)), *sn = xcalloc(T * half, sizeof(float));
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const moe_rope_scaling *s = &cases[k].s;
        moe_rope_tables(cs, sn, T, hd, cases[k].theta, s);
        const double att = ref_rope_attention(s);
        double worst = 0.0;
        int64_t bad = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < half; i++) {
                const double a = ref_rope_angle(t, i, hd, cases[k].theta, s);
                const double err = fmax(fabs(cs[t * half + i] - att * cos(a)), fabs(sn[t * half + i] - att * sin(a)));
                if (!(err <= att * (1e-7 + 2e-7 * a))) bad++;
                worst = fmax(worst, err);
            }
        cr_expect(bad == 0, "%s: %lld entries off transformers' formulas; worst err %.3g", cases[k].name,
                  (long long)bad, worst);
        /* The frequency at t = 1 is sin's angle; transformers' within an ulp or two (its fp32 pow). */
        for (int j = 0; j < 3; j++) {
            const int64_t i = cases[k].pairs[j];
            float want;
            memcpy(&want, &cases[k].want[j], sizeof want);
            const double got = asin(sn[half + i] / att);
            cr_expect(fabs(got - (double)want) <= 3e-7 * want, "%s: pair %lld's frequency %.9g, transformers' %.9g",
                      cases[k].name, (long long)i, got, (double)want);
        }
    }
    /* Landmarks, bit for bit against the unscaled tables at t = 1. */
    float *c0 = xcalloc(T * half, sizeof(float)), *s0 = xcalloc(T * half, sizeof(float));
    moe_rope_tables(c0, s0, 2, hd, 5e5, &(moe_rope_scaling){0});
    moe_rope_tables(cs, sn, 2, hd, 5e5, &cases[0].s);
    cr_expect(sn[half + 0] == s0[half + 0] && sn[half + 5] == s0[half + 5], "llama3 changed a high frequency");
    const float low = (float)(1.0 / pow(5e5, 2.0 * 63 / 128)) / 8.0f;
    cr_expect(fabs(sn[half + 63] - sinf(low)) <= 1e-7 * low, "llama3's lowest frequency %.9g, want %.9g / 8",
              (double)sn[half + 63], (double)low * 8);
    moe_rope_tables(c0, s0, 2, hd, 1e6, &(moe_rope_scaling){0});
    moe_rope_tables(cs, sn, 2, hd, 1e6, &cases[1].s);
    const float yarn_att = (float)(0.1 * log(4.0) + 1.0);
    cr_expect(cs[0] == yarn_att && sn[half] == s0[half] * yarn_att, "yarn: cos(0) %.9g, want %.9g", (double)cs[0],
              (double)yarn_att);
    /* dynamic is unscaled within max_position_embeddings, all a model reaches. */
    moe_rope_tables(cs, sn, 2, hd, 1e6, &(moe_rope_scaling){.type = MOE_ROPE_DYNAMIC, .factor = 4});
    cr_expect(memcmp(cs, c0, 2 * half * sizeof *cs) == 0 && memcmp(sn, s0, 2 * half * sizeof *sn) == 0,
              "dynamic's tables are not the unscaled ones");
    free(cs), free(sn), free(c0), free(s0);
}

typedef struct rope_ctx {
    const double *x, *cs, *sn, *dout;
    double *y;
    int64_t B, T, H, hd;
} rope_ctx;

static double rope_loss(const void *vctx) {
    const rope_ctx *c = vctx;
    ref_rope_tables(c->y, c->x, c->cs, c->sn, c->B, c->T, c->H, c->hd);
    return dot_d(c->dout, c->y, c->B * c->T * c->H * c->hd);
}

Test(dense, rope) {
    const int64_t B = 2, T = 5, H = 3, hd = 6, half = hd / 2, n = B * T * H * hd;
    const float theta = 10000.0f;
    rng r = {4};
    float *cs = xcalloc(T * half, sizeof(float)), *sn = xcalloc(T * half, sizeof(float));
    moe_rope_tables(cs, sn, T, hd, theta, &(moe_rope_scaling){0});
    float *x = rand_floats(n, &r, -1, 1), *y = copy_floats(x, n);
    moe_cpu_rope_forward(y, cs, sn, B, T, H, hd);

    /* Direct formula with exact angles: HF's fp32 angles differ by up to
     * 4e-7 of the angle (hd = 6 rounds 2i/hd as well), times |x| <= 1.5. */
    double *xd = to_double(x, n), *yd = xcalloc(n, sizeof(double));
    double *csx = xcalloc(T * half, sizeof(double)), *snx = xcalloc(T * half, sizeof(double));
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            const double a = (double)t * pow((double)theta, -2.0 * (double)i / (double)hd);
            csx[t * half + i] = cos(a), snx[t * half + i] = sin(a);
        }
    ref_rope_tables(yd, xd, csx, snx, B, T, H, hd);
    expect_close("rope forward", y, yd, n, 5e-6, 1e-6);

    /* Backward: the transpose of the very rotation the tables define. */
    double *csd = to_double(cs, T * half), *snd = to_double(sn, T * half);
    float *dout = rand_floats(n, &r, -1, 1), *dx = copy_floats(dout, n);
    moe_cpu_rope_backward(dx, cs, sn, B, T, H, hd);
    double *doutd = to_double(dout, n);
    rope_ctx ctx = {xd, csd, snd, doutd, yd, B, T, H, hd};
    double *fd = fd_grad(xd, n, rope_loss, &ctx), *got = to_double(dx, n);
    expect_grad("rope dx", got, fd, n);

    /* The rotation is orthogonal: backward undoes forward. */
    moe_cpu_rope_backward(y, cs, sn, B, T, H, hd);
    expect_close("rope backward(forward(x))", y, xd, n, 1e-6, 1e-6);
    free(cs), free(sn), free(x), free(y), free(xd), free(yd), free(csx), free(snx), free(csd),
        free(snd), free(dout), free(dx), free(doutd), free(fd), free(got);
}

/* ---------------------------------------------------------- attention */

typedef struct att_ctx {
    const double *q, *k, *v, *dout;
    double *out, *att;
    int64_t B, T, Hq, Hkv, hd, window;
} att_ctx;

static double att_loss(const void *vctx) {
    const att_ctx *c = vctx;
    ref_attention(c->out, c->att, c->q, c->k, c->v, c->B, c->T, c->Hq, c->Hkv, c->hd, c->window);
    return dot_d(c->dout, c->out, c->B * c->T * c->Hq * c->hd);
}

static void check_attention(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window,
                            uint64_t seed) {
    const int64_t nq = B * T * Hq * hd, nk = B * T * Hkv * hd, na = B * Hq * T * T;
    char what[96];
    rng r = {seed};
    float *q = rand_floats(nq, &r, -1.5, 1.5), *k = rand_floats(nk, &r, -1.5, 1.5);
    float *v = rand_floats(nk, &r, -1, 1);
    float *out = xcalloc(nq, sizeof(float)), *att = xcalloc(na, sizeof(float));
    moe_cpu_attention_forward(out, att, q, k, v, B, T, Hq, Hkv, hd, window);
    double *qd = to_double(q, nq), *kd = to_double(k, nk), *vd = to_double(v, nk);
    double *outd = xcalloc(nq, sizeof(double)), *attd = xcalloc(na, sizeof(double));
    ref_attention(outd, attd, qd, kd, vd, B, T, Hq, Hkv, hd, window);
    snprintf(what, sizeof what, "attention out (Hq %lld Hkv %lld T %lld window %lld)", (long long)Hq,
             (long long)Hkv, (long long)T, (long long)window);
    expect_close(what, out, outd, nq, 1e-6, 1e-5);
    snprintf(what, sizeof what, "attention probs (Hq %lld Hkv %lld T %lld window %lld)", (long long)Hq,
             (long long)Hkv, (long long)T, (long long)window);
    expect_close(what, att, attd, na, 1e-7, 1e-5); /* zeros outside each row's keys included */

    float *dout = rand_floats(nq, &r, -1, 1), *datt = xcalloc(na, sizeof(float));
    for (int64_t i = 0; i < na; i++) datt[i] = NAN; /* scratch: contents must not matter */
    float *dq0 = rand_floats(nq, &r, -1, 1), *dk0 = rand_floats(nk, &r, -1, 1);
    float *dv0 = rand_floats(nk, &r, -1, 1);
    float *dq = copy_floats(dq0, nq), *dk = copy_floats(dk0, nk), *dv = copy_floats(dv0, nk);
    moe_cpu_attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, Hq, Hkv, hd, window);
    double *doutd = to_double(dout, nq);
    att_ctx ctx = {qd, kd, vd, doutd, outd, attd, B, T, Hq, Hkv, hd, window};
    double *fq = fd_grad(qd, nq, att_loss, &ctx), *fk = fd_grad(kd, nk, att_loss, &ctx);
    double *fv = fd_grad(vd, nk, att_loss, &ctx);
    double *gq = increment(dq, dq0, nq), *gk = increment(dk, dk0, nk), *gv = increment(dv, dv0, nk);
    snprintf(what, sizeof what, "attention dq (Hq %lld Hkv %lld)", (long long)Hq, (long long)Hkv);
    expect_grad(what, gq, fq, nq);
    snprintf(what, sizeof what, "attention dk (Hq %lld Hkv %lld)", (long long)Hq, (long long)Hkv);
    expect_grad(what, gk, fk, nk);
    snprintf(what, sizeof what, "attention dv (Hq %lld Hkv %lld)", (long long)Hq, (long long)Hkv);
    expect_grad(what, gv, fv, nk);
    free(q), free(k), free(v), free(out), free(att), free(qd), free(kd), free(vd), free(outd),
        free(attd), free(dout), free(datt), free(dq0), free(dk0), free(dv0), free(dq), free(dk),
        free(dv), free(doutd), free(fq), free(fk), free(fv), free(gq), free(gk), free(gv);
}

Test(dense, attention_gqa) { check_attention(2, 5, 4, 2, 6, 0, 5); }
Test(dense, attention_one_kv_head) { check_attention(2, 5, 4, 1, 6, 0, 6); }
Test(dense, attention_kv_per_head) { check_attention(2, 5, 4, 4, 6, 0, 7); }
/* T = 11: several blocks of four keys and query rows, plus their tails. */
Test(dense, attention_longer) { check_attention(1, 11, 3, 1, 5, 0, 8); }
/* hd 8, the default model's, which the kernel compiles for on its own; T 13
 * ends in part-blocks of eight keys and of four rows. */
Test(dense, attention_hd8) { check_attention(2, 13, 4, 2, 8, 0, 9); }
/* hd 204: 16 keys per transposed tile, so T 18 spans two tiles, and 25
 * blocks of eight channels plus a tail of four. */
Test(dense, attention_key_tiles) { check_attention(1, 18, 1, 1, 204, 0, 10); }
/* hd 264, past the key-vectorised path's limit: the head-dim layout. */
Test(dense, attention_large_hd) { check_attention(1, 5, 2, 1, 264, 0, 11); }
/* Sliding windows on both layouts: of two keys (the smallest whose
 * softmax has a gradient: a query that sees itself alone has none), of a
 * few (shorter than a block of eight keys, and across the blocks of four
 * rows), of the whole sequence but one, and wider than it (the same as
 * none). */
Test(dense, attention_window) {
    check_attention(2, 13, 4, 2, 8, 2, 12);
    check_attention(2, 13, 4, 2, 8, 3, 13);
    check_attention(1, 18, 1, 1, 204, 5, 14);
    check_attention(2, 13, 4, 2, 8, 12, 15);
    check_attention(1, 11, 3, 1, 5, 40, 16);
    check_attention(1, 9, 2, 1, 264, 4, 17);
    /* hd 128: tiles of 32 keys, so T 40 spans two, and a window of 7 skips
     * the first tile's rows past it and the blocks before each row's. */
    check_attention(1, 40, 1, 1, 128, 7, 18);
}

/* ------------------------------------------------------ cross-entropy */

typedef struct xent_ctx {
    const double *z, *dloss;
    const int32_t *targets;
    int64_t N, V;
    double z_coef; /* the logits' z-loss, lse^2 per counted row */
} xent_ctx;

static double xent_loss(const void *vctx) {
    const xent_ctx *c = vctx;
    double s = 0.0, lse;
    for (int64_t n = 0; n < c->N; n++) {
        const double ce = ref_xent_row(c->z + n * c->V, c->V, c->targets[n], &lse);
        if (c->targets[n] >= 0) s += c->dloss[n] * (ce + c->z_coef * lse * lse);
    }
    return s;
}

Test(dense, crossentropy) {
    const int64_t N = 10, V = 11;
    rng r = {9};
    int32_t targets[10] = {0, 10, 3, -100, 5, 5, 1, 9, 2, 7}; /* row 3 ignored */
    float *z = rand_floats(N * V, &r, -4, 4), *losses = xcalloc(N, sizeof(float));
    double *lse = xcalloc(N, sizeof(double));
    moe_cpu_crossentropy_forward(losses, lse, z, targets, N, V);
    double *zd = to_double(z, N * V), loss_ref[10], lse_ref[10];
    for (int64_t n = 0; n < N; n++) loss_ref[n] = ref_xent_row(zd + n * V, V, targets[n], &lse_ref[n]);
    expect_close("crossentropy losses", losses, loss_ref, N, 1e-6, 1e-6);
    for (int64_t n = 0; n < N; n++)
        cr_expect(fabs(lse[n] - lse_ref[n]) <= 1e-6 * fabs(lse_ref[n]), "lse[%lld] %.12g ref %.12g",
                  (long long)n, lse[n], lse_ref[n]);

    float *dloss = rand_floats(N, &r, 0.05, 0.2), *dz = xcalloc(N * V, sizeof(float));
    double *dlossd = to_double(dloss, N);
    float *zi = copy_floats(z, N * V);
    /* Without and with the logits' z-loss (PaLM's 1e-4 would hide in the
     * tolerance: 0.05). */
    for (int with_z = 0; with_z < 2; with_z++) {
        const float z_coef = with_z ? 0.05f : 0.0f;
        for (int64_t i = 0; i < N * V; i++) dz[i] = NAN; /* written, not accumulated */
        moe_cpu_crossentropy_backward(dz, z, lse, targets, dloss, z_coef, N, V);
        xent_ctx ctx = {zd, dlossd, targets, N, V, z_coef};
        double *fd = fd_grad(zd, N * V, xent_loss, &ctx), *got = to_double(dz, N * V);
        expect_grad(with_z ? "crossentropy dlogits with a z-loss" : "crossentropy dlogits", got, fd, N * V);
        for (int64_t j = 0; j < V; j++)
            cr_expect(dz[3 * V + j] == 0.0f, "ignored row 3 has dlogits[%lld] = %g", (long long)j,
                      (double)dz[3 * V + j]);
        free(fd), free(got);

        /* In place over the logits: the same bits. */
        memcpy(zi, z, (size_t)(N * V) * sizeof *zi);
        moe_cpu_crossentropy_backward(zi, zi, lse, targets, dloss, z_coef, N, V);
        cr_expect(memcmp(zi, dz, (size_t)(N * V) * sizeof(float)) == 0,
                  "in-place crossentropy backward differs from out-of-place");
    }
    free(z), free(losses), free(lse), free(zd), free(dloss), free(dz), free(dlossd), free(zi);
}

/* Logits near 1e4 overflow a naive exp; max-subtraction keeps them finite,
 * and the double lse keeps the probabilities accurate. */
Test(dense, crossentropy_large_logits) {
    const int64_t N = 3, V = 11;
    rng r = {10};
    int32_t targets[3] = {4, 0, 10};
    float *z = xcalloc(N * V, sizeof(float));
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < V; j++) z[n * V + j] = (float)((n == 1 ? -1e4 : 1e4) + uniform(&r, -8, 8));
    float losses[3], dloss[3] = {1.0f, 1.0f, 1.0f}, *dz = xcalloc(N * V, sizeof(float));
    double lse[3];
    moe_cpu_crossentropy_forward(losses, lse, z, targets, N, V);
    moe_cpu_crossentropy_backward(dz, z, lse, targets, dloss, 0.0f, N, V);
    double *zd = to_double(z, N * V), loss_ref[3], dz_ref[33];
    for (int64_t n = 0; n < N; n++) {
        double l;
        loss_ref[n] = ref_xent_row(zd + n * V, V, targets[n], &l);
        for (int64_t j = 0; j < V; j++) dz_ref[n * V + j] = exp(zd[n * V + j] - l) - (j == targets[n]);
    }
    expect_close("crossentropy losses at |logits| ~ 1e4", losses, loss_ref, N, 1e-5, 1e-6);
    expect_close("crossentropy dlogits at |logits| ~ 1e4", dz, dz_ref, N * V, 1e-6, 1e-5);
    free(z), free(dz), free(zd);
}

/* ----------------------------------------------------------- residual */

Test(dense, residual) {
    const int64_t n = 37;
    rng r = {11};
    float *a = rand_floats(n, &r, -1, 1), *b = rand_floats(n, &r, -1, 1);
    float *out = xcalloc(n, sizeof(float));
    moe_cpu_residual_forward(out, a, b, n);
    for (int64_t i = 0; i < n; i++)
        cr_expect(out[i] == a[i] + b[i], "residual out[%lld] %.9g != %.9g", (long long)i,
                  (double)out[i], (double)(a[i] + b[i]));
    float *d = rand_floats(n, &r, -1, 1), *da = copy_floats(a, n), *db = copy_floats(b, n);
    moe_cpu_residual_backward(da, db, d, n);
    for (int64_t i = 0; i < n; i++)
        cr_expect(da[i] == a[i] + d[i] && db[i] == b[i] + d[i],
                  "residual backward [%lld]: da %.9g db %.9g, want %.9g %.9g", (long long)i,
                  (double)da[i], (double)db[i], (double)(a[i] + d[i]), (double)(b[i] + d[i]));
    moe_cpu_residual_forward(a, a, b, n); /* in place */
    cr_expect(memcmp(a, out, (size_t)n * sizeof(float)) == 0, "in-place residual add differs");
    free(a), free(b), free(out), free(d), free(da), free(db);
}

/* ------------------------------------------------- shared expert gate */

typedef struct sgate_ctx {
    const double *logits, *in, *dout;
    int64_t T, d;
} sgate_ctx;

/* sum out * dout with out[t] = sigmoid(logits[t]) in[t], ref_moe.h's
 * sigmoid in double (exp(100) is finite there). */
static double sgate_loss(const void *vctx) {
    const sgate_ctx *c = vctx;
    double s = 0.0;
    for (int64_t t = 0; t < c->T; t++)
        s += ref_sigmoid(c->logits[t]) * dot_d(c->in + t * c->d, c->dout + t * c->d, c->d);
    return s;
}

/* Qwen2-MoE's gated shared expert. Rows 0-3 hold logits of 30, -30, -100
 * and 100, where exp(-x) or exp(x) overflows float: every output must stay
 * finite. The backward reads the forward's output (gate times the input),
 * its reference the input itself. The gate is moe_sigmoidf, a few ulp from the exact one (rtol
 * 1e-6); below -88 it is 6e-39 where the exact one is 4e-44 (atol 1e-37).
 * dlogits is made from the float gate, as torch's sigmoid backward is, so
 * 1 - gate carries the gate's rounding relative to itself: 1e-5 at a
 * logit of 4 (rtol 1e-4), and is 0 at a logit of 30 where the exact one is
 * 9e-14 times the dot (atol 1e-11). Both are written, not accumulated: they
 * start as NaN. */
Test(dense, sigmoid_gate) {
    const int64_t T = 11, d = 13;
    rng r = {15};
    float *logits = rand_floats(T, &r, -4, 4), *in = rand_floats(T * d, &r, -2, 2);
    logits[0] = 30.0f, logits[1] = -30.0f, logits[2] = -100.0f, logits[3] = 100.0f;
    float *out = xcalloc(T * d, sizeof(float)), *gate = xcalloc(T, sizeof(float));
    moe_cpu_sigmoid_gate_forward(out, gate, in, logits, T, d);
    double *ld = to_double(logits, T), *ind = to_double(in, T * d);
    double *gate_ref = xcalloc(T, sizeof(double)), *out_ref = xcalloc(T * d, sizeof(double));
    for (int64_t t = 0; t < T; t++) {
        gate_ref[t] = ref_sigmoid(ld[t]);
        for (int64_t j = 0; j < d; j++) out_ref[t * d + j] = gate_ref[t] * ind[t * d + j];
    }
    expect_close("sigmoid_gate gate", gate, gate_ref, T, 1e-37, 1e-6);
    expect_close("sigmoid_gate out", out, out_ref, T * d, 1e-37, 1e-6);

    float *dout = rand_floats(T * d, &r, -1, 1), *din = xcalloc(T * d, sizeof(float));
    float *dlogits = xcalloc(T, sizeof(float));
    for (int64_t i = 0; i < T * d; i++) din[i] = NAN;
    for (int64_t t = 0; t < T; t++) dlogits[t] = NAN;
    moe_cpu_sigmoid_gate_backward(din, dlogits, dout, out, gate, T, d);
    double *doutd = to_double(dout, T * d), *din_ref = xcalloc(T * d, sizeof(double));
    double *dl_ref = xcalloc(T, sizeof(double));
    for (int64_t t = 0; t < T; t++) {
        dl_ref[t] = gate_ref[t] * (1.0 - gate_ref[t]) * dot_d(doutd + t * d, ind + t * d, d);
        for (int64_t j = 0; j < d; j++) din_ref[t * d + j] = gate_ref[t] * doutd[t * d + j];
    }
    expect_close("sigmoid_gate din", din, din_ref, T * d, 1e-37, 1e-6);
    expect_close("sigmoid_gate dlogits", dlogits, dl_ref, T, 1e-11, 1e-4);
    sgate_ctx ctx = {ld, ind, doutd, T, d};
    double *fdl = fd_grad(ld, T, sgate_loss, &ctx), *fdx = fd_grad(ind, T * d, sgate_loss, &ctx);
    double *gl = to_double(dlogits, T), *gx = to_double(din, T * d);
    expect_grad("sigmoid_gate dlogits", gl, fdl, T);
    expect_grad("sigmoid_gate din", gx, fdx, T * d);

    /* In place: out over in, din over dout; the same bits. */
    float *buf = copy_floats(in, T * d), *gate2 = xcalloc(T, sizeof(float));
    moe_cpu_sigmoid_gate_forward(buf, gate2, buf, logits, T, d);
    cr_expect(memcmp(buf, out, (size_t)(T * d) * sizeof(float)) == 0 &&
                  memcmp(gate2, gate, (size_t)T * sizeof(float)) == 0,
              "sigmoid_gate forward with out == in differs from out-of-place");
    memcpy(buf, dout, (size_t)(T * d) * sizeof(float));
    float *dlogits2 = xcalloc(T, sizeof(float));
    moe_cpu_sigmoid_gate_backward(buf, dlogits2, buf, out, gate, T, d);
    cr_expect(memcmp(buf, din, (size_t)(T * d) * sizeof(float)) == 0 &&
                  memcmp(dlogits2, dlogits, (size_t)T * sizeof(float)) == 0,
              "sigmoid_gate backward with din == dout differs from out-of-place");
    free(logits), free(in), free(out), free(gate), free(ld), free(ind), free(gate_ref), free(out_ref),
        free(dout), free(din), free(dlogits), free(doutd), free(din_ref), free(dl_ref), free(fdl), free(fdx),
        free(gl), free(gx), free(buf), free(gate2), free(dlogits2);
}

/* -------------------------------------------------------------- AdamW */

/* torch.optim.AdamW, in double, three steps with fresh gradients, over
 * spans with and without weight decay (one a single parameter); the third
 * step's gradients clipped by a factor of 0.3. */
Test(dense, adamw) {
    const int64_t n = 29;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    static const moe_adamw_span spans[] = {{10, true}, {13, false}, {14, true}, {29, false}};
    rng r = {12};
    float *p = rand_floats(n, &r, -1, 1), *m = xcalloc(n, sizeof(float)), *v = xcalloc(n, sizeof(float));
    double *pd = to_double(p, n), *md = xcalloc(n, sizeof(double)), *vd = xcalloc(n, sizeof(double));
    for (int64_t t = 1; t <= 3; t++) {
        float *g = rand_floats(n, &r, -2, 2);
        if (t == 2) g[0] = 0.0f; /* a zero gradient still decays and moves by momentum */
        const float clip = t == 3 ? 0.3f : 1.0f;
        moe_cpu_adamw(p, m, v, g, clip, n, spans, 4, lr, b1, b2, eps, wd, t);
        const double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
        for (int64_t i = 0; i < n; i++) {
            const bool decays = i < 10 || i == 13;
            const double gi = (double)g[i] * clip;
            if (decays) pd[i] *= 1.0 - (double)lr * wd;
            md[i] = b1 * md[i] + (1.0 - b1) * gi;
            vd[i] = b2 * vd[i] + (1.0 - b2) * gi * gi;
            pd[i] -= lr * (md[i] / bc1) / (sqrt(vd[i] / bc2) + eps);
        }
        char what[32];
        snprintf(what, sizeof what, "adamw step %lld params", (long long)t);
        expect_close(what, p, pd, n, 1e-7, 1e-6);
        snprintf(what, sizeof what, "adamw step %lld m", (long long)t);
        expect_close(what, m, md, n, 1e-8, 1e-6);
        snprintf(what, sizeof what, "adamw step %lld v", (long long)t);
        expect_close(what, v, vd, n, 1e-9, 1e-6);
        free(g);
    }
    free(p), free(m), free(v), free(pd), free(md), free(vd);
}

/* The scale is the one rounding of scaling the gradients in place first:
 * the same bits as AdamW on fl(g * s) with a scale of 1. */
Test(dense, adamw_grad_scale_rounds_like_scaling_in_place) {
    const int64_t n = 257;
    static const moe_adamw_span spans[] = {{100, true}, {257, false}};
    rng r = {13};
    float *g = rand_floats(n, &r, -3, 3), *gs = copy_floats(g, n);
    const float s = 0.7071f;
    for (int64_t i = 0; i < n; i++) gs[i] *= s;
    float *p1 = rand_floats(n, &r, -1, 1), *p2 = copy_floats(p1, n);
    float *m1 = rand_floats(n, &r, -0.1, 0.1), *m2 = copy_floats(m1, n);
    float *v1 = rand_floats(n, &r, 0, 0.01), *v2 = copy_floats(v1, n);
    moe_cpu_adamw(p1, m1, v1, g, s, n, spans, 2, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 5);
    moe_cpu_adamw(p2, m2, v2, gs, 1.0f, n, spans, 2, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 5);
    cr_expect(memcmp(p1, p2, (size_t)n * sizeof *p1) == 0 && memcmp(m1, m2, (size_t)n * sizeof *m1) == 0 &&
                  memcmp(v1, v2, (size_t)n * sizeof *v1) == 0,
              "adamw with grad_scale %g differs from adamw on the gradients scaled first", (double)s);
    free(g), free(gs), free(p1), free(p2), free(m1), free(m2), free(v1), free(v2);
}

/* ------------------------------------------------- determinism, norms */

Test(dense, sumsq_thread_independent) {
    const int64_t sizes[3] = {5, 1000, 1000003};
    rng r = {13};
    for (int s = 0; s < 3; s++) {
        const int64_t n = sizes[s];
        float *x = rand_floats(n, &r, -1, 1);
        double ref = 0.0, one, two;
        for (int64_t i = 0; i < n; i++) ref += (double)x[i] * x[i];
        omp_set_num_threads(1);
        moe_cpu_sumsq(&one, x, n);
        omp_set_num_threads(2);
        moe_cpu_sumsq(&two, x, n);
        cr_expect(memcmp(&one, &two, sizeof one) == 0,
                  "sumsq n=%lld: 1 thread %.17g, 2 threads %.17g", (long long)n, one, two);
        cr_expect(fabs(one - ref) <= 1e-12 * ref, "sumsq n=%lld: %.17g, reference %.17g",
                  (long long)n, one, ref);
        free(x);
    }
}

/* The row reductions of the backwards (dwte, dweight) give the same bits on
 * one thread and two, with many rows colliding on few tokens; so do the
 * sigmoid gate's per-row dots. */
Test(dense, reductions_thread_independent) {
    const int64_t N = 3000, C = 37, V = 5;
    rng r = {14};
    int32_t *tokens = xcalloc(N, sizeof *tokens);
    for (int64_t n = 0; n < N; n++) tokens[n] = (int32_t)(uniform(&r, 0, 1) * V);
    float *dout = rand_floats(N * C, &r, -1, 1), *x = rand_floats(N * C, &r, -1, 1);
    float *w = rand_floats(C, &r, 0.5, 1.5), *y = xcalloc(N * C, sizeof(float));
    float *rstd = xcalloc(N, sizeof(float)), *dx = xcalloc(N * C, sizeof(float));
    float *logits = rand_floats(N, &r, -4, 4), *gate = xcalloc(N, sizeof(float));
    float *dwte[2], *dw[2], *dlogits[2];
    for (int th = 0; th < 2; th++) {
        omp_set_num_threads(th + 1);
        dwte[th] = xcalloc(V * C, sizeof(float));
        dw[th] = xcalloc(C, sizeof(float));
        dlogits[th] = xcalloc(N, sizeof(float));
        moe_cpu_embedding_backward(dwte[th], dout, tokens, N, C);
        moe_cpu_rmsnorm_forward(y, rstd, x, w, 1e-5f, N, C);
        moe_cpu_rmsnorm_backward(dx, dw[th], dout, x, w, rstd, N, C);
        moe_cpu_sigmoid_gate_forward(y, gate, x, logits, N, C);
        moe_cpu_sigmoid_gate_backward(dx, dlogits[th], dout, y, gate, N, C);
    }
    cr_expect(memcmp(dwte[0], dwte[1], (size_t)(V * C) * sizeof(float)) == 0,
              "embedding dwte differs between 1 and 2 threads");
    cr_expect(memcmp(dw[0], dw[1], (size_t)C * sizeof(float)) == 0,
              "rmsnorm dweight differs between 1 and 2 threads");
    cr_expect(memcmp(dlogits[0], dlogits[1], (size_t)N * sizeof(float)) == 0,
              "sigmoid_gate dlogits differs between 1 and 2 threads");
    free(tokens), free(dout), free(x), free(w), free(y), free(rstd), free(dx), free(logits), free(gate);
    for (int th = 0; th < 2; th++) free(dwte[th]), free(dw[th]), free(dlogits[th]);
}
