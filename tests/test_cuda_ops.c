/* test_cuda_ops.c: every CUDA op (kernels/cuda/cuda_ops.h) against the CPU
 * op of the same name (moe_cpu_ops()) on fresh random inputs. Every output buffer is poisoned before the op runs
 * (0xFF bytes: NaN floats; 0x5A bytes for integers), so an element the
 * kernel never wrote fails the comparison.
 *
 * Tolerances: fp32 outputs pass when |gpu - cpu| <= 1e-5 (|cpu| + max|cpu|)
 * over the array: 1e-5 relative to the element or, for elements that sums
 * cancelled down, to the array's scale, since the two backends add in
 * different orders. bf16 storage: the same with 1e-2. Selections, counts,
 * plans and copies must match exactly; the double sum of squares to 1e-10
 * relative (1e5 terms added in another order) and run to run bitwise.
 *
 * The table tests run the same way through moe_cuda_ops() (its alloc,
 * upload and download too) against moe_cpu_ops() for the entries whose
 * signature differs from their launcher's, and check that every entry is
 * filled and that a failing entry is kept and reported.
 *
 * Without a device every test skips and says why; built without CUDA, the
 * same tests skip with "built without CUDA". */
#include <criterion/criterion.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model.h"
#include "engine/rope.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/profile.h"
#include "moe.h"
#include "ref_moe.h"
#include "router/plan.h"

#define CUDA_TEST_NAMES(X)                                                                         \
    X(gemm_transposes_strides_beta)                                                                \
    X(gate_forward_all_kinds)                                                                      \
    X(gate_backward_all_kinds)                                                                     \
    X(plan_build_matches_cpu_plan)                                                                 \
    X(permute_combine_unpermute)                                                                   \
    X(experts_fp32_loop_and_batched)                                                               \
    X(grouped_gemm_bf16_all_algos)                                                                 \
    X(experts_bf16)                                                                                \
    X(embedding_rmsnorm_matmul_residual)                                                           \
    X(sigmoid_gate)                                                                                \
    X(rope_attention)                                                                              \
    X(crossentropy_adamw_sumsq)                                                                    \
    X(table_fills_every_entry)                                                                     \
    X(table_gate_plan_permute)                                                                     \
    X(table_experts_uneven_groups)                                                                 \
    X(table_experts_bf16_math)                                                                     \
    X(table_rmsnorm_backward_sumsq)                                                                \
    X(table_uniform_same_bits)                                                                     \
    X(table_keeps_first_failure)                                                                   \
    X(gemm_tensor_core_math)                                                                       \
    X(model_on_the_table)                                                                          \
    X(gate_forward_ranks_nan_like_cpu)                                                             \
    X(gate_normalised_weights_far_below_the_row_max)                                               \
    X(table_marks_time_ops_in_the_stream)                                                         \
    X(public_layer_on_a_callers_stream)

#if !defined(MOE_HAVE_CUDA)

#define SKIP_TEST(name)                                                                            \
    Test(cuda, name) { cr_skip_test("built without CUDA (no kernels/cuda/*.cu in this build)"); }
CUDA_TEST_NAMES(SKIP_TEST)

#else

#define TOL_F32 1e-5
#define TOL_BF16 1e-2
#define POISON_FLOAT 0xFF /* NaN in every float */
#define POISON_INT 0x5A   /* 0x5A5A5A5A: no valid index, count or row */
#define ARENA_BYTES ((size_t)256 << 20)

#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status st_ = (call);                                                                   \
        cr_assert(st_ == MOE_OK, "%s: %s: %s", #call, moe_status_string(st_), moe_last_error());   \
    } while (0)

/* ------------------------------------------------------------ device state */

static moe_cuda_ctx *ctx;
static moe_cuda_arena arena;

/* Each test runs in its own process: the device state is made there. */
static void gpu_begin(void) {
    char why[256];
    if (!moe_cuda_available(why, sizeof why)) cr_skip_test("no GPU: %s", why);
    CHECK(moe_cuda_ctx_create(&ctx, -1));
    CHECK(moe_cuda_arena_create(&arena, ARENA_BYTES, ctx));
}

static void gpu_end(void) {
    CHECK(moe_cuda_sync(ctx));
    moe_cuda_arena_destroy(&arena);
    moe_cuda_ctx_destroy(ctx);
}

static void *dalloc(size_t bytes) {
    void *p = NULL;
    CHECK(moe_cuda_arena_alloc(&arena, &p, bytes));
    return p;
}

static void *dput(const void *host, size_t bytes) {
    void *p = dalloc(bytes);
    CHECK(moe_cuda_upload(p, host, bytes, ctx));
    return p;
}

static void *dpoison(size_t bytes, int byte) {
    void *p = dalloc(bytes);
    CHECK(moe_cuda_memset(p, byte, bytes, ctx));
    return p;
}

/* Waits for the device (so a fault inside a kernel shows here) and copies. */
static void dget(void *host, const void *dev, size_t bytes) {
    CHECK(moe_cuda_sync(ctx));
    CHECK(moe_cuda_download(host, dev, bytes, ctx));
}

/* ---------------------------------------------------------------- helpers */

static float *rnd(int64_t n, ref_rng *r, double lo, double hi) {
    float *a = ref_alloc((size_t)(n > 0 ? n : 1) * sizeof *a);
    ref_fill(a, n, r, lo, hi);
    return a;
}

static float *fdup(const float *a, int64_t n) {
    float *b = ref_alloc((size_t)(n > 0 ? n : 1) * sizeof *b);
    memcpy(b, a, (size_t)n * sizeof *b);
    return b;
}

/* got (from the GPU) against want (from the CPU), see the file comment. */
static void expect_close(const char *what, const float *got, const float *want, int64_t n,
                         double tol) {
    double *ref = ref_to_double(want, n);
    REF_EXPECT_CLOSE(what, got, ref, n, tol * ref_max_abs(ref, n), tol);
    free(ref);
}

/* Downloads a device float array of n and compares it. */
static void expect_dev(const char *what, const float *dev, const float *want, int64_t n,
                       double tol) {
    float *got = ref_alloc((size_t)(n > 0 ? n : 1) * sizeof *got);
    dget(got, dev, (size_t)n * sizeof *got);
    expect_close(what, got, want, n, tol);
    free(got);
}

static void expect_same_i64(const char *what, const int64_t *got, const int64_t *want, int64_t n) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i] && bad++ == 0) first = i;
    cr_expect(bad == 0, "%s: %lld of %lld differ; first [%lld] got %lld want %lld", what,
              (long long)bad, (long long)n, (long long)first, (long long)(bad ? got[first] : 0),
              (long long)(bad ? want[first] : 0));
}

static void expect_same_i32(const char *what, const int32_t *got, const int32_t *want, int64_t n) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i] && bad++ == 0) first = i;
    cr_expect(bad == 0, "%s: %lld of %lld differ; first [%lld] got %d want %d", what,
              (long long)bad, (long long)n, (long long)first, bad ? got[first] : 0,
              bad ? want[first] : 0);
}

/* The bytes [from, to) of device memory dev, poisoned with POISON_FLOAT
 * before the op, must still be: an op wrote nothing past its rows. */
static void expect_untouched(const char *what, const void *dev, size_t from, size_t to) {
    if (to <= from) return;
    unsigned char *got = ref_alloc(to);
    dget(got, dev, to);
    size_t written = 0, first = to;
    for (size_t i = from; i < to; i++)
        if (got[i] != POISON_FLOAT && written++ == 0) first = i;
    cr_expect(written == 0, "%s: %zu bytes past the rows written, the first at byte %zu of [%zu, %zu)", what,
              written, first, from, to);
    free(got);
}

/* bf16 round to nearest even (inputs are finite), and back. */
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* a [n] rounded to bf16 in place; bits [n] gets the bf16 values. */
static uint16_t *round_bf16(float *a, int64_t n) {
    uint16_t *bits = ref_alloc((size_t)(n > 0 ? n : 1) * sizeof *bits);
    for (int64_t i = 0; i < n; i++) {
        bits[i] = to_bf16(a[i]);
        a[i] = from_bf16(bits[i]);
    }
    return bits;
}

static void expect_dev_bf16(const char *what, const void *dev, const float *want, int64_t n) {
    uint16_t *bits = ref_alloc((size_t)(n > 0 ? n : 1) * sizeof *bits);
    float *got = ref_alloc((size_t)(n > 0 ? n : 1) * sizeof *got);
    dget(bits, dev, (size_t)n * sizeof *bits);
    for (int64_t i = 0; i < n; i++) got[i] = from_bf16(bits[i]);
    expect_close(what, got, want, n, TOL_BF16);
    free(got);
    free(bits);
}

static const char *kind_name(moe_gate_kind k) {
    return k == MOE_GATE_SOFTMAX_TOPK   ? "softmax_topk"
           : k == MOE_GATE_TOPK_SOFTMAX ? "topk_softmax"
                                        : "sigmoid";
}

/* ------------------------------------------------------------------- gemm */

/* Checks one fp32 GEMM in the given math against the CPU's to tol; returns
 * how many elements differ from the bits of the same GEMM in fp32 math on
 * the device (none, for fp32 itself). */
static int64_t check_gemm_tol(int64_t m, int64_t n, int64_t k, bool ta, bool tb, int64_t pad,
                              float alpha, float beta, ref_rng *rng, moe_cuda_math math,
                              double tol) {
    const int64_t a_rows = ta ? k : m, lda = (ta ? m : k) + pad;
    const int64_t b_rows = tb ? n : k, ldb = (tb ? k : n) + pad, ldc = n + pad;
    float *a = rnd(a_rows * lda, rng, -1, 1), *b = rnd(b_rows * ldb, rng, -1, 1);
    float *c0 = rnd(m * ldc, rng, -1, 1), *want = fdup(c0, m * ldc);
    moe_cpu_ops()->gemm(want, a, b, m, n, k, lda, ldb, ldc, ta, tb, alpha, beta);
    /* With beta 0 the op must not read c: its m x n part is NaN; the
     * padding must come back untouched either way. */
    float *c_in = fdup(c0, m * ldc);
    if (beta == 0.0f)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) c_in[i * ldc + j] = NAN;
    float *da = dput(a, (size_t)(a_rows * lda) * sizeof *a),
          *db = dput(b, (size_t)(b_rows * ldb) * sizeof *b);
    float *dc = dput(c_in, (size_t)(m * ldc) * sizeof *c_in);
    float *dc32 = dput(c_in, (size_t)(m * ldc) * sizeof *c_in);
    moe_cuda_set_math(ctx, math);
    CHECK(moe_cuda_gemm(dc, da, db, m, n, k, lda, ldb, ldc, ta, tb, alpha, beta, ctx));
    moe_cuda_set_math(ctx, MOE_CUDA_MATH_FP32);
    CHECK(moe_cuda_gemm(dc32, da, db, m, n, k, lda, ldb, ldc, ta, tb, alpha, beta, ctx));
    char what[160];
    snprintf(what, sizeof what, "gemm m=%lld n=%lld k=%lld ta=%d tb=%d pad=%lld beta=%g",
             (long long)m, (long long)n, (long long)k, ta, tb, (long long)pad, beta);
    expect_dev(what, dc, want, m * ldc, tol);
    float *got = ref_alloc((size_t)(m * ldc) * sizeof *got);
    float *got32 = ref_alloc((size_t)(m * ldc) * sizeof *got32);
    dget(got, dc, (size_t)(m * ldc) * sizeof *got);
    dget(got32, dc32, (size_t)(m * ldc) * sizeof *got32);
    int64_t differ = 0;
    for (int64_t i = 0; i < m * ldc; i++) differ += memcmp(&got[i], &got32[i], sizeof *got) != 0;
    free(a), free(b), free(c0), free(want), free(c_in), free(got), free(got32);
    return differ;
}

static void check_gemm(int64_t m, int64_t n, int64_t k, bool ta, bool tb, int64_t pad, float alpha,
                       float beta, ref_rng *rng) {
    check_gemm_tol(m, n, k, ta, tb, pad, alpha, beta, rng, MOE_CUDA_MATH_FP32, TOL_F32);
}

