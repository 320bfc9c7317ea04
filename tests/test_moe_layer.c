/* test_moe_layer.c: the whole MoE layer through the public API, against the
 * naive double-precision reference in ref_moe.h.
 *
 * Forward: y within |err| <= 2e-5 * max(1, max|y_ref|) + 1e-5 * |y_ref|;
 * routing counts exact; aux and z losses within 1e-5 relative.
 *
 * Backward: the layer's analytic gradients (fp32) against central finite
 * differences of L = sum(dy * y) + aux_coef * aux + z_coef * z evaluated by
 * the DOUBLE reference at the same parameter values (step 1e-5: truncation
 * and rounding error ~1e-10, far below fp32 error). A coordinate whose
 * perturbation changes the reference's selection or kept pairs is skipped
 * (the loss is not differentiable there); inputs are drawn so that the
 * top-(k+1) scores are >= 1e-3 apart, and at least 95% of coordinates must
 * be checked. Tolerance per tensor: |err| <= 5e-5 * max(max|fd|, 1e-3) +
 * 2e-4 * |fd| (fp32 errors seen are ~1e-7 of the tensor's largest value; a
 * 1% error in any term of the loss is caught). */
#include <criterion/criterion.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/moe_layer.h"
#include "kernels/ops.h"
#include "ref_moe.h"

#define MAX_TENSORS 256
#define FD_STEP 1e-5
#define MIN_GAP 1e-3

typedef struct fx_tensor {
    char name[64];
    int64_t rows, cols;
    double *ref; /* the tensor inside the reference's arrays */
} fx_tensor;

typedef struct fx {
    moe_layer_config cfg;
    moe_layer *layer;
    ref_layer ref;
    double bias[64];
    int64_t n_tensors;
    fx_tensor t[MAX_TENSORS];
} fx;

static const char *kind_name(moe_gate_kind k) {
    return k == MOE_GATE_SOFTMAX_TOPK   ? "softmax_topk"
           : k == MOE_GATE_TOPK_SOFTMAX ? "topk_softmax"
                                        : "sigmoid";
}

static void fx_add(fx *f, const char *name, int64_t rows, int64_t cols, double *ref) {
    cr_assert(f->n_tensors < MAX_TENSORS);
    fx_tensor *t = &f->t[f->n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows;
    t->cols = cols;
    t->ref = ref;
}

/* Copies the layer's parameters (and selection bias) into the reference. */
static void fx_sync_ref(fx *f) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        moe_tensor_view v;
        cr_assert(moe_layer_tensor_by_name(f->layer, f->t[i].name, &v) == MOE_OK,
                  "moe_layer_tensor_by_name(\"%s\"): %s", f->t[i].name, moe_last_error());
        cr_assert(v.rows == f->t[i].rows && v.cols == f->t[i].cols,
                  "%s is [%lld, %lld], want [%lld, %lld]", f->t[i].name, (long long)v.rows,
                  (long long)v.cols, (long long)f->t[i].rows, (long long)f->t[i].cols);
        for (int64_t j = 0; j < v.rows * v.cols; j++) f->t[i].ref[j] = v.param[j];
    }
    float *b = moe_layer_selection_bias(f->layer);
    f->ref.bias = NULL;
    if (f->cfg.bias_update_rate > 0) {
        cr_assert(b != NULL, "bias_update_rate > 0 but moe_layer_selection_bias is NULL");
        for (int64_t e = 0; e < f->cfg.n_experts; e++) f->bias[e] = b[e];
        f->ref.bias = f->bias;
    }
}

/* A layer with seeded random parameters and its reference twin. */
static void fx_create(fx *f, const moe_layer_config *cfg, uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->cfg = *cfg;
    cr_assert(moe_layer_create(&f->layer, cfg) == MOE_OK, "moe_layer_create: %s", moe_last_error());
    const int64_t d = cfg->d_model, ff = cfg->d_ff, E = cfg->n_experts,
                  S = cfg->n_shared_experts * (cfg->shared_d_ff ? cfg->shared_d_ff : cfg->d_ff);
    cr_assert(E <= 64);
    ref_layer *r = &f->ref;
    *r = (ref_layer){.d = d,
                     .ff = ff,
                     .E = E,
                     .k = cfg->top_k,
                     .shared_ff = S,
                     .n_groups = cfg->n_groups,
                     .top_groups = cfg->top_groups,
                     .gate = cfg->gate,
                     .renormalize = cfg->renormalize,
                     .routed_scale = cfg->routed_scale,
                     .capacity_factor = cfg->capacity_factor,
                     .aux_loss_coef = cfg->aux_loss_coef,
                     .z_loss_coef = cfg->z_loss_coef,
                     .seq_aux_loss_coef = cfg->seq_aux_loss_coef,
                     .seq_len = cfg->seq_aux_loss_coef > 0.0 ? cfg->seq_len : 0};
    r->wg = ref_alloc((size_t)(E * d) * sizeof(double));
    r->w1 = ref_alloc((size_t)(E * ff * d) * sizeof(double));
    r->w3 = ref_alloc((size_t)(E * ff * d) * sizeof(double));
    r->w2 = ref_alloc((size_t)(E * d * ff) * sizeof(double));
    r->sg = ref_alloc((size_t)(S * d) * sizeof(double));
    r->su = ref_alloc((size_t)(S * d) * sizeof(double));
    r->sd = ref_alloc((size_t)(d * S) * sizeof(double));
    if (cfg->shared_gate) r->sgate = ref_alloc((size_t)d * sizeof(double));
    char name[64];
    fx_add(f, "gate.weight", E, d, r->wg);
    for (int64_t e = 0; e < E; e++) {
        snprintf(name, sizeof name, "experts.%lld.w1.weight", (long long)e);
        fx_add(f, name, ff, d, r->w1 + e * ff * d);
        snprintf(name, sizeof name, "experts.%lld.w3.weight", (long long)e);
        fx_add(f, name, ff, d, r->w3 + e * ff * d);
        snprintf(name, sizeof name, "experts.%lld.w2.weight", (long long)e);
        fx_add(f, name, d, ff, r->w2 + e * d * ff);
    }
    if (S > 0) {
        fx_add(f, "shared_experts.gate_proj.weight", S, d, r->sg);
        fx_add(f, "shared_experts.up_proj.weight", S, d, r->su);
        fx_add(f, "shared_experts.down_proj.weight", d, S, r->sd);
        if (cfg->shared_gate) fx_add(f, "shared_expert_gate.weight", 1, d, r->sgate);
    }
    ref_rng rng = {seed};
    for (int64_t i = 0; i < f->n_tensors; i++) {
        moe_tensor_view v;
        cr_assert(moe_layer_tensor_by_name(f->layer, f->t[i].name, &v) == MOE_OK,
                  "moe_layer_tensor_by_name(\"%s\"): %s", f->t[i].name, moe_last_error());
        /* wide router weights spread the scores, so near-ties are rare */
        double a = i == 0 ? 1.0 : 0.5;
        ref_fill(v.param, v.rows * v.cols, &rng, -a, a);
    }
    fx_sync_ref(f);
}

static void fx_destroy(fx *f) {
    moe_layer_destroy(f->layer);
    free(f->ref.wg);
    free(f->ref.w1);
    free(f->ref.w3);
    free(f->ref.w2);
    free(f->ref.sg);
    free(f->ref.su);
    free(f->ref.sd);
    free(f->ref.sgate);
}

/* Draws x [T, d] until the reference's routing is MIN_GAP away from a tie
 * (and, if want_drops, drops some pairs). */
static void draw_x(float *x, const fx *f, int64_t T, int want_drops, uint64_t seed) {
    const int64_t d = f->cfg.d_model;
    double *y = ref_alloc((size_t)(T * d) * sizeof *y);
    ref_out o = ref_out_alloc(T, f->cfg.n_experts, f->cfg.top_k);
    for (int tries = 0; tries < 500; tries++) {
        ref_rng rng = {seed * 1000 + (uint64_t)tries};
        ref_fill(x, T * d, &rng, -1, 1);
        double *xd = ref_to_double(x, T * d);
        ref_layer_forward(y, &o, &f->ref, xd, T);
        free(xd);
        if (o.min_gap > MIN_GAP && (!want_drops || o.dropped > 0)) {
            free(y);
            ref_out_free(&o);
            return;
        }
    }
    cr_assert_fail("no input without near-ties%s found", want_drops ? " and with drops" : "");
}

/* Runs the layer forward and checks y and the stats against the reference. */
static void check_forward(fx *f, const float *x, int64_t T, const char *what) {
    const int64_t d = f->cfg.d_model, E = f->cfg.n_experts, k = f->cfg.top_k;
    float *y = ref_alloc((size_t)(T * d) * sizeof *y);
    double *want = ref_alloc((size_t)(T * d) * sizeof *want);
    double *xd = ref_to_double(x, T * d);
    int64_t tpe[64];
    moe_layer_stats st = {.tokens_per_expert = tpe};
    cr_assert(moe_layer_forward(f->layer, y, x, T, &st) == MOE_OK, "%s: forward: %s", what,
              moe_last_error());
    ref_out o = ref_out_alloc(T, E, k);
    ref_layer_forward(want, &o, &f->ref, xd, T);

    char label[256];
    snprintf(label, sizeof label, "%s: y", what);
    REF_EXPECT_CLOSE(label, y, want, T * d, 2e-5 * fmax(1.0, ref_max_abs(want, T * d)), 1e-5);
    for (int64_t e = 0; e < E; e++)
        cr_expect(tpe[e] == o.kept_count[e], "%s: tokens_per_expert[%lld] = %lld, want %lld", what,
                  (long long)e, (long long)tpe[e], (long long)o.kept_count[e]);
    cr_expect(st.dropped == o.dropped, "%s: dropped = %lld, want %lld", what, (long long)st.dropped,
              (long long)o.dropped);
    cr_expect(fabs(st.aux_loss - o.aux) <= 1e-5 * (1.0 + fabs(o.aux)),
              "%s: aux_loss = %.9g, want %.9g", what, st.aux_loss, o.aux);
    cr_expect(fabs(st.z_loss - o.z) <= 1e-5 * (1.0 + fabs(o.z)), "%s: z_loss = %.9g, want %.9g",
              what, st.z_loss, o.z);
    cr_expect(fabs(st.seq_aux_loss - o.seq_aux) <= 1e-5 * (1.0 + fabs(o.seq_aux)),
              "%s: seq_aux_loss = %.9g, want %.9g", what, st.seq_aux_loss, o.seq_aux);
    cr_expect(fabs(st.load_imbalance - o.imbalance) <= 1e-9 * o.imbalance,
              "%s: load_imbalance = %.9g, want %.9g", what, st.load_imbalance, o.imbalance);
    ref_out_free(&o);
    free(y);
    free(want);
    free(xd);
}

