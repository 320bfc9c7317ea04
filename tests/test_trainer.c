/* test_trainer.c: moe_trainer_step (engine/trainer.h) against a training
 * step written out here, and moe_model_step_flops against the formula its
 * documentation gives (at the end).
 *
 * The step reference takes its gradients from the model API, per
 * micro-batch at grad_scale 1 (test_model_grad.c checks those against
 * finite differences), on a twin model holding the trainer's parameters,
 * with batches cut from the token array by llm.c's rule (engine/data.h).
 * The rest is done here in double: the mean over the micro-batches, the
 * global L2 norm, clipping to GRAD_CLIP, the learning rate of a schedule
 * written out below (linear warm-up, then cosine to MIN_LR at the last
 * step), and torch.optim.AdamW (decoupled decay p *= 1 - lr * wd, then
 * moments, bias corrections with t counted from 1, p -= lr * m_hat /
 * (sqrt(v_hat) + eps)), weight decay on every tensor except the RMSNorm
 * weights.
 *
 * Each step starts the reference from the trainer's state before it
 * (parameters and both moments), so each step is checked on its own and
 * fp32 differences do not compound. Tolerance: parameters and moments
 * within STATE_RTOL of the largest |value| of their tensor in the
 * reference. The trainer's fp32 arithmetic (its gradient summed over the
 * micro-batches in another order, its float betas: 1 - 0.9f is 2.4e-7 off
 * 0.1) stays below 6e-7 of that, while each error the reference is built
 * to catch (the clip scale, the mean over micro-batches, the step whose lr
 * is used, the bias corrections, which tensors decay, the schedule's
 * shape) moves some tensor by 3e-5 of it or more, most by 1e-3. The
 * metrics: loss terms are the mean of the micro-batches' (the same
 * forwards: within 1e-12), the lr within 1e-12, the norm before clipping
 * within 1e-6. GRAD_CLIP sits between the steps' norms (0.75 to 0.92), so
 * some steps clip and some do not. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/data.h"
#include "engine/model.h"
#include "engine/trainer.h"
#include "ref_model.h"

#define VOCAB 11
#define BATCH 2
#define SEQ 5
#define N_POS (BATCH * SEQ)
#define ACCUM 2
#define STEPS 4
#define N_TOKENS (STEPS * ACCUM * N_POS + 1)
#define WEIGHT_SCALE 4.0f

/* The optimizer: warm-up over 2 steps, then cosine over the 4 steps of a
 * 6-step run, of which STEPS are taken: lr LR/2, LR, LR, then MIN_LR + 0.75
 * (LR - MIN_LR) at step 3 (progress 1/3), where linear would give 2/3. */
#define LR 2e-2
#define MIN_LR 2e-3
#define WARMUP 2
#define TOTAL_STEPS 6
#define WEIGHT_DECAY 0.1
#define BETA1 0.9
#define BETA2 0.95
#define ADAM_EPS 1e-8
#define GRAD_CLIP 0.85

#define STATE_RTOL 1e-6
#define METRIC_RTOL 1e-12
#define NORM_RTOL 1e-6

static const double PI = 3.14159265358979323846;

/* The learning rate of step s (0-based) of the schedule above. */
static double ref_lr(int64_t s) {
    if (s < WARMUP) return LR * (double)(s + 1) / WARMUP;
    const double progress = (double)(s - WARMUP) / (double)(TOTAL_STEPS - WARMUP - 1);
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1.0 + cos(PI * progress));
}

/* RMSNorm weights are the tensors weight decay leaves alone. */
static bool decays(const moe_model_tensor *t) {
    const char *suffix = "norm.weight";
    const size_t n = strlen(t->name), s = strlen(suffix);
    return !(n >= s && strcmp(t->name + n - s, suffix) == 0);
}

/* Batch number b of the stream: row r's inputs are tokens [b*B*T + r*T, +T),
 * its targets one further. */
static void cut_batch(int32_t *inputs, int32_t *targets, const int32_t *tokens, int64_t b) {
    for (int64_t i = 0; i < N_POS; i++) {
        inputs[i] = tokens[b * N_POS + i];
        targets[i] = tokens[b * N_POS + i + 1];
    }
}

/* One step of the reference: what the trainer's state [n] must become. */
typedef struct ref_step {
    double *p, *m, *v; /* [n] */
    double loss, ce, aux, z;
    double lr, norm;
    bool clipped;
    double load[2 * 4]; /* [layers, E]: each expert's pairs over the micro-batches (the tiny config is dropless) */
} ref_step;

/* The reference step from the state (p0, m0, v0) [n]: gradients of the
 * twin at p0 over micro-batches first_batch .. first_batch + ACCUM - 1. */