Test(cuda, gemm_transposes_strides_beta) {
    gpu_begin();
    ref_rng rng = {101};
    static const int64_t shapes[][3] = {
        {5, 7, 3}, {1, 13, 9}, {33, 19, 40}, {64, 48, 96}, {6, 6, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int64_t pad = 0; pad <= 3; pad += 3) {
                    check_gemm(shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, pad, 0.75f, 0.5f,
                               &rng);
                    check_gemm(shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, pad, 1.0f, 0.0f,
                               &rng);
                }
    gpu_end();
}

/* TF32 and BF16 math: the tensor cores round each input (to 10 and 7
 * mantissa bits) and sum in fp32, so the products stay within bf16's 1e-2,
 * and within half of that for tf32 (its rounding error is 1/8 of bf16's);
 * and they must differ somewhere from the same GEMM in fp32 math on the
 * device, or the math was not applied. Rows 16-byte aligned (no padding)
 * and sizes large enough that cuBLASLt's heuristic picks its tensor-core
 * kernels. */
Test(cuda, gemm_tensor_core_math) {
    gpu_begin();
    ref_rng rng = {102};
    static const struct {
        moe_cuda_math math;
        const char *name;
        double tol;
    } maths[] = {{MOE_CUDA_MATH_TF32, "tf32", TOL_BF16 / 2}, {MOE_CUDA_MATH_BF16, "bf16", TOL_BF16}};
    for (size_t i = 0; i < sizeof maths / sizeof maths[0]; i++) {
        int64_t differ = 0;
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                differ += check_gemm_tol(128, 128, 256, ta, tb, 0, 1.0f, 0.0f, &rng, maths[i].math,
                                         maths[i].tol);
        cr_expect(differ > 0, "%s math gave the device's fp32 bits everywhere: the tensor cores were not used",
                  maths[i].name);
    }
    gpu_end();
}

/* ------------------------------------------------------------------- gate */

typedef struct gate_case {
    int64_t E, k, T;
    moe_gate_kind kind;
    bool renormalize, with_bias;
    bool far_behind; /* all but k - 1 experts over 87 below the best (no bias) */
    int64_t n_groups, top_groups; /* group-limited routing when n_groups > 1 */
    float scale;                  /* routed_scale */
} gate_case;

static moe_gate_params params_of(const gate_case *gc) {
    return (moe_gate_params){gc->E, gc->k, gc->kind, gc->renormalize, gc->n_groups, gc->top_groups, gc->scale, 0};
}

static const gate_case gate_cases[] = {
    {8, 2, 300, MOE_GATE_SOFTMAX_TOPK, true, false, false, 0, 0, 1.0f},
    {8, 2, 300, MOE_GATE_SOFTMAX_TOPK, false, true, false, 0, 0, 1.0f},
    {64, 6, 200, MOE_GATE_SOFTMAX_TOPK, true, true, false, 0, 0, 1.0f},
    {16, 4, 130, MOE_GATE_TOPK_SOFTMAX, true, true, false, 0, 0, 1.0f},
    {24, 3, 90, MOE_GATE_SOFTMAX_TOPK, true, true, false, 0, 0, 1.0f},
    {40, 3, 65, MOE_GATE_SIGMOID, true, true, false, 0, 0, 1.0f},
    {7, 7, 64, MOE_GATE_SOFTMAX_TOPK, true, false, false, 0, 0, 1.0f},
    {300, 8, 100, MOE_GATE_SOFTMAX_TOPK, true, false, false, 0, 0, 1.0f},
    {1000, 5, 70, MOE_GATE_SIGMOID, true, false, false, 0, 0, 1.0f},
    {12, 3, 90, MOE_GATE_SOFTMAX_TOPK, true, false, true, 0, 0, 1.0f},
    {12, 2, 90, MOE_GATE_TOPK_SOFTMAX, true, false, true, 0, 0, 1.0f},
    /* Group-limited routing: 8 groups keeping 4, and groups of one. */
    {64, 8, 100, MOE_GATE_SIGMOID, true, true, false, 8, 4, 1.0f},
    {16, 4, 70, MOE_GATE_SOFTMAX_TOPK, true, false, false, 16, 3, 1.0f},
    /* DeepSeek-V3's routed weights, scaled by 2.5; unnormalised ones too. */
    {64, 8, 100, MOE_GATE_SIGMOID, true, true, false, 8, 4, 2.5f},
    {8, 2, 90, MOE_GATE_SOFTMAX_TOPK, false, false, false, 0, 0, 2.5f},
};
#define N_GATE_CASES ((int)(sizeof gate_cases / sizeof gate_cases[0]))

/* Logits whose selection is at least 1e-3 from changing, so the two
 * backends' exponentials cannot pick differently. Up to 64 experts the
 * reference ranks them (bias included); beyond, a shuffled grid of
 * logits 0.01 apart orders every score by the logit (no bias there).
 * far_behind: k - 1 experts at 0, -1, ... and the rest between 100 and 120
 * below, where moe_expf's clamp gives them one probability, so the last
 * pick is a tie that goes to the lowest index, on either backend. */
static float *gen_logits(const gate_case *gc, const float *bias, ref_rng *rng) {
    const int64_t E = gc->E, T = gc->T;
    float *logits = ref_alloc((size_t)(T * E) * sizeof *logits);
    for (int64_t t = 0; t < T; t++) {
        float *row = logits + t * E;
        if (gc->far_behind) {
            for (int64_t e = 0; e < E; e++)
                row[e] = e < gc->k - 1 ? -(float)e : -100.0f - (float)ref_uniform(rng, 0.0, 20.0);
            for (int64_t e = E - 1; e > 0; e--) {
                int64_t j = (int64_t)(ref_next(rng) % (uint64_t)(e + 1));
                float tmp = row[e];
                row[e] = row[j], row[j] = tmp;
            }
            continue;
        }
        if (E > 64) {
            for (int64_t e = 0; e < E; e++) row[e] = 0.01f * (float)e - 0.005f * (float)E;
            for (int64_t e = E - 1; e > 0; e--) {
                int64_t j = (int64_t)(ref_next(rng) % (uint64_t)(e + 1));
                float tmp = row[e];
                row[e] = row[j], row[j] = tmp;
            }
            continue;
        }
        double bias_d[64], gap = 0.0;
        for (int64_t e = 0; e < E; e++) bias_d[e] = bias ? bias[e] : 0.0;
        for (int tries = 0; tries < 1000 && gap <= 1e-3; tries++) {
            double l[64];
            int32_t idx[64];
            for (int64_t e = 0; e < E; e++) l[e] = row[e] = (float)ref_uniform(rng, -2.5, 2.5);
            ref_topk_grouped(idx, &gap, l, bias ? bias_d : NULL, E, gc->k, gc->kind, gc->n_groups, gc->top_groups);
        }
        cr_assert(gap > 1e-3, "could not draw logits without near-ties (E=%lld)", (long long)E);
    }
    return logits;
}

typedef struct gate_run {
    int32_t *idx;
    float *w, *prob, *lse, *logits, *bias;
    int64_t *assigned;
    double *prob_sum, z_sum;
} gate_run;

/* The CPU's gating pass, the reference for forward and the input of the
 * backward tests. */
static gate_run cpu_gate(const gate_case *gc, ref_rng *rng) {
    const int64_t E = gc->E, k = gc->k, T = gc->T;
    gate_run g = {0};
    g.bias = gc->with_bias ? rnd(E, rng, -0.3, 0.3) : NULL;
    g.logits = gen_logits(gc, g.bias, rng);
    g.idx = ref_alloc((size_t)(T * k) * sizeof *g.idx);
    g.w = ref_alloc((size_t)(T * k) * sizeof *g.w);
    g.prob = ref_alloc((size_t)(T * E) * sizeof *g.prob);
    g.lse = ref_alloc((size_t)T * sizeof *g.lse);
    g.assigned = ref_alloc((size_t)E * sizeof *g.assigned);
    g.prob_sum = ref_alloc((size_t)E * sizeof *g.prob_sum);
    double *scratch =
        ref_alloc((size_t)((T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS * (2 * E + 1)) *
                  sizeof *scratch);
    moe_gate_totals totals = {g.assigned, g.prob_sum, &g.z_sum, scratch};
    moe_gate_params p = params_of(gc);
    moe_cpu_ops()->gate_forward(g.idx, g.w, g.prob, g.lse, &totals, g.logits, g.bias, &p, T);
    free(scratch);
    return g;
}

static void free_gate(gate_run *g) {
    free(g->idx), free(g->w), free(g->prob), free(g->lse), free(g->logits), free(g->bias);
    free(g->assigned), free(g->prob_sum);
}

Test(cuda, gate_forward_all_kinds) {
    gpu_begin();
    ref_rng rng = {202};
    for (int c = 0; c < N_GATE_CASES; c++) {
        const gate_case *gc = &gate_cases[c];
        const int64_t E = gc->E, k = gc->k, T = gc->T;
        const int64_t n_chunks = (T + MOE_CUDA_GATE_CHUNK_TOKENS - 1) / MOE_CUDA_GATE_CHUNK_TOKENS;
        gate_run want = cpu_gate(gc, &rng);
        float *d_logits = dput(want.logits, (size_t)(T * E) * sizeof(float));
        float *d_bias = want.bias ? dput(want.bias, (size_t)E * sizeof(float)) : NULL;
        int32_t *d_idx = dpoison((size_t)(T * k) * sizeof(int32_t), POISON_INT);
        float *d_w = dpoison((size_t)(T * k) * sizeof(float), POISON_FLOAT);
        float *d_prob = dpoison((size_t)(T * E) * sizeof(float), POISON_FLOAT);
        float *d_lse = dpoison((size_t)T * sizeof(float), POISON_FLOAT);
        moe_cuda_gate_totals totals = {
            dpoison((size_t)E * sizeof(int64_t), POISON_INT),
            dpoison((size_t)E * sizeof(double), POISON_FLOAT),
            dpoison(sizeof(double), POISON_FLOAT),
            dpoison((size_t)(n_chunks * (2 * E + 1)) * sizeof(double), POISON_FLOAT)};
        moe_gate_params p = params_of(gc);
        CHECK(moe_cuda_gate_forward(d_idx, d_w, d_prob, d_lse, &totals, d_logits, d_bias, &p, T,
                                    ctx));

        char what[160];
        int n =
            snprintf(what, sizeof what, "gate_forward %s renorm=%d bias=%d E=%lld k=%lld T=%lld",
                     kind_name(gc->kind), gc->renormalize, gc->with_bias, (long long)E,
                     (long long)k, (long long)T);
        int32_t *idx = ref_alloc((size_t)(T * k) * sizeof *idx);
        dget(idx, d_idx, (size_t)(T * k) * sizeof *idx);
        expect_same_i32(what, idx, want.idx, T * k);
        int64_t *assigned = ref_alloc((size_t)E * sizeof *assigned);
        dget(assigned, totals.assigned, (size_t)E * sizeof *assigned);
        expect_same_i64(what, assigned, want.assigned, E);
        snprintf(what + n, sizeof what - (size_t)n, " topk_w");
        expect_dev(what, d_w, want.w, T * k, TOL_F32);
        snprintf(what + n, sizeof what - (size_t)n, " prob");
        expect_dev(what, d_prob, want.prob, T * E, TOL_F32);
        snprintf(what + n, sizeof what - (size_t)n, " lse");
        expect_dev(what, d_lse, want.lse, T, TOL_F32);
        double *prob_sum = ref_alloc((size_t)E * sizeof *prob_sum), z_sum = 0.0;
        dget(prob_sum, totals.prob_sum, (size_t)E * sizeof *prob_sum);
        dget(&z_sum, totals.z_sum, sizeof z_sum);
        for (int64_t e = 0; e < E; e++)
            cr_expect(fabs(prob_sum[e] - want.prob_sum[e]) <=
                          TOL_F32 * (double)T / (double)E + 1e-9,
                      "%s: prob_sum[%lld] = %.12g, cpu %.12g", what, (long long)e, prob_sum[e],
                      want.prob_sum[e]);
        cr_expect(fabs(z_sum - want.z_sum) <= TOL_F32 * fabs(want.z_sum) + 1e-9,
                  "%s: z_sum = %.12g, cpu %.12g", what, z_sum, want.z_sum);
        free(idx), free(assigned), free(prob_sum);
        free_gate(&want);
        moe_cuda_arena_reset(&arena);
    }
    gpu_end();
}

/* The gate on both backends over logits [T, E] (bias [E] or NULL): the
 * CPU's top-k, weights and counts, and the GPU's, every device output
 * poisoned first. */
typedef struct gate_pair {
    int32_t *want_idx, *got_idx; /* [T, k] */
    float *want_w, *got_w;       /* [T, k] */
    int64_t *want_assigned, *got_assigned; /* [E] */
} gate_pair;

static gate_pair gate_both(const float *logits, const float *bias, const moe_gate_params *p, int64_t T) {
    const int64_t E = p->n_experts, k = p->top_k;
    gate_pair g = {
        ref_alloc((size_t)(T * k) * sizeof(int32_t)), ref_alloc((size_t)(T * k) * sizeof(int32_t)),
        ref_alloc((size_t)(T * k) * sizeof(float)),   ref_alloc((size_t)(T * k) * sizeof(float)),
        ref_alloc((size_t)E * sizeof(int64_t)),       ref_alloc((size_t)E * sizeof(int64_t))};
    float *prob = ref_alloc((size_t)(T * E) * sizeof *prob), *lse = ref_alloc((size_t)T * sizeof *lse);
    double *prob_sum = ref_alloc((size_t)E * sizeof *prob_sum), z_sum = 0.0;
    double *scratch =
        ref_alloc((size_t)((T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS * (2 * E + 1)) * sizeof *scratch);
    moe_gate_totals host_totals = {g.want_assigned, prob_sum, &z_sum, scratch};
    moe_cpu_ops()->gate_forward(g.want_idx, g.want_w, prob, lse, &host_totals, logits, bias, p, T);

    const int64_t n_dev_chunks = (T + MOE_CUDA_GATE_CHUNK_TOKENS - 1) / MOE_CUDA_GATE_CHUNK_TOKENS;
    moe_cuda_gate_totals totals = {
        dpoison((size_t)E * sizeof(int64_t), POISON_INT), dpoison((size_t)E * sizeof(double), POISON_FLOAT),
        dpoison(sizeof(double), POISON_FLOAT),
        dpoison((size_t)(n_dev_chunks * (2 * E + 1)) * sizeof(double), POISON_FLOAT)};
    int32_t *d_idx = dpoison((size_t)(T * k) * sizeof(int32_t), POISON_INT);
    float *d_w = dpoison((size_t)(T * k) * sizeof(float), POISON_FLOAT);
    CHECK(moe_cuda_gate_forward(d_idx, d_w, dpoison((size_t)(T * E) * sizeof(float), POISON_FLOAT),
                                dpoison((size_t)T * sizeof(float), POISON_FLOAT), &totals,
                                dput(logits, (size_t)(T * E) * sizeof(float)),
                                bias ? dput(bias, (size_t)E * sizeof(float)) : NULL, p, T, ctx));
    dget(g.got_idx, d_idx, (size_t)(T * k) * sizeof(int32_t));
    dget(g.got_w, d_w, (size_t)(T * k) * sizeof(float));
    dget(g.got_assigned, totals.assigned, (size_t)E * sizeof(int64_t));
    free(prob), free(lse), free(prob_sum), free(scratch);
    moe_cuda_arena_reset(&arena);
    return g;
}

static void free_gate_pair(gate_pair *g) {
    free(g->want_idx), free(g->got_idx), free(g->want_w), free(g->got_w);
    free(g->want_assigned), free(g->got_assigned);
}

/* Logits with NaN among them pick the same experts on both backends
 * (moe_score_outranks): each kind, E past one warp's 32 lanes, a NaN in
 * every fifth logit and a row of NaN only. */
Test(cuda, gate_forward_ranks_nan_like_cpu) {
    gpu_begin();
    ref_rng rng = {404};
    const int64_t E = 40, k = 4, T = 96;
    for (int kind = 0; kind < 3; kind++) {
        float *logits = rnd(T * E, &rng, -2.0, 2.0);
        for (int64_t i = 0; i < T * E; i++)
            if (ref_next(&rng) % 5 == 0 || i / E == T - 1) logits[i] = NAN;
        const moe_gate_params p = {E, k, (moe_gate_kind)kind, true, 0, 0, 1.0f, 0};
        gate_pair g = gate_both(logits, NULL, &p, T);
        char what[96];
        snprintf(what, sizeof what, "gate_forward %s with NaN logits", kind_name((moe_gate_kind)kind));
        expect_same_i32(what, g.got_idx, g.want_idx, T * k);
        expect_same_i64(what, g.got_assigned, g.want_assigned, E);
        free_gate_pair(&g);
        free(logits);
    }
    gpu_end();
}

/* topk_softmax with a bias that passes over each row's largest logit (150,
 * with bias -1000) for experts some 150 below it: the weights are a softmax
 * over the chosen logits on both backends, not expf's clamp. The selection
 * compares logit + bias, the same float sums on both, so it must match
 * exactly. */
/* A bias that chooses experts far below the row's largest logit (every
 * one 150 below expert 7, which the bias shuts out): each normalised kind's
 * weights are a softmax over the chosen logits (log-sigmoids), as on the
 * CPU, and no clamp's ties. */
Test(cuda, gate_normalised_weights_far_below_the_row_max) {
    gpu_begin();
    ref_rng rng = {505};
    const int64_t E = 40, k = 4, T = 70;
    float *logits = rnd(T * E, &rng, -2.0, 2.0), *bias = ref_alloc((size_t)E * sizeof *bias);
    for (int64_t e = 0; e < E; e++) bias[e] = e == 7 ? -1000.0f : 0.0f;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) logits[t * E + e] = e == 7 ? 0.0f : logits[t * E + e] - 150.0f;
    static const moe_gate_kind kinds[] = {MOE_GATE_TOPK_SOFTMAX, MOE_GATE_SOFTMAX_TOPK,
                                          MOE_GATE_SIGMOID};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        const moe_gate_params p = {E, k, kinds[i], true, 0, 0, 1.0f, 0};
        gate_pair g = gate_both(logits, bias, &p, T);
        char what[96];
        snprintf(what, sizeof what, "%s far below the row max: topk_idx", kind_name(kinds[i]));
        expect_same_i32(what, g.got_idx, g.want_idx, T * k);
        snprintf(what, sizeof what, "%s far below the row max: topk_w", kind_name(kinds[i]));
        expect_close(what, g.got_w, g.want_w, T * k, TOL_F32);
        int64_t ties = 0;
        for (int64_t t = 0; t < T; t++) ties += g.want_w[t * k] == g.want_w[t * k + 1];
        cr_expect(ties == 0, "%s: %lld rows with tied weights on the CPU", kind_name(kinds[i]),
                  (long long)ties);
        free_gate_pair(&g);
    }
    free(logits), free(bias);
    gpu_end();
}

Test(cuda, gate_backward_all_kinds) {
    gpu_begin();
    ref_rng rng = {303};
    for (int c = 0; c < N_GATE_CASES; c++) {
        const gate_case *gc = &gate_cases[c];
        const int64_t E = gc->E, k = gc->k, T = gc->T;
        gate_run g = cpu_gate(gc, &rng);
        float *dweights = rnd(T * k, &rng, -1, 1);
        float *aux = c % 2 ? rnd(E, &rng, -0.01, 0.01) : NULL;
        const float z_coef = c % 3 ? 1e-3f / (float)T : 0.0f;
        moe_gate_params p = params_of(gc);
        float *want = ref_alloc((size_t)(T * E) * sizeof *want);
        moe_cpu_ops()->gate_backward(want, dweights, g.idx, g.w, g.prob, g.lse, g.logits, aux,
                                     z_coef, &p, T);

        float *d_dl = dpoison((size_t)(T * E) * sizeof(float), POISON_FLOAT);
        CHECK(moe_cuda_gate_backward(
            d_dl, dput(dweights, (size_t)(T * k) * sizeof(float)),
            dput(g.idx, (size_t)(T * k) * sizeof(int32_t)),
            dput(g.w, (size_t)(T * k) * sizeof(float)),
            dput(g.prob, (size_t)(T * E) * sizeof(float)), dput(g.lse, (size_t)T * sizeof(float)),
            dput(g.logits, (size_t)(T * E) * sizeof(float)),
            aux ? dput(aux, (size_t)E * sizeof(float)) : NULL, z_coef, &p, T, ctx));
        char what[160];
        snprintf(what, sizeof what, "gate_backward %s renorm=%d aux=%d z=%g E=%lld k=%lld T=%lld",
                 kind_name(gc->kind), gc->renormalize, aux != NULL, z_coef, (long long)E,
                 (long long)k, (long long)T);
        expect_dev(what, d_dl, want, T * E, TOL_F32);
        free(dweights), free(aux), free(want);
        free_gate(&g);
        moe_cuda_arena_reset(&arena);
    }
    gpu_end();
}

/* ------------------------------------------------------------------- plan */

/* The CPU table's plan under capacity factor cf, and the keep counts it
 * was built with. */
typedef struct cpu_plan {
    int64_t *pair_row;       /* [T*k] */
    int64_t *row_token;      /* [T*k], the first n_rows written */
    int64_t *expert_offsets; /* [E+1] */
    int64_t *keep;           /* [E] */
    int64_t n_rows, dropped;
} cpu_plan;

static cpu_plan make_cpu_plan(const int32_t *idx, const int64_t *assigned, double cf, int64_t T,
                              int64_t k, int64_t E) {
    const moe_ops *cpu = moe_cpu_ops();
    cpu_plan c;
    c.keep = ref_alloc((size_t)E * sizeof *c.keep);
    const int64_t cap = moe_capacity(cf, T, k, E);
    for (int64_t e = 0; e < E; e++) c.keep[e] = cap < 0 || assigned[e] < cap ? assigned[e] : cap;
    c.pair_row = ref_alloc((size_t)(T * k) * sizeof(int64_t));
    c.row_token = ref_alloc((size_t)(T * k) * sizeof(int64_t));
    c.expert_offsets = ref_alloc((size_t)(E + 1) * sizeof(int64_t));
    void *scratch = ref_alloc(cpu->plan_scratch_bytes(T, k, E));
    cpu->plan_build(c.pair_row, c.row_token, c.expert_offsets, idx, c.keep, scratch, T, k, E);
    free(scratch);
    c.n_rows = c.expert_offsets[E];
    c.dropped = T * k - c.n_rows;
    return c;
}

static void free_cpu_plan(cpu_plan *c) {
    free(c->keep), free(c->pair_row), free(c->row_token), free(c->expert_offsets);
}

Test(cuda, plan_build_matches_cpu_plan) {
    gpu_begin();
    ref_rng rng = {404};
    static const gate_case cases[] = {
        {8, 2, 300, MOE_GATE_SOFTMAX_TOPK, true, true, false, 0, 0, 1.0f},
        {64, 8, 1000, MOE_GATE_SOFTMAX_TOPK, true, true, false, 0, 0, 1.0f},
        {5, 1, 1, MOE_GATE_SOFTMAX_TOPK, true, false, false, 0, 0, 1.0f},
        {300, 8, 100, MOE_GATE_SOFTMAX_TOPK, true, false, false, 0, 0, 1.0f},
    };
    static const double cfs[] = {0.0, 1.0, 0.5};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (size_t f = 0; f < sizeof cfs / sizeof cfs[0]; f++) {
            const gate_case *gc = &cases[c];
            const int64_t E = gc->E, k = gc->k, T = gc->T;
            gate_run g = cpu_gate(gc, &rng);
            cpu_plan want = make_cpu_plan(g.idx, g.assigned, cfs[f], T, k, E);
            const bool dropless = cfs[f] == 0.0;
            int64_t *d_pair = dpoison((size_t)(T * k) * sizeof(int64_t), POISON_INT);
            int64_t *d_rows = dpoison((size_t)(T * k) * sizeof(int64_t), POISON_INT);
            int64_t *d_off = dpoison((size_t)(E + 1) * sizeof(int64_t), POISON_INT);
            void *scratch = dpoison(moe_cuda_plan_scratch_bytes(T, k, E), POISON_INT);
            CHECK(moe_cuda_plan_build(
                d_pair, d_rows, d_off, dput(g.idx, (size_t)(T * k) * sizeof(int32_t)),
                dropless ? NULL : dput(want.keep, (size_t)E * sizeof(int64_t)), scratch, T, k, E,
                ctx));
            char what[128];
            snprintf(what, sizeof what, "plan E=%lld k=%lld T=%lld cf=%g", (long long)E,
                     (long long)k, (long long)T, cfs[f]);
            int64_t *got = ref_alloc((size_t)(T * k + E + 1) * sizeof *got);
            dget(got, d_off, (size_t)(E + 1) * sizeof *got);
            expect_same_i64(what, got, want.expert_offsets, E + 1);
            dget(got, d_pair, (size_t)(T * k) * sizeof *got);
            expect_same_i64(what, got, want.pair_row, T * k);
            dget(got, d_rows, (size_t)want.n_rows * sizeof *got);
            expect_same_i64(what, got, want.row_token, want.n_rows);
            free(got);
            free_cpu_plan(&want);
            free_gate(&g);
            moe_cuda_arena_reset(&arena);
        }
    gpu_end();
}

/* ------------------------------------------------------------ row movers */

Test(cuda, permute_combine_unpermute) {
    gpu_begin();
    ref_rng rng = {505};
    static const gate_case gc = {8, 3, 150, MOE_GATE_SOFTMAX_TOPK, true, true, false, 0, 0, 1.0f};
    static const int64_t dims[] = {64, 37};
    for (size_t s = 0; s < sizeof dims / sizeof dims[0]; s++) {
        const int64_t E = gc.E, k = gc.k, T = gc.T, d = dims[s], max_rows = T * k;
        gate_run g = cpu_gate(&gc, &rng);
        cpu_plan cp = make_cpu_plan(g.idx, g.assigned, 0.7, T, k, E); /* drops some pairs */
        const int64_t n_rows = cp.n_rows;
        cr_assert(cp.dropped > 0, "the case should drop pairs");
        const moe_ops *cpu = moe_cpu_ops();
        int64_t *d_pair = dput(cp.pair_row, (size_t)(T * k) * sizeof(int64_t));
        int64_t *d_rows = dput(cp.row_token, (size_t)max_rows * sizeof(int64_t));
        int64_t *d_off = dput(cp.expert_offsets, (size_t)(E + 1) * sizeof(int64_t));
        float *d_w = dput(g.w, (size_t)(T * k) * sizeof(float));
        char what[96];

        float *x = rnd(T * d, &rng, -1, 1), *xp = ref_alloc((size_t)(max_rows * d) * sizeof *xp);
        cpu->permute(xp, x, cp.row_token, n_rows, d);
        float *d_xp = dpoison((size_t)(max_rows * d) * sizeof(float), POISON_FLOAT);
        CHECK(moe_cuda_permute(d_xp, dput(x, (size_t)(T * d) * sizeof(float)), d_rows, d_off + E,
                               max_rows, d, ctx));
        snprintf(what, sizeof what, "permute d=%lld", (long long)d);
        expect_dev(what, d_xp, xp, n_rows * d, 0.0);

        float *yp = rnd(max_rows * d, &rng, -1, 1), *shared = rnd(T * d, &rng, -1, 1);
        float *d_yp = dput(yp, (size_t)(max_rows * d) * sizeof(float));
        float *y = ref_alloc((size_t)(T * d) * sizeof *y);
        for (int with_shared = 0; with_shared < 2; with_shared++) {
            cpu->combine(y, yp, g.w, cp.pair_row, with_shared ? shared : NULL, T, k, d);
            float *d_y = dpoison((size_t)(T * d) * sizeof(float), POISON_FLOAT);
            CHECK(moe_cuda_combine(
                d_y, d_yp, d_w, d_pair,
                with_shared ? dput(shared, (size_t)(T * d) * sizeof(float)) : NULL, T, k, d, ctx));
            snprintf(what, sizeof what, "combine d=%lld shared=%d", (long long)d, with_shared);
            expect_dev(what, d_y, y, T * d, TOL_F32);
        }

        float *dy = rnd(T * d, &rng, -1, 1), *dyp = ref_alloc((size_t)(max_rows * d) * sizeof *dyp);
        float *dweights = ref_alloc((size_t)(T * k) * sizeof *dweights);
        cpu->combine_backward(dyp, dweights, dy, yp, g.w, cp.pair_row, T, k, d);
        float *d_dyp = dpoison((size_t)(max_rows * d) * sizeof(float), POISON_FLOAT);
        float *d_dw = dpoison((size_t)(T * k) * sizeof(float), POISON_FLOAT);
        CHECK(moe_cuda_combine_backward(d_dyp, d_dw, dput(dy, (size_t)(T * d) * sizeof(float)),
                                        d_yp, d_w, d_pair, T, k, d, ctx));
        snprintf(what, sizeof what, "combine_backward dyp d=%lld", (long long)d);
        expect_dev(what, d_dyp, dyp, n_rows * d, TOL_F32);
        snprintf(what, sizeof what, "combine_backward dweights d=%lld", (long long)d);
        expect_dev(what, d_dw, dweights, T * k, TOL_F32);

        float *dxp = rnd(max_rows * d, &rng, -1, 1), *dx = rnd(T * d, &rng, -1, 1);
        float *d_dx = dput(dx, (size_t)(T * d) * sizeof(float)); /* accumulated into */
        cpu->unpermute_add(dx, dxp, cp.pair_row, T, k, d);
        CHECK(moe_cuda_unpermute_add(d_dx, dput(dxp, (size_t)(max_rows * d) * sizeof(float)),
                                     d_pair, T, k, d, ctx));
        snprintf(what, sizeof what, "unpermute_add d=%lld", (long long)d);
        expect_dev(what, d_dx, dx, T * d, TOL_F32);

        free(x), free(xp), free(yp), free(shared), free(y), free(dy), free(dyp), free(dweights),
            free(dxp), free(dx);
        free_cpu_plan(&cp);
        free_gate(&g);
        moe_cuda_arena_reset(&arena);
    }
    gpu_end();
}

/* ---------------------------------------------------------------- experts */

/* Host buffers of an expert-major batch, fp32 (bf16 cases round them). */
typedef struct expert_case {
    int64_t E, d, f, rows, max_rows;
    int64_t off[16];
    float *x, *w13, *w2, *dy, *dw13, *dw2; /* inputs; dw13, dw2 hold the starting gradients */
    float *h, *g, *y, *dh, *dx;            /* CPU outputs */
} expert_case;

static expert_case make_experts(const int64_t *rows, int64_t E, int64_t d, int64_t f,
                                ref_rng *rng) {
    expert_case c = {.E = E, .d = d, .f = f};
    c.off[0] = 0;
    for (int64_t e = 0; e < E; e++) c.off[e + 1] = c.off[e] + rows[e];
    c.rows = c.off[E];
    c.max_rows = c.rows + 3; /* rows past offsets[E] must stay untouched */
    c.x = rnd(c.max_rows * d, rng, -1, 1);
    c.w13 = rnd(E * 2 * f * d, rng, -1.0 / sqrt((double)d), 1.0 / sqrt((double)d));
    c.w2 = rnd(E * d * f, rng, -1.0 / sqrt((double)f), 1.0 / sqrt((double)f));
    c.dy = rnd(c.max_rows * d, rng, -1, 1);
    c.dw13 = rnd(E * 2 * f * d, rng, -1, 1);
    c.dw2 = rnd(E * d * f, rng, -1, 1);
    c.h = ref_alloc((size_t)(c.max_rows * 2 * f) * sizeof(float));
    c.g = ref_alloc((size_t)(c.max_rows * f) * sizeof(float));
    c.y = ref_alloc((size_t)(c.max_rows * d) * sizeof(float));
    c.dh = ref_alloc((size_t)(c.max_rows * 2 * f) * sizeof(float));
    c.dx = ref_alloc((size_t)(c.max_rows * d) * sizeof(float));
    return c;
}

static void free_experts(expert_case *c) {
    free(c->x), free(c->w13), free(c->w2), free(c->dy), free(c->dw13), free(c->dw2);
    free(c->h), free(c->g), free(c->y), free(c->dh), free(c->dx);
}

/* The CPU experts on c; dw13_out/dw2_out start as copies of c's. */
static void cpu_experts(expert_case *c, float *dw13_out, float *dw2_out) {
    moe_expert_group groups[16];
    const int64_t d = c->d, f = c->f;
    for (int64_t e = 0; e < c->E; e++) {
        const int64_t o = c->off[e];
        groups[e] = (moe_expert_group){.rows = c->off[e + 1] - o,
                                       .d_ff = f,
                                       .x = c->x + o * d,
                                       .w13 = c->w13 + e * 2 * f * d,
                                       .w2 = c->w2 + e * d * f,
                                       .h = c->h + o * 2 * f,
                                       .g = c->g + o * f,
                                       .y = c->y + o * d,
                                       .dy = c->dy + o * d,
                                       .dh = c->dh + o * 2 * f,
                                       .dx = c->dx + o * d,
                                       .dw13 = dw13_out + e * 2 * f * d,
                                       .dw2 = dw2_out + e * d * f};
    }
    moe_cpu_ops()->experts_forward(groups, c->E, d);
    moe_cpu_ops()->experts_backward(groups, c->E, d);
}

/* Whether algo runs on this device, saying why not when it does not. The
 * wgmma kernels must run on every compute capability 9.0 device: there, a
 * build without them fails the test. */
static bool runs_here(moe_cuda_grouped_algo algo) {
    if ((algo != MOE_CUDA_GROUPED_WGMMA && algo != MOE_CUDA_GROUPED_WGMMA_TMA) ||
        moe_cuda_wgmma_check(ctx) == MOE_OK)
        return true;
    cr_expect(strstr(moe_cuda_device_name(ctx), "(sm_90,") == NULL, "%s", moe_last_error());
    fprintf(stderr, "wgmma not run: %s\n", moe_last_error());
    return false;
}

Test(cuda, experts_fp32_loop_and_batched) {
    gpu_begin();
    ref_rng rng = {606};
    static const int64_t rows[] = {0, 5, 37, 1, 130, 12};
    const int64_t E = 6, d = 24, f = 20;
    static const moe_cuda_grouped_algo algos[] = {MOE_CUDA_GROUPED_LT_LOOP,
                                                  MOE_CUDA_GROUPED_BATCHED};
    for (size_t a = 0; a < sizeof algos / sizeof algos[0]; a++) {
        expert_case c = make_experts(rows, E, d, f, &rng);
        float *dw13 = fdup(c.dw13, E * 2 * f * d), *dw2 = fdup(c.dw2, E * d * f);
        cpu_experts(&c, dw13, dw2);
        const int64_t R = c.max_rows;
        moe_cuda_experts b = {
            .dtype = MOE_CUDA_F32,
            .n_experts = E,
            .d_model = d,
            .d_ff = f,
            .max_rows = R,
            .offsets = dput(c.off, (size_t)(E + 1) * sizeof(int64_t)),
            .x = dput(c.x, (size_t)(R * d) * sizeof(float)),
            .w13 = dput(c.w13, (size_t)(E * 2 * f * d) * sizeof(float)),
            .w2 = dput(c.w2, (size_t)(E * d * f) * sizeof(float)),
            .h = dpoison((size_t)(R * 2 * f) * sizeof(float), POISON_FLOAT),
            .g = dpoison((size_t)(R * f) * sizeof(float), POISON_FLOAT),
            .y = dpoison((size_t)(R * d) * sizeof(float), POISON_FLOAT),
            .dy = dput(c.dy, (size_t)(R * d) * sizeof(float)),
            .dh = dpoison((size_t)(R * 2 * f) * sizeof(float), POISON_FLOAT),
            .dx = dpoison((size_t)(R * d) * sizeof(float), POISON_FLOAT),
            .dw13 = dput(c.dw13, (size_t)(E * 2 * f * d) * sizeof(float)),
            .dw2 = dput(c.dw2, (size_t)(E * d * f) * sizeof(float)),
        };
        CHECK(moe_cuda_experts_forward(&b, algos[a], ctx));
        CHECK(moe_cuda_experts_backward(&b, algos[a], ctx));
        char what[96];
        const char *name = moe_cuda_grouped_algo_name(algos[a]);
#define EXPECT_OUT(field, want, n)                                                                 \
    snprintf(what, sizeof what, "experts fp32 %s %s", name, #field);                               \
    expect_dev(what, b.field, want, n, TOL_F32)
#define EXPECT_ROWS(field, want, width)                                                            \
    EXPECT_OUT(field, want, c.rows * (width));                                                     \
    expect_untouched(what, b.field, (size_t)(c.rows * (width)) * sizeof(float),                    \
                     (size_t)(R * (width)) * sizeof(float))
        EXPECT_ROWS(h, c.h, 2 * f);
        EXPECT_ROWS(g, c.g, f);
        EXPECT_ROWS(y, c.y, d);
        EXPECT_ROWS(dh, c.dh, 2 * f);
        EXPECT_ROWS(dx, c.dx, d);
        EXPECT_OUT(dw13, dw13, E * 2 * f * d);
        EXPECT_OUT(dw2, dw2, E * d * f);
#undef EXPECT_ROWS
#undef EXPECT_OUT
        free(dw13), free(dw2);
        free_experts(&c);
        moe_cuda_arena_reset(&arena);
    }
    gpu_end();
}

/* c = a b_e^T over each expert's rows, bf16 inputs, by every algorithm. */
static void check_grouped_gemm_bf16(const int64_t *rows, int64_t E, int64_t n, int64_t k,
                                    ref_rng *rng) {
    int64_t off[MOE_EXPERTS_MAX + 1] = {0};
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + rows[e];
    const int64_t R = off[E] + 5;
    float *a = rnd(R * k, rng, -1, 1), *b = rnd(E * n * k, rng, -1, 1);
    uint16_t *a16 = round_bf16(a, R * k), *b16 = round_bf16(b, E * n * k);
    float *want = ref_alloc((size_t)(R * n) * sizeof *want);
    for (int64_t e = 0; e < E; e++)
        moe_cpu_ops()->gemm(want + off[e] * n, a + off[e] * k, b + e * n * k, rows[e], n, k, k, k,
                            n, false, true, 1.0f, 0.0f);
    const int64_t *d_off = dput(off, (size_t)(E + 1) * sizeof *off);
    const void *da = dput(a16, (size_t)(R * k) * 2), *db = dput(b16, (size_t)(E * n * k) * 2);
    static const struct {
        moe_cuda_grouped_algo algo;
        moe_cuda_dtype out;
    } runs[] = {
        {MOE_CUDA_GROUPED_MMA, MOE_CUDA_BF16},     {MOE_CUDA_GROUPED_MMA, MOE_CUDA_F32},
        {MOE_CUDA_GROUPED_WGMMA, MOE_CUDA_BF16},   {MOE_CUDA_GROUPED_WGMMA, MOE_CUDA_F32},
        {MOE_CUDA_GROUPED_WGMMA_TMA, MOE_CUDA_BF16}, {MOE_CUDA_GROUPED_WGMMA_TMA, MOE_CUDA_F32},
        {MOE_CUDA_GROUPED_LT_LOOP, MOE_CUDA_BF16}, {MOE_CUDA_GROUPED_LT_LOOP, MOE_CUDA_F32},
        {MOE_CUDA_GROUPED_BATCHED, MOE_CUDA_BF16},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        if (!runs_here(runs[r].algo)) continue;
        void *dc = dpoison((size_t)(R * n) * moe_cuda_dtype_bytes(runs[r].out), POISON_FLOAT);
        CHECK(moe_cuda_grouped_gemm(dc, runs[r].out, da, db, MOE_CUDA_BF16, d_off, E, R, n, k,
                                    runs[r].algo, ctx));
        char what[96];
        snprintf(what, sizeof what, "grouped_gemm bf16 n=%lld k=%lld %s out=%s", (long long)n,
                 (long long)k, moe_cuda_grouped_algo_name(runs[r].algo),
                 runs[r].out == MOE_CUDA_BF16 ? "bf16" : "fp32");
        if (runs[r].out == MOE_CUDA_BF16)
            expect_dev_bf16(what, dc, want, off[E] * n);
        else
            expect_dev(what, dc, want, off[E] * n, TOL_BF16);
        const size_t bytes = moe_cuda_dtype_bytes(runs[r].out);
        expect_untouched(what, dc, (size_t)(off[E] * n) * bytes, (size_t)(R * n) * bytes);
    }
    free(a), free(b), free(a16), free(b16), free(want);
}

/* The wgmma kernels' first runs on a device may hang on a barrier: the
 * timeout ends such a test alone, and the suite goes on. */
Test(cuda, grouped_gemm_bf16_all_algos, .timeout = 60) {
    gpu_begin();
    ref_rng rng = {707};
    /* Several 128-row tiles in one expert, a one-row expert, an idle one; n
     * and k off the 256-column tiles and the 32- and 64-wide k-slices. */
    static const int64_t rows[] = {0, 1, 130, 257, 40};
    check_grouped_gemm_bf16(rows, 5, 200, 72, &rng);
    /* More k-slices than either kernel has stages, and three column tiles. */
    static const int64_t long_rows[] = {129, 0, 64};
    check_grouped_gemm_bf16(long_rows, 3, 520, 328, &rng);
    gpu_end();
}

Test(cuda, experts_bf16, .timeout = 60) {
    gpu_begin();
    ref_rng rng = {808};
    static const int64_t rows[] = {3, 0, 140, 17};
    const int64_t E = 4, d = 64, f = 48;
    static const moe_cuda_grouped_algo algos[] = {
        MOE_CUDA_GROUPED_MMA, MOE_CUDA_GROUPED_WGMMA, MOE_CUDA_GROUPED_WGMMA_TMA,
        MOE_CUDA_GROUPED_LT_LOOP, MOE_CUDA_GROUPED_BATCHED};
    for (size_t a = 0; a < sizeof algos / sizeof algos[0]; a++) {
        if (!runs_here(algos[a])) continue;
        expert_case c = make_experts(rows, E, d, f, &rng);
        const int64_t R = c.max_rows;
        uint16_t *x16 = round_bf16(c.x, R * d), *w13_16 = round_bf16(c.w13, E * 2 * f * d);
        uint16_t *w2_16 = round_bf16(c.w2, E * d * f), *dy16 = round_bf16(c.dy, R * d);
        float *dw13 = fdup(c.dw13, E * 2 * f * d), *dw2 = fdup(c.dw2, E * d * f);
        cpu_experts(&c, dw13, dw2);
        moe_cuda_experts b = {
            .dtype = MOE_CUDA_BF16,
            .n_experts = E,
            .d_model = d,
            .d_ff = f,
            .max_rows = R,
            .offsets = dput(c.off, (size_t)(E + 1) * sizeof(int64_t)),
            .x = dput(x16, (size_t)(R * d) * 2),
            .w13 = dput(w13_16, (size_t)(E * 2 * f * d) * 2),
            .w2 = dput(w2_16, (size_t)(E * d * f) * 2),
            .h = dpoison((size_t)(R * 2 * f) * 2, POISON_FLOAT),
            .g = dpoison((size_t)(R * f) * 2, POISON_FLOAT),
            .y = dpoison((size_t)(R * d) * 2, POISON_FLOAT),
            .dy = dput(dy16, (size_t)(R * d) * 2),
            .dh = dpoison((size_t)(R * 2 * f) * 2, POISON_FLOAT),
            .dx = dpoison((size_t)(R * d) * 2, POISON_FLOAT),
            .dw13 = dput(c.dw13, (size_t)(E * 2 * f * d) * sizeof(float)),
            .dw2 = dput(c.dw2, (size_t)(E * d * f) * sizeof(float)),
        };
        const char *name = moe_cuda_grouped_algo_name(algos[a]);
        char what[96];
        CHECK(moe_cuda_experts_forward(&b, algos[a], ctx));
#define EXPECT_ROWS_BF16(label, field, want, width)                                                \
    snprintf(what, sizeof what, label, name);                                                      \
    expect_dev_bf16(what, b.field, want, c.rows * (width));                                        \
    expect_untouched(what, b.field, (size_t)(c.rows * (width)) * 2, (size_t)(R * (width)) * 2)
        EXPECT_ROWS_BF16("experts bf16 %s h", h, c.h, 2 * f);
        EXPECT_ROWS_BF16("experts bf16 %s g", g, c.g, f);
        EXPECT_ROWS_BF16("experts bf16 %s y", y, c.y, d);
        /* cuBLAS's grouped call has no bf16-in, fp32-out mode for the weight
         * gradients, and our kernels serve the forward only: the
         * backward runs on the loop. */
        CHECK(moe_cuda_experts_backward(&b, MOE_CUDA_GROUPED_LT_LOOP, ctx));
        EXPECT_ROWS_BF16("experts bf16 backward after %s dx", dx, c.dx, d);
#undef EXPECT_ROWS_BF16
        snprintf(what, sizeof what, "experts bf16 backward after %s dw13", name);
        expect_dev(what, b.dw13, dw13, E * 2 * f * d, TOL_BF16);
        snprintf(what, sizeof what, "experts bf16 backward after %s dw2", name);
        expect_dev(what, b.dw2, dw2, E * d * f, TOL_BF16);
        free(x16), free(w13_16), free(w2_16), free(dy16), free(dw13), free(dw2);
        free_experts(&c);
        moe_cuda_arena_reset(&arena);
    }
    gpu_end();
}

/* ------------------------------------------------------------------ dense */

Test(cuda, embedding_rmsnorm_matmul_residual) {
    gpu_begin();
    ref_rng rng = {909};
    const moe_ops *cpu = moe_cpu_ops();
    const int64_t N = 45, C = 70, V = 11, OC = 33;
    char what[64];

    int32_t tokens[45];
    for (int64_t n = 0; n < N; n++)
        tokens[n] = (int32_t)(ref_next(&rng) % (uint64_t)V); /* repeats */
    int32_t *d_tok = dput(tokens, sizeof tokens);
    float *wte = rnd(V * C, &rng, -1, 1), *emb = ref_alloc((size_t)(N * C) * sizeof *emb);
    cpu->embedding_forward(emb, tokens, wte, N, C);
    float *d_emb = dpoison((size_t)(N * C) * sizeof(float), POISON_FLOAT);
    CHECK(moe_cuda_embedding_forward(d_emb, d_tok, dput(wte, (size_t)(V * C) * sizeof(float)), N, C,
                                     ctx));
    expect_dev("embedding_forward", d_emb, emb, N * C, 0.0);
    float *dout = rnd(N * C, &rng, -1, 1), *dwte = rnd(V * C, &rng, -1, 1);
    float *d_dwte = dput(dwte, (size_t)(V * C) * sizeof(float));
    cpu->embedding_backward(dwte, dout, tokens, N, C);
    CHECK(moe_cuda_embedding_backward(d_dwte, dput(dout, (size_t)(N * C) * sizeof(float)), d_tok, N,
                                      C, ctx));
    /* Each token's rows are added in row order on both sides: the same bits. */
    expect_dev("embedding_backward", d_dwte, dwte, V * C, 0.0);
    {
        /* Long runs of each token, and more rows than the grid has blocks. */
        const int64_t N2 = 9000, V2 = 5, C2 = 40;
        int32_t *tok2 = ref_alloc((size_t)N2 * sizeof *tok2);
        for (int64_t n = 0; n < N2; n++) tok2[n] = (int32_t)(ref_next(&rng) % (uint64_t)V2);
        float *dout2 = rnd(N2 * C2, &rng, -1, 1), *dwte2 = rnd(V2 * C2, &rng, -1, 1);
        float *d_dwte2 = dput(dwte2, (size_t)(V2 * C2) * sizeof(float));
        cpu->embedding_backward(dwte2, dout2, tok2, N2, C2);
        CHECK(moe_cuda_embedding_backward(d_dwte2, dput(dout2, (size_t)(N2 * C2) * sizeof(float)),
                                          dput(tok2, (size_t)N2 * sizeof *tok2), N2, C2, ctx));
        expect_dev("embedding_backward, long runs", d_dwte2, dwte2, V2 * C2, 0.0);
        free(tok2), free(dout2), free(dwte2);
    }

    float *x = rnd(N * C, &rng, -2, 2), *w = rnd(C, &rng, 0.5, 1.5);
    float *y = ref_alloc((size_t)(N * C) * sizeof *y), *rstd = ref_alloc((size_t)N * sizeof *rstd);
    cpu->rmsnorm_forward(y, rstd, x, w, 1e-5f, N, C);
    float *d_x = dput(x, (size_t)(N * C) * sizeof(float)),
          *d_w = dput(w, (size_t)C * sizeof(float));
    float *d_y = dpoison((size_t)(N * C) * sizeof(float), POISON_FLOAT);
    float *d_rstd = dpoison((size_t)N * sizeof(float), POISON_FLOAT);
    CHECK(moe_cuda_rmsnorm_forward(d_y, d_rstd, d_x, d_w, 1e-5f, N, C, ctx));
    expect_dev("rmsnorm_forward out", d_y, y, N * C, TOL_F32);
    expect_dev("rmsnorm_forward rstd", d_rstd, rstd, N, TOL_F32);
    float *dx = rnd(N * C, &rng, -1, 1), *dw = rnd(C, &rng, -1, 1);
    float *d_dx = dput(dx, (size_t)(N * C) * sizeof(float)),
          *d_dw = dput(dw, (size_t)C * sizeof(float));
    void *cpu_scratch = ref_alloc(cpu->rmsnorm_scratch_bytes(N, C));
    cpu->rmsnorm_backward(dx, dw, dout, x, w, rstd, cpu_scratch, N, C);
    free(cpu_scratch);
    CHECK(moe_cuda_rmsnorm_backward(d_dx, d_dw, dput(dout, (size_t)(N * C) * sizeof(float)), d_x,
                                    d_w, dput(rstd, (size_t)N * sizeof(float)),
                                    dpoison(moe_cuda_rmsnorm_scratch_bytes(N, C), POISON_FLOAT), N,
                                    C, ctx));
    expect_dev("rmsnorm_backward dinp", d_dx, dx, N * C, TOL_F32);
    expect_dev("rmsnorm_backward dweight", d_dw, dw, C, TOL_F32);
    {
        /* More rows than the weight gradient's grid has parts in y (65535
         * of 256 rows), as a norm over each head of q has: narrow rows. */
        const int64_t N2 = 65535 * 256 + 300, C2 = 2;
        float *x2 = rnd(N2 * C2, &rng, -2, 2), *w2 = rnd(C2, &rng, 0.5, 1.5), *dout2 = rnd(N2 * C2, &rng, -1, 1);
        float *y2 = ref_alloc((size_t)(N2 * C2) * sizeof *y2), *rstd2 = ref_alloc((size_t)N2 * sizeof *rstd2);
        float *dx2 = rnd(N2 * C2, &rng, -1, 1), dw2[2] = {0.25f, -0.5f};
        cpu->rmsnorm_forward(y2, rstd2, x2, w2, 1e-5f, N2, C2);
        float *d_dx2 = dput(dx2, (size_t)(N2 * C2) * sizeof(float)), *d_dw2 = dput(dw2, sizeof dw2);
        void *scratch2 = ref_alloc(cpu->rmsnorm_scratch_bytes(N2, C2));
        CHECK(moe_cuda_rmsnorm_backward(d_dx2, d_dw2, dput(dout2, (size_t)(N2 * C2) * sizeof(float)),
                                        dput(x2, (size_t)(N2 * C2) * sizeof(float)), dput(w2, sizeof(float) * C2),
                                        dput(rstd2, (size_t)N2 * sizeof(float)),
                                        dpoison(moe_cuda_rmsnorm_scratch_bytes(N2, C2), POISON_FLOAT), N2, C2, ctx));
        cpu->rmsnorm_backward(dx2, dw2, dout2, x2, w2, rstd2, scratch2, N2, C2);
        expect_dev("rmsnorm_backward dinp, many rows", d_dx2, dx2, N2 * C2, TOL_F32);
        expect_dev("rmsnorm_backward dweight, many rows", d_dw2, dw2, C2, TOL_F32);
        free(x2), free(w2), free(dout2), free(y2), free(rstd2), free(dx2), free(scratch2);
    }

    float *wm = rnd(OC * C, &rng, -1, 1), *out = ref_alloc((size_t)(N * OC) * sizeof *out);
    cpu->matmul_forward(out, x, wm, N, C, OC);
    float *d_wm = dput(wm, (size_t)(OC * C) * sizeof(float));
    float *d_out = dpoison((size_t)(N * OC) * sizeof(float), POISON_FLOAT);
    CHECK(moe_cuda_matmul_forward(d_out, d_x, d_wm, N, C, OC, ctx));
    expect_dev("matmul_forward", d_out, out, N * OC, TOL_F32);
    float *dmo = rnd(N * OC, &rng, -1, 1), *dwm = rnd(OC * C, &rng, -1, 1);
    float *dinp = rnd(N * C, &rng, -1, 1);
    float *d_dinp = dput(dinp, (size_t)(N * C) * sizeof(float)),
          *d_dwm = dput(dwm, (size_t)(OC * C) * sizeof(float));
    cpu->matmul_backward(dinp, dwm, dmo, x, wm, N, C, OC);
    CHECK(moe_cuda_matmul_backward(d_dinp, d_dwm, dput(dmo, (size_t)(N * OC) * sizeof(float)), d_x,
                                   d_wm, N, C, OC, ctx));
    expect_dev("matmul_backward dinp", d_dinp, dinp, N * C, TOL_F32);
    expect_dev("matmul_backward dweight", d_dwm, dwm, OC * C, TOL_F32);

    const int64_t n = N * C;
    float *ra = rnd(n, &rng, -1, 1), *rb = rnd(n, &rng, -1, 1),
          *rs = ref_alloc((size_t)n * sizeof *rs);
    cpu->residual_forward(rs, ra, rb, n);
    float *d_ra = dput(ra, (size_t)n * sizeof(float)), *d_rb = dput(rb, (size_t)n * sizeof(float));
    float *d_rs = dpoison((size_t)n * sizeof(float), POISON_FLOAT);
    CHECK(moe_cuda_residual_forward(d_rs, d_ra, d_rb, n, ctx));
    expect_dev("residual_forward", d_rs, rs, n, 0.0);
    cpu->residual_backward(ra, rb, dout, n);
    CHECK(moe_cuda_residual_backward(d_ra, d_rb, dput(dout, (size_t)n * sizeof(float)), n, ctx));
    snprintf(what, sizeof what, "residual_backward da");
    expect_dev(what, d_ra, ra, n, 0.0);
    snprintf(what, sizeof what, "residual_backward db");
    expect_dev(what, d_rb, rb, n, 0.0);

    free(wte), free(emb), free(dout), free(dwte), free(x), free(w), free(y), free(rstd), free(dx),
        free(dw);
    free(wm), free(out), free(dmo), free(dwm), free(dinp), free(ra), free(rb), free(rs);
    gpu_end();
}

/* The shared expert's sigmoid gate, with logits where exp overflows
 * float; a row shorter than a block, one longer, and more tokens than a
 * grid's y could hold. The backward gets the CPU's gate and output, so it
 * alone is compared. Then in place: out over in, din over dout. */
Test(cuda, sigmoid_gate) {
    gpu_begin();
    ref_rng rng = {1010};
    const moe_ops *cpu = moe_cpu_ops();
    static const int64_t shapes[][2] = {{45, 70}, {37, 1000}, {70000, 3}};
    char what[96];
    CHECK(moe_cuda_sigmoid_gate_forward(NULL, NULL, NULL, NULL, 0, 5, ctx)); /* T = 0: nothing */
    CHECK(moe_cuda_sigmoid_gate_backward(NULL, NULL, NULL, NULL, NULL, 0, 5, ctx));
    for (int s = 0; s < 3; s++) {
        const int64_t T = shapes[s][0], d = shapes[s][1], n = T * d;
        const size_t rows_bytes = (size_t)n * sizeof(float), gate_bytes = (size_t)T * sizeof(float);
        float *logits = rnd(T, &rng, -6, 6), *in = rnd(n, &rng, -2, 2), *dout = rnd(n, &rng, -1, 1);
        logits[0] = 30.0f, logits[1] = -30.0f, logits[2] = -100.0f;
        float *out = ref_alloc(rows_bytes), *gate = ref_alloc(gate_bytes);
        float *din = ref_alloc(rows_bytes), *dlogits = ref_alloc(gate_bytes);
        cpu->sigmoid_gate_forward(out, gate, in, logits, T, d);
        cpu->sigmoid_gate_backward(din, dlogits, dout, out, gate, T, d);

        float *d_in = dput(in, rows_bytes), *d_logits = dput(logits, gate_bytes);
        float *d_dout = dput(dout, rows_bytes), *d_gate_cpu = dput(gate, gate_bytes);
        float *d_out_cpu = dput(out, rows_bytes);
        float *d_out = dpoison(rows_bytes, POISON_FLOAT), *d_gate = dpoison(gate_bytes, POISON_FLOAT);
        CHECK(moe_cuda_sigmoid_gate_forward(d_out, d_gate, d_in, d_logits, T, d, ctx));
        snprintf(what, sizeof what, "sigmoid_gate_forward gate, T %lld d %lld", (long long)T, (long long)d);
        expect_dev(what, d_gate, gate, T, TOL_F32);
        snprintf(what, sizeof what, "sigmoid_gate_forward out, T %lld d %lld", (long long)T, (long long)d);
        expect_dev(what, d_out, out, n, TOL_F32);
        float *d_din = dpoison(rows_bytes, POISON_FLOAT), *d_dlogits = dpoison(gate_bytes, POISON_FLOAT);
        CHECK(moe_cuda_sigmoid_gate_backward(d_din, d_dlogits, d_dout, d_out_cpu, d_gate_cpu, T, d, ctx));
        snprintf(what, sizeof what, "sigmoid_gate_backward din, T %lld d %lld", (long long)T, (long long)d);
        expect_dev(what, d_din, din, n, TOL_F32);
        snprintf(what, sizeof what, "sigmoid_gate_backward dlogits, T %lld d %lld", (long long)T, (long long)d);
        expect_dev(what, d_dlogits, dlogits, T, TOL_F32);

        float *d_buf = dput(in, rows_bytes);
        CHECK(moe_cuda_sigmoid_gate_forward(d_buf, dpoison(gate_bytes, POISON_FLOAT), d_buf, d_logits, T, d,
                                            ctx));
        snprintf(what, sizeof what, "sigmoid_gate_forward out == in, T %lld d %lld", (long long)T, (long long)d);
        expect_dev(what, d_buf, out, n, TOL_F32);
        d_buf = dput(dout, rows_bytes);
        d_dlogits = dpoison(gate_bytes, POISON_FLOAT);
        CHECK(moe_cuda_sigmoid_gate_backward(d_buf, d_dlogits, d_buf, d_out_cpu, d_gate_cpu, T, d, ctx));
        snprintf(what, sizeof what, "sigmoid_gate_backward din == dout, T %lld d %lld", (long long)T,
                 (long long)d);
        expect_dev(what, d_buf, din, n, TOL_F32);
        snprintf(what, sizeof what, "sigmoid_gate_backward dlogits, din == dout, T %lld d %lld", (long long)T,
                 (long long)d);
        expect_dev(what, d_dlogits, dlogits, T, TOL_F32);
        free(logits), free(in), free(dout), free(out), free(gate), free(din), free(dlogits);
    }
    gpu_end();
}

/* Attention in bf16 math against the CPU's fp32, forward and backward,
 * within bf16's tolerance, and not the device's fp32 bits (the tensor cores
 * were used). The batched path's att holds the probabilities; the fused
 * kernels keep their own state there. */
static void check_attention_bf16(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd,
                                 int64_t window, ref_rng *rng) {
    const moe_ops *cpu = moe_cpu_ops();
    const int64_t nq = B * T * Hq * hd, nk = B * T * Hkv * hd, na = B * Hq * T * T;
    float *q = rnd(nq, rng, -1, 1), *k = rnd(nk, rng, -1, 1), *v = rnd(nk, rng, -1, 1);
    float *dout = rnd(nq, rng, -1, 1);
    float *out = ref_alloc((size_t)nq * sizeof *out), *att = ref_alloc((size_t)na * sizeof *att);
    float *datt = ref_alloc((size_t)na * sizeof *datt);
    float *dq = calloc((size_t)nq, sizeof *dq), *dk = calloc((size_t)nk, sizeof *dk);
    float *dv = calloc((size_t)nk, sizeof *dv);
    cr_assert(dq && dk && dv);
    cpu->attention_forward(out, att, q, k, v, B, T, Hq, Hkv, hd, window);
    cpu->attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, Hq, Hkv, hd, window);

    float *d_q = dput(q, (size_t)nq * sizeof(float)), *d_k = dput(k, (size_t)nk * sizeof(float));
    float *d_v = dput(v, (size_t)nk * sizeof(float)), *d_dout = dput(dout, (size_t)nq * sizeof(float));
    float *d_out32 = dpoison((size_t)nq * sizeof(float), POISON_FLOAT);
    float *d_out16 = dpoison((size_t)nq * sizeof(float), POISON_FLOAT);
    float *d_att = dpoison((size_t)na * sizeof(float), POISON_FLOAT);
    float *d_datt = dpoison((size_t)na * sizeof(float), POISON_FLOAT);
    float *zeros = calloc((size_t)nq, sizeof *zeros);
    cr_assert(zeros);
    float *d_dq = dput(zeros, (size_t)nq * sizeof(float)), *d_dk = dput(zeros, (size_t)nk * sizeof(float));
    float *d_dv = dput(zeros, (size_t)nk * sizeof(float));
    CHECK(moe_cuda_attention_forward(d_out32, d_att, d_q, d_k, d_v, B, T, Hq, Hkv, hd, window, ctx));
    moe_cuda_set_math(ctx, MOE_CUDA_MATH_BF16);
    const bool fused = moe_cuda_attention_fused(T, Hq, hd, ctx);
    CHECK(moe_cuda_attention_forward(d_out16, d_att, d_q, d_k, d_v, B, T, Hq, Hkv, hd, window, ctx));
    CHECK(moe_cuda_attention_backward(d_dq, d_dk, d_dv, d_datt, d_dout, d_q, d_k, d_v, d_att, B, T,
                                      Hq, Hkv, hd, window, ctx));
    moe_cuda_set_math(ctx, MOE_CUDA_MATH_FP32);
    char what[128];
#define ATT_WHAT(name)                                                                             \
    snprintf(what, sizeof what,                                                                    \
             "attention bf16 math (%s) B=%lld T=%lld Hq=%lld Hkv=%lld hd=%lld window=%lld %s",       \
             fused ? "fused" : "batched", (long long)B, (long long)T, (long long)Hq, (long long)Hkv,   \
             (long long)hd, (long long)window, name)
    ATT_WHAT("out");
    expect_dev(what, d_out16, out, nq, TOL_BF16);
    ATT_WHAT("out in fp32 math");
    expect_dev(what, d_out32, out, nq, TOL_F32);
    if (!fused) {
        ATT_WHAT("att");
        expect_dev(what, d_att, att, na, TOL_BF16);
    }
    ATT_WHAT("dq");
    expect_dev(what, d_dq, dq, nq, TOL_BF16);
    ATT_WHAT("dk");
    expect_dev(what, d_dk, dk, nk, TOL_BF16);
    ATT_WHAT("dv");
    expect_dev(what, d_dv, dv, nk, TOL_BF16);
#undef ATT_WHAT
    float *out32 = ref_alloc((size_t)nq * sizeof *out32), *out16 = ref_alloc((size_t)nq * sizeof *out16);
    dget(out32, d_out32, (size_t)nq * sizeof *out32);
    dget(out16, d_out16, (size_t)nq * sizeof *out16);
    int64_t differ = 0;
    for (int64_t i = 0; i < nq; i++) differ += memcmp(&out32[i], &out16[i], sizeof *out32) != 0;
    cr_expect(differ > 0, "attention in bf16 math (hd %lld) gave the fp32 bits everywhere: the tensor cores were not used",
              (long long)hd);
    free(q), free(k), free(v), free(dout), free(out), free(att), free(datt), free(dq), free(dk);
    free(dv), free(zeros), free(out32), free(out16);
}

Test(cuda, rope_attention) {
    gpu_begin();
    ref_rng rng = {1010};
    const moe_ops *cpu = moe_cpu_ops();
    const int64_t B = 2, T = 37, Hq = 4, Hkv = 2, hd = 16, half = hd / 2;
    const float theta = 10000.0f;

    float *cos_t = ref_alloc((size_t)(T * half) * sizeof *cos_t),
          *sin_t = ref_alloc((size_t)(T * half) * sizeof *sin_t);
    moe_rope_tables(cos_t, sin_t, T, hd, theta, &(moe_rope_scaling){0});
    float *d_cos = dput(cos_t, (size_t)(T * half) * sizeof(float));
    float *d_sin = dput(sin_t, (size_t)(T * half) * sizeof(float));
    const int64_t nq = B * T * Hq * hd, nk = B * T * Hkv * hd;
    float *q = rnd(nq, &rng, -1, 1);
    float *d_q = dput(q, (size_t)nq * sizeof(float));
    cpu->rope_forward(q, cos_t, sin_t, B, T, Hq, hd);
    CHECK(moe_cuda_rope_forward(d_q, d_cos, d_sin, B, T, Hq, hd, ctx));
    expect_dev("rope_forward", d_q, q, nq, TOL_F32);
    float *g = rnd(nq, &rng, -1, 1);
    float *d_g = dput(g, (size_t)nq * sizeof(float));
    cpu->rope_backward(g, cos_t, sin_t, B, T, Hq, hd);
    CHECK(moe_cuda_rope_backward(d_g, d_cos, d_sin, B, T, Hq, hd, ctx));
    expect_dev("rope_backward", d_g, g, nq, TOL_F32);

    float *k = rnd(nk, &rng, -1, 1), *v = rnd(nk, &rng, -1, 1);
    const int64_t na = B * Hq * T * T;
    float *out = ref_alloc((size_t)nq * sizeof *out), *att = ref_alloc((size_t)na * sizeof *att);
    cpu->attention_forward(out, att, q, k, v, B, T, Hq, Hkv, hd, 0);
    float *d_k = dput(k, (size_t)nk * sizeof(float)), *d_v = dput(v, (size_t)nk * sizeof(float));
    d_q = dput(q, (size_t)nq * sizeof(float));
    float *d_out = dpoison((size_t)nq * sizeof(float), POISON_FLOAT);
    float *d_att = dpoison((size_t)na * sizeof(float), POISON_FLOAT);
    CHECK(moe_cuda_attention_forward(d_out, d_att, d_q, d_k, d_v, B, T, Hq, Hkv, hd, 0, ctx));
    expect_dev("attention_forward out", d_out, out, nq, TOL_F32);
    expect_dev("attention_forward att", d_att, att, na, TOL_F32);
    /* Decoding: row 1's query at position T - 9 against its keys and
     * values up to there, on both backends. */
    {
        const int64_t len = T - 8;
        const float *qd = q + ((T + len - 1) * Hq) * hd, *kd = k + T * Hkv * hd, *vd = v + T * Hkv * hd;
        float *dec = ref_alloc((size_t)(Hq * hd) * sizeof *dec), *scratch = ref_alloc((size_t)(Hq * len) * sizeof *scratch);
        cpu->attention_decode(dec, scratch, qd, kd, vd, len, Hq, Hkv, hd);
        float *d_dec = dpoison((size_t)(Hq * hd) * sizeof(float), POISON_FLOAT);
        CHECK(moe_cuda_attention_decode(d_dec, dpoison((size_t)(Hq * len) * sizeof(float), POISON_FLOAT),
                                        dput(qd, (size_t)(Hq * hd) * sizeof(float)),
                                        dput(kd, (size_t)(len * Hkv * hd) * sizeof(float)),
                                        dput(vd, (size_t)(len * Hkv * hd) * sizeof(float)), len, Hq, Hkv, hd, ctx));
        expect_dev("attention_decode out", d_dec, dec, Hq * hd, TOL_F32);
        free(dec), free(scratch);
    }

    /* bf16 math: the fused kernels (hd 16, 64 and 128, a ragged last tile,
     * grouped kv heads) and the tensor-core GEMMs of the batched path
     * (hd 8, which the fused kernels do not take). */
    check_attention_bf16(2, 40, 4, 2, 16, 0, &rng);
    check_attention_bf16(1, 130, 4, 2, 64, 0, &rng);
    check_attention_bf16(1, 150, 2, 1, 128, 0, &rng);
    check_attention_bf16(2, 40, 4, 2, 8, 0, &rng);
    /* Sliding windows, fused (shorter than a tile, across tiles) and
     * batched. */
    check_attention_bf16(1, 150, 2, 1, 16, 7, &rng);
    check_attention_bf16(2, 130, 4, 2, 64, 70, &rng);
    check_attention_bf16(2, 40, 4, 2, 8, 5, &rng);

    float *dout = rnd(nq, &rng, -1, 1);
    float *dq = rnd(nq, &rng, -1, 1), *dk = rnd(nk, &rng, -1, 1), *dv = rnd(nk, &rng, -1, 1);
    float *d_dq = dput(dq, (size_t)nq * sizeof(float)),
          *d_dk = dput(dk, (size_t)nk * sizeof(float));
    float *d_dv = dput(dv, (size_t)nk * sizeof(float));
    float *datt = ref_alloc((size_t)na * sizeof *datt);
    cpu->attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, Hq, Hkv, hd, 0);
    CHECK(moe_cuda_attention_backward(
        d_dq, d_dk, d_dv, dpoison((size_t)na * sizeof(float), POISON_FLOAT),
        dput(dout, (size_t)nq * sizeof(float)), d_q, d_k, d_v,
        dput(att, (size_t)na * sizeof(float)), B, T, Hq, Hkv, hd, 0, ctx));
    expect_dev("attention_backward dq", d_dq, dq, nq, TOL_F32);
    expect_dev("attention_backward dk", d_dk, dk, nk, TOL_F32);
    expect_dev("attention_backward dv", d_dv, dv, nk, TOL_F32);

    free(cos_t), free(sin_t), free(q), free(g), free(k), free(v), free(out), free(att);
    free(dout), free(dq), free(dk), free(dv), free(datt);
    gpu_end();
}

