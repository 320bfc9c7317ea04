/* test_model_grad.c: the whole model (engine/model.h) against the naive
 * double-precision reference in ref_model.h, on a tiny config: vocab 11,
 * hidden 8, ff 6, 2 layers, 4 query heads over 2 kv heads (GQA), head_dim 4,
 * 4 experts top-2, B=2, T=5, aux coef 0.1, z coef 0.01. Every matrix is the
 * model's own N(0, 0.02) init times WEIGHT_SCALE, so gradients are not tiny,
 * and every norm weight is 1 + U(-0.25, 0.25), so the norms' gradients
 * differ per channel.
 *
 * Forward: loss, ce, aux and z within 1e-5 relative of the reference,
 * per-position losses within 1e-5 * max(1, |ref|), and the model's router
 * choices equal the reference's (the cases are drawn with the top-(k+1)
 * scores >= MIN_GAP apart, far beyond fp32 noise).
 *
 * Backward: the model's analytic fp32 gradient of the total loss against
 * central differences (step FD_STEP) of the DOUBLE reference's loss at the
 * same parameters, for every tensor: all elements of a tensor of up to
 * FD_ALL_MAX elements, a seeded random FD_SUBSET of the larger ones. A
 * coordinate whose +-step changes any layer's selection or kept pairs is
 * skipped (the loss jumps there); at least 90% must be checked. Tolerance:
 * |analytic - fd| <= GRAD_ATOL * scale + GRAD_RTOL * |fd|, where scale is
 * the largest |fd| over all checked coordinates of the case (fp32 errors are
 * relative to the loss's sensitivity, not to each element). The FD error
 * itself is ~1e-10; the fp32 errors seen are below 3e-7 * scale, 30x under
 * GRAD_ATOL, while a gradient of the aux or the z-loss that is 1% off (the
 * smallest paths) already fails on several tensors.
 *
 * grad_scale: backward at 0.5 gives half the gradient at 1.0 (scaling by a
 * power of two is exact in binary floating point, the tolerance only covers
 * summation order); two backwards accumulate to twice one. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model.h"
#include "ref_model.h"

#define VOCAB 11
#define BATCH 2
#define SEQ 5
#define N_POS (BATCH * SEQ)
#define WEIGHT_SCALE 4.0f
#define FD_STEP 1e-5
#define FD_ALL_MAX 64
#define FD_SUBSET 30
#define MIN_GAP 1e-4
#define MIN_CHECKED_FRAC 0.9
#define GRAD_ATOL 1e-5
#define GRAD_RTOL 2e-4
#define LOSS_RTOL 1e-5

typedef struct grad_case {
    const char *name;
    moe_gate_kind gate;
    double capacity_factor;
    int64_t n_shared_experts;
    int ignored_targets; /* positions whose target is -1 */
    uint64_t seed;
    double seq_aux_coef; /* the sequence-wise balancing loss's coefficient */
    double logit_z_coef; /* the logits' z-loss coefficient */
    int64_t sliding_window;
    bool tied; /* tie_word_embeddings */
    /* A scaled RoPE, at theta 100, where head_dim 4's two pairs turn once
     * in 6 and in 63 positions: the scalings change the second within the
     * 5 positions. */
    moe_rope_scaling rope;
    /* q and k normalised (Qwen3-MoE's per head, OLMoE's across heads),
     * with their default norm_topk_prob false (moe_renormalize off). */
    moe_qk_norm_kind qk_norm;
    /* Qwen2-MoE's: one shared expert 5 wide (the routed ones are 6) behind
     * its sigmoid gate, q, k and v biases, norm_topk_prob false. */
    bool qwen2;
    /* Dense MLP layers among the MoE layers: bit l makes layer l one, of
     * dense_width (0: intermediate_size, 6); layers, the model's (0: 2). */
    uint64_t dense;
    int64_t dense_width;
    int64_t layers;
} grad_case;

