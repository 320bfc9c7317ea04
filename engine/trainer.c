/* trainer.c: one step = grad_accum micro-batches forward and backward, the
 * global gradient norm, clipping, and AdamW tensor by tensor (weight decay
 * only where the tensor table says so). */
#include "engine/trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/status.h"
#include "kernels/ops.h"

struct moe_trainer {
    moe_model *model;
    moe_optim_config cfg;
    const moe_ops *ops;
    int64_t steps_done;
    float *m, *v;       /* [n_params] each, one allocation */
    int32_t *inputs;    /* [B, T] */
    int32_t *targets;   /* [B, T] */
};

moe_status moe_optim_config_validate(const moe_optim_config *c) {
    if (!c) return moe_error(MOE_ERR_INVALID_ARG, "optimizer config: NULL");
    if (!isfinite(c->lr) || c->lr <= 0.0) return moe_error(MOE_ERR_CONFIG, "--lr %g must be positive", c->lr);
    if (!isfinite(c->min_lr) || c->min_lr < 0.0 || c->min_lr > c->lr)
        return moe_error(MOE_ERR_CONFIG, "--min-lr %g must be in [0, lr=%g]", c->min_lr, c->lr);
    if (c->warmup < 0) return moe_error(MOE_ERR_CONFIG, "--warmup %lld must not be negative", (long long)c->warmup);
    if (c->total_steps <= 0) return moe_error(MOE_ERR_CONFIG, "--steps %lld must be positive", (long long)c->total_steps);
    if (c->schedule != MOE_LR_COSINE && c->schedule != MOE_LR_LINEAR && c->schedule != MOE_LR_CONSTANT)
        return moe_error(MOE_ERR_CONFIG, "lr schedule %d unknown", (int)c->schedule);
    if (!isfinite(c->weight_decay) || c->weight_decay < 0.0)
        return moe_error(MOE_ERR_CONFIG, "--weight-decay %g must be finite and not negative", c->weight_decay);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0) || !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return moe_error(MOE_ERR_CONFIG, "adam betas (%g, %g) must be in [0, 1)", c->beta1, c->beta2);
    if (!isfinite(c->eps) || c->eps <= 0.0) return moe_error(MOE_ERR_CONFIG, "adam eps %g must be positive", c->eps);
    if (!isfinite(c->grad_clip) || c->grad_clip < 0.0)
        return moe_error(MOE_ERR_CONFIG, "--grad-clip %g must be finite and not negative", c->grad_clip);
    if (c->grad_accum <= 0) return moe_error(MOE_ERR_CONFIG, "--grad-accum %lld must be positive", (long long)c->grad_accum);
    return MOE_OK;
}

double moe_lr_at(const moe_optim_config *c, int64_t step) {
    if (step < c->warmup) return c->lr * (double)(step + 1) / (double)c->warmup;
    if (c->schedule == MOE_LR_CONSTANT) return c->lr;
    int64_t decay_steps = c->total_steps - c->warmup;
    if (decay_steps <= 1) return c->lr;
    double progress = (double)(step - c->warmup) / (double)(decay_steps - 1);
    if (progress > 1.0) progress = 1.0;
    double frac = c->schedule == MOE_LR_COSINE ? 0.5 * (1.0 + cos(3.14159265358979323846 * progress)) : 1.0 - progress;
    return c->min_lr + (c->lr - c->min_lr) * frac;
}

moe_status moe_trainer_create(moe_trainer **out, moe_model *model, const moe_optim_config *cfg) {
    if (!out || !model) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_create: NULL argument");
    *out = NULL;
    MOE_TRY(moe_optim_config_validate(cfg));
    moe_trainer *t = calloc(1, sizeof *t);
    if (!t) return moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: struct");
    t->model = model;
    t->cfg = *cfg;
    t->ops = moe_cpu_ops();
    const int64_t n = moe_model_param_count(model), BT = moe_model_batch_size(model) * moe_model_seq_len(model);
    t->m = calloc((size_t)(2 * n), sizeof(float));
    t->inputs = calloc((size_t)(2 * BT), sizeof(int32_t));
    if (!t->m || !t->inputs) {
        moe_trainer_destroy(t);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: AdamW state for %lld parameters", (long long)n);
    }
    t->v = t->m + n;
    t->targets = t->inputs + BT;
    *out = t;
    return MOE_OK;
}

void moe_trainer_destroy(moe_trainer *t) {
    if (!t) return;
    free(t->m);
    free(t->inputs);
    free(t);
}

int64_t moe_trainer_steps_done(const moe_trainer *t) { return t->steps_done; }
void moe_trainer_set_steps_done(moe_trainer *t, int64_t steps) { t->steps_done = steps; }
float *moe_trainer_adam_m(moe_trainer *t) { return t->m; }
float *moe_trainer_adam_v(moe_trainer *t) { return t->v; }

/* Each rank's losses are means over its rows; the step's are over the world
 * (every rank has the same number of rows). */
static moe_status world_mean(moe_model *model, double *a, double *b) {
    moe_comm *world = moe_model_world(model);
    if (!world) return MOE_OK;
    double v[2] = {*a, *b};
    MOE_TRY(moe_comm_allreduce_sum(world, v, 2, MOE_COMM_F64));
    *a = v[0] / moe_model_world_size(model);
    *b = v[1] / moe_model_world_size(model);
    return MOE_OK;
}