Test(cuda, crossentropy_adamw_sumsq) {
    gpu_begin();
    ref_rng rng = {1111};
    const moe_ops *cpu = moe_cpu_ops();
    const int64_t N = 13, V = 300;

    float *logits = rnd(N * V, &rng, -8, 8);
    int32_t targets[13];
    for (int64_t n = 0; n < N; n++)
        targets[n] = n == 4 ? -100 : (int32_t)(ref_next(&rng) % (uint64_t)V);
    float *losses = ref_alloc((size_t)N * sizeof *losses);
    double lse[13], got_lse[13];
    cpu->crossentropy_forward(losses, lse, logits, targets, N, V);
    float *d_logits = dput(logits, (size_t)(N * V) * sizeof(float));
    int32_t *d_tgt = dput(targets, sizeof targets);
    float *d_losses = dpoison((size_t)N * sizeof(float), POISON_FLOAT);
    double *d_lse = dpoison(sizeof lse, POISON_FLOAT);
    CHECK(moe_cuda_crossentropy_forward(d_losses, d_lse, d_logits, d_tgt, N, V, ctx));
    expect_dev("crossentropy_forward losses", d_losses, losses, N, TOL_F32);
    dget(got_lse, d_lse, sizeof got_lse);
    for (int64_t n = 0; n < N; n++)
        cr_expect(fabs(got_lse[n] - lse[n]) <= 1e-6 * fabs(lse[n]) + 1e-9,
                  "crossentropy lse[%lld] = %.12g, cpu %.12g", (long long)n, got_lse[n], lse[n]);
    float *dloss = rnd(N, &rng, 0.01, 0.1), *dlogits = ref_alloc((size_t)(N * V) * sizeof *dlogits);
    cpu->crossentropy_backward(dlogits, logits, lse, targets, dloss, 0.01f, N, V);
    /* In place, as the trainer calls it: dlogits is logits; with a z-loss. */
    CHECK(moe_cuda_crossentropy_backward(d_logits, d_logits, dput(lse, sizeof lse), d_tgt,
                                         dput(dloss, (size_t)N * sizeof(float)), 0.01f, N, V, ctx));
    expect_dev("crossentropy_backward (in place)", d_logits, dlogits, N * V, TOL_F32);

    const int64_t n = 100003;
    float *p = rnd(n, &rng, -1, 1), *m = rnd(n, &rng, -0.1, 0.1), *v = rnd(n, &rng, 0, 0.01);
    float *grads = rnd(n, &rng, -1, 1);
    float *d_p = dput(p, (size_t)n * sizeof(float)), *d_m = dput(m, (size_t)n * sizeof(float));
    float *d_v = dput(v, (size_t)n * sizeof(float));
    /* Spans shorter than a block's pass, and one across several passes. */
    static const moe_adamw_span spans[] = {
        {5, true}, {4103, false}, {4104, true}, {50000, false}, {100003, true}};
    const int64_t n_spans = (int64_t)(sizeof spans / sizeof spans[0]);
    cpu->adamw(p, m, v, grads, 0.375f, n, spans, n_spans, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 7);
    CHECK(moe_cuda_adamw(d_p, d_m, d_v, dput(grads, (size_t)n * sizeof(float)), 0.375f, n,
                         dput(spans, sizeof spans), n_spans, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 7,
                         ctx));
    expect_dev("adamw params", d_p, p, n, TOL_F32);
    expect_dev("adamw m", d_m, m, n, TOL_F32);
    expect_dev("adamw v", d_v, v, n, TOL_F32);

    double want = 0.0, got = 0.0, again = 0.0;
    cpu->sumsq(&want, grads, n);
    double *d_out = dpoison(sizeof(double), POISON_FLOAT);
    float *d_grads = dput(grads, (size_t)n * sizeof(float));
    CHECK(moe_cuda_sumsq(d_out, d_grads, n, ctx));
    dget(&got, d_out, sizeof got);
    CHECK(moe_cuda_sumsq(d_out, d_grads, n, ctx));
    dget(&again, d_out, sizeof again);
    cr_expect(fabs(got - want) <= 1e-10 * want, "sumsq = %.17g, cpu %.17g", got, want);
    cr_expect(memcmp(&got, &again, sizeof got) == 0, "sumsq is not deterministic: %.17g then %.17g",
              got, again);

    free(logits), free(losses), free(dloss), free(dlogits), free(p), free(m), free(v), free(grads);
    gpu_end();
}

