/* test_moe_ops.c: every op of the CPU table against the naive double
 * reference in ref_moe.h, on seeded random inputs.
 *
 * Tolerances (fp32 op vs double reference): an element passes when
 * |got - ref| <= atol + rtol * |ref|, with rtol = 1e-5 and atol = 1e-5 times
 * the magnitude of the terms that were summed (gemm, combine, experts) or
 * 1e-6 for values in [0, 1] (probabilities, weights). Copies (permute) and
 * selections (top-k indices, counts) must match exactly. gate_backward is
 * compared with central finite differences of the reference in double
 * (step 1e-5, truncation error ~1e-10), with rtol 1e-4 and atol 1e-5 times
 * the largest gradient. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/host_memory.h"
#include "common/status.h"
#include "kernels/ops.h"
#include "kernels/moe_math.h"
#include "ref_moe.h"

#define RTOL 1e-5
#define GARBAGE 1e30f

static const moe_ops *ops(void) {
    const moe_ops *o = moe_cpu_ops();
    cr_assert(o != NULL && o->gemm && o->gate_forward && o->gate_backward && o->permute &&
                  o->combine && o->combine_backward && o->unpermute_add && o->experts_forward &&
                  o->experts_backward,
              "moe_cpu_ops() must fill every op");
    return o;
}

static const char *kind_name(moe_gate_kind k) {
    return k == MOE_GATE_SOFTMAX_TOPK   ? "softmax_topk"
           : k == MOE_GATE_TOPK_SOFTMAX ? "topk_softmax"
                                        : "sigmoid";
}

/* ------------------------------------------------------------------ gemm */

static void check_gemm(int64_t m, int64_t n, int64_t k, bool ta, bool tb, int64_t pad, float alpha,
                       float beta, uint64_t seed) {
    ref_rng rng = {seed};
    int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
    int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
    int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
    float *a = ref_alloc((size_t)(a_rows * lda) * sizeof *a);
    float *b = ref_alloc((size_t)(b_rows * ldb) * sizeof *b);
    float *c = ref_alloc((size_t)(m * ldc) * sizeof *c);
    float *c0 = ref_alloc((size_t)(m * ldc) * sizeof *c0);
    double *want = ref_alloc((size_t)(m * ldc) * sizeof *want);
    ref_fill(a, a_rows * lda, &rng, -1, 1);
    ref_fill(b, b_rows * ldb, &rng, -1, 1);
    ref_fill(c0, m * ldc, &rng, -1, 1);
    memcpy(c, c0, (size_t)(m * ldc) * sizeof *c);
    double scale = 0.0;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < ldc; j++) {
            if (j >= n) { /* the padding must stay as it was */
                want[i * ldc + j] = c0[i * ldc + j];
                continue;
            }
            double s = 0.0, s_abs = 0.0;
            for (int64_t p = 0; p < k; p++) {
                double av = ta ? a[p * lda + i] : a[i * lda + p];
                double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += av * bv;
                s_abs += fabs(av * bv);
            }
            want[i * ldc + j] = (double)alpha * s + (double)beta * c0[i * ldc + j];
            scale = fmax(scale, fabs(alpha) * s_abs + fabs(beta * c0[i * ldc + j]));
        }
    }
    ops()->gemm(c, a, b, m, n, k, lda, ldb, ldc, ta, tb, alpha, beta);
    char what[128];
    snprintf(what, sizeof what, "gemm m=%lld n=%lld k=%lld ta=%d tb=%d pad=%lld beta=%g",
             (long long)m, (long long)n, (long long)k, ta, tb, (long long)pad, beta);
    REF_EXPECT_CLOSE(what, c, want, m * ldc, 1e-5 * fmax(scale, 1e-3), RTOL);
    free(a);
    free(b);
    free(c);
    free(c0);
    free(want);
}

Test(ops, gemm_all_transposes_and_strides) {
    static const int64_t shapes[][3] = {
        {5, 7, 3}, {1, 13, 9}, {17, 1, 11}, {6, 6, 1}, {33, 19, 40}};
    uint64_t seed = 1;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int64_t pad = 0; pad <= 3; pad += 3) {
                    check_gemm(shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, pad, 0.75f, 0.5f,
                               seed++);
                    check_gemm(shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, pad, 1.0f, 0.0f,
                               seed++);
                }
}

/* ------------------------------------------------------------------ gate */

/* Random logits for one token whose selection (and slot order) is at least
 * min_gap away from changing, so fp32 and double agree on it. hot >= 0 makes
 * that expert win for every token. */
static void gen_logits_row(float *row, const double *bias, int64_t E, int64_t k, moe_gate_kind kind,
                           int64_t hot, int64_t n_groups, int64_t top_groups, ref_rng *rng) {
    for (int tries = 0; tries < 1000; tries++) {
        double l[64], gap;
        int32_t idx[64];
        for (int64_t e = 0; e < E; e++) {
            row[e] = (float)ref_uniform(rng, -2.5, 2.5) + (e == hot ? 6.0f : 0.0f);
            l[e] = row[e];
        }
        ref_topk_grouped(idx, &gap, l, bias, E, k, kind, n_groups, top_groups);
        if (gap > 1e-3) return;
    }
    cr_assert_fail("could not draw logits without near-ties (E=%lld k=%lld)", (long long)E,
                   (long long)k);
}

typedef struct gate_case {
    int64_t E, k, T;
    moe_gate_kind kind;
    bool renormalize, with_bias;
    int64_t hot; /* -1: none */
    int64_t n_groups, top_groups; /* group-limited routing when n_groups > 1 */
    float scale;                  /* routed_scale */
} gate_case;