static const grad_case CASES[] = {
    {"softmax_topk", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 0, 11, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"topk_softmax", MOE_GATE_TOPK_SOFTMAX, 0.0, 0, 0, 12, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"sigmoid", MOE_GATE_SIGMOID, 0.0, 0, 0, 13, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"capacity_1", MOE_GATE_SOFTMAX_TOPK, 1.0, 0, 0, 14, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"shared_experts", MOE_GATE_SOFTMAX_TOPK, 0.0, 1, 0, 15, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"ignored_targets", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 2, 16, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"sequence_wise_balancing", MOE_GATE_SIGMOID, 0.0, 0, 0, 17, 0.3, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"logit_z_loss", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 1, 18, 0.0, 0.05, 0, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"sliding_window", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 0, 19, 0.0, 0.0, 2, false, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"tied_embeddings", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 1, 20, 0.0, 0.0, 0, true, {0}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"rope_llama3", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 0, 21, 0.0, 0.0, 0, false,
     {.type = MOE_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
      .original_max_position_embeddings = 64}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"rope_yarn", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 0, 22, 0.0, 0.0, 0, false,
     {.type = MOE_ROPE_YARN, .factor = 4, .original_max_position_embeddings = 64, .beta_fast = 32, .beta_slow = 1,
      .truncate = true}, MOE_QK_NORM_NONE, false, 0, 0, 0},
    {"qwen3", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 1, 23, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_PER_HEAD, false, 0, 0, 0},
    {"olmoe", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 0, 24, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_ACROSS_HEADS, false, 0, 0, 0},
    {"qwen2", MOE_GATE_SOFTMAX_TOPK, 0.0, 1, 1, 25, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, true, 0, 0, 0},
    /* A dense layer between two MoE layers, 7 wide; and Qwen3-MoE's
     * mlp_only_layers [0] in the experts' width, with the MoE layer's
     * losses and a capacity that drops pairs. */
    {"dense_middle", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 1, 26, 0.3, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0x2, 7,
     3},
    {"dense_first_qwen3", MOE_GATE_SOFTMAX_TOPK, 1.0, 0, 0, 27, 0.0, 0.0, 0, false, {0}, MOE_QK_NORM_PER_HEAD, false,
     0x1, 0, 2},
    /* Every layer dense, 9 wide: a dense baseline, with the aux loss's
     * coefficient set, which has no MoE layer to average over. */
    {"dense_only", MOE_GATE_SOFTMAX_TOPK, 0.0, 0, 1, 28, 0.3, 0.0, 0, false, {0}, MOE_QK_NORM_NONE, false, 0x3, 9, 2},
};
#define N_CASES ((int)(sizeof CASES / sizeof *CASES))

typedef struct fx {
    const grad_case *gc;
    moe_model *m;
    ref_model ref;
    int32_t inputs[N_POS];
    int32_t targets[N_POS];
} fx;

static void fx_create(fx *f, const grad_case *gc) {
    memset(f, 0, sizeof *f);
    f->gc = gc;
    moe_model_config cfg = ref_tiny_config(VOCAB, gc->layers ? gc->layers : 2, 0);
    cfg.moe_dense_layers[0] = gc->dense;
    cfg.moe_dense_intermediate_size = gc->dense_width;
    cfg.moe_gate = gc->gate;
    cfg.moe_capacity_factor = gc->capacity_factor;
    cfg.moe_n_shared_experts = gc->n_shared_experts;
    cfg.moe_seq_aux_loss_coef = gc->seq_aux_coef;
    cfg.sliding_window = gc->sliding_window;
    cfg.tie_word_embeddings = gc->tied;
    cfg.moe_qk_norm = gc->qk_norm;
    cfg.moe_renormalize = gc->qk_norm == MOE_QK_NORM_NONE && !gc->qwen2;
    if (gc->qwen2) cfg.moe_shared_intermediate_size = 5, cfg.moe_shared_expert_gate = true, cfg.moe_qkv_bias = true;
    if (gc->rope.type != MOE_ROPE_DEFAULT) cfg.rope_theta = 100.0, cfg.rope_scaling = gc->rope;
    cr_assert(moe_model_create(&f->m, &cfg, BATCH, SEQ, gc->seed) == MOE_OK, "%s: moe_model_create: %s", gc->name,
              moe_last_error());
    ref_rng rng = {gc->seed};
    float *p = moe_model_params(f->m);
    for (int64_t i = 0; i < moe_model_tensor_count(f->m); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(f->m, i);
        for (int64_t j = 0; j < t->numel; j++)
            p[t->offset + j] = t->ndim == 1 ? (float)ref_uniform(&rng, 0.75, 1.25) : WEIGHT_SCALE * p[t->offset + j];
    }
    for (int64_t n = 0; n < N_POS; n++) {
        f->inputs[n] = (int32_t)(ref_next(&rng) % VOCAB);
        f->targets[n] = (int32_t)(ref_next(&rng) % VOCAB);
    }
    /* Spread over both sequences, and never all of them. */
    for (int i = 0; i < gc->ignored_targets; i++) f->targets[(3 + 4 * i) % N_POS] = -1;
    ref_model_init(&f->ref, f->m);
    moe_model_set_logit_z_loss(f->m, gc->logit_z_coef);
    f->ref.logit_z_coef = gc->logit_z_coef;
}

static void fx_destroy(fx *f) {
    ref_model_free(&f->ref);
    moe_model_destroy(f->m);
}

static double rel_err(double got, double ref) { return fabs(got - ref) / fmax(fabs(ref), 1e-30); }

/* The reference's routing must not sit within fp32 noise of a tie, or the
 * model may legitimately choose otherwise. */