static moe_layer_config make_cfg(int64_t d, int64_t ff, int64_t E, int64_t k, moe_gate_kind g,
                                 int renorm, double cf, int64_t n_shared) {
    moe_layer_config c = MOE_LAYER_CONFIG_INIT;
    c.d_model = d;
    c.d_ff = ff;
    c.n_experts = E;
    c.top_k = k;
    c.gate = g;
    c.renormalize = renorm;
    c.capacity_factor = cf;
    c.n_shared_experts = n_shared;
    c.aux_loss_coef = 0.3;
    c.z_loss_coef = 0.1;
    return c;
}

/* -------------------------------------------------------------- forward */

Test(layer, forward_matches_reference) {
    uint64_t seed = 1;
    for (int kind = 0; kind < 3; kind++)
        for (int renorm = 0; renorm < 2; renorm++)
            for (int cap = 0; cap < 2; cap++)
                for (int64_t shared = 0; shared <= 2; shared += 2) {
                    /* cap: 0.75 * 9 * 2 / 5 = 2.7 -> 3 pairs per expert */
                    moe_layer_config cfg = make_cfg(13, 7, 5, 2, (moe_gate_kind)kind, renorm,
                                                    cap ? 0.75 : 0.0, shared);
                    fx f;
                    fx_create(&f, &cfg, seed);
                    const int64_t T = 9;
                    float x[9 * 13];
                    draw_x(x, &f, T, cap, seed);
                    char what[128];
                    snprintf(what, sizeof what, "%s renorm=%d cf=%g shared=%lld",
                             kind_name(cfg.gate), renorm, cfg.capacity_factor, (long long)shared);
                    check_forward(&f, x, T, what);
                    fx_destroy(&f);
                    seed++;
                }
}

/* T = 1, k = 1, k = E, E = 1: the edges of the routing. */
Test(layer, forward_edge_shapes) {
    static const int64_t shapes[][5] = {
        /* d, ff, E, k, T */
        {6, 5, 4, 1, 1}, {8, 3, 4, 4, 5}, {5, 9, 1, 1, 3}, {16, 8, 6, 2, 1}, {7, 6, 3, 3, 1},
    };
    uint64_t seed = 77;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int kind = 0; kind < 3; kind++) {
            moe_layer_config cfg = make_cfg(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3],
                                            (moe_gate_kind)kind, 1, 0.0, 1);
            fx f;
            fx_create(&f, &cfg, seed);
            const int64_t T = shapes[s][4];
            float *x = ref_alloc((size_t)(T * cfg.d_model) * sizeof *x);
            draw_x(x, &f, T, 0, seed);
            char what[128];
            snprintf(what, sizeof what, "%s d=%lld ff=%lld E=%lld k=%lld T=%lld",
                     kind_name(cfg.gate), (long long)cfg.d_model, (long long)cfg.d_ff,
                     (long long)cfg.n_experts, (long long)cfg.top_k, (long long)T);
            check_forward(&f, x, T, what);
            free(x);
            fx_destroy(&f);
            seed++;
        }
}

/* Routing every token to expert 0 (k = 1) by construction: with capacity
 * ceil(1.0 * 8 * 1 / 4) = 2, tokens 0 and 1 are kept, tokens 2..7 dropped
 * and their output is exactly zero (no shared expert). */
Test(layer, capacity_drops_the_late_tokens) {
    const int64_t d = 6, E = 4, T = 8;
    moe_layer_config cfg = make_cfg(d, 5, E, 1, MOE_GATE_SOFTMAX_TOPK, 1, 1.0, 0);
    fx f;
    fx_create(&f, &cfg, 5);
    moe_tensor_view g;
    cr_assert(moe_layer_tensor_by_name(f.layer, "gate.weight", &g) == MOE_OK);
    for (int64_t e = 0; e < E; e++)
        for (int64_t c = 0; c < d; c++) g.param[e * d + c] = e == 0 ? 1.0f : -1.0f;
    fx_sync_ref(&f);
    float x[8 * 6], y[8 * 6];
    ref_rng rng = {9};
    ref_fill(x, T * d, &rng, 0.1, 1.0); /* positive: expert 0 has the top logit */
    int64_t tpe[4];
    moe_layer_stats st = {.tokens_per_expert = tpe};
    cr_assert(moe_layer_forward(f.layer, y, x, T, &st) == MOE_OK, "%s", moe_last_error());
    cr_expect(tpe[0] == 2 && tpe[1] == 0 && tpe[2] == 0 && tpe[3] == 0,
              "tokens_per_expert = [%lld %lld %lld %lld], want [2 0 0 0]", (long long)tpe[0],
              (long long)tpe[1], (long long)tpe[2], (long long)tpe[3]);
    cr_expect(st.dropped == 6, "dropped = %lld, want 6", (long long)st.dropped);
    cr_expect(fabs(st.load_imbalance - 4.0) < 1e-12, "load_imbalance = %g, want 4",
              st.load_imbalance);
    for (int64_t t = 0; t < T; t++) {
        double norm = 0.0;
        for (int64_t c = 0; c < d; c++) norm += fabs(y[t * d + c]);
        if (t < 2)
            cr_expect(norm > 0.0, "token %lld was kept but its output is zero", (long long)t);
        else
            cr_expect(norm == 0.0, "token %lld was dropped but its output is %g (L1)", (long long)t,
                      norm);
    }
    check_forward(&f, x, T, "all on expert 0, cf=1");
    fx_destroy(&f);
}

/* stats may be NULL; a bias set through moe_layer_selection_bias steers the
 * selection but not the weights. */
Test(layer, forward_with_selection_bias_and_null_stats) {
    uint64_t seed = 300;
    for (int kind = 0; kind < 3; kind++) {
        moe_layer_config cfg = make_cfg(9, 6, 6, 2, (moe_gate_kind)kind, 1, 0.0, 0);
        cfg.bias_update_rate = 0.01;
        fx f;
        fx_create(&f, &cfg, seed);
        float *b = moe_layer_selection_bias(f.layer);
        cr_assert(b != NULL);
        for (int64_t e = 0; e < cfg.n_experts; e++)
            cr_expect(b[e] == 0.0f, "a new layer's selection bias[%lld] = %g, want 0", (long long)e,
                      b[e]);
        ref_rng rng = {seed};
        /* sigmoid/softmax scores live in (0, 1): a bias of that size matters */
        ref_fill(b, cfg.n_experts, &rng, -0.5, 0.5);
        fx_sync_ref(&f);
        const int64_t T = 7;
        float x[7 * 9], y[7 * 9];
        draw_x(x, &f, T, 0, seed);
        char what[64];
        snprintf(what, sizeof what, "%s with selection bias", kind_name(cfg.gate));
        check_forward(&f, x, T, what);
        cr_expect(moe_layer_forward(f.layer, y, x, T, NULL) == MOE_OK, "stats NULL: %s",
                  moe_last_error());
        fx_destroy(&f);
        seed++;
    }
    moe_layer_config cfg = make_cfg(9, 6, 6, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 0);
    moe_layer *l;
    cr_assert(moe_layer_create(&l, &cfg) == MOE_OK);
    cr_expect(moe_layer_selection_bias(l) == NULL, "bias_update_rate = 0 must give no bias");
    moe_layer_destroy(l);
}

/* ------------------------------------------------------------- backward */

typedef struct grad_case {
    int64_t E, k, T;
    moe_gate_kind kind;
    int renormalize;
    double cf;
    int64_t n_shared;
    int dy_zero;  /* only the balancing losses */
    int set_bias; /* a selection bias from moe_layer_selection_bias */
    int64_t n_groups, top_groups; /* group-limited routing when n_groups > 1 */
    double routed_scale;          /* 0: none */
    int64_t seq_len;              /* > 0: the sequence-wise balancing loss too, over sequences this long */
    int64_t shared_d_ff;          /* the shared experts' own width; 0: d_ff */
    int shared_gate;              /* Qwen2-MoE's sigmoid gate on them */
} grad_case;

static double ref_loss_at(const fx *f, const double *xd, int64_t T, const double *dy, double *y,
                          ref_out *o) {
    ref_layer_forward(y, o, &f->ref, xd, T);
    return ref_layer_loss(y, dy, o, &f->ref, T);
}

/* Fills want [n] with central differences of the reference loss in the
 * coordinates p[0..n); where the routing moves, copies got instead and
 * counts a skip. */
static int64_t fd_fill(double *want, double *p, const float *got, int64_t n, const fx *f,
                       const double *xd, int64_t T, const double *dy, const ref_out *base,
                       double *y, ref_out *o) {
    int64_t skipped = 0;
    for (int64_t i = 0; i < n; i++) {
        double save = p[i];
        p[i] = save + FD_STEP;
        double lp = ref_loss_at(f, xd, T, dy, y, o);
        int same = ref_same_routing(o, base, T, f->cfg.top_k);
        p[i] = save - FD_STEP;
        double lm = ref_loss_at(f, xd, T, dy, y, o);
        same = same && ref_same_routing(o, base, T, f->cfg.top_k);
        p[i] = save;
        if (same) {
            want[i] = (lp - lm) / (2 * FD_STEP);
        } else {
            want[i] = got[i];
            skipped++;
        }
    }
    return skipped;
}