static void reference_step(ref_step *out, moe_model *twin, const float *p0, const float *m0, const float *v0,
                           const int32_t *tokens, int64_t first_batch, int64_t step) {
    const int64_t n = moe_model_param_count(twin);
    double *g = ref_alloc((size_t)n * sizeof *g);
    memcpy(moe_model_params(twin), p0, (size_t)n * sizeof *p0);
    out->loss = out->ce = out->aux = out->z = 0.0;
    const int64_t E = moe_model_get_config(twin)->num_local_experts, k = moe_model_get_config(twin)->num_experts_per_tok;
    cr_assert(2 * E == (int64_t)(sizeof out->load / sizeof *out->load));
    memset(out->load, 0, sizeof out->load);
    for (int64_t micro = 0; micro < ACCUM; micro++) {
        int32_t inputs[N_POS], targets[N_POS];
        cut_batch(inputs, targets, tokens, first_batch + micro);
        moe_model_stats st;
        moe_model_zero_grad(twin);
        cr_assert(moe_model_forward(twin, inputs, targets, &st) == MOE_OK, "twin forward: %s", moe_last_error());
        for (int64_t l = 0; l < 2; l++) {
            const int32_t *topk;
            cr_assert(moe_model_last_topk(twin, l, &topk) == MOE_OK, "%s", moe_last_error());
            for (int64_t i = 0; i < N_POS * k; i++) out->load[l * E + topk[i]] += 1.0;
        }
        cr_assert(moe_model_backward(twin, 1.0f) == MOE_OK, "twin backward: %s", moe_last_error());
        const float *gm = moe_model_grads(twin);
        for (int64_t i = 0; i < n; i++) g[i] += gm[i];
        out->loss += st.loss, out->ce += st.ce_loss, out->aux += st.aux_loss, out->z += st.z_loss;
    }
    out->loss /= ACCUM, out->ce /= ACCUM, out->aux /= ACCUM, out->z /= ACCUM;
    double sumsq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        g[i] /= ACCUM;
        sumsq += g[i] * g[i];
    }
    out->norm = sqrt(sumsq);
    out->clipped = out->norm > GRAD_CLIP;
    if (out->clipped)
        for (int64_t i = 0; i < n; i++) g[i] *= GRAD_CLIP / out->norm;

    const double lr = out->lr = ref_lr(step);
    const double t = (double)(step + 1);
    const double bc1 = 1.0 - pow(BETA1, t), bc2 = 1.0 - pow(BETA2, t);
    for (int64_t ti = 0; ti < moe_model_tensor_count(twin); ti++) {
        const moe_model_tensor *tensor = moe_model_tensor_at(twin, ti);
        const double keep = decays(tensor) ? 1.0 - lr * WEIGHT_DECAY : 1.0;
        for (int64_t i = tensor->offset; i < tensor->offset + tensor->numel; i++) {
            const double m = BETA1 * m0[i] + (1.0 - BETA1) * g[i];
            const double v = BETA2 * v0[i] + (1.0 - BETA2) * g[i] * g[i];
            out->m[i] = m;
            out->v[i] = v;
            out->p[i] = p0[i] * keep - lr * (m / bc1) / (sqrt(v / bc2) + ADAM_EPS);
        }
    }
    free(g);
}

/* got vs want per tensor, within STATE_RTOL of the tensor's largest |want|,
 * naming the worst element of every tensor that is off. */
static void expect_state(const moe_model *m, const float *got, const double *want, const char *what, int64_t step) {
    for (int64_t ti = 0; ti < moe_model_tensor_count(m); ti++) {
        const moe_model_tensor *t = moe_model_tensor_at(m, ti);
        double scale = 0.0;
        for (int64_t i = t->offset; i < t->offset + t->numel; i++) scale = fmax(scale, fabs(want[i]));
        const double tol = STATE_RTOL * scale;
        int64_t bad = 0, worst = t->offset;
        double worst_err = -1.0;
        for (int64_t i = t->offset; i < t->offset + t->numel; i++) {
            const double err = fabs((double)got[i] - want[i]);
            bad += !(err <= tol);
            if (!(err <= worst_err)) {
                worst_err = err;
                worst = i;
            }
        }
        cr_expect(bad == 0, "step %lld: %s of %s: %lld of %lld off; worst [%lld] %.9g, reference %.9g, |err| %.3g > %.3g",
                  (long long)step, what, t->name, (long long)bad, (long long)t->numel, (long long)(worst - t->offset),
                  got[worst], want[worst], worst_err, tol);
    }
}