static void expect_clear_routing(const fx *f) {
    for (int64_t l = 0; l < f->ref.cfg.num_hidden_layers; l++)
        cr_assert(f->ref.layers[l].dense || f->ref.layers[l].route.min_gap >= MIN_GAP,
                  "%s: layer %lld's top-(k+1) scores are %.3g apart, below %.1g: pick another seed", f->gc->name,
                  (long long)l, f->ref.layers[l].route.min_gap, MIN_GAP);
}

/* ------------------------------------------------------------- forward */

static void check_forward(const grad_case *gc) {
    fx f;
    fx_create(&f, gc);
    moe_model_stats st;
    cr_assert(moe_model_forward(f.m, f.inputs, f.targets, &st) == MOE_OK, "%s: forward: %s", gc->name,
              moe_last_error());
    ref_model_loss ref;
    double ref_losses[N_POS];
    ref_model_forward(&f.ref, &ref, ref_losses, f.inputs, f.targets);
    expect_clear_routing(&f);
    const struct {
        const char *what;
        double got, ref;
    } terms[] = {{"loss", st.loss, ref.loss}, {"ce_loss", st.ce_loss, ref.ce},
                 {"aux_loss", st.aux_loss, ref.aux}, {"z_loss", st.z_loss, ref.z},
                 {"seq_aux_loss", st.seq_aux_loss, ref.seq_aux}, {"logit_z_loss", st.logit_z_loss, ref.logit_z}};
    for (size_t i = 0; i < sizeof terms / sizeof *terms; i++)
        cr_expect(rel_err(terms[i].got, terms[i].ref) <= LOSS_RTOL, "%s: %s %.9g, reference %.9g (rel err %.3g > %.1g)",
                  gc->name, terms[i].what, terms[i].got, terms[i].ref, rel_err(terms[i].got, terms[i].ref), LOSS_RTOL);
    const float *losses = moe_model_last_losses(f.m);
    for (int64_t n = 0; n < N_POS; n++)
        cr_expect(fabs(losses[n] - ref_losses[n]) <= LOSS_RTOL * fmax(1.0, fabs(ref_losses[n])),
                  "%s: position %lld (target %d) loss %.9g, reference %.9g", gc->name, (long long)n, f.targets[n],
                  losses[n], ref_losses[n]);
    const int64_t k = f.ref.cfg.num_experts_per_tok;
    int64_t dropped = 0, moe_layers = 0;
    for (int64_t l = 0; l < f.ref.cfg.num_hidden_layers; l++) {
        const int32_t *got;
        if (f.ref.layers[l].dense) {
            cr_expect(moe_model_last_topk(f.m, l, &got) == MOE_ERR_INVALID_ARG, "%s: dense layer %lld routed",
                      gc->name, (long long)l);
            continue;
        }
        moe_layers++;
        cr_assert(moe_model_last_topk(f.m, l, &got) == MOE_OK, "%s", moe_last_error());
        const ref_out *ro = &f.ref.layers[l].route;
        for (int64_t i = 0; i < N_POS * k; i++)
            cr_expect(got[i] == ro->idx[i], "%s: layer %lld token %lld slot %lld chose expert %d, reference %d",
                      gc->name, (long long)l, (long long)(i / k), (long long)(i % k), got[i], ro->idx[i]);
        dropped += ro->dropped;
    }
    /* No MoE layer drops nothing. */
    const double ref_dropped_frac = moe_layers ? (double)dropped / (double)(moe_layers * N_POS * k) : 0.0;
    cr_expect(fabs(st.dropped_frac - ref_dropped_frac) < 1e-12, "%s: dropped fraction %.6g, reference %.6g", gc->name,
              st.dropped_frac, ref_dropped_frac);
    if (gc->capacity_factor > 0.0)
        cr_expect(dropped > 0, "%s: capacity factor %g dropped nothing, so the case tests no drops", gc->name,
                  gc->capacity_factor);
    fx_destroy(&f);
}

Test(model_forward, parity_with_double_reference) {
    for (int c = 0; c < N_CASES; c++) check_forward(&CASES[c]);
}

/* ------------------------------------------------------------ gradient */

/* Up to FD_SUBSET distinct indices below n, or all of them when n <=
 * FD_ALL_MAX; returns how many. */
static int64_t pick_coords(int64_t *idx, int64_t n, ref_rng *rng) {
    if (n <= FD_ALL_MAX) {
        for (int64_t i = 0; i < n; i++) idx[i] = i;
        return n;
    }
    int64_t *perm = ref_alloc((size_t)n * sizeof *perm);
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    for (int64_t i = 0; i < FD_SUBSET; i++) {
        int64_t j = i + (int64_t)(ref_next(rng) % (uint64_t)(n - i));
        int64_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
        idx[i] = perm[i];
    }
    free(perm);
    return FD_SUBSET;
}