static void check_gate_forward(const gate_case *gc, uint64_t seed) {
    const int64_t E = gc->E, k = gc->k, T = gc->T;
    ref_rng rng = {seed};
    double bias_d[64];
    float bias[64];
    for (int64_t e = 0; e < E; e++)
        bias[e] = (float)ref_uniform(&rng, -0.3, 0.3), bias_d[e] = bias[e];
    const double *bias_ref = gc->with_bias ? bias_d : NULL;

    float *logits = ref_alloc((size_t)(T * E) * sizeof *logits);
    for (int64_t t = 0; t < T; t++)
        gen_logits_row(logits + t * E, bias_ref, E, k, gc->kind, gc->hot, gc->n_groups, gc->top_groups, &rng);

    int32_t *idx = ref_alloc((size_t)(T * k) * sizeof *idx);
    float *w = ref_alloc((size_t)(T * k) * sizeof *w);
    float *prob = ref_alloc((size_t)(T * E) * sizeof *prob);
    float *lse = ref_alloc((size_t)T * sizeof *lse);
    int64_t assigned[64];
    double prob_sum[64];
    for (int64_t e = 0; e < E; e++) assigned[e] = -7, prob_sum[e] = -7.0; /* overwritten */
    const int64_t n_chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;
    double *scratch = ref_alloc((size_t)(n_chunks * (2 * E + 1)) * sizeof *scratch);
    double z_sum = -7.0;
    moe_gate_totals totals = {assigned, prob_sum, &z_sum, scratch};
    moe_gate_params p = {E, k, gc->kind, gc->renormalize, gc->n_groups, gc->top_groups, gc->scale, 0};
    ops()->gate_forward(idx, w, prob, lse, &totals, logits, gc->with_bias ? bias : NULL, &p, T);
    free(scratch);

    int32_t *want_idx = ref_alloc((size_t)(T * k) * sizeof *want_idx);
    double *want_w = ref_alloc((size_t)(T * k) * sizeof *want_w);
    double *want_prob = ref_alloc((size_t)(T * E) * sizeof *want_prob);
    double *want_lse = ref_alloc((size_t)T * sizeof *want_lse);
    int64_t want_assigned[64] = {0};
    double want_prob_sum[64] = {0}, want_z = 0.0;
    for (int64_t t = 0; t < T; t++) {
        double l[64];
        for (int64_t e = 0; e < E; e++) l[e] = logits[t * E + e];
        ref_router_prob(want_prob + t * E, want_lse + t, l, E, gc->kind);
        ref_topk_grouped(want_idx + t * k, NULL, l, bias_ref, E, k, gc->kind, gc->n_groups, gc->top_groups);
        ref_topk_weights(want_w + t * k, l, want_idx + t * k, E, k, gc->kind, gc->renormalize);
        for (int64_t j = 0; j < k; j++) want_w[t * k + j] *= gc->scale;
        for (int64_t j = 0; j < k; j++) want_assigned[want_idx[t * k + j]]++;
        for (int64_t e = 0; e < E; e++) want_prob_sum[e] += want_prob[t * E + e];
        want_z += want_lse[t] * want_lse[t];
    }

    char what[192];
    int n = snprintf(what, sizeof what,
                     "gate_forward %s renorm=%d bias=%d E=%lld k=%lld T=%lld hot=%lld groups=%lld/%lld scale=%g",
                     kind_name(gc->kind), gc->renormalize, gc->with_bias, (long long)E,
                     (long long)k, (long long)T, (long long)gc->hot, (long long)gc->top_groups,
                     (long long)gc->n_groups, (double)gc->scale);
    for (int64_t i = 0; i < T * k; i++)
        cr_expect(idx[i] == want_idx[i], "%s: topk_idx[t=%lld, j=%lld] = %d, want %d", what,
                  (long long)(i / k), (long long)(i % k), idx[i], want_idx[i]);
    for (int64_t e = 0; e < E; e++)
        cr_expect(assigned[e] == want_assigned[e], "%s: totals.assigned[%lld] = %lld, want %lld",
                  what, (long long)e, (long long)assigned[e], (long long)want_assigned[e]);
    snprintf(what + n, sizeof what - (size_t)n, " topk_w");
    REF_EXPECT_CLOSE(what, w, want_w, T * k, 1e-6, RTOL);
    snprintf(what + n, sizeof what - (size_t)n, " prob");
    REF_EXPECT_CLOSE(what, prob, want_prob, T * E, 1e-6, RTOL);
    snprintf(what + n, sizeof what - (size_t)n, " lse");
    REF_EXPECT_CLOSE(what, lse, want_lse, T, 1e-6, RTOL);
    for (int64_t e = 0; e < E; e++)
        cr_expect(fabs(prob_sum[e] - want_prob_sum[e]) <=
                      1e-6 * (double)T + RTOL * want_prob_sum[e],
                  "%s: totals.prob_sum[%lld] = %.9g, want %.9g", what, (long long)e, prob_sum[e],
                  want_prob_sum[e]);
    cr_expect(fabs(z_sum - want_z) <= 1e-6 * (double)T + RTOL * want_z,
              "%s: totals.z_sum = %.9g, want %.9g", what, z_sum, want_z);

    free(logits);
    free(idx);
    free(w);
    free(prob);
    free(lse);
    free(want_idx);
    free(want_w);
    free(want_prob);
    free(want_lse);
}

/* Shapes: a typical one, T=1 with k=1, k=E, all tokens on one expert, and
 * T over several MOE_GATE_CHUNK_TOKENS chunks (the last one partial);
 * group-limited routing with 4 groups of 2 keeping 2, groups of one, and
 * k filling the kept groups. */
static const gate_case gate_shapes[] = {
    {6, 2, 9, 0, 0, 0, -1, 0, 0, 1.0f}, {5, 1, 1, 0, 0, 0, -1, 0, 0, 1.0f},  {4, 4, 7, 0, 0, 0, -1, 0, 0, 1.0f},
    {7, 3, 8, 0, 0, 0, 2, 0, 0, 1.0f},  {8, 2, 150, 0, 0, 0, -1, 0, 0, 1.0f}, {8, 3, 70, 0, 0, 0, -1, 4, 2, 1.0f},
    {6, 2, 20, 0, 0, 0, -1, 6, 3, 1.0f}, {12, 6, 20, 0, 0, 0, 5, 3, 2, 1.0f},
};