/* --------------------------------------------------------------- op table */

/* The table tests go through moe_cuda_ops() alone: its alloc, upload and
 * download included. Pieces are released at the end of the test. */
#define TABLE_PIECES 128

static const moe_ops *gpu;
static void *table_pieces[TABLE_PIECES];
static int n_table_pieces;

static void table_begin(void) {
    gpu_begin();
    gpu = moe_cuda_ops(ctx);
    cr_assert(gpu != NULL, "moe_cuda_ops returned NULL");
}

static void table_release_pieces(void) {
    for (int i = 0; i < n_table_pieces; i++) gpu->release(table_pieces[i]);
    n_table_pieces = 0;
}

static void table_end(void) {
    table_release_pieces();
    CHECK(gpu->sync());
    gpu_end();
}

static void *talloc(size_t bytes) {
    cr_assert(n_table_pieces < TABLE_PIECES, "more than %d table pieces", TABLE_PIECES);
    void *p = NULL;
    CHECK(gpu->alloc(&p, bytes));
    table_pieces[n_table_pieces++] = p;
    return p;
}

static void *tput(const void *host, size_t bytes) {
    void *p = talloc(bytes);
    CHECK(gpu->upload(p, host, bytes));
    return p;
}

/* The table's zero cannot poison: the bytes come from the host. */
static void *tpoison(size_t bytes, int byte) {
    void *host = ref_alloc(bytes);
    memset(host, byte, bytes);
    void *p = tput(host, bytes);
    free(host);
    return p;
}