typedef struct fd_point {
    int64_t tensor, index; /* element index inside the tensor */
    double analytic, fd;
} fd_point;

static void check_gradients(const grad_case *gc) {
    fx f;
    fx_create(&f, gc);
    moe_model_stats st;
    moe_model_zero_grad(f.m);
    cr_assert(moe_model_forward(f.m, f.inputs, f.targets, &st) == MOE_OK, "%s: forward: %s", gc->name,
              moe_last_error());
    cr_assert(moe_model_backward(f.m, 1.0f) == MOE_OK, "%s: backward: %s", gc->name,
              moe_last_error());
    const float *grads = moe_model_grads(f.m);
    ref_model *r = &f.ref;
    ref_model_forward(r, NULL, NULL, f.inputs, f.targets);
    expect_clear_routing(&f);
    ref_model_save_routing(r);

    const int64_t n_tensors = moe_model_tensor_count(f.m);
    fd_point *pts = ref_alloc((size_t)moe_model_param_count(f.m) * sizeof *pts);
    int64_t *idx = ref_alloc((size_t)(FD_ALL_MAX > FD_SUBSET ? FD_ALL_MAX : FD_SUBSET) * sizeof *idx);
    int64_t n_pts = 0, attempted = 0;
    ref_rng rng = {gc->seed ^ 0xF00Dull};
    int64_t *checked_per_tensor = ref_alloc((size_t)n_tensors * sizeof *checked_per_tensor);
    for (int64_t ti = 0; ti < n_tensors; ti++) {
        const moe_model_tensor *t = moe_model_tensor_at(f.m, ti);
        const int64_t n = pick_coords(idx, t->numel, &rng);
        for (int64_t j = 0; j < n; j++) {
            const int64_t off = t->offset + idx[j];
            const double keep = r->p[off];
            attempted++;
            r->p[off] = keep + FD_STEP;
            const double lp = ref_model_forward(r, NULL, NULL, f.inputs, f.targets);
            const int same_p = ref_model_same_routing(r);
            r->p[off] = keep - FD_STEP;
            const double lm = ref_model_forward(r, NULL, NULL, f.inputs, f.targets);
            const int same_m = ref_model_same_routing(r);
            r->p[off] = keep;
            if (!same_p || !same_m) continue;
            pts[n_pts++] = (fd_point){ti, idx[j], grads[off], (lp - lm) / (2.0 * FD_STEP)};
            checked_per_tensor[ti]++;
        }
    }
    cr_expect((double)n_pts >= MIN_CHECKED_FRAC * (double)attempted,
              "%s: only %lld of %lld coordinates kept the routing under +-%g", gc->name, (long long)n_pts,
              (long long)attempted, FD_STEP);
    for (int64_t ti = 0; ti < n_tensors; ti++)
        cr_expect(checked_per_tensor[ti] > 0, "%s: no coordinate of %s could be checked", gc->name,
                  moe_model_tensor_at(f.m, ti)->name);

    double scale = 0.0;
    for (int64_t i = 0; i < n_pts; i++) scale = fmax(scale, fabs(pts[i].fd));
    cr_assert(scale > 1e-3, "%s: the largest gradient is %.3g: the check would be vacuous", gc->name, scale);
    /* Worst per tensor, so a failure names every tensor that is off. */
    for (int64_t ti = 0; ti < n_tensors; ti++) {
        const fd_point *worst = NULL;
        double worst_ratio = -1.0;
        int64_t bad = 0, count = 0;
        for (int64_t i = 0; i < n_pts; i++) {
            if (pts[i].tensor != ti) continue;
            const double err = fabs(pts[i].analytic - pts[i].fd);
            const double tol = GRAD_ATOL * scale + GRAD_RTOL * fabs(pts[i].fd);
            const double ratio = isnan(err) ? INFINITY : err / tol;
            bad += !(err <= tol);
            count++;
            if (ratio > worst_ratio) {
                worst_ratio = ratio;
                worst = &pts[i];
            }
        }
        if (!worst) continue;
        cr_expect(bad == 0,
                  "%s: %s: %lld of %lld checked elements off; worst [%lld] analytic %.9g fd %.9g, |err| %.3g > tol "
                  "%.3g (scale %.3g)",
                  gc->name, moe_model_tensor_at(f.m, ti)->name, (long long)bad, (long long)count,
                  (long long)worst->index, worst->analytic, worst->fd, fabs(worst->analytic - worst->fd),
                  GRAD_ATOL * scale + GRAD_RTOL * fabs(worst->fd), scale);
    }
    free(checked_per_tensor);
    free(idx);
    free(pts);
    fx_destroy(&f);
}