moe_status moe_trainer_step(moe_trainer *t, moe_data *data, moe_step_metrics *metrics) {
    if (!t || !data) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_step: NULL argument");
    moe_model *model = t->model;
    const moe_optim_config *c = &t->cfg;
    const int64_t B = moe_model_batch_size(model), T = moe_model_seq_len(model);
    const float micro_scale = 1.0f / (float)c->grad_accum;
    moe_model_stats sum = {0};

    /* Data parallelism: the global batch is world x B rows, this rank's are
     * rows rank*B .. rank*B + B - 1 of it. */
    const int W = moe_model_world_size(model), rank = moe_model_world_rank(model);
    moe_model_set_training(model, true);
    moe_model_zero_grad(model);
    for (int64_t micro = 0; micro < c->grad_accum; micro++) {
        MOE_TRY(moe_data_next_batch(data, t->inputs, t->targets, (int64_t)W * B, (int64_t)rank * B, B, T));
        moe_model_stats s;
        MOE_TRY(moe_model_forward(model, t->inputs, t->targets, &s));
        moe_model_set_grad_sync(model, micro + 1 == c->grad_accum);
        MOE_TRY(moe_model_backward(model, t->inputs, t->targets, micro_scale));
        sum.loss += s.loss;
        sum.ce_loss += s.ce_loss;
        sum.aux_loss += s.aux_loss;
        sum.z_loss += s.z_loss;
        sum.load_imbalance += s.load_imbalance;
        sum.dropped_frac += s.dropped_frac;
        moe_model_update_router_bias(model);
    }

    MOE_TRY(moe_model_finish_grad_sync(model));
    MOE_TRY(world_mean(model, &sum.loss, &sum.ce_loss));

    const int64_t n = moe_model_param_count(model);
    float *params = moe_model_params(model), *grads = moe_model_grads(model);
    double sumsq;
    MOE_TRY(moe_model_grad_sumsq(model, &sumsq));
    const double norm = sqrt(sumsq);
    if (!isfinite(norm))
        return moe_error(MOE_ERR_INTERNAL, "step %lld: gradient norm is %g (the loss diverged; lower --lr)",
                         (long long)t->steps_done + 1, norm);
    /* Clipping scales the gradient by clip / norm; AdamW is not scale-free
     * because of eps, so the scaling is applied to the gradients themselves. */
    if (c->grad_clip > 0.0 && norm > c->grad_clip) {
        const float scale = (float)(c->grad_clip / norm);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) grads[i] *= scale;
    }
    const double lr = moe_lr_at(c, t->steps_done);
    const int64_t adam_t = t->steps_done + 1;
    for (int64_t i = 0; i < moe_model_tensor_count(model); i++) {
        const moe_model_tensor *tensor = moe_model_tensor_at(model, i);
        int64_t off = tensor->offset;
        t->ops->adamw(params + off, t->m + off, t->v + off, grads + off, tensor->numel, (float)lr, (float)c->beta1,
                      (float)c->beta2, (float)c->eps, tensor->decay ? (float)c->weight_decay : 0.0f, adam_t);
    }
    t->steps_done++;
    if (metrics) {
        const double a = (double)c->grad_accum;
        *metrics = (moe_step_metrics){
            .step = t->steps_done, .loss = sum.loss / a, .ce_loss = sum.ce_loss / a, .aux_loss = sum.aux_loss / a,
            .z_loss = sum.z_loss / a, .lr = lr, .grad_norm = norm, .load_imbalance = sum.load_imbalance / a,
            .dropped_frac = sum.dropped_frac / a};
    }
    return MOE_OK;
}

moe_status moe_trainer_eval(moe_trainer *t, moe_data *data, int64_t n_batches, double *val_loss, moe_eval_fn on_batch,
                            void *ctx) {
    if (!t || !data || !val_loss) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_eval: NULL argument");
    if (n_batches <= 0) return moe_error(MOE_ERR_CONFIG, "--eval-batches %lld must be positive", (long long)n_batches);
    moe_model *model = t->model;
    const int64_t B = moe_model_batch_size(model), T = moe_model_seq_len(model);
    const int W = moe_model_world_size(model), rank = moe_model_world_rank(model);
    const moe_data_position saved = moe_data_get_position(data);
    MOE_TRY(moe_data_set_position(data, (moe_data_position){0, 0}));
    moe_model_set_training(model, false);
    double total = 0.0;
    moe_status st = MOE_OK;
    for (int64_t b = 0; b < n_batches && st == MOE_OK; b++) {
        moe_model_stats s;
        st = moe_data_next_batch(data, t->inputs, t->targets, (int64_t)W * B, (int64_t)rank * B, B, T);
        if (st == MOE_OK) st = moe_model_forward(model, t->inputs, t->targets, &s);
        if (st == MOE_OK) {
            total += s.ce_loss;
            if (on_batch) on_batch(ctx, model, t->targets, b);
        }
    }
    moe_model_set_training(model, true);
    moe_status restore = moe_data_set_position(data, saved);
    if (st != MOE_OK) return st;
    MOE_TRY(restore);
    double unused = 0.0;
    MOE_TRY(world_mean(model, &total, &unused));
    *val_loss = total / (double)n_batches;
    return MOE_OK;
}