static void check_grad(const grad_case *gc, uint64_t seed) {
    moe_layer_config cfg =
        make_cfg(7, 5, gc->E, gc->k, gc->kind, gc->renormalize, gc->cf, gc->n_shared);
    cfg.aux_loss_coef = 0.7;
    cfg.z_loss_coef = 0.2;
    if (gc->set_bias) cfg.bias_update_rate = 0.01;
    cfg.n_groups = gc->n_groups;
    cfg.top_groups = gc->top_groups;
    cfg.routed_scale = gc->routed_scale;
    cfg.seq_aux_loss_coef = gc->seq_len ? 0.9 : 0.0;
    cfg.seq_len = gc->seq_len;
    cfg.shared_d_ff = gc->shared_d_ff;
    cfg.shared_gate = gc->shared_gate;
    fx f;
    fx_create(&f, &cfg, seed);
    if (gc->set_bias) {
        ref_rng brng = {seed + 17};
        ref_fill(moe_layer_selection_bias(f.layer), cfg.n_experts, &brng, -0.3, 0.3);
        fx_sync_ref(&f);
    }
    const int64_t T = gc->T, d = cfg.d_model;
    float *x = ref_alloc((size_t)(T * d) * sizeof *x), *y = ref_alloc((size_t)(T * d) * sizeof *y);
    float *dy = ref_alloc((size_t)(T * d) * sizeof *dy),
          *dx = ref_alloc((size_t)(T * d) * sizeof *dx);
    draw_x(x, &f, T, gc->cf > 0, seed);
    ref_rng rng = {seed + 99};
    ref_fill(dy, T * d, &rng, gc->dy_zero ? 0 : -1, gc->dy_zero ? 0 : 1);
    for (int64_t i = 0; i < T * d; i++) dx[i] = 1e30f; /* written, not accumulated */

    cr_assert(moe_layer_zero_grad(f.layer) == MOE_OK);
    cr_assert(moe_layer_set_training(f.layer, 1) == MOE_OK);
    cr_assert(moe_layer_forward(f.layer, y, x, T, NULL) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_backward(f.layer, dx, dy, x) == MOE_OK, "%s", moe_last_error());

    double *xd = ref_to_double(x, T * d), *dyd = ref_to_double(dy, T * d);
    double *yr = ref_alloc((size_t)(T * d) * sizeof *yr);
    ref_out base = ref_out_alloc(T, cfg.n_experts, cfg.top_k);
    ref_out o = ref_out_alloc(T, cfg.n_experts, cfg.top_k);
    ref_layer_forward(yr, &base, &f.ref, xd, T);
    if (gc->cf > 0) cr_assert(base.dropped > 0, "the capacity case must drop pairs");

    char what[256];
    int n = snprintf(what, sizeof what,
                     "grad %s E=%lld k=%lld T=%lld renorm=%d cf=%g shared=%lld (ff %lld, gate %d) dy_zero=%d "
                     "bias=%d seq_len=%lld",
                     kind_name(gc->kind), (long long)gc->E, (long long)gc->k, (long long)T,
                     gc->renormalize, gc->cf, (long long)gc->n_shared, (long long)gc->shared_d_ff,
                     gc->shared_gate, gc->dy_zero, gc->set_bias, (long long)gc->seq_len);
    int64_t checked = 0, skipped = 0;
    for (int64_t i = 0; i <= f.n_tensors; i++) {
        /* i == n_tensors: the input x */
        int is_x = i == f.n_tensors;
        int64_t cnt = is_x ? T * d : f.t[i].rows * f.t[i].cols;
        const float *got = dx;
        double *p = xd;
        if (!is_x) {
            moe_tensor_view v;
            cr_assert(moe_layer_tensor_by_name(f.layer, f.t[i].name, &v) == MOE_OK);
            got = v.grad;
            p = f.t[i].ref;
        }
        double *want = ref_alloc((size_t)cnt * sizeof *want);
        int64_t s = fd_fill(want, p, got, cnt, &f, xd, T, dyd, &base, yr, &o);
        skipped += s;
        checked += cnt - s;
        snprintf(what + n, sizeof what - (size_t)n, " d%s", is_x ? "x" : f.t[i].name);
        REF_EXPECT_CLOSE(what, got, want, cnt, 5e-5 * fmax(ref_max_abs(want, cnt), 1e-3), 2e-4);
        free(want);
    }
    what[n] = '\0';
    cr_expect(skipped * 20 <= checked + skipped,
              "%s: %lld of %lld coordinates skipped for routing changes (want <= 5%%)", what,
              (long long)skipped, (long long)(checked + skipped));
    ref_out_free(&base);
    ref_out_free(&o);
    free(xd);
    free(dyd);
    free(yr);
    free(x);
    free(y);
    free(dy);
    free(dx);
    fx_destroy(&f);
}

Test(layer, backward_vs_finite_differences) {
    uint64_t seed = 1000;
    for (int kind = 0; kind < 3; kind++)
        for (int renorm = 0; renorm < (kind == MOE_GATE_SOFTMAX_TOPK ? 2 : 1); renorm++)
            for (int cap = 0; cap < 2; cap++)
                for (int64_t shared = 0; shared < 2; shared++) {
                    /* cap: ceil(0.75 * 8 * 2 / 5) = 3 of 3.2 pairs per expert on average */
                    grad_case gc = {.E = 5,
                                    .k = 2,
                                    .T = 8,
                                    .kind = (moe_gate_kind)kind,
                                    .renormalize = renorm,
                                    .cf = cap ? 0.75 : 0.0,
                                    .n_shared = shared};
                    check_grad(&gc, seed++);
                }
}

/* dy = 0 leaves only the aux and z losses: their gradient alone reaches the
 * router and x, and the experts get none. */
Test(layer, backward_balancing_losses_alone) {
    uint64_t seed = 2000;
    for (int kind = 0; kind < 3; kind++)
        for (int cap = 0; cap < 2; cap++) {
            grad_case gc = {.E = 5,
                            .k = 2,
                            .T = 8,
                            .kind = (moe_gate_kind)kind,
                            .renormalize = 1,
                            .cf = cap ? 0.75 : 0.0,
                            .n_shared = 1,
                            .dy_zero = 1};
            check_grad(&gc, seed++);
        }
}

Test(layer, backward_with_selection_bias) {
    uint64_t seed = 3000;
    for (int kind = 0; kind < 3; kind++) {
        grad_case gc = {.E = 5,
                        .k = 2,
                        .T = 8,
                        .kind = (moe_gate_kind)kind,
                        .renormalize = 1,
                        .cf = 0.75,
                        .set_bias = 1};
        check_grad(&gc, seed++);
    }
}

/* Group-limited routing: 6 experts in 3 groups keeping 2, with capacity
 * and a selection bias; the gradient follows the experts chosen. */
Test(layer, backward_with_expert_groups) {
    uint64_t seed = 3500;
    for (int kind = 0; kind < 3; kind++) {
        grad_case gc = {.E = 6,
                        .k = 2,
                        .T = 8,
                        .kind = (moe_gate_kind)kind,
                        .renormalize = 1,
                        .cf = 1.0,
                        .set_bias = kind == MOE_GATE_SIGMOID,
                        .n_groups = 3,
                        .top_groups = 2};
        check_grad(&gc, seed++);
    }
}

/* DeepSeek-V3's routed_scaling_factor: the routed weights times 2.5
 * beside a shared expert, with groups and a selection bias; and on
 * unnormalised weights, whose gradient goes to the probabilities. */
Test(layer, backward_with_routed_scale) {
    const grad_case cases[] = {
        {.E = 6, .k = 2, .T = 8, .kind = MOE_GATE_SIGMOID, .renormalize = 1, .n_shared = 1, .set_bias = 1,
         .n_groups = 3, .top_groups = 2, .routed_scale = 2.5},
        {.E = 5, .k = 2, .T = 8, .kind = MOE_GATE_SOFTMAX_TOPK, .renormalize = 0, .cf = 0.75, .routed_scale = 2.5},
    };
    uint64_t seed = 3700;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_grad(&cases[i], seed++);
}

/* Qwen2-MoE's shared expert: its own width, behind a sigmoid gate of the
 * input, with each gate kind, capacity and unnormalised weights; and two
 * shared experts of their own width. */
Test(layer, backward_with_gated_shared_expert) {
    const grad_case cases[] = {
        {.E = 5, .k = 2, .T = 8, .kind = MOE_GATE_SOFTMAX_TOPK, .renormalize = 0, .n_shared = 1, .shared_d_ff = 3,
         .shared_gate = 1},
        {.E = 4, .k = 2, .T = 9, .kind = MOE_GATE_SIGMOID, .renormalize = 1, .cf = 0.75, .n_shared = 1,
         .shared_d_ff = 8, .shared_gate = 1},
        {.E = 4, .k = 1, .T = 6, .kind = MOE_GATE_TOPK_SOFTMAX, .renormalize = 1, .n_shared = 1, .shared_gate = 1},
        {.E = 4, .k = 2, .T = 6, .kind = MOE_GATE_SOFTMAX_TOPK, .renormalize = 1, .n_shared = 2, .shared_d_ff = 3},
    };
    uint64_t seed = 3900;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_grad(&cases[i], seed++);
}

/* DeepSeek-V3's sequence-wise balancing loss beside the batch-wide one:
 * three sequences of four tokens, every gate kind, alone (dy = 0) and with
 * the experts' gradient, with capacity, groups and a routed scale; and
 * sequences of one token. */