Test(model_grad, softmax_topk) { check_gradients(&CASES[0]); }
Test(model_grad, topk_softmax) { check_gradients(&CASES[1]); }
Test(model_grad, sigmoid) { check_gradients(&CASES[2]); }
Test(model_grad, capacity_factor_1) { check_gradients(&CASES[3]); }
Test(model_grad, shared_experts) { check_gradients(&CASES[4]); }
Test(model_grad, ignored_targets) { check_gradients(&CASES[5]); }
Test(model_grad, sequence_wise_balancing) { check_gradients(&CASES[6]); }
Test(model_grad, logit_z_loss) { check_gradients(&CASES[7]); }
Test(model_grad, sliding_window) { check_gradients(&CASES[8]); }
Test(model_grad, tied_embeddings) { check_gradients(&CASES[9]); }
Test(model_grad, rope_llama3) { check_gradients(&CASES[10]); }
Test(model_grad, rope_yarn) { check_gradients(&CASES[11]); }
Test(model_grad, qwen3_qk_norm) { check_gradients(&CASES[12]); }
Test(model_grad, olmoe_qk_norm) { check_gradients(&CASES[13]); }
Test(model_grad, qwen2_shared_gate_and_qkv_bias) { check_gradients(&CASES[14]); }
Test(model_grad, dense_layer_between_moe_layers) { check_gradients(&CASES[15]); }
Test(model_grad, qwen3_dense_first_layer) { check_gradients(&CASES[16]); }
Test(model_grad, dense_layers_only) { check_gradients(&CASES[17]); }

/* ---------------------------------------------------------- grad_scale */

/* got vs want elementwise within tol = atol + rtol * |want|, naming the
 * worst tensor element. */
static void expect_grads(const moe_model *m, const float *got, const float *want, double atol, double rtol,
                         const char *what) {
    int64_t bad = 0, worst = -1;
    double worst_ratio = -1.0;
    const int64_t n = moe_model_param_count(m);
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - (double)want[i]), tol = atol + rtol * fabs((double)want[i]);
        const double ratio = isnan(err) ? INFINITY : err / tol;
        bad += !(err <= tol);
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst = i;
        }
    }
    const moe_model_tensor *t = NULL;
    for (int64_t ti = 0; ti < moe_model_tensor_count(m); ti++) {
        const moe_model_tensor *c = moe_model_tensor_at(m, ti);
        if (worst >= c->offset && worst < c->offset + c->numel) t = c;
    }
    cr_expect(bad == 0, "%s: %lld of %lld gradients off; worst %s[%lld] got %.9g want %.9g", what, (long long)bad,
              (long long)n, t ? t->name : "?", (long long)(t ? worst - t->offset : worst), got[worst], want[worst]);
}

Test(model_grad, grad_scale_and_accumulation) {
    fx f;
    fx_create(&f, &CASES[3]); /* capacity: every loss term and drops */
    const int64_t n = moe_model_param_count(f.m);
    float *g1 = ref_alloc((size_t)n * sizeof *g1), *want = ref_alloc((size_t)n * sizeof *want);
    moe_model_stats st;

    moe_model_zero_grad(f.m);
    cr_assert(moe_model_forward(f.m, f.inputs, f.targets, &st) == MOE_OK, "forward: %s", moe_last_error());
    cr_assert(moe_model_backward(f.m, 1.0f) == MOE_OK, "backward: %s", moe_last_error());
    memcpy(g1, moe_model_grads(f.m), (size_t)n * sizeof *g1);
    double gmax = 0.0;
    for (int64_t i = 0; i < n; i++) gmax = fmax(gmax, fabs(g1[i]));
    cr_assert(gmax > 1e-3, "the largest gradient is %.3g: the check would be vacuous", gmax);

    moe_model_zero_grad(f.m);
    cr_assert(moe_model_forward(f.m, f.inputs, f.targets, &st) == MOE_OK, "forward: %s", moe_last_error());
    cr_assert(moe_model_backward(f.m, 0.5f) == MOE_OK, "backward: %s", moe_last_error());
    for (int64_t i = 0; i < n; i++) want[i] = 0.5f * g1[i];
    expect_grads(f.m, moe_model_grads(f.m), want, 1e-7 * gmax, 1e-6, "grad_scale 0.5 vs half of 1.0");

    /* Backward spends the forward's logits, so each backward gets its own. */
    moe_model_zero_grad(f.m);
    for (int rep = 0; rep < 2; rep++) {
        cr_assert(moe_model_forward(f.m, f.inputs, f.targets, &st) == MOE_OK, "forward: %s", moe_last_error());
        cr_assert(moe_model_backward(f.m, 1.0f) == MOE_OK, "backward: %s", moe_last_error());
    }
    for (int64_t i = 0; i < n; i++) want[i] = 2.0f * g1[i];
    expect_grads(f.m, moe_model_grads(f.m), want, 1e-7 * gmax, 1e-5, "two backwards vs twice one");
    free(g1);
    free(want);
    fx_destroy(&f);
}