/* download waits for every op queued before it. */
static void tget(void *host, const void *dev, size_t bytes) {
    CHECK(gpu->download(host, dev, bytes));
}

static void expect_table(const char *what, const float *dev, const float *want, int64_t n,
                         double tol) {
    float *got = ref_alloc((size_t)n * sizeof *got);
    tget(got, dev, (size_t)n * sizeof *got);
    expect_close(what, got, want, n, tol);
    free(got);
}

Test(cuda, table_fills_every_entry) {
    table_begin();
    cr_expect(gpu->name && strcmp(gpu->name, "cuda") == 0, "table name %s",
              gpu->name ? gpu->name : "(null)");
    cr_expect(!gpu->host_visible, "device memory is said to be host-visible");
    /* Every member from alloc on is a function pointer, so that part of the
     * table is an array of pointer-sized slots; an entry added to ops.h is
     * checked without being named here. */
    typedef void (*any_fn)(void);
    const size_t first = offsetof(moe_ops, alloc);
    cr_assert((sizeof(moe_ops) - first) % sizeof(any_fn) == 0 && first % sizeof(any_fn) == 0,
              "moe_ops is not name, host_visible, then function pointers");
    const size_t n = (sizeof(moe_ops) - first) / sizeof(any_fn);
    for (size_t i = 0; i < n; i++) {
        any_fn f;
        memcpy(&f, (const char *)gpu + first + i * sizeof f, sizeof f);
        cr_expect(f != NULL, "moe_cuda_ops(): function %zu of %zu in ops.h order (alloc is 0) is NULL",
                  i, n);
    }
    table_end();
}