Test(layer, backward_with_sequence_wise_balancing) {
    const grad_case cases[] = {
        {.E = 5, .k = 2, .T = 12, .kind = MOE_GATE_SOFTMAX_TOPK, .renormalize = 1, .dy_zero = 1, .seq_len = 4},
        {.E = 5, .k = 2, .T = 12, .kind = MOE_GATE_TOPK_SOFTMAX, .renormalize = 1, .dy_zero = 1, .seq_len = 4},
        {.E = 5, .k = 2, .T = 12, .kind = MOE_GATE_SIGMOID, .renormalize = 1, .dy_zero = 1, .seq_len = 4},
        {.E = 5, .k = 2, .T = 12, .kind = MOE_GATE_SOFTMAX_TOPK, .renormalize = 0, .cf = 0.75, .n_shared = 1,
         .seq_len = 4},
        {.E = 6, .k = 2, .T = 12, .kind = MOE_GATE_SIGMOID, .renormalize = 1, .set_bias = 1, .n_groups = 3,
         .top_groups = 2, .routed_scale = 2.5, .seq_len = 6},
        {.E = 5, .k = 2, .T = 8, .kind = MOE_GATE_SOFTMAX_TOPK, .renormalize = 1, .seq_len = 1},
    };
    uint64_t seed = 3800;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_grad(&cases[i], seed++);
}

/* The loss's value per sequence against the reference's; only training
 * forwards take it, which need whole sequences; an evaluation takes any T
 * and reports 0; a coefficient without a length is refused. */
Test(layer, sequence_wise_balancing_loss) {
    moe_layer_config cfg = make_cfg(8, 6, 6, 2, MOE_GATE_SIGMOID, 1, 0.0, 0);
    cfg.seq_aux_loss_coef = 0.5;
    cfg.seq_len = 0;
    cr_expect_eq(moe_layer_config_validate(&cfg), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "seq_len") != NULL, "%s", moe_last_error());
    cfg.seq_len = 5;
    fx f;
    fx_create(&f, &cfg, 41);
    const int64_t T = 20, d = cfg.d_model;
    float *x = ref_alloc((size_t)(T * d) * sizeof *x), *y = ref_alloc((size_t)(T * d) * sizeof *y);
    draw_x(x, &f, T, 0, 41);
    check_forward(&f, x, T, "4 sequences of 5");
    moe_layer_stats st = {0};
    cr_expect_eq(moe_layer_forward(f.layer, y, x, T - 1, &st), MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "T=19 is not a multiple of seq_len=5") != NULL, "%s", moe_last_error());
    /* A failed forward leaves none for backward, not the one before it,
     * whatever it failed on. */
    cr_expect_eq(moe_layer_backward(f.layer, y, x, x), MOE_ERR_STATE);
    check_forward(&f, x, T, "again");
    cr_expect_eq(moe_layer_forward(f.layer, y, NULL, T, &st), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_layer_backward(f.layer, y, x, x), MOE_ERR_STATE);
    cr_assert(moe_layer_set_training(f.layer, 0) == MOE_OK);
    cr_expect_eq(moe_layer_forward(f.layer, y, x, T - 1, &st), MOE_OK, "%s", moe_last_error());
    cr_expect(st.seq_aux_loss == 0.0 && st.aux_loss > 0.0, "evaluation: seq_aux_loss %g, aux_loss %g",
              st.seq_aux_loss, st.aux_loss);
    free(x);
    free(y);
    fx_destroy(&f);
}

/* A token's experts come from at most top_groups groups: with the groups
 * on EP ranks, its rows reach at most that many ranks. Without the limit
 * the same tokens spread wider, so the check has something to catch. */
Test(layer, expert_groups_bound_the_groups_a_token_reaches) {
    const int64_t T = 64, E = 16, k = 4, groups = 4, per = E / groups;
    int64_t widest[2] = {0, 0};
    for (int limited = 0; limited < 2; limited++) {
        moe_layer_config cfg = make_cfg(12, 6, E, k, MOE_GATE_SIGMOID, 1, 0.0, 0);
        cfg.n_groups = limited ? groups : 0;
        cfg.top_groups = limited ? 2 : 0;
        fx f;
        fx_create(&f, &cfg, 77);
        float x[64 * 12], y[64 * 12];
        draw_x(x, &f, T, 0, 77);
        if (limited) check_forward(&f, x, T, "4 groups keeping 2");
        cr_assert(moe_layer_forward(f.layer, y, x, T, NULL) == MOE_OK, "%s", moe_last_error());
        const int32_t *topk;
        cr_assert(moe_layer_last_topk(f.layer, &topk) == MOE_OK, "%s", moe_last_error());
        for (int64_t t = 0; t < T; t++) {
            unsigned seen = 0;
            for (int64_t j = 0; j < k; j++) seen |= 1u << (topk[t * k + j] / per);
            const int64_t n = __builtin_popcount(seen);
            if (n > widest[limited]) widest[limited] = n;
        }
        fx_destroy(&f);
    }
    cr_expect(widest[1] <= 2, "a token's experts span %lld groups under a limit of 2", (long long)widest[1]);
    cr_expect(widest[0] > 2, "without the limit no token spans more than %lld of 4 groups: the check is empty",
              (long long)widest[0]);
}

/* k = E (every expert for every token; cf 0.5 keeps 2 of 3 per expert),
 * k = 1 at T = 1, and E = 1. */
Test(layer, backward_edge_shapes) {
    uint64_t seed = 4000;
    for (moe_gate_kind kind = 0; kind < 3; kind++) {
        const grad_case cases[] = {
            {.E = 4, .k = 4, .T = 3, .kind = kind, .renormalize = 1, .n_shared = 1},
            {.E = 4, .k = 4, .T = 3, .kind = kind, .renormalize = 0, .cf = 0.5},
            {.E = 4, .k = 1, .T = 1, .kind = kind, .renormalize = 1, .n_shared = 1},
            {.E = 1, .k = 1, .T = 4, .kind = kind, .renormalize = 1},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_grad(&cases[i], seed++);
    }
}

/* Two forward+backward passes accumulate twice the gradient. */
Test(layer, gradients_accumulate) {
    moe_layer_config cfg = make_cfg(8, 6, 4, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 1);
    fx f;
    fx_create(&f, &cfg, 42);
    const int64_t T = 6, d = 8;
    float x[6 * 8], y[6 * 8], dy[6 * 8], dx[6 * 8];
    draw_x(x, &f, T, 0, 42);
    ref_rng rng = {43};
    ref_fill(dy, T * d, &rng, -1, 1);
    const int64_t np = moe_layer_param_count(f.layer);
    cr_assert(moe_layer_zero_grad(f.layer) == MOE_OK);
    for (int64_t i = 0; i < np; i++)
        cr_assert(moe_layer_grads(f.layer)[i] == 0.0f, "zero_grad left grad[%lld] = %g",
                  (long long)i, moe_layer_grads(f.layer)[i]);
    cr_assert(moe_layer_forward(f.layer, y, x, T, NULL) == MOE_OK);
    cr_assert(moe_layer_backward(f.layer, dx, dy, x) == MOE_OK);
    double *once = ref_to_double(moe_layer_grads(f.layer), np);
    cr_assert(moe_layer_forward(f.layer, y, x, T, NULL) == MOE_OK);
    cr_assert(moe_layer_backward(f.layer, dx, dy, x) == MOE_OK);
    for (int64_t i = 0; i < np; i++) once[i] *= 2.0;
    REF_EXPECT_CLOSE("grads after two backward passes", moe_layer_grads(f.layer), once, np,
                     1e-6 * fmax(1.0, ref_max_abs(once, np)), 1e-6);
    free(once);
    fx_destroy(&f);
}

/* -------------------------------------------------- tensors and layout */

Test(layer, tensor_views_tile_params_and_grads) {
    for (int64_t shared = 0; shared <= 2; shared++) {
        moe_layer_config cfg = make_cfg(10, 6, 5, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, shared);
        moe_layer *l;
        cr_assert(moe_layer_create(&l, &cfg) == MOE_OK, "%s", moe_last_error());
        const int64_t n = moe_layer_tensor_count(l);
        cr_expect(n == 1 + 3 * cfg.n_experts + (shared ? 3 : 0), "tensor count %lld", (long long)n);
        float *params = moe_layer_params(l), *grads = moe_layer_grads(l);
        cr_assert(params != NULL && grads != NULL);
        int64_t off = 0;
        for (int64_t i = 0; i < n; i++) {
            moe_tensor_view v, w;
            cr_assert(moe_layer_tensor(l, i, &v) == MOE_OK, "%s", moe_last_error());
            cr_expect(v.param == params + off && v.grad == grads + off,
                      "tensor %lld (%s) is not at offset %lld of params/grads", (long long)i,
                      v.name, (long long)off);
            cr_assert(moe_layer_tensor_by_name(l, v.name, &w) == MOE_OK, "by name \"%s\": %s",
                      v.name, moe_last_error());
            cr_expect(w.param == v.param && w.rows == v.rows && w.cols == v.cols,
                      "by name \"%s\" differs from by index", v.name);
            off += v.rows * v.cols;
        }
        cr_expect(off == moe_layer_param_count(l), "tensors hold %lld values, param_count %lld",
                  (long long)off, (long long)moe_layer_param_count(l));
        const int64_t S = shared * cfg.d_ff;
        moe_tensor_view v;
        cr_expect(moe_layer_tensor_by_name(l, "shared_experts.down_proj.weight", &v) ==
                      (shared ? MOE_OK : MOE_ERR_INVALID_ARG),
                  "shared_experts.down_proj.weight with n_shared=%lld", (long long)shared);
        if (shared) cr_expect(v.rows == cfg.d_model && v.cols == S);
        moe_layer_destroy(l);
    }
}

/* ------------------------------------------------------- determinism */

static void run_step(float *y, float *dx, float *grads, moe_layer *l, const float *x,
                     const float *dy, int64_t T) {
    cr_assert(moe_layer_zero_grad(l) == MOE_OK);
    cr_assert(moe_layer_forward(l, y, x, T, NULL) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_backward(l, dx, dy, x) == MOE_OK, "%s", moe_last_error());
    memcpy(grads, moe_layer_grads(l), (size_t)moe_layer_param_count(l) * sizeof *grads);
}

static int64_t first_diff(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof *a) != 0) return i;
    return -1;
}