/* ------------------------------------------------------ backend memory */

/* Models a and b of cfg (made with par_a and par_b) trained side by side,
 * a step being forward, backward, the gradient norm and the bias update:
 * every loss, per-token loss, router choice, gradient and bias is the same
 * bits on both. */
static void expect_same_bits(const moe_model_config *cfg, const moe_model_parallel *par_a,
                             const moe_model_parallel *par_b, const int32_t *inputs, const int32_t *targets) {
    moe_model *models[2] = {NULL, NULL};
    const moe_model_parallel *pars[2] = {par_a, par_b};
    for (int i = 0; i < 2; i++)
        cr_assert(moe_model_create_parallel(&models[i], cfg, BATCH, SEQ, 21, pars[i]) == MOE_OK, "%s", moe_last_error());
    const int64_t n = moe_model_param_count(models[0]);
    cr_assert(moe_model_param_count(models[1]) == n);
    float *grads[2] = {ref_alloc((size_t)n * sizeof(float)), ref_alloc((size_t)n * sizeof(float))};
    float *bias[2] = {ref_alloc((size_t)cfg->num_local_experts * sizeof(float)),
                      ref_alloc((size_t)cfg->num_local_experts * sizeof(float))};
    for (int step = 0; step < 3; step++) {
        moe_model_stats st[2];
        double sumsq[2];
        for (int i = 0; i < 2; i++) {
            moe_model_zero_grad(models[i]);
            cr_assert(moe_model_forward(models[i], inputs, targets, &st[i]) == MOE_OK, "%s", moe_last_error());
            cr_assert(moe_model_backward(models[i], 1.0f) == MOE_OK, "%s", moe_last_error());
            cr_assert(moe_model_grad_sumsq(models[i], &sumsq[i]) == MOE_OK, "%s", moe_last_error());
            moe_model_update_router_bias(models[i]);
            const moe_ops *ops = moe_model_ops(models[i]);
            cr_assert(ops->download(grads[i], moe_model_grads(models[i]), (size_t)n * sizeof(float)) == MOE_OK);
        }
        cr_expect(st[1].loss == st[0].loss && st[1].aux_loss == st[0].aux_loss && st[1].z_loss == st[0].z_loss,
                  "step %d: loss %.9g aux %.9g z %.9g, want %.9g %.9g %.9g", step, st[1].loss, st[1].aux_loss,
                  st[1].z_loss, st[0].loss, st[0].aux_loss, st[0].z_loss);
        cr_expect(sumsq[1] == sumsq[0], "step %d: gradient sum of squares %.17g, want %.17g", step, sumsq[1], sumsq[0]);
        cr_expect(memcmp(moe_model_last_losses(models[1]), moe_model_last_losses(models[0]), N_POS * sizeof(float)) == 0,
                  "step %d: per-token losses differ", step);
        for (int64_t l = 0; l < cfg->num_hidden_layers; l++) {
            const int32_t *topk[2];
            if (moe_model_config_layer_is_dense(cfg, l)) continue;
            for (int i = 0; i < 2; i++)
                cr_assert(moe_model_last_topk(models[i], l, &topk[i]) == MOE_OK, "%s", moe_last_error());
            cr_expect(memcmp(topk[1], topk[0], (size_t)(N_POS * cfg->num_experts_per_tok) * sizeof(int32_t)) == 0,
                      "step %d: layer %lld's router choices differ", step, (long long)l);
        }
        int64_t i = 0;
        while (i < n && memcmp(&grads[1][i], &grads[0][i], sizeof(float)) == 0) i++;
        cr_expect(i == n, "step %d: gradient %lld is %.9g, want %.9g", step, (long long)i, i < n ? grads[1][i] : 0.0,
                  i < n ? grads[0][i] : 0.0);
    }
    /* The bias moved (so later steps' gating used it) and agrees. */
    for (int64_t l = 0; l < cfg->num_hidden_layers; l++) {
        if (moe_model_config_layer_is_dense(cfg, l)) continue;
        for (int i = 0; i < 2; i++)
            memcpy(bias[i], moe_model_router_bias(models[i], l), (size_t)cfg->num_local_experts * sizeof(float));
        int64_t e = 0;
        while (e < cfg->num_local_experts && bias[0][e] == 0.0f) e++;
        cr_expect(e < cfg->num_local_experts, "layer %lld's selection bias never moved", (long long)l);
        cr_expect(memcmp(bias[1], bias[0], (size_t)cfg->num_local_experts * sizeof(float)) == 0,
                  "layer %lld's bias differs", (long long)l);
    }
    for (int i = 0; i < 2; i++) {
        free(grads[i]);
        free(bias[i]);
        moe_model_destroy(models[i]);
    }
}