static void expect_metric(const char *what, double got, double want, double rtol, int64_t step) {
    cr_expect(fabs(got - want) <= rtol * fabs(want), "step %lld: %s %.15g, reference %.15g (rel err %.3g > %.1g)",
              (long long)step, what, got, want, fabs(got - want) / fabs(want), rtol);
}

Test(trainer, steps_match_the_adamw_reference) {
    const moe_model_config cfg = ref_tiny_config(VOCAB, 2, 1);
    moe_model *model = NULL, *twin = NULL;
    cr_assert(moe_model_create(&model, &cfg, BATCH, SEQ, 7) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_model_create(&twin, &cfg, BATCH, SEQ, 7) == MOE_OK, "%s", moe_last_error());
    const int64_t n = moe_model_param_count(model);
    /* Larger weights than the init's, so gradients are not tiny; norm weights
     * off 1, so their decay would show. */
    ref_rng rng = {2024};
    float *params = moe_model_params(model);
    for (int64_t ti = 0; ti < moe_model_tensor_count(model); ti++) {
        const moe_model_tensor *t = moe_model_tensor_at(model, ti);
        for (int64_t j = t->offset; j < t->offset + t->numel; j++)
            params[j] = t->ndim == 1 ? (float)ref_uniform(&rng, 0.75, 1.25) : WEIGHT_SCALE * params[j];
    }
    int32_t tokens[N_TOKENS];
    for (int64_t i = 0; i < N_TOKENS; i++) tokens[i] = (int32_t)(ref_next(&rng) % VOCAB);
    moe_data *data = NULL;
    cr_assert(moe_data_from_tokens(&data, tokens, N_TOKENS, VOCAB, "tokens") == MOE_OK, "%s", moe_last_error());

    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    oc.lr = LR;
    oc.min_lr = MIN_LR;
    oc.warmup = WARMUP;
    oc.total_steps = TOTAL_STEPS;
    oc.schedule = MOE_LR_COSINE;
    oc.weight_decay = WEIGHT_DECAY;
    oc.beta1 = BETA1;
    oc.beta2 = BETA2;
    oc.eps = ADAM_EPS;
    oc.grad_clip = GRAD_CLIP;
    oc.grad_accum = ACCUM;
    moe_trainer *trainer = NULL;
    cr_assert(moe_trainer_create(&trainer, model, &oc) == MOE_OK, "%s", moe_last_error());
    const float *adam_m = moe_trainer_adam_m(trainer), *adam_v = moe_trainer_adam_v(trainer);
    cr_assert(adam_m && adam_v, "one rank without ZeRO: the moments must be visible");

    ref_step ref = {.p = ref_alloc((size_t)n * sizeof(double)), .m = ref_alloc((size_t)n * sizeof(double)),
                    .v = ref_alloc((size_t)n * sizeof(double))};
    float *p0 = ref_alloc((size_t)n * sizeof *p0), *m0 = ref_alloc((size_t)n * sizeof *m0),
          *v0 = ref_alloc((size_t)n * sizeof *v0);
    int clipped = 0;
    for (int64_t s = 0; s < STEPS; s++) {
        memcpy(p0, params, (size_t)n * sizeof *p0);
        memcpy(m0, adam_m, (size_t)n * sizeof *m0);
        memcpy(v0, adam_v, (size_t)n * sizeof *v0);
        reference_step(&ref, twin, p0, m0, v0, tokens, s * ACCUM, s);
        clipped += ref.clipped;
        moe_step_metrics got;
        cr_assert(moe_trainer_step(trainer, data, &got) == MOE_OK, "step %lld: %s", (long long)s, moe_last_error());
        cr_expect(got.step == s + 1, "step %lld: metrics.step %lld", (long long)s, (long long)got.step);
        expect_metric("loss", got.loss, ref.loss, METRIC_RTOL, s);
        expect_metric("ce_loss", got.ce_loss, ref.ce, METRIC_RTOL, s);
        expect_metric("aux_loss", got.aux_loss, ref.aux, METRIC_RTOL, s);
        expect_metric("z_loss", got.z_loss, ref.z, METRIC_RTOL, s);
        expect_metric("lr", got.lr, ref.lr, METRIC_RTOL, s);
        expect_metric("grad_norm", got.grad_norm, ref.norm, NORM_RTOL, s);
        const double *load = moe_trainer_expert_load(trainer);
        for (int64_t i = 0; i < (int64_t)(sizeof ref.load / sizeof *ref.load); i++)
            cr_expect(load[i] == ref.load[i], "step %lld: layer %lld expert %lld kept %g pairs, reference %g",
                      (long long)s, (long long)(i / 4), (long long)(i % 4), load[i], ref.load[i]);
        expect_state(model, params, ref.p, "parameter", s);
        expect_state(model, adam_m, ref.m, "first moment", s);
        expect_state(model, adam_v, ref.v, "second moment", s);
    }
    /* Both sides of the clip are exercised. */
    cr_expect(clipped > 0 && clipped < STEPS, "%d of %d steps clipped: want some, not all (GRAD_CLIP %g)", clipped,
              STEPS, GRAD_CLIP);
    free(p0), free(m0), free(v0);
    free(ref.p), free(ref.m), free(ref.v);
    moe_trainer_destroy(trainer);
    moe_data_close(data);
    moe_model_destroy(twin);
    moe_model_destroy(model);
}