/* Large enough that every parallel loop splits across threads. Across runs
 * the layer is bitwise; across thread counts its own loops and the experts
 * are by construction (kernels/cpu/experts.c), while the router's three
 * GEMMs are multi-threaded OpenBLAS calls, which at some shapes (d or T of
 * 1000, say) sum differently with another thread count, as dense.h says of
 * the matmuls; at this one they agree. */
Test(layer, bitwise_deterministic_across_runs_and_threads) {
    moe_layer_config cfg = make_cfg(48, 40, 8, 2, MOE_GATE_SOFTMAX_TOPK, 1, 1.25, 1);
    fx f;
    fx_create(&f, &cfg, 11);
    const int64_t T = 96, d = cfg.d_model, np = moe_layer_param_count(f.layer);
    float *x = ref_alloc((size_t)(T * d) * sizeof *x),
          *dy = ref_alloc((size_t)(T * d) * sizeof *dy);
    ref_rng rng = {12};
    ref_fill(x, T * d, &rng, -1, 1);
    ref_fill(dy, T * d, &rng, -1, 1);
    float *y[3], *dx[3], *g[3];
    for (int r = 0; r < 3; r++) {
        y[r] = ref_alloc((size_t)(T * d) * sizeof(float));
        dx[r] = ref_alloc((size_t)(T * d) * sizeof(float));
        g[r] = ref_alloc((size_t)np * sizeof(float));
    }
    omp_set_num_threads(2);
    run_step(y[0], dx[0], g[0], f.layer, x, dy, T);
    run_step(y[1], dx[1], g[1], f.layer, x, dy, T);
    omp_set_num_threads(1);
    run_step(y[2], dx[2], g[2], f.layer, x, dy, T);
    omp_set_num_threads(2);
    static const char *runs[] = {"", "second run", "one thread"};
    for (int r = 1; r < 3; r++) {
        int64_t i;
        cr_expect((i = first_diff(y[0], y[r], T * d)) < 0, "%s: y[%lld] %.9g vs %.9g", runs[r],
                  (long long)i, i < 0 ? 0 : y[0][i], i < 0 ? 0 : y[r][i]);
        cr_expect((i = first_diff(dx[0], dx[r], T * d)) < 0, "%s: dx[%lld] %.9g vs %.9g", runs[r],
                  (long long)i, i < 0 ? 0 : dx[0][i], i < 0 ? 0 : dx[r][i]);
        cr_expect((i = first_diff(g[0], g[r], np)) < 0, "%s: grad[%lld] %.9g vs %.9g", runs[r],
                  (long long)i, i < 0 ? 0 : g[0][i], i < 0 ? 0 : g[r][i]);
    }
    for (int r = 0; r < 3; r++) {
        free(y[r]);
        free(dx[r]);
        free(g[r]);
    }
    free(x);
    free(dy);
    fx_destroy(&f);
}

/* The workspace sized by the largest T serves smaller and equal T again;
 * a backward after the smaller forward matches a fresh layer's. */
Test(layer, repeated_forward_at_smaller_and_same_T) {
    moe_layer_config cfg = make_cfg(11, 7, 5, 2, MOE_GATE_SIGMOID, 1, 1.0, 1);
    fx f;
    fx_create(&f, &cfg, 21);
    const int64_t T = 9, Ts = 4, d = cfg.d_model;
    float x[9 * 11], y[9 * 11], dy[9 * 11], dx[9 * 11], dx2[9 * 11];
    draw_x(x, &f, T, 0, 21);
    check_forward(&f, x, T, "T=9");
    check_forward(&f, x, Ts, "T=4 after T=9");
    check_forward(&f, x + 2 * d, Ts, "T=4 (other rows)");
    ref_rng rng = {22};
    ref_fill(dy, T * d, &rng, -1, 1);
    cr_assert(moe_layer_zero_grad(f.layer) == MOE_OK);
    /* The forward sized the backward's scratch: the first backward takes
     * nothing more (on a GPU, growing it would wait for the device). */
    const int64_t workspace = moe_layer_workspace_bytes(f.layer);
    cr_assert(moe_layer_backward(f.layer, dx, dy, x + 2 * d) == MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_layer_workspace_bytes(f.layer), workspace, "the first backward grew the workspace");

    moe_layer *fresh;
    cr_assert(moe_layer_create(&fresh, &cfg) == MOE_OK);
    const int64_t np = moe_layer_param_count(fresh);
    memcpy(moe_layer_params(fresh), moe_layer_params(f.layer), (size_t)np * sizeof(float));
    cr_assert(moe_layer_zero_grad(fresh) == MOE_OK);
    cr_assert(moe_layer_forward(fresh, y, x + 2 * d, Ts, NULL) == MOE_OK);
    cr_assert(moe_layer_backward(fresh, dx2, dy, x + 2 * d) == MOE_OK);
    double *want_dx = ref_to_double(dx2, Ts * d),
           *want_g = ref_to_double(moe_layer_grads(fresh), np);
    REF_EXPECT_CLOSE("dx at T=4 after T=9 vs fresh layer", dx, want_dx, Ts * d,
                     1e-6 * fmax(1.0, ref_max_abs(want_dx, Ts * d)), 1e-6);
    REF_EXPECT_CLOSE("grads at T=4 after T=9 vs fresh layer", moe_layer_grads(f.layer), want_g, np,
                     1e-6 * fmax(1.0, ref_max_abs(want_g, np)), 1e-6);
    check_forward(&f, x, T, "T=9 again");
    free(want_dx);
    free(want_g);
    moe_layer_destroy(fresh);
    fx_destroy(&f);
}

/* A layer made without gradients runs forwards, the same as one with
 * them, and refuses a backward; gradients given in part are refused. */