/* Runs check over every shape x gate kind x renormalize x bias, each case
 * with its own seed from seed on, the routed weights scaled by 2.5 (as
 * DeepSeek-V3's) in every other case. */
static void for_each_gate_case(void (*check)(const gate_case *, uint64_t), uint64_t seed) {
    for (size_t s = 0; s < sizeof gate_shapes / sizeof gate_shapes[0]; s++)
        for (int kind = 0; kind < 3; kind++)
            for (int renorm = 0; renorm < 2; renorm++)
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    gate_case gc = gate_shapes[s];
                    gc.kind = (moe_gate_kind)kind;
                    gc.renormalize = renorm;
                    gc.with_bias = with_bias;
                    gc.scale = seed / 2 % 2 ? 2.5f : 1.0f; /* with and without the bias */
                    check(&gc, seed++);
                }
}

Test(ops, gate_forward_every_kind) { for_each_gate_case(check_gate_forward, 100); }

/* The gating pass over one token's logits row [E] (E <= 16), bias [E] or
 * NULL: its top-k idx [k] and weights w [k]. */
static void gate_one_token(int32_t *idx, float *w, const float *row, const float *bias, int64_t E, int64_t k,
                           moe_gate_kind kind, bool renormalize) {
    cr_assert(E <= 16);
    float prob[16], lse;
    int64_t assigned[16];
    double prob_sum[16], scratch[2 * 16 + 1], z_sum = 0.0;
    moe_gate_totals totals = {assigned, prob_sum, &z_sum, scratch};
    const moe_gate_params p = {E, k, kind, renormalize, 0, 0, 1.0f, 0};
    ops()->gate_forward(idx, w, prob, &lse, &totals, row, bias, &p, 1);
}

/* Exactly equal scores: the lower expert index comes first. */
Test(ops, gate_forward_ties_go_to_lower_index) {
    static const float rows[][5] = {
        {0.25f, 0.25f, 0.25f, 0.25f, 0.25f},
        {1.0f, 2.0f, 2.0f, 0.0f, 2.0f},
        {-1.0f, 3.0f, -1.0f, 3.0f, -1.0f},
    };
    static const int32_t want[][3][3] = {
        /* k = 1, 2, 3 */
        {{0}, {0, 1}, {0, 1, 2}},
        {{1}, {1, 2}, {1, 2, 4}},
        {{1}, {1, 3}, {1, 3, 0}},
    };
    for (int kind = 0; kind < 3; kind++)
        for (int r = 0; r < 3; r++)
            for (int64_t k = 1; k <= 3; k++) {
                int32_t idx[3];
                float w[3];
                gate_one_token(idx, w, rows[r], NULL, 5, k, (moe_gate_kind)kind, true);
                for (int64_t j = 0; j < k; j++)
                    cr_expect(idx[j] == want[r][k - 1][j],
                              "%s row %d k=%lld: slot %lld chose expert %d, want %d",
                              kind_name((moe_gate_kind)kind), r, (long long)k, (long long)j, idx[j],
                              want[r][k - 1][j]);
            }
}

/* alloc refuses a size that rounding up to its alignment would wrap. */
Test(ops, alloc_refuses_sizes_near_size_max) {
    const moe_ops *backends[2] = {moe_cpu_ops(), moe_strict_ops()};
    for (int b = 0; b < 2; b++) {
        void *p = (void *)1;
        cr_expect(backends[b]->alloc(&p, SIZE_MAX - 100) == MOE_ERR_OUT_OF_MEMORY && p == NULL,
                  "%s: alloc of SIZE_MAX - 100 bytes", backends[b]->name);
        cr_expect(backends[b]->alloc(&p, 100) == MOE_OK && p != NULL, "%s: alloc of 100 bytes", backends[b]->name);
        backends[b]->release(p);
    }
}

/* A block past the machine's total memory can never be had: refused as a
 * setting at fault (MOE_ERR_CONFIG, exit 2 in moe-train), naming that
 * bound, not as a shortage another try may survive. */
Test(ops, alloc_past_the_total_memory_is_a_config_error) {
    const moe_host_memory m = moe_host_memory_available("");
    if (m.total < 0) cr_skip_test("nothing says this machine's total memory");
    void *p = (void *)1;
    const moe_status st = moe_cpu_ops()->alloc(&p, (size_t)m.total + ((size_t)1 << 30));
    cr_expect(st == MOE_ERR_CONFIG && p == NULL, "alloc of the total memory + 1 GiB: status %d: %s", (int)st,
              moe_last_error());
    cr_expect(strstr(moe_last_error(), m.total_by), "'%s' does not name '%s'", moe_last_error(), m.total_by);
}

/* Weights normalised over the chosen k are a softmax over the chosen
 * logits (the sigmoid's: over their log-sigmoids, here the logits again)
 * even when a bias chooses experts far below the row's largest logit, past
 * expf's range, where the probabilities would underflow and tie: logits
 * {0, -100, -95}, bias {-1000, 0, 0}, k = 2; and the backward gives
 * w (dw - <w, dw>) on the chosen logits, nothing on the other. */