Test(cuda, table_gate_plan_permute) {
    table_begin();
    ref_rng rng = {1212};
    const moe_ops *cpu = moe_cpu_ops();
    static const gate_case gc = {16, 4, 300, MOE_GATE_SOFTMAX_TOPK, true, true, false, 0, 0, 1.0f};
    const int64_t E = gc.E, k = gc.k, T = gc.T, Tk = T * k;
    const int64_t n_chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;

    /* gate_forward: the totals are device memory, z_sum included. */
    gate_run want = cpu_gate(&gc, &rng); /* the CPU table's gate_forward */
    moe_gate_totals totals = {tpoison((size_t)E * sizeof(int64_t), POISON_INT),
                              tpoison((size_t)E * sizeof(double), POISON_FLOAT),
                              tpoison(sizeof(double), POISON_FLOAT),
                              tpoison((size_t)(n_chunks * (2 * E + 1)) * sizeof(double),
                                      POISON_FLOAT)};
    int32_t *d_idx = tpoison((size_t)Tk * sizeof(int32_t), POISON_INT);
    float *d_w = tpoison((size_t)Tk * sizeof(float), POISON_FLOAT);
    float *d_prob = tpoison((size_t)(T * E) * sizeof(float), POISON_FLOAT);
    float *d_lse = tpoison((size_t)T * sizeof(float), POISON_FLOAT);
    const moe_gate_params p = {E, k, gc.kind, gc.renormalize, 0, 0, 1.0f, 0};
    gpu->gate_forward(d_idx, d_w, d_prob, d_lse, &totals,
                      tput(want.logits, (size_t)(T * E) * sizeof(float)),
                      tput(want.bias, (size_t)E * sizeof(float)), &p, T);
    int32_t *idx = ref_alloc((size_t)Tk * sizeof *idx);
    tget(idx, d_idx, (size_t)Tk * sizeof *idx);
    expect_same_i32("table gate_forward topk_idx", idx, want.idx, Tk);
    expect_table("table gate_forward topk_w", d_w, want.w, Tk, TOL_F32);
    expect_table("table gate_forward prob", d_prob, want.prob, T * E, TOL_F32);
    expect_table("table gate_forward lse", d_lse, want.lse, T, TOL_F32);
    int64_t *assigned = ref_alloc((size_t)E * sizeof *assigned);
    double *prob_sum = ref_alloc((size_t)E * sizeof *prob_sum), z_sum = 0.0;
    tget(assigned, totals.assigned, (size_t)E * sizeof *assigned);
    tget(prob_sum, totals.prob_sum, (size_t)E * sizeof *prob_sum);
    tget(&z_sum, totals.z_sum, sizeof z_sum);
    expect_same_i64("table gate_forward assigned", assigned, want.assigned, E);
    for (int64_t e = 0; e < E; e++)
        cr_expect(fabs(prob_sum[e] - want.prob_sum[e]) <= TOL_F32 * (double)T / (double)E + 1e-9,
                  "table gate_forward prob_sum[%lld] = %.12g, cpu %.12g", (long long)e,
                  prob_sum[e], want.prob_sum[e]);
    cr_expect(fabs(z_sum - want.z_sum) <= TOL_F32 * fabs(want.z_sum) + 1e-9,
              "table gate_forward z_sum = %.12g, cpu %.12g", z_sum, want.z_sum);

    /* gate_seq_stats over 5 sequences of 60: the CPU's sums, in its order. */
    const moe_gate_params ps = {E, k, gc.kind, gc.renormalize, 0, 0, 1.0f, 60};
    float *seq_want = ref_alloc((size_t)(T / 60 * 2 * E) * sizeof *seq_want);
    cpu->gate_seq_stats(seq_want, want.idx, want.prob, &ps, T);
    float *d_seq = tpoison((size_t)(T / 60 * 2 * E) * sizeof(float), POISON_FLOAT);
    gpu->gate_seq_stats(d_seq, tput(want.idx, (size_t)Tk * sizeof(int32_t)),
                        tput(want.prob, (size_t)(T * E) * sizeof(float)), &ps, T);
    expect_table("table gate_seq_stats", d_seq, seq_want, T / 60 * 2 * E, 0.0);

    /* plan_build with keep on the device, at a capacity that drops pairs. */
    cpu_plan cp = make_cpu_plan(want.idx, want.assigned, 0.75, T, k, E);
    const int64_t n_rows = cp.n_rows;
    cr_assert(cp.dropped > 0, "the case should drop pairs");
    int64_t *d_pair = tpoison((size_t)Tk * sizeof(int64_t), POISON_INT);
    int64_t *d_rows = tpoison((size_t)Tk * sizeof(int64_t), POISON_INT);
    int64_t *d_off = tpoison((size_t)(E + 1) * sizeof(int64_t), POISON_INT);
    gpu->plan_build(d_pair, d_rows, d_off, tput(want.idx, (size_t)Tk * sizeof(int32_t)),
                    tput(cp.keep, (size_t)E * sizeof(int64_t)),
                    tpoison(gpu->plan_scratch_bytes(T, k, E), POISON_INT), T, k, E);
    int64_t *got = ref_alloc((size_t)Tk * sizeof *got);
    tget(got, d_off, (size_t)(E + 1) * sizeof *got);
    expect_same_i64("table plan_build expert_offsets", got, cp.expert_offsets, E + 1);
    tget(got, d_pair, (size_t)Tk * sizeof *got);
    expect_same_i64("table plan_build pair_row", got, cp.pair_row, Tk);
    tget(got, d_rows, (size_t)n_rows * sizeof *got);
    expect_same_i64("table plan_build row_token", got, cp.row_token, n_rows);

    /* permute with the host's row count: rows from n_rows on stay
     * poisoned. d = 40 moves float4s, d = 37 floats. */
    static const int64_t dims[] = {40, 37};
    for (size_t s = 0; s < sizeof dims / sizeof dims[0]; s++) {
        const int64_t d = dims[s];
        float *x = rnd(T * d, &rng, -1, 1), *xp = ref_alloc((size_t)(n_rows * d) * sizeof *xp);
        cpu->permute(xp, x, cp.row_token, n_rows, d);
        float *d_xp = tpoison((size_t)(Tk * d) * sizeof(float), POISON_FLOAT);
        gpu->permute(d_xp, tput(x, (size_t)(T * d) * sizeof(float)), d_rows, n_rows, d);
        float *xp_got = ref_alloc((size_t)(Tk * d) * sizeof *xp_got);
        tget(xp_got, d_xp, (size_t)(Tk * d) * sizeof *xp_got);
        char what[64];
        snprintf(what, sizeof what, "table permute d=%lld", (long long)d);
        expect_close(what, xp_got, xp, n_rows * d, 0.0);
        expect_untouched(what, d_xp, (size_t)(n_rows * d) * sizeof(float), (size_t)(Tk * d) * sizeof(float));
        free(x), free(xp), free(xp_got);
    }

    free(idx), free(assigned), free(prob_sum), free(got);
    free_cpu_plan(&cp);
    free_gate(&want);
    table_end();
}