Test(layer, a_layer_without_gradients_runs_forwards_only) {
    moe_layer_config cfg = make_cfg(8, 6, 4, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 1);
    fx f;
    fx_create(&f, &cfg, 8);
    const int64_t n = moe_layer_param_count(f.layer), T = 5, d = cfg.d_model, E = cfg.n_experts;
    float *params = ref_alloc((size_t)n * sizeof *params), *grads = ref_alloc((size_t)n * sizeof *grads);
    memcpy(params, moe_layer_params(f.layer), (size_t)n * sizeof *params);
    const int64_t shared = n - moe_layer_shared_params(&cfg);
    moe_layer_memory mem = {.router = params, .experts = params + E * d, .shared = params + shared};
    moe_layer *bare = NULL;
    cr_assert_eq(moe_layer_create_in(&bare, &cfg, &mem, NULL, NULL), MOE_OK, "%s", moe_last_error());
    float x[5 * 8], y[5 * 8], want[5 * 8], dy[5 * 8] = {0}, dx[5 * 8];
    draw_x(x, &f, T, 0, 8);
    cr_assert_eq(moe_layer_forward(f.layer, want, x, T, NULL), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_layer_forward(bare, y, x, T, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect(first_diff(y, want, T * d) < 0, "a layer without gradients computed another forward");
    cr_expect_eq(moe_layer_backward(bare, dx, dy, x), MOE_ERR_STATE, "a backward without gradients");
    moe_layer_destroy(bare);
    mem.experts_grad = grads + E * d;
    cr_expect_eq(moe_layer_create_in(&bare, &cfg, &mem, NULL, NULL), MOE_ERR_INVALID_ARG, "gradients in part");
    free(params);
    free(grads);
    fx_destroy(&f);
}

/* ----------------------------------------------------- shared workspace */

/* One layer's step, on its own workspace or a shared one. */
typedef struct step_out {
    float *y, *dx, *g;
} step_out;

static step_out step_out_alloc(int64_t T, int64_t d, int64_t np) {
    return (step_out){ref_alloc((size_t)(T * d) * sizeof(float)), ref_alloc((size_t)(T * d) * sizeof(float)),
                      ref_alloc((size_t)np * sizeof(float))};
}

static void step_out_free(step_out *o) {
    free(o->y);
    free(o->dx);
    free(o->g);
}

static void expect_same_step(const step_out *got, const step_out *want, int64_t T, int64_t d, int64_t np,
                             const char *what) {
    int64_t i;
    cr_expect((i = first_diff(got->y, want->y, T * d)) < 0, "%s: y[%lld] differs", what, (long long)i);
    cr_expect((i = first_diff(got->dx, want->dx, T * d)) < 0, "%s: dx[%lld] differs", what, (long long)i);
    cr_expect((i = first_diff(got->g, want->g, np)) < 0, "%s: grad[%lld] differs", what, (long long)i);
}

/* Two layers of one shape (a model's) share their backward scratch, and
 * with activations their forward's too: each computes the bits it computes
 * alone, provided (with activations) its forward is the last one before its
 * backward; a backward after the other layer's forward is refused, not
 * computed from that forward's activations. The second layer's larger T
 * grows the shared memory under the first. Jitter, capacity and shared
 * experts on, so that every array is in use. */
Test(layer, shared_workspace_computes_what_its_own_does) {
    moe_layer_config cfg = make_cfg(12, 10, 6, 2, MOE_GATE_SOFTMAX_TOPK, 1, 1.25, 1);
    cfg.jitter_eps = 0.1;
    const int64_t T[2] = {9, 14}, d = cfg.d_model;
    moe_layer *alone[2], *shared[2];
    for (int i = 0; i < 2; i++) {
        moe_layer_config c = cfg;
        c.seed = 40 + (uint64_t)i;
        cr_assert(moe_layer_create(&alone[i], &c) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_create(&shared[i], &c) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_init_params(alone[i], 0.3f, 7, (uint64_t)i) == MOE_OK);
        cr_assert(moe_layer_init_params(shared[i], 0.3f, 7, (uint64_t)i) == MOE_OK);
    }
    const int64_t np = moe_layer_param_count(alone[0]);
    float *x = ref_alloc((size_t)(T[1] * d) * sizeof *x), *dy = ref_alloc((size_t)(T[1] * d) * sizeof *dy);
    ref_rng rng = {61};
    ref_fill(x, T[1] * d, &rng, -1, 1);
    ref_fill(dy, T[1] * d, &rng, -1, 1);
    step_out want[2], got[2];
    for (int i = 0; i < 2; i++) {
        want[i] = step_out_alloc(T[1], d, np);
        got[i] = step_out_alloc(T[1], d, np);
        run_step(want[i].y, want[i].dx, want[i].g, alone[i], x, dy, T[i]);
    }
    for (int activations = 0; activations < 2; activations++) {
        cr_assert(moe_layer_share_workspace(shared[1], shared[0], activations) == MOE_OK, "%s", moe_last_error());
        for (int i = 0; i < 2; i++) {
            moe_layer_set_jitter_counter(shared[i], 0);
            cr_assert(moe_layer_zero_grad(shared[i]) == MOE_OK);
        }
        /* Both forwards, then both backwards: what a model keeping its
         * activations does. */
        for (int i = 0; i < 2; i++)
            cr_assert(moe_layer_forward(shared[i], got[i].y, x, T[i], NULL) == MOE_OK, "%s", moe_last_error());
        moe_status st = moe_layer_backward(shared[0], got[0].dx, dy, x);
        if (activations) {
            cr_expect(st == MOE_ERR_STATE && strstr(moe_last_error(), "overwritten"),
                      "a backward after another layer's forward on shared activations: %s: %s",
                      moe_status_string(st), moe_last_error());
            /* What a model recomputing its layers does: each forward
             * again, with its first pass's jitter, just before its
             * backward. */
            for (int i = 0; i < 2; i++) {
                moe_layer_set_jitter_counter(shared[i], 0);
                moe_layer_set_replay(shared[i], true);
                cr_assert(moe_layer_forward(shared[i], got[i].y, x, T[i], NULL) == MOE_OK, "%s", moe_last_error());
                moe_layer_set_replay(shared[i], false);
                cr_assert(moe_layer_backward(shared[i], got[i].dx, dy, x) == MOE_OK, "%s", moe_last_error());
            }
        } else {
            cr_assert(st == MOE_OK, "%s", moe_last_error());
            cr_assert(moe_layer_backward(shared[1], got[1].dx, dy, x) == MOE_OK, "%s", moe_last_error());
        }
        for (int i = 0; i < 2; i++) {
            memcpy(got[i].g, moe_layer_grads(shared[i]), (size_t)np * sizeof(float));
            expect_same_step(&got[i], &want[i], T[i], d, np,
                             activations ? "shared activations and scratch" : "shared scratch");
        }
    }
    /* Other shapes are refused: d_ff; the sequence-wise loss on, or of
     * another seq_len, whose per-sequence arrays the blocks hold. */
    moe_layer_config others[3] = {cfg, cfg, cfg};
    others[0].d_ff = 8;
    others[1].seq_aux_loss_coef = others[2].seq_aux_loss_coef = 0.1;
    others[1].seq_len = 1;
    others[2].seq_len = 4;
    moe_layer *other[3];
    for (int i = 0; i < 3; i++) {
        cr_assert(moe_layer_create(&other[i], &others[i]) == MOE_OK, "%s", moe_last_error());
        cr_expect(moe_layer_share_workspace(other[i], shared[0], false) == MOE_ERR_INVALID_ARG,
                  "a layer of another shape (%d) shares the workspace", i);
    }
    cr_expect(moe_layer_share_workspace(other[1], other[2], true) == MOE_ERR_INVALID_ARG,
              "sequences of 1 and 4 share the workspace");
    for (int i = 0; i < 3; i++) moe_layer_destroy(other[i]);
    /* The memory outlives the layer that made it. */
    moe_layer_destroy(shared[0]);
    cr_assert(moe_layer_forward(shared[1], got[1].y, x, T[1], NULL) == MOE_OK, "%s", moe_last_error());
    for (int i = 0; i < 2; i++) {
        step_out_free(&want[i]);
        step_out_free(&got[i]);
        moe_layer_destroy(alone[i]);
    }
    moe_layer_destroy(shared[1]);
    free(x);
    free(dy);
}

/* ------------------------------------------------- balancing and noise */

/* A sigmoid-gated top-1 layer of d 6 and 4 experts with a selection bias
 * updated at rate, whose router is gate = [I | 0]: a token x_t = 3 e_target
 * + noise goes to expert target (routing by construction). */
enum { ROUTED_D = 6, ROUTED_E = 4, ROUTED_T = 8 };

static void routed_layer(fx *f, moe_layer_config *cfg, double rate) {
    *cfg = make_cfg(ROUTED_D, 5, ROUTED_E, 1, MOE_GATE_SIGMOID, 1, 0.0, 0);
    cfg->bias_update_rate = rate;
    fx_create(f, cfg, 31);
    moe_tensor_view g;
    cr_assert(moe_layer_tensor_by_name(f->layer, "gate.weight", &g) == MOE_OK);
    for (int64_t e = 0; e < ROUTED_E; e++)
        for (int64_t c = 0; c < ROUTED_D; c++) g.param[e * ROUTED_D + c] = c == e ? 1.0f : 0.0f;
}

/* x [ROUTED_T, ROUTED_D] whose token t goes to expert target[t]. */
static void routed_tokens(float *x, const int *target, uint64_t seed) {
    ref_rng rng = {seed};
    ref_fill(x, ROUTED_T * ROUTED_D, &rng, -0.1, 0.1);
    for (int64_t t = 0; t < ROUTED_T; t++) x[t * ROUTED_D + target[t]] += 3.0f;
}

/* Routing by construction, loads [4, 2, 2, 0] for mean 2: the bias moves
 * by -rate, 0, 0, +rate. */
Test(layer, update_bias_moves_against_the_load) {
    const int64_t E = ROUTED_E, T = ROUTED_T;
    static const int target[8] = {0, 1, 0, 2, 0, 1, 2, 0};
    moe_layer_config cfg;
    fx f;
    routed_layer(&f, &cfg, 0.01);
    float x[8 * 6], y[8 * 6];
    routed_tokens(x, target, 32);
    const float *b = moe_layer_selection_bias(f.layer);
    const double rate = (float)cfg.bias_update_rate;
    static const double want_sign[4] = {-1, 0, 0, 1};
    for (int step = 1; step <= 2; step++) {
        int64_t tpe[4];
        moe_layer_stats st = {.tokens_per_expert = tpe};
        cr_assert(moe_layer_forward(f.layer, y, x, T, &st) == MOE_OK, "%s", moe_last_error());
        cr_assert(tpe[0] == 4 && tpe[1] == 2 && tpe[2] == 2 && tpe[3] == 0,
                  "routing by construction failed: [%lld %lld %lld %lld]", (long long)tpe[0],
                  (long long)tpe[1], (long long)tpe[2], (long long)tpe[3]);
        cr_assert(moe_layer_update_bias(f.layer) == MOE_OK, "%s", moe_last_error());
        for (int64_t e = 0; e < E; e++)
            cr_expect(fabs(b[e] - step * want_sign[e] * rate) <= 1e-6,
                      "after %d updates bias[%lld] = %.9g, want %.9g", step, (long long)e, b[e],
                      step * want_sign[e] * rate);
    }
    fx_destroy(&f);
}

/* The bias answers the load summed over the training forwards since the
 * last update (the micro-batches of one step), not the last forward's:
 * loads [4, 2, 2, 0] then [0, 2, 2, 4] sum to the mean 4 everywhere, so the
 * bias stays 0, where the last forward alone would move it by +rate, 0, 0,
 * -rate. An eval-mode forward in between (loads [4, 2, 2, 0]) is not
 * training and does not count, nor does a replay of the second forward (a
 * pipeline stage recomputing it before its backward), which would make the
 * sum [4, 6, 6, 8]; with no training forward since the last update there
 * is nothing to answer. Same construction as above. */
Test(layer, update_bias_answers_every_training_forward_since_the_last) {
    const int64_t E = ROUTED_E, T = ROUTED_T;
    static const int targets[2][8] = {{0, 1, 0, 2, 0, 1, 2, 0}, {3, 1, 3, 2, 3, 1, 2, 3}};
    moe_layer_config cfg;
    fx f;
    routed_layer(&f, &cfg, 0.01);
    float x[2][8 * 6], y[8 * 6];
    for (int b = 0; b < 2; b++) routed_tokens(x[b], targets[b], 33 + (uint64_t)b);
    static const int64_t want_load[4][4] = {{4, 2, 2, 0}, {4, 2, 2, 0}, {0, 2, 2, 4}, {0, 2, 2, 4}};
    static const int x_of[4] = {0, 0, 1, 1}, training[4] = {1, 0, 1, 1}, replay[4] = {0, 0, 0, 1};
    for (int i = 0; i < 4; i++) {
        int64_t tpe[4];
        moe_layer_stats st = {.tokens_per_expert = tpe};
        cr_assert(moe_layer_set_training(f.layer, training[i]) == MOE_OK);
        moe_layer_set_replay(f.layer, replay[i]);
        cr_assert(moe_layer_forward(f.layer, y, x[x_of[i]], T, &st) == MOE_OK, "%s", moe_last_error());
        for (int64_t e = 0; e < E; e++)
            cr_assert(tpe[e] == want_load[i][e], "forward %d: routing by construction failed at expert %lld: %lld",
                      i, (long long)e, (long long)tpe[e]);
    }
    cr_assert(moe_layer_update_bias(f.layer) == MOE_OK, "%s", moe_last_error());
    const float *b = moe_layer_selection_bias(f.layer);
    for (int64_t e = 0; e < E; e++)
        cr_expect(b[e] == 0.0f, "bias[%lld] = %.9g after loads summing to the mean, want 0", (long long)e, b[e]);
    cr_expect(moe_layer_update_bias(f.layer) == MOE_ERR_STATE, "an update with no training forward since the last");
    fx_destroy(&f);
}

/* Jitter perturbs the router input in training only; eval mode is exactly
 * the layer without jitter. */
Test(layer, jitter_only_in_training) {
    moe_layer_config cfg = make_cfg(12, 6, 6, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 0);
    moe_layer_config jcfg = cfg;
    jcfg.jitter_eps = 0.2;
    jcfg.seed = 5;
    fx plain;
    fx_create(&plain, &cfg, 51);
    moe_layer *jit;
    cr_assert(moe_layer_create(&jit, &jcfg) == MOE_OK, "%s", moe_last_error());
    const int64_t T = 16, d = cfg.d_model, np = moe_layer_param_count(jit);
    cr_assert(np == moe_layer_param_count(plain.layer));
    memcpy(moe_layer_params(jit), moe_layer_params(plain.layer), (size_t)np * sizeof(float));
    float x[16 * 12], y_plain[16 * 12], y_train[16 * 12], y_eval[16 * 12];
    draw_x(x, &plain, T, 0, 51);
    check_forward(&plain, x, T, "no jitter");
    cr_assert(moe_layer_forward(plain.layer, y_plain, x, T, NULL) == MOE_OK);
    cr_assert(moe_layer_forward(jit, y_train, x, T, NULL) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_set_training(jit, 0) == MOE_OK);
    cr_assert(moe_layer_forward(jit, y_eval, x, T, NULL) == MOE_OK);
    int64_t i = first_diff(y_eval, y_plain, T * d);
    cr_expect(i < 0, "eval mode with jitter_eps > 0: y[%lld] = %.9g, without jitter %.9g",
              (long long)i, i < 0 ? 0 : y_eval[i], i < 0 ? 0 : y_plain[i]);
    cr_expect(first_diff(y_train, y_plain, T * d) >= 0,
              "training mode with jitter_eps = 0.2 gave exactly the un-jittered output");
    moe_layer_destroy(jit);
    fx_destroy(&plain);
}

/* The loss of check_grad (sum dy * y + aux_coef * aux + z_coef * z) of the
 * layer's own forward, in double from its fp32 outputs, with the jitter
 * draw of the given counter; *same: the router chose base_topk [T, k]. */
static double layer_loss_at(moe_layer *l, const moe_layer_config *cfg, uint64_t counter, float *y,
                            const float *x, const float *dy, int64_t T, const int32_t *base_topk, int *same) {
    moe_layer_set_jitter_counter(l, counter);
    moe_layer_stats st = {0};
    cr_assert(moe_layer_forward(l, y, x, T, &st) == MOE_OK, "%s", moe_last_error());
    const int32_t *topk;
    cr_assert(moe_layer_last_topk(l, &topk) == MOE_OK, "%s", moe_last_error());
    *same = memcmp(topk, base_topk, (size_t)(T * cfg->top_k) * sizeof *topk) == 0;
    double s = 0.0;
    for (int64_t i = 0; i < T * cfg->d_model; i++) s += (double)dy[i] * y[i];
    return s + cfg->aux_loss_coef * st.aux_loss + cfg->z_loss_coef * st.z_loss;
}

/* Training with jitter computes f(x * noise), one noise draw per forward:
 * with the draw held (the counter set back before every forward), the
 * gradients must be those of x -> f(x * noise), so dx carries the noise
 * factor and the router and experts see the jittered input. No reference
 * knows the noise, so the finite differences are of the layer's own fp32
 * forward (which forward_matches_reference checks without jitter): central,
 * over the float steps actually taken (x +- JITTER_FD_STEP rounded), with
 * the routing held as in check_grad. Their error (fp32 rounding of the loss
 * over a 2e-3 step) reaches ~1e-4 of the largest gradient, so the
 * tolerance is 2e-3 of it plus 1e-2 of each element (the errors seen stay
 * under a tenth of that); jitter_eps = 0.5 makes the noise factors 0.5 ..
 * 1.5, so a dx without them is off by a quarter on average. */
#define JITTER_FD_STEP 1e-3f
Test(layer, backward_with_jitter_vs_finite_differences) {
    moe_layer_config cfg = make_cfg(7, 5, 5, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 1);
    cfg.aux_loss_coef = 0.7;
    cfg.z_loss_coef = 0.2;
    cfg.jitter_eps = 0.5;
    cfg.seed = 9;
    fx f;
    fx_create(&f, &cfg, 5000);
    const int64_t T = 8, d = cfg.d_model, k = cfg.top_k;
    float *x = ref_alloc((size_t)(T * d) * sizeof *x), *y = ref_alloc((size_t)(T * d) * sizeof *y);
    float *dy = ref_alloc((size_t)(T * d) * sizeof *dy), *dx = ref_alloc((size_t)(T * d) * sizeof *dx);
    draw_x(x, &f, T, 0, 5000);
    ref_rng rng = {5099};
    ref_fill(dy, T * d, &rng, -1, 1);

    cr_assert(moe_layer_set_training(f.layer, 1) == MOE_OK);
    const uint64_t counter = moe_layer_jitter_counter(f.layer);
    cr_assert(moe_layer_zero_grad(f.layer) == MOE_OK);
    cr_assert(moe_layer_forward(f.layer, y, x, T, NULL) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_backward(f.layer, dx, dy, x) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_jitter_counter(f.layer) == counter + 1, "a training forward must draw new noise");
    const int32_t *topk;
    cr_assert(moe_layer_last_topk(f.layer, &topk) == MOE_OK, "%s", moe_last_error());
    int32_t *base = ref_alloc((size_t)(T * k) * sizeof *base);
    memcpy(base, topk, (size_t)(T * k) * sizeof *base);
    const int64_t np = moe_layer_param_count(f.layer);
    float *grads = ref_alloc((size_t)np * sizeof *grads);
    memcpy(grads, moe_layer_grads(f.layer), (size_t)np * sizeof *grads);

    int64_t checked = 0, skipped = 0;
    for (int64_t i = 0; i <= f.n_tensors; i++) {
        /* i == n_tensors: the input x */
        const int is_x = i == f.n_tensors;
        float *p = x;
        const float *got = dx;
        int64_t cnt = T * d;
        if (!is_x) {
            moe_tensor_view v;
            cr_assert(moe_layer_tensor_by_name(f.layer, f.t[i].name, &v) == MOE_OK);
            p = v.param;
            got = grads + (v.param - moe_layer_params(f.layer));
            cnt = v.rows * v.cols;
        }
        double *want = ref_alloc((size_t)cnt * sizeof *want);
        for (int64_t j = 0; j < cnt; j++) {
            const float keep = p[j];
            int same_p, same_m;
            p[j] = keep + JITTER_FD_STEP;
            const double step_p = (double)p[j] - keep;
            const double lp = layer_loss_at(f.layer, &cfg, counter, y, x, dy, T, base, &same_p);
            p[j] = keep - JITTER_FD_STEP;
            const double step_m = keep - (double)p[j];
            const double lm = layer_loss_at(f.layer, &cfg, counter, y, x, dy, T, base, &same_m);
            p[j] = keep;
            if (same_p && same_m) {
                want[j] = (lp - lm) / (step_p + step_m);
                checked++;
            } else {
                want[j] = got[j];
                skipped++;
            }
        }
        char what[96];
        snprintf(what, sizeof what, "jitter_eps=0.5 d%s", is_x ? "x" : f.t[i].name);
        REF_EXPECT_CLOSE(what, got, want, cnt, 2e-3 * fmax(ref_max_abs(want, cnt), 1e-3), 1e-2);
        free(want);
    }
    cr_expect(skipped * 20 <= checked + skipped,
              "jitter: %lld of %lld coordinates skipped for routing changes (want <= 5%%)", (long long)skipped,
              (long long)(checked + skipped));
    free(base);
    free(grads);
    free(x);
    free(y);
    free(dy);
    free(dx);
    fx_destroy(&f);
}

/* 2 flops per multiply-add: router T*E*d, each of the T*k routed pairs and
 * each token's shared expert three d x width GEMVs. */
Test(layer, forward_flops) {
    moe_layer_config cfg = make_cfg(64, 96, 8, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 2);
    const double T = 100, d = 64, ff = 96, E = 8, k = 2, S = 2 * 96;
    double want = 2 * T * E * d + 2 * T * k * 3 * d * ff + 2 * T * 3 * d * S;
    double got = moe_layer_forward_flops(&cfg, 100);
    cr_expect(fabs(got - want) <= 1e-9 * want, "forward flops %.6g, want %.6g", got, want);
    cr_expect(moe_layer_forward_flops(NULL, 100) == 0.0 && moe_layer_forward_flops(&cfg, -3) == 0.0,
              "no config or no tokens: no FLOPs");
    cfg.d_model = -4;
    cr_expect(moe_layer_forward_flops(&cfg, 100) == 0.0, "a negative size: no FLOPs");
}

/* ------------------------------------------------------ backend memory */

/* The layer on memory the host cannot touch outside an op (the strict
 * backend): every host access goes through upload and download, as a
 * device backend needs, and the results are the bits of the host layer.
 * Jitter, capacity, shared experts and the selection bias on, so every
 * path runs; two steps, so the moved bias is used. */
Test(layer, same_bits_when_the_host_cannot_touch_its_memory) {
    moe_layer_config cfg = make_cfg(24, 20, 8, 2, MOE_GATE_SOFTMAX_TOPK, 1, 1.25, 1);
    cfg.jitter_eps = 0.05;
    cfg.bias_update_rate = 0.01;
    const moe_ops *ops = moe_strict_ops();
    moe_layer *host = NULL, *dev = NULL;
    cr_assert(moe_layer_create(&host, &cfg) == MOE_OK, "%s", moe_last_error());
    const int64_t n = moe_layer_param_count(host), d = cfg.d_model, T = 40, E = cfg.n_experts;
    const int64_t router = E * d, experts = E * 3 * cfg.d_ff * d;
    float *params = NULL, *grads = NULL, *x = NULL, *dy = NULL, *y = NULL, *dx = NULL;
    cr_assert(ops->alloc((void **)&params, (size_t)n * sizeof(float)) == MOE_OK);
    cr_assert(ops->alloc((void **)&grads, (size_t)n * sizeof(float)) == MOE_OK);
    const moe_layer_memory mem = {.ops = ops,
                                  .router = params, .router_grad = grads,
                                  .experts = params + router, .experts_grad = grads + router,
                                  .shared = params + router + experts, .shared_grad = grads + router + experts};
    cr_assert(moe_layer_create_in(&dev, &cfg, &mem, NULL, NULL) == MOE_OK, "%s", moe_last_error());
    cr_assert(ops->upload(params, moe_layer_params(host), (size_t)n * sizeof(float)) == MOE_OK);
    float *hx = ref_alloc((size_t)(T * d) * sizeof *hx), *hdy = ref_alloc((size_t)(T * d) * sizeof *hdy);
    float *hy = ref_alloc((size_t)(T * d) * sizeof *hy), *hdx = ref_alloc((size_t)(T * d) * sizeof *hdx);
    float *got = ref_alloc((size_t)(n > T * d ? n : T * d) * sizeof *got);
    ref_rng rng = {31};
    ref_fill(hx, T * d, &rng, -1, 1);
    ref_fill(hdy, T * d, &rng, -1, 1);
    float **bufs[] = {&x, &dy, &y, &dx};
    for (int i = 0; i < 4; i++) cr_assert(ops->alloc((void **)bufs[i], (size_t)(T * d) * sizeof(float)) == MOE_OK);
    cr_assert(ops->upload(x, hx, (size_t)(T * d) * sizeof(float)) == MOE_OK);
    cr_assert(ops->upload(dy, hdy, (size_t)(T * d) * sizeof(float)) == MOE_OK);
    for (int step = 0; step < 2; step++) {
        moe_layer_stats hs = {0}, ds = {0};
        cr_assert(moe_layer_zero_grad(host) == MOE_OK && moe_layer_zero_grad(dev) == MOE_OK);
        cr_assert(moe_layer_forward(host, hy, hx, T, &hs) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_backward(host, hdx, hdy, hx) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_forward(dev, y, x, T, &ds) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_backward(dev, dx, dy, x) == MOE_OK, "%s", moe_last_error());
        cr_expect(ds.aux_loss == hs.aux_loss && ds.z_loss == hs.z_loss && ds.dropped == hs.dropped,
                  "step %d: aux %.9g z %.9g dropped %lld, host %.9g %.9g %lld", step, ds.aux_loss, ds.z_loss,
                  (long long)ds.dropped, hs.aux_loss, hs.z_loss, (long long)hs.dropped);
        cr_expect(step == 0 || hs.dropped > 0, "capacity 1.25 dropped nothing: the check misses the drop path");
        const struct { const char *name; const float *dev, *host; int64_t n; } out[] = {
            {"y", y, hy, T * d}, {"dx", dx, hdx, T * d}, {"grads", grads, moe_layer_grads(host), n}};
        for (int o = 0; o < 3; o++) {
            cr_assert(ops->download(got, out[o].dev, (size_t)out[o].n * sizeof(float)) == MOE_OK);
            int64_t i = first_diff(got, out[o].host, out[o].n);
            cr_expect(i < 0, "step %d: %s[%lld] = %.9g, host %.9g", step, out[o].name, (long long)i,
                      i < 0 ? 0.0 : got[i], i < 0 ? 0.0 : out[o].host[i]);
        }
        const int32_t *topk_dev, *topk_host;
        cr_assert(moe_layer_last_topk(dev, &topk_dev) == MOE_OK && moe_layer_last_topk(host, &topk_host) == MOE_OK,
                  "%s", moe_last_error());
        cr_expect(memcmp(topk_dev, topk_host, (size_t)(T * cfg.top_k) * sizeof(int32_t)) == 0,
                  "step %d: router choices differ", step);
        cr_assert(moe_layer_update_bias(host) == MOE_OK && moe_layer_update_bias(dev) == MOE_OK);
        cr_expect(memcmp(moe_layer_selection_bias(dev), moe_layer_selection_bias(host), (size_t)E * sizeof(float)) == 0,
                  "step %d: the selection bias differs", step);
    }
    moe_layer_destroy(dev);
    moe_layer_destroy(host);
    for (int i = 0; i < 4; i++) ops->release(*bufs[i]);
    ops->release(params);
    ops->release(grads);
    free(hx), free(hdy), free(hy), free(hdx), free(got);
}

/* A layer that owns its memory on another backend (what
 * moe_layer_create_cuda makes over the CUDA table), here the strict one: it
 * draws the host layer's initial parameters, its views and flat arrays
 * point into backend memory, and forward, backward and zero_grad on
 * backend buffers give the host layer's bits. */
Test(layer, owning_layer_on_a_backend_matches_the_host_layer) {
    moe_layer_config cfg = make_cfg(24, 20, 8, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 1);
    cfg.seed = 77;
    const moe_ops *ops = moe_strict_ops();
    moe_layer *host = NULL, *dev = NULL;
    cr_assert(moe_layer_create(&host, &cfg) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_create_on_ops(&dev, &cfg, ops) == MOE_OK, "%s", moe_last_error());
    const int64_t n = moe_layer_param_count(host), d = cfg.d_model, T = 33;
    cr_assert_eq(moe_layer_param_count(dev), n);
    float *got = ref_alloc((size_t)(n > T * d ? n : T * d) * sizeof *got);
    cr_assert(ops->download(got, moe_layer_params(dev), (size_t)n * sizeof(float)) == MOE_OK);
    int64_t i = first_diff(got, moe_layer_params(host), n);
    cr_expect(i < 0, "initial params[%lld] = %.9g, host %.9g", (long long)i, i < 0 ? 0.0 : got[i],
              i < 0 ? 0.0 : moe_layer_params(host)[i]);
    moe_tensor_view hv, dv;
    cr_assert(moe_layer_tensor_by_name(dev, "experts.3.w2.weight", &dv) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_layer_tensor_by_name(host, "experts.3.w2.weight", &hv) == MOE_OK, "%s", moe_last_error());
    cr_expect(dv.param - moe_layer_params(dev) == hv.param - moe_layer_params(host) &&
                  dv.grad - moe_layer_grads(dev) == hv.grad - moe_layer_grads(host),
              "a view does not point where the host layer's does");

    float *hx = ref_alloc((size_t)(T * d) * sizeof *hx), *hdy = ref_alloc((size_t)(T * d) * sizeof *hdy);
    float *hy = ref_alloc((size_t)(T * d) * sizeof *hy), *hdx = ref_alloc((size_t)(T * d) * sizeof *hdx);
    ref_rng rng = {41};
    ref_fill(hx, T * d, &rng, -1, 1);
    ref_fill(hdy, T * d, &rng, -1, 1);
    float *x = NULL, *dy = NULL, *y = NULL, *dx = NULL;
    float **bufs[] = {&x, &dy, &y, &dx};
    for (int b = 0; b < 4; b++) cr_assert(ops->alloc((void **)bufs[b], (size_t)(T * d) * sizeof(float)) == MOE_OK);
    cr_assert(ops->upload(x, hx, (size_t)(T * d) * sizeof(float)) == MOE_OK);
    cr_assert(ops->upload(dy, hdy, (size_t)(T * d) * sizeof(float)) == MOE_OK);
    for (int step = 0; step < 2; step++) { /* the second after zero_grad: the same gradients */
        cr_assert(moe_layer_zero_grad(host) == MOE_OK && moe_layer_zero_grad(dev) == MOE_OK);
        cr_assert(moe_layer_forward(host, hy, hx, T, NULL) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_backward(host, hdx, hdy, hx) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_forward(dev, y, x, T, NULL) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_backward(dev, dx, dy, x) == MOE_OK, "%s", moe_last_error());
        cr_assert(moe_layer_sync(dev) == MOE_OK, "%s", moe_last_error());
        const struct { const char *name; const float *dev, *host; int64_t n; } out[] = {
            {"y", y, hy, T * d}, {"dx", dx, hdx, T * d}, {"grads", moe_layer_grads(dev), moe_layer_grads(host), n}};
        for (int o = 0; o < 3; o++) {
            cr_assert(ops->download(got, out[o].dev, (size_t)out[o].n * sizeof(float)) == MOE_OK);
            i = first_diff(got, out[o].host, out[o].n);
            cr_expect(i < 0, "step %d: %s[%lld] = %.9g, host %.9g", step, out[o].name, (long long)i,
                      i < 0 ? 0.0 : got[i], i < 0 ? 0.0 : out[o].host[i]);
        }
    }
    moe_layer_destroy(dev);
    moe_layer_destroy(host);
    for (int b = 0; b < 4; b++) ops->release(*bufs[b]);
    free(hx), free(hdy), free(hy), free(hdx), free(got);
}

/* Without a GPU (or without CUDA in the build) the CUDA layer is refused,
 * saying why, and leaves no layer behind. */
Test(layer, cuda_layer_without_a_device_is_refused) {
    moe_layer_config cfg = make_cfg(16, 8, 4, 2, MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 0);
    moe_layer *l = (moe_layer *)&cfg; /* any non-NULL value, which the call must clear */
    const moe_status st = moe_layer_create_cuda(&l, &cfg, -1, NULL);
    if (st == MOE_OK) { /* a GPU answered: test_cuda_ops holds the layer to the CPU's */
        moe_layer_destroy(l);
        return;
    }
    cr_expect_eq(st, MOE_ERR_UNSUPPORTED, "status %d: %s", st, moe_last_error());
    cr_expect(strstr(moe_last_error(), "moe_layer_create_cuda"), "%s", moe_last_error());
    cr_expect(l == NULL);
    /* A bad config is the config's error, device or not. */
    cfg.top_k = 9;
    cr_expect_eq(moe_layer_create_cuda(&l, &cfg, -1, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "top_k"), "%s", moe_last_error());
}