Test(ops, normalised_weights_when_the_bias_chooses_far_below) {
    const float logits[3] = {0.0f, -100.0f, -95.0f}, bias[3] = {-1000.0f, 0.0f, 0.0f};
    const float dw[2] = {1.0f, -0.5f};
    const double w_big = 1.0 / (1.0 + exp(-5.0)); /* softmax of {-95, -100} */
    for (int kind = 0; kind < 3; kind++) {
        int32_t idx[2];
        float w[2], prob[3], lse, dl[3];
        int64_t assigned[3];
        double prob_sum[3], scratch[2 * 3 + 1], z_sum = 0.0;
        moe_gate_totals totals = {assigned, prob_sum, &z_sum, scratch};
        const moe_gate_params p = {3, 2, (moe_gate_kind)kind, true, 0, 0, 1.0f, 0};
        /* softmax_topk's and the sigmoid's bias is added to probabilities:
         * a bias of 1 outranks any of them. */
        const float bias_p[3] = {kind == MOE_GATE_TOPK_SOFTMAX ? bias[0] : -1.0f, 1.0f, 1.0f};
        ops()->gate_forward(idx, w, prob, &lse, &totals, logits, bias_p, &p, 1);
        /* The scores of softmax_topk and the sigmoid tie there (probabilities
         * past float's range, plus the same bias), so either order will do. */
        const char *name = kind_name((moe_gate_kind)kind);
        cr_expect((idx[0] == 2 && idx[1] == 1) || (idx[0] == 1 && idx[1] == 2),
                  "%s: chose %d, %d; want 1 and 2", name, idx[0], idx[1]);
        double want_w[2], want[3] = {0.0, 0.0, 0.0}, dot = 0.0;
        for (int j = 0; j < 2; j++) {
            want_w[j] = idx[j] == 2 ? w_big : 1.0 - w_big;
            cr_expect(fabs(w[j] - want_w[j]) <= 1e-6, "%s: slot %d (expert %d) weight %.9g; want %.9g",
                      name, j, idx[j], w[j], want_w[j]);
            dot += want_w[j] * dw[j];
        }
        ops()->gate_backward(dl, dw, idx, w, prob, &lse, logits, NULL, 0.0f, &p, 1);
        for (int j = 0; j < 2; j++) want[idx[j]] = want_w[j] * (dw[j] - dot);
        for (int e = 0; e < 3; e++)
            cr_expect(fabs(dl[e] - want[e]) <= 1e-6, "%s: dlogits[%d] = %.9g, want %.9g", name, e,
                      dl[e], want[e]);
    }
}

/* The sigmoid's probabilities s / sum(s), its choice and its aux gradient
 * where s leaves float's range (logits -100 and -90, k = 1, no bias): the
 * larger logit is chosen, the probabilities are e^-10 apart, and the aux
 * gradient r (dr - <r, dr>) (1 - s) follows them. */
Test(ops, sigmoid_probabilities_below_floats_range) {
    const float logits[2] = {-100.0f, -90.0f}, aux[2] = {1.0f, 0.0f}, dw[1] = {0.0f};
    int32_t idx[1];
    float w[1], prob[2], lse, dl[2];
    int64_t assigned[2];
    double prob_sum[2], scratch[2 * 2 + 1], z_sum = 0.0;
    moe_gate_totals totals = {assigned, prob_sum, &z_sum, scratch};
    const moe_gate_params p = {2, 1, MOE_GATE_SIGMOID, true, 0, 0, 1.0f, 0};
    ops()->gate_forward(idx, w, prob, &lse, &totals, logits, NULL, &p, 1);
    const double small = 1.0 / (1.0 + exp(10.0)); /* s0 / (s0 + s1), s = e^l there */
    cr_expect(idx[0] == 1 && w[0] == 1.0f, "chose expert %d with weight %.9g; want 1 with 1", idx[0], w[0]);
    cr_expect(fabs(prob[0] - small) <= 1e-6 * small && fabs(prob[1] - (1.0 - small)) <= 1e-6,
              "probabilities %.9g, %.9g; want %.9g, %.9g", prob[0], prob[1], small, 1.0 - small);
    ops()->gate_backward(dl, dw, idx, w, prob, &lse, logits, aux, 0.0f, &p, 1);
    const double want = small * (1.0 - small); /* r0 (1 - r0), times 1 - s0 = 1 */
    cr_expect(fabs(dl[0] - want) <= 1e-6 * want && fabs(dl[1] + want) <= 1e-6 * want,
              "dlogits %.9g, %.9g; want %.9g, %.9g", dl[0], dl[1], want, -want);
}

/* moe_expf (moe_math.h) keeps NaN a NaN, and clamps the infinities to
 * float's normal range, with no undefined int conversion on the way (the
 * sanitizer build aborts on one). */
Test(ops, expf_keeps_nan_and_clamps) {
    cr_expect(isnan(moe_expf(NAN)) && isnan(moe_expf(-NAN)), "exp(NaN) is %g", moe_expf(NAN));
    cr_expect(moe_expf(INFINITY) == moe_expf(88.0f) && isfinite(moe_expf(INFINITY)), "exp(inf) is %g",
              moe_expf(INFINITY));
    cr_expect(moe_expf(-INFINITY) == moe_expf(-87.0f) && moe_expf(-INFINITY) > 0.0f, "exp(-inf) is %g",
              moe_expf(-INFINITY));
    for (float x = -87.0f; x <= 88.0f; x += 0.37f) {
        const double want = exp((double)x), got = moe_expf(x);
        cr_expect(fabs(got - want) <= 3e-7 * want, "exp(%g) = %.9g, want %.9g", x, got, want);
    }
}