/* ------------------------------------------------- selection bias per step */

#define BIAS_RATE 0.01
#define BIAS_STEPS 3

static moe_model *bias_model(int64_t batch) {
    moe_model_config cfg = ref_tiny_config(VOCAB, 2, 0);
    cfg.moe_bias_update_rate = BIAS_RATE;
    cfg.router_aux_loss_coef = 0.0; /* the bias alone balances */
    cfg.router_jitter_noise = 0.0;  /* noise would depend on the batch's split */
    cfg.moe_capacity_factor = 0.0;
    moe_model *m = NULL;
    cr_assert(moe_model_create(&m, &cfg, batch, SEQ, 11) == MOE_OK, "%s", moe_last_error());
    return m;
}

static moe_trainer *bias_trainer(moe_model *m, int64_t grad_accum) {
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    oc.lr = LR;
    oc.total_steps = BIAS_STEPS;
    oc.grad_accum = grad_accum;
    moe_trainer *t = NULL;
    cr_assert(moe_trainer_create(&t, m, &oc) == MOE_OK, "%s", moe_last_error());
    return t;
}

/* The auxiliary-loss-free bias moves once per optimizer step, from the load
 * of all the step's micro-batches (DeepSeek-V3), which all route with the
 * same bias. Step 1 of 2 micro-batches of BATCH rows and step 1 of one batch
 * of 2 BATCH rows read the same rows with the same weights and a zero bias,
 * so both must leave the reference bias: rate * sign(mean load - load_e)
 * per layer, the load counted here from the big batch's router choices
 * (dropless, so every choice is a pair). Exact: each entry is 0 or
 * +-(float)rate. Later steps of the split run move no entry by more than
 * one rate. */
Test(trainer, selection_bias_moves_once_per_step) {
    enum { BIG = 2 * BATCH, N = BIAS_STEPS * BIG * SEQ + 1 };
    int32_t tokens[N];
    ref_rng rng = {77};
    for (int64_t i = 0; i < N; i++) tokens[i] = (int32_t)(ref_next(&rng) % VOCAB);
    moe_data *data_big = NULL, *data_split = NULL;
    cr_assert(moe_data_from_tokens(&data_big, tokens, N, VOCAB, "tokens") == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_data_from_tokens(&data_split, tokens, N, VOCAB, "tokens") == MOE_OK, "%s", moe_last_error());
    moe_model *big = bias_model(BIG), *split = bias_model(BATCH);
    const int64_t n = moe_model_param_count(big);
    cr_assert(n == moe_model_param_count(split) &&
              memcmp(moe_model_params(big), moe_model_params(split), (size_t)n * sizeof(float)) == 0,
              "the two models must start from the same weights");
    moe_trainer *t_big = bias_trainer(big, 1), *t_split = bias_trainer(split, 2);
    const moe_model_config *cfg = moe_model_get_config(big);
    const int64_t L = cfg->num_hidden_layers, E = cfg->num_local_experts, k = cfg->num_experts_per_tok;

    cr_assert(moe_trainer_step(t_big, data_big, NULL) == MOE_OK, "%s", moe_last_error());
    cr_assert(moe_trainer_step(t_split, data_split, NULL) == MOE_OK, "%s", moe_last_error());
    int moved = 0;
    for (int64_t l = 0; l < L; l++) {
        const int32_t *topk; /* [BIG * SEQ, k] */
        cr_assert(moe_model_last_topk(big, l, &topk) == MOE_OK, "%s", moe_last_error());
        int64_t load[16] = {0};
        cr_assert(E <= 16);
        for (int64_t i = 0; i < BIG * SEQ * k; i++) load[topk[i]]++;
        const double mean = (double)(BIG * SEQ * k) / (double)E;
        for (int64_t e = 0; e < E; e++) {
            const double err = mean - (double)load[e];
            const float want = (float)(BIAS_RATE * (err > 0.0 ? 1.0 : err < 0.0 ? -1.0 : 0.0));
            const float got_big = moe_model_router_bias(big, l)[e], got_split = moe_model_router_bias(split, l)[e];
            moved += want != 0.0f;
            cr_expect(got_big == want && got_split == want,
                      "layer %lld expert %lld (load %lld of mean %g): bias %.9g with one batch, %.9g with two "
                      "micro-batches, want %.9g",
                      (long long)l, (long long)e, (long long)load[e], mean, got_big, got_split, want);
        }
    }
    cr_expect(moved > 0, "no expert's load was off the mean: the check sees nothing");

    /* One rate up to the rounding of the float sum it lands in. */
    const double tol = BIAS_RATE * (1.0 + 1e-5);
    float before[4][16];
    cr_assert(L <= 4);
    for (int step = 2; step <= BIAS_STEPS; step++) {
        for (int64_t l = 0; l < L; l++) memcpy(before[l], moe_model_router_bias(split, l), (size_t)E * sizeof(float));
        cr_assert(moe_trainer_step(t_split, data_split, NULL) == MOE_OK, "%s", moe_last_error());
        for (int64_t l = 0; l < L; l++)
            for (int64_t e = 0; e < E; e++) {
                const double delta = (double)moe_model_router_bias(split, l)[e] - (double)before[l][e];
                cr_expect(fabs(delta) <= tol, "step %d, layer %lld expert %lld: the bias moved by %.9g, more than "
                          "one rate %g", step, (long long)l, (long long)e, delta, BIAS_RATE);
            }
    }
    moe_trainer_destroy(t_big);
    moe_trainer_destroy(t_split);
    moe_model_destroy(big);
    moe_model_destroy(split);
    moe_data_close(data_big);
    moe_data_close(data_split);
}