/* One expert group's host arrays: inputs, the accumulated weight
 * gradients' starting values, and room for the CPU's outputs. */
typedef struct group_case {
    float *x, *w13, *w2, *dy, *dw13, *dw2; /* dw13, dw2 accumulate on the CPU */
    float *h, *g, *y, *dh, *dx;
} group_case;

#define MAX_TABLE_GROUPS 8

/* Device memory for the groups' arrays: a piece each, or (packed) one
 * piece they follow each other in with no padding, as the model packs its
 * groups' rows, so that their bases have only the alignment their sizes
 * leave (4 bytes with an odd d_ff). */
typedef struct group_mem {
    bool packed;
    char *next; /* packed: where the next array goes */
} group_mem;

static void *gmem_put(group_mem *m, const void *host, size_t bytes) {
    if (!m->packed) return tput(host, bytes);
    void *p = m->next;
    m->next += bytes;
    CHECK(gpu->upload(p, host, bytes));
    return p;
}

static void *gmem_poison(group_mem *m, size_t bytes, int byte) {
    void *host = ref_alloc(bytes);
    memset(host, byte, bytes);
    void *p = gmem_put(m, host, bytes);
    free(host);
    return p;
}

/* Groups of these rows and d_ff through both tables' experts, forward and
 * backward, in separate or packed device memory; the device's pieces are
 * released after. */