/* A float's bits, and back. */
static uint32_t float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float bits_float(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* moe_log1p_unit within 2 ulp of log1p in double over [0, 1] (every
 * 31st float, small ones included, where u / (2 + u) keeps their bits), and
 * moe_log_sigmoidf within 3 ulp where moe_expf is within its range. */
static double ulps_off(float got, double want) {
    const float w = (float)want;
    const double ulp = (double)nextafterf(fabsf(w), INFINITY) - fabs((double)w);
    return fabs((double)got - want) / ulp;
}

Test(ops, log1p_unit_and_log_sigmoid_within_ulps) {
    double worst = 0.0;
    float at = 0.0f;
    for (uint32_t b = 0; b <= 0x3f800000u; b += 31) {
        const float u = bits_float(b);
        const double off = ulps_off(moe_log1p_unit(u), log1p((double)u));
        if (off > worst) worst = off, at = u;
    }
    cr_expect(worst <= 2.0, "log1p_unit: %.3f ulp at %a", worst, at);
    worst = 0.0;
    for (float x = -86.0f; x <= 86.0f; x += 0.00731f) {
        const double want = x < 0.0f ? x - log1p(exp((double)x)) : -log1p(exp(-(double)x));
        const double off = ulps_off(moe_log_sigmoidf(x), want);
        if (off > worst) worst = off, at = x;
    }
    cr_expect(worst <= 3.0, "log_sigmoid: %.3f ulp at %g", worst, at);
}

/* moe_clampf, the integer clamp under moe_expf, gives what the float
 * comparisons x < lo ? lo : x > hi ? hi : x give, bit for bit (NaN kept
 * with its payload, signed zeros, subnormals, the bounds' neighbours), over
 * a stride through every bit pattern and the patterns near the bounds. */
static void expect_clamp_as_comparisons(uint32_t u) {
    const float x = bits_float(u), lo = -87.0f, hi = 88.0f;
    const float want = x < lo ? lo : x > hi ? hi : x, got = moe_clampf(x, lo, hi);
    cr_expect(float_bits(got) == float_bits(want), "clamp of bits %08x (%g): %08x, want %08x", (unsigned)u, x,
              (unsigned)float_bits(got), (unsigned)float_bits(want));
}

Test(ops, clampf_is_the_float_comparisons) {
    for (uint64_t u = 0; u < (1ull << 32); u += 65521) expect_clamp_as_comparisons((uint32_t)u);
    const float edges[] = {-87.0f, 88.0f, 0.0f, -0.0f, INFINITY, -INFINITY, 1.17549435e-38f, -1.17549435e-38f};
    for (size_t e = 0; e < sizeof edges / sizeof edges[0]; e++)
        for (int64_t d = -300; d <= 300; d++) expect_clamp_as_comparisons(float_bits(edges[e]) + (uint32_t)d);
    const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu};
    for (size_t n = 0; n < sizeof nans / sizeof nans[0]; n++)
        cr_expect(float_bits(moe_clampf(bits_float(nans[n]), -87.0f, 88.0f)) == nans[n], "NaN %08x changed",
                  (unsigned)nans[n]);
}

/* NaN scores rank below every number, ties among them to the lower index,
 * on every backend (moe_score_outranks): a NaN logit makes its own score
 * NaN for topk_softmax and sigmoid, and every softmax probability NaN. */
Test(ops, gate_forward_ranks_nan_last) {
    const float row[5] = {NAN, 1.0f, NAN, 3.0f, 2.0f};
    static const int32_t want[3][5] = {
        [MOE_GATE_SOFTMAX_TOPK] = {0, 1, 2, 3, 4},
        [MOE_GATE_TOPK_SOFTMAX] = {3, 4, 1, 0, 2},
        [MOE_GATE_SIGMOID] = {3, 4, 1, 0, 2},
    };
    for (int kind = 0; kind < 3; kind++)
        for (int64_t k = 1; k <= 5; k++) {
            int32_t idx[5];
            float w[5];
            gate_one_token(idx, w, row, NULL, 5, k, (moe_gate_kind)kind, false);
            for (int64_t j = 0; j < k; j++)
                cr_expect(idx[j] == want[kind][j], "%s k=%lld: slot %lld chose expert %d, want %d",
                          kind_name((moe_gate_kind)kind), (long long)k, (long long)j, idx[j],
                          want[kind][j]);
        }
}

/* F(logits) for one token with the selection idx held fixed: the scalar
 * whose gradient gate_backward returns. */
static double gate_objective(const double *l, const int32_t *idx, const double *dw,
                             const double *aux_grad, double zc, int64_t E, int64_t k,
                             moe_gate_kind kind, int renormalize, double scale) {
    double w[64], r[64], lse;
    ref_topk_weights(w, l, idx, E, k, kind, renormalize);
    ref_router_prob(r, &lse, l, E, kind);
    double f = zc * lse * lse;
    for (int64_t j = 0; j < k; j++) f += dw[j] * scale * w[j];
    for (int64_t e = 0; e < E; e++) f += aux_grad[e] * r[e];
    return f;
}

static void check_gate_backward(const gate_case *gc, uint64_t seed) {
    const int64_t E = gc->E, k = gc->k, T = gc->T;
    ref_rng rng = {seed};
    /* A bias makes the selection differ from the plain top-k, so the op must
     * follow topk_idx rather than re-derive it. */
    double bias[64];
    for (int64_t e = 0; e < E; e++) bias[e] = ref_uniform(&rng, -0.3, 0.3);
    const double *bias_ref = gc->with_bias ? bias : NULL;

    float *logits = ref_alloc((size_t)(T * E) * sizeof *logits);
    int32_t *idx = ref_alloc((size_t)(T * k) * sizeof *idx);
    float *w = ref_alloc((size_t)(T * k) * sizeof *w);
    float *dw = ref_alloc((size_t)(T * k) * sizeof *dw);
    float *prob = ref_alloc((size_t)(T * E) * sizeof *prob);
    float *lse = ref_alloc((size_t)T * sizeof *lse);
    float *dlogits = ref_alloc((size_t)(T * E) * sizeof *dlogits);
    double *want = ref_alloc((size_t)(T * E) * sizeof *want);
    float aux_grad[64];
    double aux_grad_d[64];
    for (int64_t e = 0; e < E; e++)
        aux_grad[e] = (float)ref_uniform(&rng, -0.5, 0.5), aux_grad_d[e] = aux_grad[e];
    const float zc = 0.3f / (float)T;
    ref_fill(dw, T * k, &rng, -1, 1);
    for (int64_t i = 0; i < T * E; i++) dlogits[i] = GARBAGE; /* written, not accumulated */

    for (int64_t t = 0; t < T; t++) {
        gen_logits_row(logits + t * E, bias_ref, E, k, gc->kind, gc->hot, gc->n_groups, gc->top_groups, &rng);
        double l[64], r[64], ls, wd[64], dwd[64];
        for (int64_t e = 0; e < E; e++) l[e] = logits[t * E + e];
        for (int64_t j = 0; j < k; j++) dwd[j] = dw[t * k + j];
        ref_topk_grouped(idx + t * k, NULL, l, bias_ref, E, k, gc->kind, gc->n_groups, gc->top_groups);
        ref_topk_weights(wd, l, idx + t * k, E, k, gc->kind, gc->renormalize);
        ref_router_prob(r, &ls, l, E, gc->kind);
        for (int64_t j = 0; j < k; j++) w[t * k + j] = (float)(gc->scale * wd[j]);
        for (int64_t e = 0; e < E; e++) prob[t * E + e] = (float)r[e];
        lse[t] = (float)ls;
        const double h = 1e-5;
        for (int64_t e = 0; e < E; e++) {
            double save = l[e];
            l[e] = save + h;
            double fp = gate_objective(l, idx + t * k, dwd, aux_grad_d, zc, E, k, gc->kind,
                                       gc->renormalize, gc->scale);
            l[e] = save - h;
            double fm = gate_objective(l, idx + t * k, dwd, aux_grad_d, zc, E, k, gc->kind,
                                       gc->renormalize, gc->scale);
            l[e] = save;
            want[t * E + e] = (fp - fm) / (2 * h);
        }
    }
    moe_gate_params p = {E, k, gc->kind, gc->renormalize, gc->n_groups, gc->top_groups, gc->scale, 0};
    ops()->gate_backward(dlogits, dw, idx, w, prob, lse, logits, aux_grad, zc, &p, T);

    char what[192];
    snprintf(what, sizeof what, "gate_backward %s renorm=%d bias=%d E=%lld k=%lld T=%lld hot=%lld scale=%g",
             kind_name(gc->kind), gc->renormalize, gc->with_bias, (long long)E, (long long)k,
             (long long)T, (long long)gc->hot, (double)gc->scale);
    REF_EXPECT_CLOSE(what, dlogits, want, T * E, 1e-5 * fmax(1.0, ref_max_abs(want, T * E)), 1e-4);
    free(logits);
    free(idx);
    free(w);
    free(dw);
    free(prob);
    free(lse);
    free(dlogits);
    free(want);
}