/* ------------------------------------------------------------ step FLOPs */

/* moe_model_step_flops, as engine/model.c documents it: per token, 6 FLOPs
 * (2 forward, 4 backward) per active parameter except the embedding (a
 * lookup), plus attention's q k^T and att v, 2 * 2 * T * hd * Hq FLOPs per
 * token and layer forward, halved by the causal mask, times 3 for forward
 * and backward; all over the B * T tokens of one forward + backward. The
 * active parameters are every dense one (the final norm, the head, each
 * layer's two norms, q k v o, router and shared experts) and top_k routed
 * experts of three [ff, C] matrices per layer. The config has shared
 * experts, GQA and head_dim * heads != hidden_size, so each term has its
 * own size; two batch shapes, so the T of attention shows. A tied head
 * (the embedding's tensor) computes as much as an untied one. */
static double flops_formula(const moe_model_config *c, int64_t B, int64_t T) {
    const double C = (double)c->hidden_size, V = (double)c->vocab_size, ff = (double)c->intermediate_size;
    const double L = (double)c->num_hidden_layers, E = (double)c->num_local_experts;
    const double k = (double)c->num_experts_per_tok, S = (double)(c->moe_n_shared_experts * c->intermediate_size);
    const double qdim = (double)(c->num_attention_heads * c->head_dim);
    const double kvdim = (double)(c->num_key_value_heads * c->head_dim);
    const double per_layer = 2 * C + qdim * C + 2 * kvdim * C + C * qdim + E * C + 3 * S * C + k * 3 * ff * C;
    const double matmul_params = L * per_layer + C + V * C; /* the final norm and the head; no embedding */
    const double attention = L * 3.0 * (2.0 * 2.0 * (double)T * (double)c->head_dim * (double)c->num_attention_heads) / 2.0;
    return (double)(B * T) * (6.0 * matmul_params + attention);
}

Test(trainer, step_flops_formula) {
    moe_model_config cfg = ref_tiny_config(VOCAB, 2, 1);
    static const int64_t shapes[][2] = {{BATCH, SEQ}, {3, 16}};
    for (int tied = 0; tied < 2; tied++)
        for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
            cfg.tie_word_embeddings = tied;
            moe_model *m = NULL;
            cr_assert(moe_model_create(&m, &cfg, shapes[i][0], shapes[i][1], 1) == MOE_OK, "%s", moe_last_error());
            const double got = moe_model_step_flops(m), want = flops_formula(&cfg, shapes[i][0], shapes[i][1]);
            cr_expect(fabs(got - want) <= 1e-12 * want, "%s, B=%lld T=%lld: step FLOPs %.17g, formula %.17g",
                      tied ? "tied" : "untied", (long long)shapes[i][0], (long long)shapes[i][1], got, want);
            moe_model_destroy(m);
        }
}