/* Capacity, shared experts and the selection bias on, so every path of
 * the MoE layer runs, and with jitter noise, which a recomputed forward
 * must draw again as its first pass did. */
static moe_model_config every_path_config(const fx *f, int64_t layers) {
    moe_model_config cfg = *moe_model_get_config(f->m);
    cfg.num_hidden_layers = layers;
    cfg.moe_n_shared_experts = 1;
    cfg.moe_bias_update_rate = 0.01;
    return cfg;
}

/* The whole model on memory the host cannot touch outside an op (the
 * strict backend): every host access it makes goes through upload and
 * download, as a device backend needs, and it computes the same bits as
 * on host memory, since the kernels are the same. */
Test(model_backend, same_bits_when_the_host_cannot_touch_its_memory) {
    fx f;
    fx_create(&f, &CASES[3]);
    moe_model_config cfg = every_path_config(&f, 2);
    expect_same_bits(&cfg, NULL, &(moe_model_parallel){.ops = moe_strict_ops()}, f.inputs, f.targets);
    cfg.moe_dense_layers[0] = 0x1; /* a dense layer's MLP keeps to the op table too */
    expect_same_bits(&cfg, NULL, &(moe_model_parallel){.ops = moe_strict_ops()}, f.inputs, f.targets);
    fx_destroy(&f);
}

/* Recomputation: each layer's backward runs its forward again from the
 * layer's input; the results are the same bits as keeping every
 * activation, on the host and on the strict backend (so the recomputation
 * keeps to the op table). */
Test(model_recompute, same_bits_as_keeping_the_activations) {
    fx f;
    fx_create(&f, &CASES[3]);
    moe_model_config cfg = every_path_config(&f, 3);
    cfg.router_jitter_noise = 0.05;
    expect_same_bits(&cfg, NULL, &(moe_model_parallel){.recompute = true}, f.inputs, f.targets);
    expect_same_bits(&cfg, NULL, &(moe_model_parallel){.recompute = true, .ops = moe_strict_ops()}, f.inputs,
                     f.targets);
    for (int qk = MOE_QK_NORM_PER_HEAD; qk <= MOE_QK_NORM_ACROSS_HEADS; qk++) { /* its arrays are recomputed too */
        cfg.moe_qk_norm = (moe_qk_norm_kind)qk;
        expect_same_bits(&cfg, NULL, &(moe_model_parallel){.recompute = true, .ops = moe_strict_ops()}, f.inputs,
                         f.targets);
    }
    /* A dense layer between MoE layers: its MLP's arrays are recomputed too. */
    cfg.moe_dense_layers[0] = 0x2;
    cfg.moe_dense_intermediate_size = 5;
    expect_same_bits(&cfg, NULL, &(moe_model_parallel){.recompute = true}, f.inputs, f.targets);
    fx_destroy(&f);
}

/* Activation bytes of a model of cfg with `layers` layers. */
static int64_t activation_bytes(moe_model_config cfg, int64_t layers, bool recompute) {
    cfg.num_hidden_layers = layers;
    moe_model *m = NULL;
    cr_assert(moe_model_create_parallel(&m, &cfg, BATCH, SEQ, 21, &(moe_model_parallel){.recompute = recompute}) ==
                  MOE_OK,
              "%s", moe_last_error());
    const int64_t bytes = moe_model_activation_bytes(m);
    moe_model_destroy(m);
    return bytes;
}

/* Under recomputation a layer adds only its input, [B*T, hidden] floats,
 * and its router choices, [B*T, k] ints, to the activations; keeping them,
 * a layer adds those and much more. */
Test(model_recompute, a_layer_adds_only_its_input) {
    fx f;
    fx_create(&f, &CASES[3]);
    const moe_model_config cfg = every_path_config(&f, 1);
    const int64_t input = N_POS * cfg.hidden_size * (int64_t)sizeof(float); /* a multiple of the 64-byte alignment */
    const int64_t choices = (N_POS * cfg.num_experts_per_tok * (int64_t)sizeof(int32_t) + 63) / 64 * 64;
    const int64_t kept = activation_bytes(cfg, 3, false) - activation_bytes(cfg, 1, false);
    const int64_t recomputed = activation_bytes(cfg, 3, true) - activation_bytes(cfg, 1, true);
    cr_expect(recomputed == 2 * (input + choices),
              "two more layers add %lld bytes under recomputation, want 2 x (%lld + %lld)", (long long)recomputed,
              (long long)input, (long long)choices);
    cr_expect(kept > 4 * recomputed, "two more layers add %lld bytes kept, only %lld recomputed", (long long)kept,
              (long long)recomputed);
    cr_expect(activation_bytes(cfg, 1, true) == activation_bytes(cfg, 1, false),
              "one layer: %lld bytes recomputed, %lld kept", (long long)activation_bytes(cfg, 1, true),
              (long long)activation_bytes(cfg, 1, false));
    fx_destroy(&f);
}