Test(ops, gate_backward_vs_finite_differences) { for_each_gate_case(check_gate_backward, 500); }

/* --------------------------------------------------- permute and combine */

Test(ops, permute_copies_rows) {
    const int64_t T = 5, d = 13, n_rows = 11;
    static const int64_t row_token[11] = {4, 0, 0, 3, 1, 4, 2, 2, 0, 4, 1};
    ref_rng rng = {7};
    float x[5 * 13], xp[11 * 13];
    ref_fill(x, T * d, &rng, -1, 1);
    ops()->permute(xp, x, row_token, n_rows, d);
    for (int64_t r = 0; r < n_rows; r++)
        cr_expect(memcmp(xp + r * d, x + row_token[r] * d, (size_t)d * sizeof *x) == 0,
                  "permute: row %lld is not a copy of token %lld", (long long)r,
                  (long long)row_token[r]);
}

/* A routing of T tokens x k slots onto rows: each kept pair gets its own
 * row, rows assigned in a shuffled order; pairs with drop_mod | (t*k + j + 1)
 * are dropped (-1). Returns the number of rows. */
static int64_t make_pair_rows(int64_t *pair_row, int64_t T, int64_t k, int64_t drop_mod,
                              ref_rng *rng) {
    int64_t n = 0;
    for (int64_t i = 0; i < T * k; i++)
        pair_row[i] = (drop_mod > 0 && (i + 1) % drop_mod == 0) ? -1 : n++;
    /* shuffle the row numbers among the kept pairs */
    for (int64_t i = T * k - 1; i > 0; i--) {
        int64_t j = (int64_t)(ref_next(rng) % (uint64_t)(i + 1));
        if (pair_row[i] < 0 || pair_row[j] < 0) continue;
        int64_t tmp = pair_row[i];
        pair_row[i] = pair_row[j];
        pair_row[j] = tmp;
    }
    return n;
}

typedef struct combine_case {
    int64_t T, k, d, drop_mod;
    bool shared;
} combine_case;

static const combine_case combine_cases[] = {
    {6, 3, 13, 0, false}, {6, 3, 13, 4, false}, {6, 3, 13, 4, true}, {1, 1, 7, 0, true},
    {1, 1, 7, 1, false},  {9, 2, 16, 3, true},  {4, 4, 5, 2, false},
};