static void check_table_groups(const int64_t *rows, const int64_t *ffs, int n_groups, int64_t d,
                               moe_cuda_math math, bool packed, ref_rng *rng) {
    const moe_ops *cpu = moe_cpu_ops();
    cr_assert(n_groups <= MAX_TABLE_GROUPS);
    group_case c[MAX_TABLE_GROUPS];
    moe_expert_group host[MAX_TABLE_GROUPS], dev[MAX_TABLE_GROUPS];
    group_mem mem = {.packed = packed};
    if (packed) {
        size_t floats = 0; /* x, y, dy, dx; h, dh; g; w13, dw13; w2, dw2 */
        for (int i = 0; i < n_groups; i++)
            floats += (size_t)(4 * rows[i] * d + 2 * rows[i] * 2 * ffs[i] + rows[i] * ffs[i] +
                               2 * 2 * ffs[i] * d + 2 * d * ffs[i]);
        mem.next = talloc(floats * sizeof(float));
    }
    for (int i = 0; i < n_groups; i++) {
        const int64_t n = rows[i], f = ffs[i];
        c[i] = (group_case){
            .x = rnd(n * d, rng, -1, 1),
            .w13 = rnd(2 * f * d, rng, -1.0 / sqrt((double)d), 1.0 / sqrt((double)d)),
            .w2 = rnd(d * f, rng, -1.0 / sqrt((double)f), 1.0 / sqrt((double)f)),
            .dy = rnd(n * d, rng, -1, 1),
            .dw13 = rnd(2 * f * d, rng, -1, 1),
            .dw2 = rnd(d * f, rng, -1, 1),
            .h = ref_alloc((size_t)(n * 2 * f) * sizeof(float)),
            .g = ref_alloc((size_t)(n * f) * sizeof(float)),
            .y = ref_alloc((size_t)(n * d) * sizeof(float)),
            .dh = ref_alloc((size_t)(n * 2 * f) * sizeof(float)),
            .dx = ref_alloc((size_t)(n * d) * sizeof(float)),
        };
        /* The device copies are made before the CPU accumulates. */
        dev[i] = (moe_expert_group){
            .rows = n,
            .d_ff = f,
            .x = gmem_put(&mem, c[i].x, (size_t)(n * d) * sizeof(float)),
            .w13 = gmem_put(&mem, c[i].w13, (size_t)(2 * f * d) * sizeof(float)),
            .w2 = gmem_put(&mem, c[i].w2, (size_t)(d * f) * sizeof(float)),
            .h = gmem_poison(&mem, (size_t)(n * 2 * f) * sizeof(float), POISON_FLOAT),
            .g = gmem_poison(&mem, (size_t)(n * f) * sizeof(float), POISON_FLOAT),
            .y = gmem_poison(&mem, (size_t)(n * d) * sizeof(float), POISON_FLOAT),
            .dy = gmem_put(&mem, c[i].dy, (size_t)(n * d) * sizeof(float)),
            .dh = gmem_poison(&mem, (size_t)(n * 2 * f) * sizeof(float), POISON_FLOAT),
            .dx = gmem_poison(&mem, (size_t)(n * d) * sizeof(float), POISON_FLOAT),
            .dw13 = gmem_put(&mem, c[i].dw13, (size_t)(2 * f * d) * sizeof(float)),
            .dw2 = gmem_put(&mem, c[i].dw2, (size_t)(d * f) * sizeof(float)),
        };
        host[i] = (moe_expert_group){.rows = n,
                                     .d_ff = f,
                                     .x = c[i].x,
                                     .w13 = c[i].w13,
                                     .w2 = c[i].w2,
                                     .h = c[i].h,
                                     .g = c[i].g,
                                     .y = c[i].y,
                                     .dy = c[i].dy,
                                     .dh = c[i].dh,
                                     .dx = c[i].dx,
                                     .dw13 = c[i].dw13,
                                     .dw2 = c[i].dw2};
    }
    cpu->experts_forward(host, n_groups, d);
    cpu->experts_backward(host, n_groups, d);
    moe_cuda_set_math(ctx, math);
    gpu->experts_forward(dev, n_groups, d);
    gpu->experts_backward(dev, n_groups, d);
    moe_cuda_set_math(ctx, MOE_CUDA_MATH_FP32);
    /* Under bf16 math the saved h, g and dh hold bf16 in the first half of
     * their buffers (ops.h: the backend's format), and every result is
     * within bf16's tolerance. */
    const bool bf16 = math == MOE_CUDA_MATH_BF16;
    const double tol = bf16 ? TOL_BF16 : TOL_F32;
    for (int i = 0; i < n_groups; i++) {
        const int64_t n = rows[i], f = ffs[i];
        char what[112];
#define GROUP_WHAT(field)                                                                          \
    snprintf(what, sizeof what, "table experts (%s math) group %d (rows=%lld d_ff=%lld) %s",      \
             bf16 ? "bf16" : "fp32", i, (long long)n, (long long)f, #field)
#define EXPECT_GROUP(field, count)                                                                 \
    GROUP_WHAT(field);                                                                             \
    expect_table(what, dev[i].field, c[i].field, count, tol)
#define EXPECT_SAVED(field, count)                                                                 \
    GROUP_WHAT(field);                                                                             \
    if (bf16)                                                                                      \
        expect_dev_bf16(what, dev[i].field, c[i].field, count);                                    \
    else                                                                                           \
        expect_table(what, dev[i].field, c[i].field, count, tol)
        EXPECT_SAVED(h, n * 2 * f);
        EXPECT_SAVED(g, n * f);
        EXPECT_GROUP(y, n * d);
        EXPECT_SAVED(dh, n * 2 * f);
        EXPECT_GROUP(dx, n * d);
        EXPECT_GROUP(dw13, 2 * f * d);
        EXPECT_GROUP(dw2, d * f);
#undef EXPECT_SAVED
#undef EXPECT_GROUP
#undef GROUP_WHAT
        free(c[i].x), free(c[i].w13), free(c[i].w2), free(c[i].dy), free(c[i].dw13);
        free(c[i].dw2), free(c[i].h), free(c[i].g), free(c[i].y), free(c[i].dh), free(c[i].dx);
    }
    table_release_pieces();
}

Test(cuda, table_experts_uneven_groups) {
    table_begin();
    ref_rng rng = {1313};
    /* A routed expert, an idle one, and the shared experts over every
     * token with their wider d_ff, as moe_layer.c groups them. */
    static const int64_t rows[] = {37, 0, 21}, ffs[] = {20, 20, 44};
    check_table_groups(rows, ffs, 3, 24, MOE_CUDA_MATH_FP32, false, &rng);
    /* Every row count from 1 to 600: each GEMM is planned for its rows'
     * power-of-two bucket (16 to 1024), whose algorithm must serve every
     * count in the bucket (or fall back to a plan of its own); bf16 math
     * plans other kernels, so it sweeps too. */
    enum { SWEEP_ROWS = 600 };
    static const moe_cuda_math maths[] = {MOE_CUDA_MATH_FP32, MOE_CUDA_MATH_BF16};
    for (size_t m = 0; m < sizeof maths / sizeof maths[0]; m++) {
        int64_t sweep[MAX_TABLE_GROUPS], sweep_ffs[MAX_TABLE_GROUPS];
        int n = 0;
        for (int64_t r = 1; r <= SWEEP_ROWS; r++) {
            sweep[n] = r;
            sweep_ffs[n++] = 20;
            if (n == MAX_TABLE_GROUPS || r == SWEEP_ROWS) {
                check_table_groups(sweep, sweep_ffs, n, 24, maths[m], false, &rng);
                n = 0;
            }
        }
    }
    table_end();
}

/* Under bf16 math the groups' GEMMs read bf16 copies of their operands:
 * the uneven groups above, and groups large enough for cuBLASLt's
 * tensor-core kernels, with widths whose bf16 rows are not 16-byte aligned
 * (d_ff 20: 40-byte rows of g); then packed as the model packs them, with
 * an odd d_ff, so that the bases of h, g and dh are only 4-byte aligned. */
Test(cuda, table_experts_bf16_math) {
    table_begin();
    ref_rng rng = {1314};
    static const int64_t rows[] = {37, 0, 21}, ffs[] = {20, 20, 44};
    check_table_groups(rows, ffs, 3, 24, MOE_CUDA_MATH_BF16, false, &rng);
    static const int64_t big_rows[] = {300, 129, 512}, big_ffs[] = {64, 20, 96};
    check_table_groups(big_rows, big_ffs, 3, 128, MOE_CUDA_MATH_BF16, false, &rng);
    static const int64_t packed_rows[] = {3, 130, 0, 77}, packed_ffs[] = {21, 21, 21, 21};
    check_table_groups(packed_rows, packed_ffs, 4, 40, MOE_CUDA_MATH_BF16, true, &rng);
    check_table_groups(packed_rows, packed_ffs, 4, 40, MOE_CUDA_MATH_FP32, true, &rng);
    table_end();
}

Test(cuda, table_rmsnorm_backward_sumsq) {
    table_begin();
    ref_rng rng = {1414};
    const moe_ops *cpu = moe_cpu_ops();
    /* More rows than one part of the dweight reduction. */
    const int64_t N = 600, C = 72;
    float *x = rnd(N * C, &rng, -2, 2), *w = rnd(C, &rng, 0.5, 1.5), *dout = rnd(N * C, &rng, -1, 1);
    float *y = ref_alloc((size_t)(N * C) * sizeof *y), *rstd = ref_alloc((size_t)N * sizeof *rstd);
    cpu->rmsnorm_forward(y, rstd, x, w, 1e-5f, N, C);
    float *dx = rnd(N * C, &rng, -1, 1), *dw = rnd(C, &rng, -1, 1); /* accumulated into */
    float *d_dx = tput(dx, (size_t)(N * C) * sizeof(float)), *d_dw = tput(dw, (size_t)C * sizeof(float));
    void *cpu_scratch = ref_alloc(cpu->rmsnorm_scratch_bytes(N, C));
    cpu->rmsnorm_backward(dx, dw, dout, x, w, rstd, cpu_scratch, N, C);
    gpu->rmsnorm_backward(d_dx, d_dw, tput(dout, (size_t)(N * C) * sizeof(float)),
                          tput(x, (size_t)(N * C) * sizeof(float)),
                          tput(w, (size_t)C * sizeof(float)), tput(rstd, (size_t)N * sizeof(float)),
                          tpoison(gpu->rmsnorm_scratch_bytes(N, C), POISON_FLOAT), N, C);
    expect_table("table rmsnorm_backward dinp", d_dx, dx, N * C, TOL_F32);
    expect_table("table rmsnorm_backward dweight", d_dw, dw, C, TOL_F32);

    const int64_t n = 100003;
    float *grads = rnd(n, &rng, -1, 1);
    double want = 0.0, got = 0.0;
    cpu->sumsq(&want, grads, n);
    double *d_out = tpoison(sizeof(double), POISON_FLOAT);
    gpu->sumsq(d_out, tput(grads, (size_t)n * sizeof(float)), n);
    tget(&got, d_out, sizeof got);
    cr_expect(fabs(got - want) <= 1e-10 * want, "table sumsq = %.17g, cpu %.17g", got, want);

    free(x), free(w), free(dout), free(y), free(rstd), free(dx), free(dw), free(cpu_scratch);
    free(grads);
    table_end();
}

/* The jitter factors are drawn on the device: they must be the CPU's bits,
 * so that both backends train the same model. */
Test(cuda, table_uniform_same_bits) {
    table_begin();
    const int64_t n = 70001;
    float *want = ref_alloc((size_t)n * sizeof *want), *got = ref_alloc((size_t)n * sizeof *got);
    static const float ranges[][2] = {{0.99f, 0.02f}, {1.0f, 0.0f}, {-3.0f, 6.0f}};
    for (int r = 0; r < 3; r++) {
        /* Past 2^32 in the index: the counter's high word is drawn too. */
        const uint64_t first = r == 2 ? (1ull << 32) - 1000 : (uint64_t)r;
        moe_cpu_ops()->uniform(want, 77, 5 + (uint64_t)r, first, ranges[r][0], ranges[r][1], n);
        float *d = tpoison((size_t)n * sizeof(float), POISON_FLOAT);
        gpu->uniform(d, 77, 5 + (uint64_t)r, first, ranges[r][0], ranges[r][1], n);
        tget(got, d, (size_t)n * sizeof *got);
        int64_t i = 0;
        while (i < n && memcmp(&got[i], &want[i], sizeof *got) == 0) i++;
        cr_expect(i == n, "uniform [%g, %g + %g): element %lld is %.9g, cpu %.9g", ranges[r][0],
                  ranges[r][0], ranges[r][1], (long long)i, i < n ? got[i] : 0.0, i < n ? want[i] : 0.0);
    }
    free(want), free(got);
    table_end();
}

/* A failing entry is kept, reported once by the next sync, download or
 * upload, and the entries in between do nothing. The failure: plan_build
 * with E above MOE_EXPERTS_MAX, which moe_cuda_plan_build refuses before it
 * launches anything (the buffers are sized for that E all the same). */
Test(cuda, table_keeps_first_failure) {
    table_begin();
    const int64_t E = MOE_EXPERTS_MAX + 1;
    int64_t *d_pair = talloc(sizeof(int64_t)), *d_rows = talloc(sizeof(int64_t));
    int64_t *d_off = talloc((size_t)(E + 1) * sizeof(int64_t));
    int64_t *d_keep = talloc((size_t)E * sizeof(int64_t));
    int32_t *d_idx = talloc(sizeof(int32_t));
    void *scratch = talloc(gpu->plan_scratch_bytes(1, 1, E));
    float pattern[64], got[64];
    for (int i = 0; i < 64; i++) pattern[i] = (float)(i + 1);
    float *buf = tput(pattern, sizeof pattern);
    char detail[64];
    snprintf(detail, sizeof detail, "E=%lld", (long long)E);
    static const char *const via[] = {"sync", "download", "upload"};

    for (int v = 0; v < 3; v++) {
        gpu->plan_build(d_pair, d_rows, d_off, d_idx, d_keep, scratch, 1, 1, E);
        gpu->zero(buf, sizeof pattern); /* skipped: a failure is kept */
        moe_status st = v == 0   ? gpu->sync()
                        : v == 1 ? gpu->download(got, buf, sizeof got)
                                 : gpu->upload(buf, pattern, sizeof pattern);
        cr_expect(st == MOE_ERR_INVALID_ARG && strstr(moe_last_error(), "plan_build") &&
                      strstr(moe_last_error(), detail),
                  "%s after a failed plan_build: %s: %s", via[v], moe_status_string(st),
                  moe_last_error());
        CHECK(gpu->sync()); /* reported once */
        tget(got, buf, sizeof got);
        cr_expect(memcmp(got, pattern, sizeof got) == 0,
                  "zero ran while a failure was kept (reported by %s): [0] = %g", via[v],
                  (double)got[0]);
    }

    /* Unbound, an entry fails with MOE_ERR_STATE; the failure stays with
     * the thread across rebinding. */
    cr_expect(moe_cuda_ops(NULL) == gpu, "moe_cuda_ops(NULL) returned another table");
    gpu->zero(buf, sizeof pattern);
    cr_expect(moe_cuda_ops(ctx) == gpu, "rebinding returned another table");
    moe_status st = gpu->sync();
    cr_expect(st == MOE_ERR_STATE, "zero with no context bound, then sync: %s: %s",
              moe_status_string(st), moe_last_error());
    CHECK(gpu->sync());

    gpu->zero(buf, sizeof pattern); /* nothing kept: runs */
    tget(got, buf, sizeof got);
    int64_t nonzero = 0;
    for (int i = 0; i < 64; i++) nonzero += got[i] != 0.0f;
    cr_expect(nonzero == 0, "zero left %lld of 64 floats nonzero", (long long)nonzero);
    table_end();
}

/* The whole model (dense layers and MoE layers, q and k normalised per
 * head and across heads, capacity, shared experts and router jitter on)
 * on the CUDA table against the same model on the CPU table:
 * the engine's path to the device, not one op. Every op agrees to 1e-5 on
 * its own; composed over two layers, forward and backward, their different
 * summation orders add up, so the tolerance here is 1e-4 of each array's
 * largest value (a wrong index or a missing term is far larger). */
Test(cuda, model_on_the_table) {
    table_begin();
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, 64);
    cfg.hidden_size = 32;
    cfg.intermediate_size = 24;
    cfg.num_hidden_layers = 2;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 8;
    cfg.num_local_experts = 8;
    cfg.num_experts_per_tok = 2;
    cfg.moe_capacity_factor = 1.25;
    cfg.moe_n_shared_experts = 1;
    cfg.router_aux_loss_coef = 0.01;
    cfg.moe_z_loss_coef = 0.001;
    cfg.router_jitter_noise = 0.01; /* the multiply op, both ways */
    enum { B = 2, T = 16, N = B * T };
    /* RMSNorm over rows of head_dim, then of the whole projection; then
     * none, with Qwen2-MoE's q, k and v biases and its gated shared expert
     * of its own width; then a dense MLP layer 40 wide first; then both
     * layers dense (a dense baseline). */
    for (int variant = 0; variant < 5; variant++) {
        const int qk = variant == 0 ? MOE_QK_NORM_PER_HEAD : variant == 1 ? MOE_QK_NORM_ACROSS_HEADS : MOE_QK_NORM_NONE;
        cfg.moe_qk_norm = (moe_qk_norm_kind)qk;
        cfg.moe_qkv_bias = cfg.moe_shared_expert_gate = variant == 2;
        cfg.moe_shared_intermediate_size = variant == 2 ? 20 : 0;
        cfg.moe_dense_layers[0] = variant == 3 ? 0x1 : variant == 4 ? 0x3 : 0;
        cfg.moe_dense_intermediate_size = variant >= 3 ? 40 : 0;
        moe_model *host = NULL, *dev = NULL;
        CHECK(moe_model_create(&host, &cfg, B, T, 5));
        const moe_model_parallel on_gpu = {.ops = gpu};
        CHECK(moe_model_create_parallel(&dev, &cfg, B, T, 5, &on_gpu));
        int32_t inputs[N], targets[N];
        ref_rng rng = {77};
        for (int i = 0; i < N; i++) {
            inputs[i] = (int32_t)(ref_next(&rng) % 64);
            targets[i] = (int32_t)(ref_next(&rng) % 64);
        }
        moe_model_stats hs, ds;
        CHECK(moe_model_forward(host, inputs, targets, &hs));
        CHECK(moe_model_backward(host, 1.0f));
        CHECK(moe_model_forward(dev, inputs, targets, &ds));
        CHECK(moe_model_backward(dev, 1.0f));
        cr_expect(fabs(ds.loss - hs.loss) <= 1e-5 * fabs(hs.loss),
                  "qk norm %s, qkv bias %d, dense layers %#llx: loss %.9g, cpu %.9g", moe_qk_norm_kind_name(qk),
                  cfg.moe_qkv_bias, (unsigned long long)cfg.moe_dense_layers[0], ds.loss, hs.loss);
        expect_close("per-token losses", moe_model_last_losses(dev), moe_model_last_losses(host), N, 1e-4);
        const int64_t n = moe_model_param_count(host);
        float *got = ref_alloc((size_t)n * sizeof *got);
        tget(got, moe_model_grads(dev), (size_t)n * sizeof *got);
        expect_close("gradients", got, moe_model_grads(host), n, 1e-4);
        double hsq, dsq;
        CHECK(moe_model_grad_sumsq(host, &hsq));
        CHECK(moe_model_grad_sumsq(dev, &dsq));
        cr_expect(fabs(dsq - hsq) <= 1e-4 * hsq, "gradient sum of squares %.9g, cpu %.9g", dsq, hsq);
        free(got);
        moe_model_destroy(dev);
        moe_model_destroy(host);
    }
    table_end();
}

/* The table's marks are events in its stream: a profile over it gives a
 * 2 * 2048^3 GEMM far more time than a copy of one float, and counts both. */
Test(cuda, table_marks_time_ops_in_the_stream) {
    table_begin();
    const int64_t n = 2048;
    ref_rng rng = {91};
    float *h = rnd(n * n, &rng, -1, 1);
    float *a = tput(h, (size_t)(n * n) * sizeof *h), *c = talloc((size_t)(n * n) * sizeof *c);
    const moe_ops *profiled = NULL;
    CHECK(moe_profile_open(&profiled, gpu));
    for (int rep = 0; rep < 3; rep++) {
        profiled->copy(c, c + 1, sizeof *c);
        profiled->gemm(c, a, a, n, n, n, n, n, n, false, true, 1.0f, 0.0f);
    }
    CHECK(profiled->sync());
    moe_op_time rows[4];
    int64_t n_rows = 0;
    CHECK(moe_profile_read(rows, 4, &n_rows));
    cr_assert(n_rows == 2 && strcmp(rows[0].op, "gemm") == 0 && strcmp(rows[1].op, "copy") == 0,
              "%lld ops listed; want gemm, then copy", (long long)n_rows);
    cr_expect(rows[0].calls == 3 && rows[1].calls == 3, "calls: gemm %lld, copy %lld", (long long)rows[0].calls,
              (long long)rows[1].calls);
    cr_expect(rows[0].seconds > 20.0 * rows[1].seconds && rows[1].seconds >= 0.0, "gemm %.3g s, copy %.3g s",
              rows[0].seconds, rows[1].seconds);
    moe_profile_close();
    free(h);
    table_end();
}


/* moe.h's CUDA layer, queued on a stream of the caller's (here the test
 * context's), against the CPU layer of the same config and seed: the
 * initial parameters alike bit for bit (drawn on the host), y, dx and the
 * gradients within 1e-5 of each array's largest value (fp32 GEMMs in
 * another summation order), capacity dropping and shared experts on. */
Test(cuda, public_layer_on_a_callers_stream) {
    gpu_begin();
    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = 48, cfg.d_ff = 40, cfg.n_experts = 8, cfg.top_k = 2, cfg.capacity_factor = 1.25;
    cfg.n_shared_experts = 1, cfg.aux_loss_coef = 0.01, cfg.z_loss_coef = 0.001, cfg.seed = 9;
    moe_layer *host = NULL, *dev = NULL;
    CHECK(moe_layer_create(&host, &cfg));
    CHECK(moe_layer_create_cuda(&dev, &cfg, -1, moe_cuda_stream(ctx)));
    const int64_t n = moe_layer_param_count(host), d = cfg.d_model, T = 100;
    float *got = ref_alloc((size_t)n * sizeof *got);
    CHECK(moe_layer_sync(dev));
    dget(got, moe_layer_params(dev), (size_t)n * sizeof *got);
    expect_close("initial parameters", got, moe_layer_params(host), n, 0.0);

    ref_rng rng = {4242};
    float *hx = rnd(T * d, &rng, -1, 1), *hdy = rnd(T * d, &rng, -1, 1);
    float *hy = ref_alloc((size_t)(T * d) * sizeof *hy), *hdx = ref_alloc((size_t)(T * d) * sizeof *hdx);
    float *x = dput(hx, (size_t)(T * d) * sizeof(float)), *dy = dput(hdy, (size_t)(T * d) * sizeof(float));
    float *y = dpoison((size_t)(T * d) * sizeof(float), POISON_FLOAT);
    float *dx = dpoison((size_t)(T * d) * sizeof(float), POISON_FLOAT);
    moe_layer_stats hs = {0}, ds = {0};
    CHECK(moe_layer_forward(host, hy, hx, T, &hs));
    CHECK(moe_layer_backward(host, hdx, hdy, hx));
    CHECK(moe_layer_forward(dev, y, x, T, &ds));
    CHECK(moe_layer_backward(dev, dx, dy, x));
    CHECK(moe_layer_sync(dev));
    cr_expect(ds.dropped == hs.dropped && fabs(ds.aux_loss - hs.aux_loss) <= 1e-5 * hs.aux_loss,
              "dropped %lld aux %.9g, cpu %lld %.9g", (long long)ds.dropped, ds.aux_loss, (long long)hs.dropped,
              hs.aux_loss);
    expect_dev("y", y, hy, T * d, TOL_F32);
    expect_dev("dx", dx, hdx, T * d, TOL_F32);
    expect_dev("gradients", moe_layer_grads(dev), moe_layer_grads(host), n, TOL_F32);
    moe_layer_destroy(dev);
    moe_layer_destroy(host);
    free(got), free(hx), free(hdy), free(hy), free(hdx);
    gpu_end();
}

#endif /* MOE_HAVE_CUDA */