/* Waits of one training step (forward, zero_grad, backward, the gradient
 * norm, the bias update) that found queued work: on a device each drains
 * the stream. Every MoE feature that moves data between host and device is
 * on: jitter, capacity, shared experts and the selection bias. The second
 * step is measured, after the first has grown the workspaces. */
static int64_t drains_per_step(int64_t layers) {
    moe_model_config cfg = ref_tiny_config(VOCAB, layers, 0);
    cfg.moe_capacity_factor = 1.0;
    cfg.moe_n_shared_experts = 1;
    cfg.moe_bias_update_rate = 0.01;
    cfg.router_jitter_noise = 0.05;
    moe_model *m = NULL;
    const moe_model_parallel strict = {.ops = moe_strict_ops()};
    cr_assert(moe_model_create_parallel(&m, &cfg, BATCH, SEQ, 5, &strict) == MOE_OK, "%s", moe_last_error());
    int32_t inputs[N_POS], targets[N_POS];
    for (int i = 0; i < N_POS; i++) inputs[i] = i % VOCAB, targets[i] = (3 * i + 1) % VOCAB;
    int64_t drains = 0;
    for (int step = 0; step < 2; step++) {
        const int64_t before = moe_strict_drains();
        double sumsq;
        cr_assert(moe_model_forward(m, inputs, targets, NULL) == MOE_OK, "%s", moe_last_error());
        moe_model_zero_grad(m); /* as the trainer does: after the token uploads */
        cr_assert(moe_model_backward(m, 1.0f) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_model_grad_sumsq(m, &sumsq) == MOE_OK, "%s", moe_last_error());
        moe_model_update_router_bias(m);
        drains = moe_strict_drains() - before;
    }
    moe_model_destroy(m);
    return drains;
}

/* Layer indices outside the model are refused, not read. */
Test(model_backend, layer_indices_are_checked) {
    moe_model_config c;
    moe_model_config_default_small(&c, VOCAB);
    c.hidden_size = 16, c.intermediate_size = 16, c.num_hidden_layers = 2, c.head_dim = 4;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.num_local_experts = 4, c.num_experts_per_tok = 2;
    moe_model *m = NULL;
    cr_assert(moe_model_create(&m, &c, 1, 8, 3) == MOE_OK, "%s", moe_last_error());
    const int32_t *topk = NULL;
    for (int64_t l = -1; l <= 2; l += 3) {
        cr_expect(moe_model_last_topk(m, l, &topk) == MOE_ERR_INVALID_ARG, "last_topk of layer %lld", (long long)l);
        cr_expect(strstr(moe_last_error(), "layer") != NULL, "message: %s", moe_last_error());
        cr_expect(moe_model_router_bias(m, l) == NULL, "router bias of layer %lld", (long long)l);
    }
    moe_model_destroy(m);
}

/* Sizes whose parameters no host could hold are refused from the config,
 * before any of it is allocated, as a configuration that cannot run:
 * terabytes, on any machine this runs on. */
Test(model_backend, sizes_past_the_host_are_refused_up_front) {
    moe_model_config c = ref_tiny_config(VOCAB, 2, 0);
    c.vocab_size = INT32_MAX;
    c.hidden_size = 1024, c.head_dim = 256, c.intermediate_size = 64;
    moe_model *m = NULL;
    cr_expect_eq(moe_model_create(&m, &c, 1, 8, 3), MOE_ERR_CONFIG, "vocab_size 2^31 - 1: %s", moe_last_error());
    cr_expect(strstr(moe_last_error(), "vocab_size 2147483647") && strstr(moe_last_error(), "GB"), "message: %s",
              moe_last_error());
    c = ref_tiny_config(VOCAB, 65536, 0);
    c.hidden_size = 8192, c.head_dim = 256, c.intermediate_size = 64;
    cr_expect_eq(moe_model_create(&m, &c, 1, 8, 3), MOE_ERR_CONFIG, "65536 layers of width 8192: %s",
                 moe_last_error());
    cr_expect(strstr(moe_last_error(), "65536 layers"), "message: %s", moe_last_error());
    cr_expect_null(m);
}

/* The host waits for the device once per MoE layer and step (the routing
 * totals, from which it decides capacity and the exchange), plus a fixed
 * few per step: the losses, the end of backward, the gradient norm. */
Test(model_backend, the_host_waits_once_per_moe_layer) {
    const int64_t one = drains_per_step(1), three = drains_per_step(3);
    cr_expect(three - one == 2, "waits per layer: %lld, want 1 (%lld with 1 layer, %lld with 3)",
              (long long)(three - one) / 2, (long long)one, (long long)three);
    cr_expect(one == 4, "waits per step with 1 layer: %lld, want 4 (routing, losses, backward, norm)", (long long)one);
}