Test(ops, combine_forward_and_backward) {
    uint64_t seed = 900;
    for (size_t c = 0; c < sizeof combine_cases / sizeof combine_cases[0]; c++) {
        const combine_case cc = combine_cases[c];
        const int64_t T = cc.T, k = cc.k, d = cc.d;
        ref_rng rng = {seed++};
        int64_t *pair_row = ref_alloc((size_t)(T * k) * sizeof *pair_row);
        int64_t n_rows = make_pair_rows(pair_row, T, k, cc.drop_mod, &rng);
        float *yp = ref_alloc((size_t)(n_rows * d) * sizeof *yp);
        float *w = ref_alloc((size_t)(T * k) * sizeof *w);
        float *shared = ref_alloc((size_t)(T * d) * sizeof *shared);
        float *y = ref_alloc((size_t)(T * d) * sizeof *y);
        float *dy = ref_alloc((size_t)(T * d) * sizeof *dy);
        float *dyp = ref_alloc((size_t)(n_rows * d) * sizeof *dyp);
        float *dweights = ref_alloc((size_t)(T * k) * sizeof *dweights);
        double *want_y = ref_alloc((size_t)(T * d) * sizeof *want_y);
        double *want_dyp = ref_alloc((size_t)(n_rows * d) * sizeof *want_dyp);
        double *want_dw = ref_alloc((size_t)(T * k) * sizeof *want_dw);
        ref_fill(yp, n_rows * d, &rng, -2, 2);
        ref_fill(w, T * k, &rng, 0, 1);
        ref_fill(shared, T * d, &rng, -2, 2);
        ref_fill(dy, T * d, &rng, -1, 1);
        for (int64_t i = 0; i < T * d; i++) y[i] = GARBAGE;
        for (int64_t i = 0; i < n_rows * d; i++) dyp[i] = GARBAGE;
        for (int64_t i = 0; i < T * k; i++) dweights[i] = GARBAGE;

        double scale = 1.0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t c2 = 0; c2 < d; c2++) {
                double s = cc.shared ? shared[t * d + c2] : 0.0, s_abs = fabs(s);
                for (int64_t j = 0; j < k; j++) {
                    int64_t r = pair_row[t * k + j];
                    if (r < 0) continue;
                    s += (double)w[t * k + j] * yp[r * d + c2];
                    s_abs += fabs((double)w[t * k + j] * yp[r * d + c2]);
                    want_dyp[r * d + c2] = (double)w[t * k + j] * dy[t * d + c2];
                }
                want_y[t * d + c2] = s;
                scale = fmax(scale, s_abs);
            }
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < k; j++) {
                int64_t r = pair_row[t * k + j];
                double s = 0.0;
                for (int64_t c2 = 0; r >= 0 && c2 < d; c2++)
                    s += (double)dy[t * d + c2] * yp[r * d + c2];
                want_dw[t * k + j] = s;
            }

        ops()->combine(y, yp, w, pair_row, cc.shared ? shared : NULL, T, k, d);
        ops()->combine_backward(dyp, dweights, dy, yp, w, pair_row, T, k, d);

        char what[160];
        int n =
            snprintf(what, sizeof what, "combine T=%lld k=%lld d=%lld drop_mod=%lld shared=%d",
                     (long long)T, (long long)k, (long long)d, (long long)cc.drop_mod, cc.shared);
        REF_EXPECT_CLOSE(what, y, want_y, T * d, 1e-5 * scale, RTOL);
        snprintf(what + n, sizeof what - (size_t)n, " backward dyp");
        REF_EXPECT_CLOSE(what, dyp, want_dyp, n_rows * d, 1e-6, RTOL);
        snprintf(what + n, sizeof what - (size_t)n, " backward dweights");
        REF_EXPECT_CLOSE(what, dweights, want_dw, T * k, 1e-5 * 2.0 * (double)d, RTOL);
        for (int64_t i = 0; i < T * k; i++)
            if (pair_row[i] < 0)
                cr_expect(dweights[i] == 0.0f, "%s: dropped pair %lld has dweight %g, want 0", what,
                          (long long)i, dweights[i]);

        free(pair_row);
        free(yp);
        free(w);
        free(shared);
        free(y);
        free(dy);
        free(dyp);
        free(dweights);
        free(want_y);
        free(want_dyp);
        free(want_dw);
    }
}

Test(ops, unpermute_add_accumulates) {
    uint64_t seed = 1300;
    for (size_t c = 0; c < sizeof combine_cases / sizeof combine_cases[0]; c++) {
        const combine_case cc = combine_cases[c];
        const int64_t T = cc.T, k = cc.k, d = cc.d;
        ref_rng rng = {seed++};
        int64_t *pair_row = ref_alloc((size_t)(T * k) * sizeof *pair_row);
        int64_t n_rows = make_pair_rows(pair_row, T, k, cc.drop_mod, &rng);
        float *dxp = ref_alloc((size_t)(n_rows * d) * sizeof *dxp);
        float *dx = ref_alloc((size_t)(T * d) * sizeof *dx);
        double *want = ref_alloc((size_t)(T * d) * sizeof *want);
        ref_fill(dxp, n_rows * d, &rng, -1, 1);
        ref_fill(dx, T * d, &rng, -1, 1); /* what is already there must stay */
        for (int64_t t = 0; t < T; t++)
            for (int64_t c2 = 0; c2 < d; c2++) {
                double s = dx[t * d + c2];
                for (int64_t j = 0; j < k; j++)
                    if (pair_row[t * k + j] >= 0) s += dxp[pair_row[t * k + j] * d + c2];
                want[t * d + c2] = s;
            }
        ops()->unpermute_add(dx, dxp, pair_row, T, k, d);
        char what[128];
        snprintf(what, sizeof what, "unpermute_add T=%lld k=%lld d=%lld drop_mod=%lld",
                 (long long)T, (long long)k, (long long)d, (long long)cc.drop_mod);
        REF_EXPECT_CLOSE(what, dx, want, T * d, 1e-5 * (double)(k + 1), RTOL);
        free(pair_row);
        free(dxp);
        free(dx);
        free(want);
    }
}

/* --------------------------------------------------------------- experts */

typedef struct expert_buffers {
    float *x, *w13, *w2, *h, *g, *y, *dy, *dh, *dx, *dw13, *dw2;
    float *dw13_0, *dw2_0; /* the gradients' values before backward */
} expert_buffers;

/* Groups of various sizes, one of 0 rows, one with every token of a batch
 * (24 rows), one of a different width (a shared expert). */
Test(ops, experts_forward_backward) {
    const int64_t d = 13;
    static const int64_t rows[] = {3, 0, 1, 24, 5, 0};
    static const int64_t widths[] = {7, 7, 7, 7, 14, 7};
    enum { G = 6 };
    ref_rng rng = {4242};
    moe_expert_group groups[G];
    expert_buffers b[G];
    for (int i = 0; i < G; i++) {
        const int64_t n = rows[i], f = widths[i];
        /* 0-row groups still get valid pointers; they must be left alone */
        b[i].x = ref_alloc((size_t)(n * d) * sizeof(float));
        b[i].w13 = ref_alloc((size_t)(2 * f * d) * sizeof(float));
        b[i].w2 = ref_alloc((size_t)(d * f) * sizeof(float));
        b[i].h = ref_alloc((size_t)(n * 2 * f) * sizeof(float));
        b[i].g = ref_alloc((size_t)(n * f) * sizeof(float));
        b[i].y = ref_alloc((size_t)(n * d) * sizeof(float));
        b[i].dy = ref_alloc((size_t)(n * d) * sizeof(float));
        b[i].dh = ref_alloc((size_t)(n * 2 * f) * sizeof(float));
        b[i].dx = ref_alloc((size_t)(n * d) * sizeof(float));
        b[i].dw13 = ref_alloc((size_t)(2 * f * d) * sizeof(float));
        b[i].dw2 = ref_alloc((size_t)(d * f) * sizeof(float));
        b[i].dw13_0 = ref_alloc((size_t)(2 * f * d) * sizeof(float));
        b[i].dw2_0 = ref_alloc((size_t)(d * f) * sizeof(float));
        ref_fill(b[i].x, n * d, &rng, -1, 1);
        ref_fill(b[i].w13, 2 * f * d, &rng, -0.6, 0.6);
        ref_fill(b[i].w2, d * f, &rng, -0.6, 0.6);
        ref_fill(b[i].dy, n * d, &rng, -1, 1);
        ref_fill(b[i].dw13_0, 2 * f * d, &rng, -1, 1);
        ref_fill(b[i].dw2_0, d * f, &rng, -1, 1);
        memcpy(b[i].dw13, b[i].dw13_0, (size_t)(2 * f * d) * sizeof(float));
        memcpy(b[i].dw2, b[i].dw2_0, (size_t)(d * f) * sizeof(float));
        for (int64_t j = 0; j < n * d; j++) b[i].y[j] = b[i].dx[j] = GARBAGE;
        groups[i] = (moe_expert_group){.rows = n,
                                       .d_ff = f,
                                       .x = b[i].x,
                                       .w13 = b[i].w13,
                                       .w2 = b[i].w2,
                                       .h = b[i].h,
                                       .g = b[i].g,
                                       .y = b[i].y,
                                       .dy = b[i].dy,
                                       .dh = b[i].dh,
                                       .dx = b[i].dx,
                                       .dw13 = b[i].dw13,
                                       .dw2 = b[i].dw2};
    }
    ops()->experts_forward(groups, G, d);
    ops()->experts_backward(groups, G, d);

    for (int i = 0; i < G; i++) {
        const int64_t n = rows[i], f = widths[i];
        double *h = ref_alloc((size_t)(n * 2 * f + 1) * sizeof *h);
        double *g = ref_alloc((size_t)(n * f + 1) * sizeof *g);
        double *y = ref_alloc((size_t)(n * d + 1) * sizeof *y);
        double *dh = ref_alloc((size_t)(n * 2 * f + 1) * sizeof *dh);
        double *dx = ref_alloc((size_t)(n * d + 1) * sizeof *dx);
        double *dw13 = ref_to_double(b[i].dw13_0, 2 * f * d);
        double *dw2 = ref_to_double(b[i].dw2_0, d * f);
        for (int64_t r = 0; r < n; r++) {
            for (int64_t o = 0; o < 2 * f; o++) {
                double s = 0.0;
                for (int64_t c = 0; c < d; c++)
                    s += (double)b[i].x[r * d + c] * b[i].w13[o * d + c];
                h[r * 2 * f + o] = s;
            }
            for (int64_t o = 0; o < f; o++)
                g[r * f + o] = ref_silu(h[r * 2 * f + o]) * h[r * 2 * f + f + o];
            for (int64_t c = 0; c < d; c++) {
                double s = 0.0;
                for (int64_t o = 0; o < f; o++) s += g[r * f + o] * b[i].w2[c * f + o];
                y[r * d + c] = s;
            }
            for (int64_t o = 0; o < f; o++) {
                double dg = 0.0;
                for (int64_t c = 0; c < d; c++)
                    dg += (double)b[i].dy[r * d + c] * b[i].w2[c * f + o];
                double a = h[r * 2 * f + o], bb = h[r * 2 * f + f + o], s = ref_sigmoid(a);
                dh[r * 2 * f + o] = dg * bb * s * (1.0 + a * (1.0 - s));
                dh[r * 2 * f + f + o] = dg * ref_silu(a);
            }
            for (int64_t c = 0; c < d; c++) {
                double s = 0.0;
                for (int64_t o = 0; o < 2 * f; o++) s += dh[r * 2 * f + o] * b[i].w13[o * d + c];
                dx[r * d + c] = s;
            }
            for (int64_t o = 0; o < 2 * f; o++)
                for (int64_t c = 0; c < d; c++)
                    dw13[o * d + c] += dh[r * 2 * f + o] * b[i].x[r * d + c];
            for (int64_t c = 0; c < d; c++)
                for (int64_t o = 0; o < f; o++)
                    dw2[c * f + o] += (double)b[i].dy[r * d + c] * g[r * f + o];
        }
        /* |x| <= 1 and |w| <= 0.6: each sum has at most max(d, 2f, n) terms of size <= ~1 */
        const double atol = 1e-5 * (double)(d + 2 * f + n);
        char what[96];
        int len = snprintf(what, sizeof what, "experts group %d (rows=%lld f=%lld)", i,
                           (long long)n, (long long)f);
        snprintf(what + len, sizeof what - (size_t)len, " h");
        REF_EXPECT_CLOSE(what, b[i].h, h, n * 2 * f, atol, RTOL);
        snprintf(what + len, sizeof what - (size_t)len, " g");
        REF_EXPECT_CLOSE(what, b[i].g, g, n * f, atol, RTOL);
        snprintf(what + len, sizeof what - (size_t)len, " y");
        REF_EXPECT_CLOSE(what, b[i].y, y, n * d, atol, RTOL);
        snprintf(what + len, sizeof what - (size_t)len, " dx");
        REF_EXPECT_CLOSE(what, b[i].dx, dx, n * d, atol, RTOL);
        snprintf(what + len, sizeof what - (size_t)len, " dw13 (accumulated)");
        REF_EXPECT_CLOSE(what, b[i].dw13, dw13, 2 * f * d, atol, RTOL);
        snprintf(what + len, sizeof what - (size_t)len, " dw2 (accumulated)");
        REF_EXPECT_CLOSE(what, b[i].dw2, dw2, d * f, atol, RTOL);
        free(h);
        free(g);
        free(y);
        free(dh);
        free(dx);
        free(dw13);
        free(dw2);
    }
    for (int i = 0; i < G; i++) {
        free(b[i].x);
        free(b[i].w13);
        free(b[i].w2);
        free(b[i].h);
        free(b[i].g);
        free(b[i].y);
        free(b[i].dy);
        free(b[i].dh);
        free(b[i].dx);
        free(b[i].dw13);
        free(b[i].dw2);
        free(b[i].dw13_0);
        free(b[i].dw2_0);
    }
}
