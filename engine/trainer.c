/* trainer.c: one step = grad_accum micro-batches forward and backward (in
 * a pipeline schedule's order when the model is a stage of one), the
 * global gradient norm, clipping, and AdamW tensor by tensor (weight decay
 * only where the tensor table says so), on the whole model or, with ZeRO,
 * on this rank's block of each run. */
#include "engine/trainer.h"

#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/median.h"
#include "common/status.h"
#include "engine/device.h"
#include "kernels/ops.h"

/* The optimizer's view of one run of the model's arrays. */
typedef struct optim_run {
    moe_model_run run;
    moe_comm *group;       /* the run's group when its state is sharded; NULL: kept whole */
    int64_t block;         /* sharded: padded / group size, this rank's share of the run */
    moe_optim_shard shard; /* the parameters this rank updates and the host view of their moments */
    float *m, *v;          /* the moments in backend memory */
    int64_t state_at;      /* where its moments start in each half of state */
    int64_t grad_at;       /* where its block starts in grad_blocks */
    float *grad;           /* [block] summed by the reduce-scatter when sharded, else the model's
                              gradients from shard.begin: what the update reads */
    moe_adamw_span *spans; /* [n_spans] the shard's tensors by weight decay, backend memory */
    int64_t n_spans;
} optim_run;

struct moe_trainer {
    moe_model *model;
    moe_optim_config cfg;
    const moe_ops *ops;
    int64_t steps_done;
    optim_run runs[MOE_RUN_COUNT];
    bool sharded;        /* some run is */
    int64_t state_count; /* moments of each kind this rank keeps */
    float *state;        /* [2 * state_count]: m, then v, backend memory */
    float *host_state;   /* its host view: state itself when the host sees backend memory */
    float *grad_blocks;  /* [sum of the sharded runs' blocks], backend memory; NULL when none is */
    double *sumsq;       /* [MOE_RUN_COUNT] backend memory */
    moe_adamw_span *spans; /* every run's spans, backend memory */
    int32_t *tokens;     /* [grad_accum][2, B, T]: each micro-batch's inputs, then its targets */
    /* The pipeline, per micro-batch: */
    uint64_t *jitter;    /* [grad_accum] the jitter counter its forward started from */
    /* The pipeline: */
    int chunks;              /* the stage's (moe_model_stage) */
    moe_pipe_plan *plan;     /* a step's ops and when their messages are posted */
    moe_pipe_plan *eval_plan; /* an evaluation batch's */
    const moe_pipe_plan *running; /* the one under way */
    float *stage_in;     /* [slots][B*T, C] forward inputs received (moe_pipe_post.slot) */
    float *grad_out;     /* [slots][B*T, C] output gradients received */
    /* Sends per (micro-batch m, chunk c) at m chunks + c (message_at()),
     * each left alone until the step's end waits for it: */
    float *stage_out;    /* [grad_accum chunks][B*T, C] its output on its way to the next virtual stage */
    float *grad_in;      /* [grad_accum chunks][B*T, C] the gradient of its input on its way back */
    moe_comm_request *requests; /* [the plans' posts] the running plan's, by post */
    int64_t next_post;          /* the running plan's first post not yet made */
    int64_t sends_retired;      /* its sends before this post are seen done */
    /* Where micro-batch m's forward through chunk c runs: instances[m %
     * in_flight[c]], the model and its twins (twin i holding the chunks
     * with more than i forwards in flight); held[i chunks + c]: the
     * micro-batch whose activations instance i's chunk c holds, or -1. */
    moe_model **instances;
    int64_t n_instances;
    int64_t in_flight[MOE_MODEL_CHUNKS_MAX];
    int64_t *held;
    int64_t pipe_bytes; /* stage_in, grad_out, stage_out and grad_in */
    /* The last step's expert load (moe_trainer_expert_load): [layers, E],
     * then this stage's counts [stage layers, E] as the model gives them. */
    double *expert_load;
    int64_t *stage_load;
    double *busy;       /* [3, ranks of the job]: each rank's (busy seconds, exchange bytes) of the last step, then
                           the busy seconds sorted */
    double waited; /* seconds of this step spent waiting for other stages */
    bool batch_refused; /* the last step failed on its batch's checks, having changed nothing */
    bool diverged;      /* the last step failed on a gradient norm that is not finite */
};

moe_status moe_optim_config_validate(const moe_optim_config *c) {
    if (!c) return moe_error(MOE_ERR_INVALID_ARG, "optimizer config: NULL");
    if (!isfinite(c->lr) || c->lr <= 0.0) return moe_error(MOE_ERR_CONFIG, "--lr %g must be positive", c->lr);
    if (!isfinite(c->min_lr) || c->min_lr < 0.0 || c->min_lr > c->lr)
        return moe_error(MOE_ERR_CONFIG, "--min-lr %g must be in [0, lr=%g]", c->min_lr, c->lr);
    if (c->warmup < 0) return moe_error(MOE_ERR_CONFIG, "--warmup %lld must not be negative", (long long)c->warmup);
    if (c->total_steps <= 0) return moe_error(MOE_ERR_CONFIG, "--steps %lld must be positive", (long long)c->total_steps);
    if (c->schedule != MOE_LR_COSINE && c->schedule != MOE_LR_LINEAR && c->schedule != MOE_LR_CONSTANT &&
        c->schedule != MOE_LR_WSD)
        return moe_error(MOE_ERR_CONFIG, "lr schedule %d unknown", (int)c->schedule);
    if (!(c->decay_frac > 0.0 && c->decay_frac <= 1.0))
        return moe_error(MOE_ERR_CONFIG, "--decay-frac %g must be in (0, 1]", c->decay_frac);
    if (!isfinite(c->weight_decay) || c->weight_decay < 0.0)
        return moe_error(MOE_ERR_CONFIG, "--weight-decay %g must be finite and not negative", c->weight_decay);
    /* The decoupled decay scales each matrix by 1 - lr * weight_decay a
     * step: at 1 or more it zeroes or flips them. */
    if (c->lr * c->weight_decay >= 1.0)
        return moe_error(MOE_ERR_CONFIG, "--weight-decay %g times --lr %g is %g: the decay would scale each matrix "
                                         "by 1 - %g a step; keep the product below 1",
                         c->weight_decay, c->lr, c->lr * c->weight_decay, c->lr * c->weight_decay);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0) || !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return moe_error(MOE_ERR_CONFIG, "adam betas (%g, %g) must be in [0, 1)", c->beta1, c->beta2);
    if (!isfinite(c->eps) || c->eps <= 0.0) return moe_error(MOE_ERR_CONFIG, "adam eps %g must be positive", c->eps);
    if (!isfinite(c->grad_clip) || c->grad_clip < 0.0)
        return moe_error(MOE_ERR_CONFIG, "--grad-clip %g must be finite and not negative", c->grad_clip);
    /* Its requests are counted in ints. */
    if (c->grad_accum <= 0 || c->grad_accum > INT_MAX / 2)
        return moe_error(MOE_ERR_CONFIG, "--grad-accum %lld must be in [1, %d]", (long long)c->grad_accum, INT_MAX / 2);
    if (c->zero != 0 && c->zero != 1) return moe_error(MOE_ERR_CONFIG, "--zero %d must be 0 or 1", c->zero);
    if (c->pipe_schedule != MOE_PIPE_1F1B && c->pipe_schedule != MOE_PIPE_GPIPE)
        return moe_error(MOE_ERR_CONFIG, "--pp-schedule %d unknown: expected 1f1b or gpipe", (int)c->pipe_schedule);
    return MOE_OK;
}

double moe_lr_at(const moe_optim_config *c, int64_t step) {
    if (step < c->warmup) return c->lr * (double)(step + 1) / (double)c->warmup;
    if (c->schedule == MOE_LR_CONSTANT) return c->lr;
    int64_t first = c->warmup, decay_steps = c->total_steps - c->warmup;
    if (c->schedule == MOE_LR_WSD) { /* the last decay_frac of them, at least one */
        /* A product a rounding above a whole number is that number. */
        const int64_t decay = (int64_t)ceil(c->decay_frac * (double)decay_steps * (1.0 - 1e-12));
        first = c->total_steps - (decay > 1 ? decay : 1);
        if (step < first) return c->lr;
        decay_steps = c->total_steps - first;
    }
    /* A single decay step is the last step, which gets min_lr; with none
     * (warmup >= total_steps) no step of the run comes here. */
    if (decay_steps <= 1) return c->min_lr;
    /* Cosine and linear start from lr, where the warm-up ends; WSD's
     * decay is its last steps after a stable lr, each of them lower. */
    double progress = c->schedule == MOE_LR_WSD ? (double)(step - first + 1) / (double)decay_steps
                                                : (double)(step - first) / (double)(decay_steps - 1);
    if (progress > 1.0) progress = 1.0;
    double frac = c->schedule == MOE_LR_COSINE ? 0.5 * (1.0 + cos(3.14159265358979323846 * progress)) : 1.0 - progress;
    /* Exact at both ends: min_lr + (lr - min_lr) can round above lr. */
    return frac >= 1.0 ? c->lr : frac <= 0.0 ? c->min_lr : c->min_lr + (c->lr - c->min_lr) * frac;
}

/* Which parameters each run's state covers and where its moments go;
 * returns the length of the reduce-scatter results. Unsharded, the moments
 * are indexed like the parameters (the layout of one rank); sharded, the
 * runs' states follow each other. */
static int64_t plan_runs(moe_trainer *t) {
    for (int r = 0; r < MOE_RUN_COUNT; r++) {
        optim_run *o = &t->runs[r];
        o->run = moe_model_get_run(t->model, (moe_model_run_id)r);
        o->group = t->cfg.zero && o->run.group ? o->run.group : NULL;
        t->sharded |= o->group != NULL;
    }
    int64_t state = 0, grad = 0;
    for (int r = 0; r < MOE_RUN_COUNT; r++) {
        optim_run *o = &t->runs[r];
        moe_optim_shard *s = &o->shard;
        const int64_t run_end = o->run.offset + o->run.count;
        s->begin = o->run.offset;
        s->end = run_end;
        if (o->group) {
            o->block = o->run.padded / moe_comm_size(o->group);
            s->begin += moe_comm_rank(o->group) * o->block;
            s->end = s->begin + o->block < run_end ? s->begin + o->block : run_end;
            if (s->end < s->begin) s->end = s->begin;
        }
        s->shared = o->group == NULL && o->run.group != NULL;
        o->state_at = t->sharded ? state : s->begin;
        o->grad_at = grad;
        state += o->group ? o->block : s->end - s->begin;
        grad += o->group ? o->block : 0;
    }
    t->state_count = t->sharded ? state : moe_model_param_count(t->model);
    return grad;
}

static void carve_runs(moe_trainer *t) {
    float *grads = moe_model_grads(t->model);
    for (int r = 0; r < MOE_RUN_COUNT; r++) {
        optim_run *o = &t->runs[r];
        o->m = t->state + o->state_at;
        o->v = t->state + t->state_count + o->state_at;
        o->shard.m = t->host_state ? t->host_state + o->state_at : NULL;
        o->shard.v = t->host_state ? t->host_state + t->state_count + o->state_at : NULL;
        o->grad = o->group ? t->grad_blocks + o->grad_at : grads + o->shard.begin;
    }
}

/* Where a tensor meets a shard, relative to the shard. */
typedef struct piece {
    int64_t begin, end;
    bool decays;
} piece;

static int by_begin(const void *a, const void *b) {
    const piece *x = a, *y = b;
    return (x->begin > y->begin) - (x->begin < y->begin);
}

/* Each run's shard as spans that weight decay applies to or not, adjacent
 * tensors of one kind merged, in backend memory: the update is one AdamW
 * pass per run whatever the tensor count. */
static moe_status make_spans(moe_trainer *t) {
    moe_model *model = t->model;
    const int64_t n_tensors = moe_model_tensor_count(model);
    piece *pieces = malloc((size_t)(n_tensors ? n_tensors : 1) * sizeof *pieces);
    moe_adamw_span *spans = malloc((size_t)(MOE_RUN_COUNT * n_tensors + 1) * sizeof *spans);
    if (!pieces || !spans) {
        free(pieces), free(spans);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: spans of %lld tensors", (long long)n_tensors);
    }
    int64_t total = 0, first[MOE_RUN_COUNT];
    moe_status st = MOE_OK;
    for (int r = 0; r < MOE_RUN_COUNT && st == MOE_OK; r++) {
        optim_run *o = &t->runs[r];
        const moe_optim_shard *s = &o->shard;
        int64_t n = 0;
        for (int64_t i = 0; i < n_tensors; i++) {
            const moe_model_tensor *tensor = moe_model_tensor_at(model, i);
            const int64_t a = tensor->offset > s->begin ? tensor->offset : s->begin;
            const int64_t b = tensor->offset + tensor->numel < s->end ? tensor->offset + tensor->numel : s->end;
            if (a < b) pieces[n++] = (piece){a - s->begin, b - s->begin, tensor->decay};
        }
        qsort(pieces, (size_t)n, sizeof *pieces, by_begin);
        first[r] = total;
        o->n_spans = 0;
        int64_t covered = 0;
        for (int64_t j = 0; j < n && st == MOE_OK; j++) {
            if (pieces[j].begin != covered)
                st = moe_error(MOE_ERR_INTERNAL, "trainer: run %d's parameters [%lld, %lld) belong to no tensor", r,
                               (long long)(s->begin + covered), (long long)(s->begin + pieces[j].begin));
            moe_adamw_span *last = o->n_spans ? &spans[total + o->n_spans - 1] : NULL;
            if (last && last->decays == pieces[j].decays)
                last->end = pieces[j].end;
            else
                spans[total + o->n_spans++] = (moe_adamw_span){pieces[j].end, pieces[j].decays};
            covered = pieces[j].end;
        }
        if (st == MOE_OK && covered != s->end - s->begin)
            st = moe_error(MOE_ERR_INTERNAL, "trainer: run %d's parameters from %lld belong to no tensor", r,
                           (long long)(s->begin + covered));
        total += o->n_spans;
    }
    if (st == MOE_OK) st = t->ops->alloc((void **)&t->spans, (size_t)(total ? total : 1) * sizeof *spans);
    if (st == MOE_OK) st = t->ops->upload(t->spans, spans, (size_t)total * sizeof *spans);
    for (int r = 0; r < MOE_RUN_COUNT && st == MOE_OK; r++) t->runs[r].spans = t->spans + first[r];
    free(pieces), free(spans);
    return st;
}

static moe_status connect_stages(moe_trainer *t);

moe_status moe_trainer_create(moe_trainer **out, moe_model *model, const moe_optim_config *cfg) {
    if (!out || !model) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_create: NULL argument");
    *out = NULL;
    MOE_TRY(moe_optim_config_validate(cfg));
    const bool evaluates_only = moe_model_inference(model);
    moe_trainer *t = calloc(1, sizeof *t);
    if (!t) return moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: struct");
    t->model = model;
    t->cfg = *cfg;
    t->ops = moe_model_ops(model);
    const int64_t BT = moe_model_batch_size(model) * moe_model_seq_len(model), M = cfg->grad_accum;
    const int64_t grad_blocks = evaluates_only ? 0 : plan_runs(t);
    moe_status st = MOE_OK;
    if (!evaluates_only) st = t->ops->alloc((void **)&t->state, (size_t)(2 * t->state_count) * sizeof(float));
    if (st == MOE_OK && grad_blocks) st = t->ops->alloc((void **)&t->grad_blocks, (size_t)grad_blocks * sizeof(float));
    if (st == MOE_OK) st = t->ops->alloc((void **)&t->sumsq, MOE_RUN_COUNT * sizeof(double));
    if (st != MOE_OK) st = moe_error_prefix(st, "trainer: AdamW state for %lld parameters: ", (long long)t->state_count);
    t->host_state = t->ops->host_visible ? t->state : NULL;
    t->tokens = calloc((size_t)(2 * BT * M), sizeof(int32_t));
    t->jitter = calloc((size_t)M, sizeof *t->jitter);
    moe_comm *job = moe_model_job(model);
    t->busy = calloc((size_t)(3 * (job ? moe_comm_size(job) : 1)), sizeof *t->busy);
    const moe_model_stage stage = moe_model_get_stage(model);
    t->chunks = stage.chunks;
    const int64_t n_ops = 2 * M * t->chunks;
    const moe_model_config *mc = moe_model_get_config(model);
    t->expert_load = calloc((size_t)(mc->num_hidden_layers * mc->num_local_experts), sizeof *t->expert_load);
    t->stage_load = calloc((size_t)(mc->num_hidden_layers * mc->num_local_experts), sizeof *t->stage_load);
    if (st == MOE_OK &&
        (!t->tokens || !t->jitter || !t->busy || !t->expert_load || !t->stage_load))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: %lld micro-batches of %lld tokens", (long long)M, (long long)BT);
    if (st == MOE_OK)
        st = moe_pipe_plan_create(&t->plan, cfg->pipe_schedule, false, stage.index, stage.count, t->chunks, M);
    if (st == MOE_OK)
        st = moe_pipe_plan_create(&t->eval_plan, cfg->pipe_schedule, true, stage.index, stage.count, t->chunks, 1);
    const int64_t act_elems = BT * moe_model_get_config(model)->hidden_size; /* one stage message */
    const size_t act_bytes = (size_t)act_elems * sizeof(float);
    /* A message is one MPI call, whose count is an int. */
    if (st == MOE_OK && stage.pipe && act_elems > INT_MAX)
        st = moe_error(MOE_ERR_CONFIG, "trainer: a pipeline message of B*T x hidden = %lld floats exceeds one "
                                       "message's %d: lower the batch",
                       (long long)act_elems, INT_MAX);
    /* Every chunk of an interleaved stage has a neighbour on either side. */
    const bool from_prev = !stage.first || t->chunks > 1, to_next = !stage.last || t->chunks > 1;
    /* An evaluating trainer sends one micro-batch's forwards and nothing back. */
    const moe_pipe_plan *train = evaluates_only ? t->eval_plan : t->plan;
    const int64_t messages = (evaluates_only ? 1 : M) * t->chunks;
    int64_t slots[2] = {0, 0}, posts = 0;
    for (int b = 0; st == MOE_OK && b < 2; b++)
        slots[b] = train->slots[b] > t->eval_plan->slots[b] ? train->slots[b] : t->eval_plan->slots[b];
    if (st == MOE_OK) posts = train->n_posts > t->eval_plan->n_posts ? train->n_posts : t->eval_plan->n_posts;
    if (st == MOE_OK && posts && !(t->requests = calloc((size_t)posts, sizeof *t->requests)))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: %lld pipeline messages", (long long)posts);
    if (st == MOE_OK && slots[0]) st = t->ops->alloc((void **)&t->stage_in, (size_t)slots[0] * act_bytes);
    if (st == MOE_OK && slots[1]) st = t->ops->alloc((void **)&t->grad_out, (size_t)slots[1] * act_bytes);
    const bool grads_in = from_prev && !evaluates_only;
    if (st == MOE_OK && grads_in) st = t->ops->alloc((void **)&t->grad_in, (size_t)messages * act_bytes);
    if (st == MOE_OK && to_next) st = t->ops->alloc((void **)&t->stage_out, (size_t)messages * act_bytes);
    if (stage.pipe)
        t->pipe_bytes = (int64_t)act_bytes * (slots[0] + slots[1] + (grads_in ? messages : 0) + (to_next ? messages : 0));
    /* 1F1B keeps each forward in flight on an instance of its own: chunk
     * c's forwards and backwards both go in micro-batch order, so its
     * micro-batches in flight are consecutive and m % in_flight[c] tells
     * them apart when in_flight[c] is the most it has in flight (at most
     * stages - stage without interleaving). The chunks' peaks differ, and
     * a twin holds only the chunks that need it. GPipe recomputes the
     * forwards on one instance. */
    t->n_instances = 1;
    for (int c = 0; c < t->chunks; c++) {
        int64_t now = 0;
        t->in_flight[c] = 1;
        for (int64_t i = 0; st == MOE_OK && !evaluates_only && cfg->pipe_schedule == MOE_PIPE_1F1B && i < n_ops; i++)
            if (t->plan->ops[i].chunk == c) {
                now += t->plan->ops[i].backward ? -1 : 1;
                if (now > t->in_flight[c]) t->in_flight[c] = now;
            }
        if (t->in_flight[c] > t->n_instances) t->n_instances = t->in_flight[c];
    }
    t->instances = calloc((size_t)t->n_instances, sizeof *t->instances);
    t->held = calloc((size_t)(t->n_instances * t->chunks), sizeof *t->held);
    if (st == MOE_OK && (!t->instances || !t->held))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "trainer: %lld model instances", (long long)t->n_instances);
    if (st == MOE_OK) t->instances[0] = model;
    for (int64_t i = 1; st == MOE_OK && i < t->n_instances; i++) {
        uint64_t chunks = 0;
        for (int c = 0; c < t->chunks; c++)
            if (t->in_flight[c] > i) chunks |= UINT64_C(1) << c;
        st = moe_model_create_twin(&t->instances[i], model, chunks);
    }
    if (st != MOE_OK) {
        moe_trainer_destroy(t);
        return st;
    }
    if (!evaluates_only) {
        carve_runs(t);
        st = make_spans(t);
    }
    if (st == MOE_OK && stage.pipe) st = connect_stages(t);
    if (st != MOE_OK) {
        moe_trainer_destroy(t);
        return st;
    }
    *out = t;
    return MOE_OK;
}

void moe_trainer_destroy(moe_trainer *t) {
    if (!t) return;
    if (t->host_state != t->state) free(t->host_state);
    t->ops->release(t->state);
    t->ops->release(t->grad_blocks);
    t->ops->release(t->sumsq);
    t->ops->release(t->spans);
    t->ops->release(t->stage_in);
    t->ops->release(t->grad_in);
    t->ops->release(t->stage_out);
    t->ops->release(t->grad_out);
    for (int64_t i = 1; t->instances && i < t->n_instances; i++) moe_model_destroy(t->instances[i]);
    free(t->instances);
    free(t->held);
    free(t->tokens);
    free(t->jitter);
    free(t->busy);
    free(t->requests);
    moe_pipe_plan_destroy(t->plan);
    moe_pipe_plan_destroy(t->eval_plan);
    free(t->expert_load);
    free(t->stage_load);
    free(t);
}

int64_t moe_trainer_steps_done(const moe_trainer *t) { return t->steps_done; }
moe_model *moe_trainer_model(const moe_trainer *t) { return t->model; }
const double *moe_trainer_expert_load(const moe_trainer *t) { return t->expert_load; }
void moe_trainer_set_steps_done(moe_trainer *t, int64_t steps) { t->steps_done = steps; }
float *moe_trainer_adam_m(moe_trainer *t) { return t->sharded ? NULL : t->host_state; }
float *moe_trainer_adam_v(moe_trainer *t) { return t->sharded || !t->host_state ? NULL : t->host_state + t->state_count; }

moe_status moe_trainer_pull(moe_trainer *t) {
    const bool first = !t->host_state;
    const moe_status st = moe_host_view_pull(t->ops, (void **)&t->host_state, t->state,
                                             (size_t)(2 * t->state_count) * sizeof(float), "AdamW state");
    if (first && t->host_state) carve_runs(t); /* the shards' host views point into the new copy */
    return st;
}

moe_status moe_trainer_push(moe_trainer *t) {
    return moe_host_view_push(t->ops, t->state, t->host_state, (size_t)(2 * t->state_count) * sizeof(float),
                              "AdamW state");
}
moe_optim_shard moe_trainer_shard(moe_trainer *t, moe_model_run_id run) { return t->runs[run].shard; }
int64_t moe_trainer_optimizer_bytes(const moe_trainer *t) { return 2 * t->state_count * (int64_t)sizeof(float); }

int64_t moe_trainer_activation_bytes(const moe_trainer *t) {
    int64_t bytes = t->pipe_bytes;
    for (int64_t i = 0; i < t->n_instances; i++) bytes += moe_model_activation_bytes(t->instances[i]);
    return bytes;
}

/* Each rank's losses are means over its rows; the step's are over the world
 * (every rank has the same number of rows). */
/* The loss terms each rank takes over its own tokens, the ranks' mean. */
static moe_status world_mean(moe_model *model, moe_model_stats *s) {
    moe_comm *world = moe_model_world(model);
    if (!world) return MOE_OK;
    double v[3] = {s->loss, s->ce_loss, s->logit_z_loss};
    MOE_TRY(moe_comm_allreduce_sum(world, v, 3, MOE_COMM_F64));
    const double n = moe_model_world_size(model);
    s->loss = v[0] / n, s->ce_loss = v[1] / n, s->logit_z_loss = v[2] / n;
    return MOE_OK;
}

/* Waits for reqs [n], all of them whatever fails, and returns the first
 * failure under what. */
static moe_status wait_all(moe_comm_request *reqs, int n, moe_status st, const char *what) {
    st = moe_comm_wait_all(reqs, n, st);
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "%s: ", what);
}

/* Each sharded run's gradients summed over its group, this rank's block of
 * the sum into its grad; both runs in flight at once. */
static moe_status scatter_grads(moe_trainer *t) {
    const float *grads = moe_model_grads(t->model);
    moe_comm_request reqs[MOE_RUN_COUNT];
    moe_status st = MOE_OK;
    int n = 0;
    for (int r = 0; r < MOE_RUN_COUNT && st == MOE_OK; r++) {
        const optim_run *o = &t->runs[r];
        if (!o->group) continue;
        reqs[n] = (moe_comm_request)MOE_COMM_REQUEST_INIT;
        st = moe_comm_ireduce_scatter_sum(o->run.device_group, &reqs[n++], o->grad, grads + o->run.offset, o->block,
                                          MOE_COMM_F32);
    }
    return wait_all(reqs, n, st, "gradient reduce-scatter");
}

/* Every rank's updated block back into every rank's parameters. The blocks
 * go out from the gradient blocks, which are spent by now, because the
 * destination of an all-gather may not hold its source. */
static moe_status gather_params(moe_trainer *t) {
    float *params = moe_model_params(t->model);
    moe_comm_request reqs[MOE_RUN_COUNT];
    moe_status st = MOE_OK;
    int n = 0;
    for (int r = 0; r < MOE_RUN_COUNT && st == MOE_OK; r++) {
        optim_run *o = &t->runs[r];
        if (!o->group) continue;
        t->ops->copy(o->grad, params + o->shard.begin, (size_t)o->block * sizeof(float));
        reqs[n] = (moe_comm_request)MOE_COMM_REQUEST_INIT;
        st = moe_comm_iallgather(o->run.device_group, &reqs[n++], params + o->run.offset, o->grad, o->block,
                                 MOE_COMM_F32);
    }
    return wait_all(reqs, n, st, "parameter all-gather");
}

/* The squared norm of the whole model's gradient. Sharded, the blocks of all
 * ranks (with the runs kept whole, which then differ from rank to rank)
 * cover every parameter once. */
static moe_status grad_sumsq(moe_trainer *t, double *out) {
    if (!t->sharded) return moe_model_grad_sumsq(t->model, out);
    double parts[MOE_RUN_COUNT], total = 0.0;
    for (int r = 0; r < MOE_RUN_COUNT; r++) {
        const optim_run *o = &t->runs[r];
        t->ops->sumsq(&t->sumsq[r], o->grad, o->shard.end - o->shard.begin);
    }
    MOE_TRY(t->ops->download(parts, t->sumsq, sizeof parts));
    for (int r = 0; r < MOE_RUN_COUNT; r++) total += parts[r];
    moe_comm *world = moe_model_world(t->model), *pipe = moe_model_get_stage(t->model).pipe;
    if (world) MOE_TRY(moe_comm_allreduce_sum(world, &total, 1, MOE_COMM_F64));
    if (pipe) MOE_TRY(moe_comm_allreduce_sum(pipe, &total, 1, MOE_COMM_F64));
    *out = total;
    return MOE_OK;
}

/* AdamW on the parameters this rank updates, one pass per run, on the
 * gradients times grad_scale: a tensor cut by a block boundary keeps its
 * weight-decay flag on either side. */
static void update(moe_trainer *t, float lr, float grad_scale) {
    const moe_optim_config *c = &t->cfg;
    float *params = moe_model_params(t->model);
    const int64_t adam_t = t->steps_done + 1;
    for (int r = 0; r < MOE_RUN_COUNT; r++) {
        const optim_run *o = &t->runs[r];
        const moe_optim_shard *s = &o->shard;
        if (s->end > s->begin)
            t->ops->adamw(params + s->begin, o->m, o->v, o->grad, grad_scale, s->end - s->begin, o->spans,
                          o->n_spans, lr, (float)c->beta1, (float)c->beta2, (float)c->eps, (float)c->weight_decay,
                          adam_t);
    }
}

/* ---------------------------------------------------------------- pipeline */

enum { TAG_FORWARD = 1, TAG_BACKWARD = 2 };

/* The k-th forward (backward) of a stage's chunks x M: under
 * interleaving, the micro-batches go in groups of `stages`, chunk by chunk
 * (the backwards from the last chunk), before the next group. */
static moe_pipe_op nth_op(bool backward, int64_t k, int stages, int chunks) {
    const int64_t group = k / stages, chunk = group % chunks;
    return (moe_pipe_op){.backward = backward, .chunk = (int)(backward ? chunks - 1 - chunk : chunk),
                         .micro = group / chunks * stages + k % stages};
}

moe_status moe_pipe_schedule_check(moe_pipe_schedule kind, int stages, int chunks, int64_t M) {
    if (chunks < 1 || chunks > MOE_MODEL_CHUNKS_MAX)
        return moe_error(MOE_ERR_CONFIG, "--pp-chunks %d: 1 to %d", chunks, MOE_MODEL_CHUNKS_MAX);
    if (chunks == 1) return MOE_OK;
    if (stages < 2) return moe_error(MOE_ERR_CONFIG, "--pp-chunks %d needs --pp > 1", chunks);
    if (kind != MOE_PIPE_1F1B)
        return moe_error(MOE_ERR_CONFIG, "--pp-chunks %d interleaves 1F1B: not with --pp-schedule gpipe", chunks);
    if (M % stages != 0)
        return moe_error(MOE_ERR_CONFIG,
                         "--grad-accum %lld: an interleaved pipeline (--pp-chunks %d) takes its micro-batches in "
                         "groups of --pp %d: a multiple of it",
                         (long long)M, chunks, stages);
    return MOE_OK;
}

moe_status moe_pipe_schedule_ops(moe_pipe_op *ops, moe_pipe_schedule kind, int stage, int stages, int chunks,
                                 int64_t M) {
    MOE_TRY(moe_pipe_schedule_check(kind, stages, chunks, M));
    int64_t n = 0;
    if (kind == MOE_PIPE_GPIPE) {
        for (int64_t i = 0; i < M; i++) ops[n++] = (moe_pipe_op){false, 0, i};
        /* The last forward's activations are still there for its backward. */
        for (int64_t i = M - 1; i >= 0; i--) ops[n++] = (moe_pipe_op){true, 0, i};
        return MOE_OK;
    }
    /* 1F1B: the forwards that fill the pipeline below this stage, then one
     * forward and one backward in turn, then the backwards left. Without
     * interleaving the k-th op of either kind is micro-batch k's. */
    const int64_t total = M * chunks;
    int64_t warm = chunks > 1 ? 2 * (int64_t)(stages - stage - 1) + (int64_t)(chunks - 1) * stages : stages - 1 - stage;
    if (warm > total) warm = total;
    for (int64_t k = 0; k < warm; k++) ops[n++] = nth_op(false, k, stages, chunks);
    for (int64_t k = 0; k < total - warm; k++) {
        ops[n++] = nth_op(false, warm + k, stages, chunks);
        ops[n++] = nth_op(true, k, stages, chunks);
    }
    for (int64_t k = total - warm; k < total; k++) ops[n++] = nth_op(true, k, stages, chunks);
    return MOE_OK;
}

/* Stage `stage`'s order of ops: the schedule's, or forward_only each
 * micro-batch's forwards chunk by chunk. */
static moe_status plan_ops(moe_pipe_op *ops, moe_pipe_schedule kind, bool forward_only, int stage, int stages,
                           int chunks, int64_t M) {
    if (!forward_only) return moe_pipe_schedule_ops(ops, kind, stage, stages, chunks, M);
    for (int64_t m = 0, n = 0; m < M; m++)
        for (int c = 0; c < chunks; c++) ops[n++] = (moe_pipe_op){false, c, m};
    return MOE_OK;
}

/* Whether op of virtual stage v of `last` + 1 takes its input from a
 * neighbour, or sends its result to one. */
static bool op_receives(const moe_pipe_op *op, int v, int last) { return op->backward ? v < last : v > 0; }
static bool op_sends(const moe_pipe_op *op, int v, int last) { return op->backward ? v > 0 : v < last; }

/* A stage's posts go in order of time. Two messages of one time come
 * from different virtual stages (a stage's ops end one at a time), which
 * orders a pair's alike at both ends. */
static int by_time(const void *a, const void *b) {
    const moe_pipe_post *x = a, *y = b;
    if (x->at != y->at) return (x->at > y->at) - (x->at < y->at);
    return (x->from > y->from) - (x->from < y->from);
}

void moe_pipe_plan_destroy(moe_pipe_plan *plan) {
    if (!plan) return;
    free(plan->ops);
    free(plan->posts);
    free(plan->input);
    free(plan->forward);
    free(plan);
}

moe_status moe_pipe_plan_create(moe_pipe_plan **out, moe_pipe_schedule kind, bool forward_only, int stage, int stages,
                                int chunks, int64_t M) {
    if (!out) return moe_error(MOE_ERR_INVALID_ARG, "moe_pipe_plan_create: NULL argument");
    *out = NULL;
    if (stages < 1 || stage < 0 || stage >= stages || chunks < 1 || chunks > MOE_MODEL_CHUNKS_MAX ||
        (chunks > 1 && stages < 2) || M < 1)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_pipe_plan_create: stage %d of %d, %d chunks, %lld micro-batches",
                         stage, stages, chunks, (long long)M);
    const int64_t per = (forward_only ? 1 : 2) * chunks * M; /* each stage's ops */
    const int last = stages * chunks - 1;
    moe_pipe_plan *plan = calloc(1, sizeof *plan);
    moe_pipe_op *all = malloc((size_t)(stages * per) * sizeof *all);
    /* Where each op ends on the timeline, by (backward, virtual stage,
     * micro-batch); -1 until it has run. */
    int64_t *end = malloc((size_t)(2 * (last + 1) * M) * sizeof *end);
    int64_t *done = calloc((size_t)stages, sizeof *done), *clock = calloc((size_t)stages, sizeof *clock);
    int64_t *start = malloc((size_t)per * sizeof *start), *free_slots = malloc((size_t)(2 * per) * sizeof *free_slots);
    if (plan) {
        plan->n_ops = per;
        plan->ops = malloc((size_t)per * sizeof *plan->ops);
        plan->posts = malloc((size_t)(2 * per) * sizeof *plan->posts);
        plan->input = malloc((size_t)per * sizeof *plan->input);
        plan->forward = malloc((size_t)(chunks * M) * sizeof *plan->forward);
    }
    moe_status st = MOE_OK;
    if (!plan || !plan->ops || !plan->posts || !plan->input || !plan->forward || !all || !end || !done || !clock ||
        !start || !free_slots)
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "pipeline plan: %d stages x %lld ops", stages, (long long)per);
    for (int s = 0; s < stages && st == MOE_OK; s++) st = plan_ops(all + s * per, kind, forward_only, s, stages, chunks, M);
    if (st != MOE_OK) goto out;
    memcpy(plan->ops, all + stage * per, (size_t)per * sizeof *all);
    for (int64_t i = 0; i < per; i++)
        if (!plan->ops[i].backward) plan->forward[plan->ops[i].micro * chunks + plan->ops[i].chunk] = i;
#define END_AT(backward, v, m) end[((int64_t)(backward) * (last + 1) + (v)) * M + (m)]
    for (int64_t i = 0; i < 2 * (last + 1) * M; i++) end[i] = -1;
    for (bool moved = true; moved;) {
        moved = false;
        for (int s = 0; s < stages; s++)
            while (done[s] < per) {
                const moe_pipe_op *op = &all[s * per + done[s]];
                const int v = op->chunk * stages + s;
                int64_t ready = clock[s];
                if (op_receives(op, v, last)) {
                    const int64_t sent = END_AT(op->backward, op->backward ? v + 1 : v - 1, op->micro);
                    if (sent < 0) break;
                    if (sent > ready) ready = sent;
                }
                if (s == stage) start[done[s]] = ready;
                clock[s] = ready + (op->backward ? 2 : 1);
                END_AT(op->backward, v, op->micro) = clock[s];
                done[s]++;
                moved = true;
            }
    }
    for (int s = 0; s < stages && st == MOE_OK; s++)
        if (done[s] < per)
            st = moe_error(MOE_ERR_INTERNAL, "pipeline plan: stage %d of %d waits for ever at op %lld", s, stages,
                           (long long)done[s]);
    if (st != MOE_OK) goto out;
    int64_t n = 0;
    for (int64_t i = 0; i < per; i++) {
        const moe_pipe_op *op = &plan->ops[i];
        const int v = op->chunk * stages + stage, from = op->backward ? v + 1 : v - 1;
        if (op_receives(op, v, last))
            plan->posts[n++] = (moe_pipe_post){.op = i, .send = false, .from = from,
                                               .at = END_AT(op->backward, from, op->micro), .slot = -1};
        if (op_sends(op, v, last))
            plan->posts[n++] = (moe_pipe_post){.op = i, .send = true, .from = v,
                                               .at = END_AT(op->backward, v, op->micro), .slot = -1};
    }
#undef END_AT
    plan->n_posts = n;
    qsort(plan->posts, (size_t)n, sizeof *plan->posts, by_time);
    /* Each post before the first op that starts at its time or later; a
     * receive's buffer from those whose readers are done. GPipe replays a
     * forward before its backward, from the input it keeps. */
    const bool keeps = kind == MOE_PIPE_GPIPE && !forward_only;
    int64_t n_free[2] = {0, 0};
    for (int64_t i = 0; i < per; i++) plan->input[i] = -1;
    for (int64_t i = 0, p = 0; i <= per; i++) {
        for (; p < n && (i == per || plan->posts[p].at <= start[i]); p++) {
            moe_pipe_post *post = &plan->posts[p];
            post->before = i;
            if (post->send) continue;
            const int b = plan->ops[post->op].backward;
            post->slot = n_free[b] ? free_slots[b * per + --n_free[b]] : plan->slots[b]++;
            plan->input[post->op] = p;
        }
        if (i == per) break;
        const moe_pipe_op *op = &plan->ops[i];
        const int64_t forward = plan->forward[op->micro * chunks + op->chunk];
        const int64_t done_with[2] = {op->backward || !keeps ? plan->input[i] : -1,
                                      op->backward && keeps ? plan->input[forward] : -1};
        for (int k = 0; k < 2; k++)
            if (done_with[k] >= 0) {
                const moe_pipe_post *post = &plan->posts[done_with[k]];
                const int b = plan->ops[post->op].backward;
                free_slots[b * per + n_free[b]++] = post->slot;
            }
    }
out:
    free(all), free(end), free(done), free(clock), free(start), free(free_slots);
    if (st != MOE_OK) {
        moe_pipe_plan_destroy(plan);
        return st;
    }
    *out = plan;
    return MOE_OK;
}

/* The index of the instance that runs micro-batch micro through chunk. */
static int64_t instance_at(const moe_trainer *t, int chunk, int64_t micro) { return micro % t->in_flight[chunk]; }

/* Where (micro, chunk)'s messages sit among a step's. */
static int64_t message_at(const moe_trainer *t, int64_t micro, int chunk) { return micro * t->chunks + chunk; }

/* A message's share of the pipeline buffers. */
static float *slot(float *buffers, int64_t at, int64_t count) { return buffers ? buffers + at * count : NULL; }

/* Reads micro-batch micro's tokens and checks them. Every stage reads every
 * micro-batch, so the data advance alike and a bad batch fails every stage
 * before any of them waits for another. what: whose data, for the error. */
static moe_status read_batch(moe_trainer *t, moe_data *data, int64_t micro, const char *what) {
    moe_model *model = t->model;
    const int64_t B = moe_model_batch_size(model), T = moe_model_seq_len(model), BT = B * T;
    const int W = moe_model_world_size(model), rank = moe_model_world_rank(model);
    int32_t *inputs = t->tokens + 2 * BT * micro, *targets = inputs + BT;
    /* Data parallelism: the global batch is world x B rows, this rank's are
     * rows rank*B .. rank*B + B - 1 of it. */
    moe_status st = moe_data_next_batch(data, inputs, targets, (int64_t)W * B, (int64_t)rank * B, B, T);
    if (st == MOE_OK) st = moe_model_check_batch(model, inputs, targets);
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "%s: ", what);
}

/* Reads the step's micro-batches. A rank whose batch fails its checks
 * (a token outside the vocabulary, say) fails every rank before any of
 * them starts the step: each learns of it here, puts the data back where
 * the step found them and fails, the rank at fault with its own error, so
 * that the state is the last step's for a checkpoint to save. */
static moe_status read_step_batches(moe_trainer *t, moe_data *data) {
    const moe_data_position before = moe_data_get_position(data);
    moe_status st = MOE_OK;
    for (int64_t micro = 0; micro < t->cfg.grad_accum && st == MOE_OK; micro++)
        st = read_batch(t, data, micro, "training data");
    char why[1024] = "";
    if (st != MOE_OK) snprintf(why, sizeof why, "%s", moe_last_error());
    int at_fault = st != MOE_OK ? moe_model_world_rank(t->model) : -1;
    moe_comm *job = moe_model_job(t->model);
    if (job) {
        /* Every rank's verdict; t->busy is the step's scratch for one per rank until gather_ranks. */
        const double mine = st != MOE_OK;
        MOE_TRY(moe_comm_allgather(job, t->busy, &mine, 1, MOE_COMM_F64));
        at_fault = -1;
        for (int r = moe_comm_size(job) - 1; r >= 0; r--)
            if (t->busy[r] != 0.0) at_fault = r;
    }
    if (at_fault < 0) return MOE_OK;
    t->batch_refused = true;
    MOE_TRY(moe_data_set_position(data, before));
    if (st != MOE_OK) return moe_error(st, "%s (for step %lld)", why, (long long)t->steps_done + 1);
    return moe_error(MOE_ERR_FORMAT, "training data: rank %d's share of the batch for step %lld failed its checks "
                                     "(that rank's error says why)",
                     at_fault, (long long)t->steps_done + 1);
}

bool moe_trainer_batch_refused(const moe_trainer *t) { return t->batch_refused; }

bool moe_trainer_diverged(const moe_trainer *t) { return t->diverged; }

/* A stage message: count floats of B*T x hidden. */
static int64_t message_floats(const moe_model *model) {
    return moe_model_batch_size(model) * moe_model_seq_len(model) * moe_model_get_config(model)->hidden_size;
}

/* The stages before and after this one, around the ring an interleaved
 * pipeline's chunks go through. */
static int prev_stage(const moe_model_stage *stage) { return (stage->index + stage->count - 1) % stage->count; }
static int next_stage(const moe_model_stage *stage) { return (stage->index + 1) % stage->count; }

/* A post's buffer: a receive's slot, or a send's own. */
static float *post_buffer(const moe_trainer *t, const moe_pipe_post *post) {
    const moe_pipe_op *op = &t->running->ops[post->op];
    const int64_t n = message_floats(t->model);
    if (!post->send) return slot(op->backward ? t->grad_out : t->stage_in, post->slot, n);
    return slot(op->backward ? t->grad_in : t->stage_out, message_at(t, op->micro, op->chunk), n);
}

/* Makes the running plan's posts due before op i (every one left, i its
 * op count) and launches them, one group, without waiting. A send copies
 * its op's result into its buffer first. On NCCL the messages go on the
 * pipeline communicator's own stream, so the device finishes what the
 * ops before wrote (the copies) and read (a receive's buffer before it is
 * used again) first; the sync also ends the last op's time, so that a
 * profile gives no op the waits. */
static moe_status post_messages(moe_trainer *t, int64_t i) {
    const moe_pipe_plan *plan = t->running;
    const int64_t first = t->next_post;
    int64_t end = first;
    while (end < plan->n_posts && plan->posts[end].before <= i) end++;
    if (end == first) return MOE_OK;
    const moe_model_stage stage = moe_model_get_stage(t->model);
    const int64_t n = message_floats(t->model);
    for (int64_t p = first; p < end; p++) {
        const moe_pipe_post *post = &plan->posts[p];
        if (!post->send) continue;
        const moe_pipe_op *op = &plan->ops[post->op];
        moe_model *model = t->instances[instance_at(t, op->chunk, op->micro)];
        t->ops->copy(post_buffer(t, post),
                     op->backward ? moe_model_stage_input_grad(model, op->chunk) : moe_model_stage_output(model, op->chunk),
                     (size_t)n * sizeof(float));
    }
    MOE_TRY(t->ops->sync());
    for (int64_t p = first; p < end; p++) {
        const moe_pipe_post *post = &plan->posts[p];
        const moe_pipe_op *op = &plan->ops[post->op];
        /* A forward's output and a backward's input go to the next stage. */
        const int peer = post->send != op->backward ? next_stage(&stage) : prev_stage(&stage);
        const int tag = op->backward ? TAG_BACKWARD : TAG_FORWARD;
        moe_comm_request *req = &t->requests[p];
        *req = (moe_comm_request)MOE_COMM_REQUEST_INIT;
        MOE_TRY(post->send ? moe_comm_isend(stage.device_pipe, req, post_buffer(t, post), n, MOE_COMM_F32, peer, tag)
                           : moe_comm_irecv(stage.device_pipe, req, post_buffer(t, post), n, MOE_COMM_F32, peer, tag));
        t->next_post = p + 1; /* what the step's end waits for, should a later post fail */
    }
    bool done = false;
    return moe_comm_test(&t->requests[end - 1], &done);
}

/* Waits for the message op i of the running plan reads, its wait counted
 * as idle time. */
static moe_status wait_input(moe_trainer *t, int64_t i) {
    const moe_pipe_plan *plan = t->running;
    MOE_TRY(t->ops->sync());
    const double start = omp_get_wtime();
    MOE_TRY(moe_comm_wait(&t->requests[plan->input[i]]));
    t->waited += omp_get_wtime() - start;
    /* Sends complete in the order posted; each that has holds backend
     * resources (an NCCL event slot) until it is seen done, and a step has
     * 2 grad_accum chunks of them. */
    for (; t->sends_retired < t->next_post; t->sends_retired++) {
        if (!plan->posts[t->sends_retired].send) continue;
        bool done = false;
        MOE_TRY(moe_comm_test(&t->requests[t->sends_retired], &done));
        if (!done) break;
    }
    return MOE_OK;
}

/* The running plan's op i, a forward (its tokens read): its input from
 * the virtual stage before, if it takes one, its output for the one
 * after (post_messages sends it). replay: again, before its backward, the
 * input still at hand. */
static moe_status stage_forward(moe_trainer *t, int64_t i, bool replay, moe_model_stats *stats) {
    const moe_pipe_plan *plan = t->running;
    const moe_pipe_op *op = &plan->ops[i];
    const int64_t instance = instance_at(t, op->chunk, op->micro);
    moe_model *model = t->instances[instance];
    const int64_t BT = moe_model_batch_size(model) * moe_model_seq_len(model);
    int32_t *inputs = t->tokens + 2 * BT * op->micro, *targets = inputs + BT;
    const int64_t input = plan->input[i];
    if (!replay) {
        t->jitter[op->micro] = moe_model_jitter_counter(model);
        if (input >= 0) MOE_TRY(wait_input(t, i));
    }
    const float *in = input >= 0 ? post_buffer(t, &plan->posts[input]) : NULL;
    MOE_TRY(moe_model_stage_forward(model, op->chunk, inputs, in, targets, replay, stats));
    t->held[instance * t->chunks + op->chunk] = op->micro;
    return MOE_OK;
}

/* The running plan's op i, a backward, after a replay of its forward
 * when its instance holds another's activations by now; the chunk's last
 * of the step (sync) sums the gradients over the ranks that share them. */
static moe_status stage_backward(moe_trainer *t, int64_t i, bool sync, float grad_scale) {
    const moe_pipe_plan *plan = t->running;
    const moe_pipe_op *op = &plan->ops[i];
    const int64_t instance = instance_at(t, op->chunk, op->micro);
    moe_model *model = t->instances[instance];
    if (plan->input[i] >= 0) MOE_TRY(wait_input(t, i));
    if (t->held[instance * t->chunks + op->chunk] != op->micro) {
        /* GPipe's plan keeps each forward's input until its backward; 1F1B
         * keeps every forward in flight on an instance of its own. */
        if (t->cfg.pipe_schedule != MOE_PIPE_GPIPE)
            return moe_error(MOE_ERR_INTERNAL, "trainer: micro-batch %lld's activations are gone, its forward "
                                               "cannot be replayed",
                             (long long)op->micro);
        const uint64_t latest = moe_model_jitter_counter(model);
        moe_model_set_jitter_counter(model, t->jitter[op->micro]);
        const moe_status st = stage_forward(t, plan->forward[message_at(t, op->micro, op->chunk)], true, NULL);
        moe_model_set_jitter_counter(model, latest);
        MOE_TRY(st);
    }
    moe_model_set_grad_sync(model, sync);
    const float *dy = plan->input[i] >= 0 ? post_buffer(t, &plan->posts[plan->input[i]]) : NULL;
    MOE_TRY(moe_model_stage_backward(model, op->chunk, dy, grad_scale));
    t->held[instance * t->chunks + op->chunk] = -1;
    return MOE_OK;
}

/* One message each way with each neighbour stage, all in one group on
 * every stage. NCCL connects a pair for each direction at its first
 * message there, inside the call that launches that message's group, and
 * the call waits until the peer launches the group with the other end: a
 * plan's group that held a first message beside one its peer needs first
 * could leave both waiting (GPipe on 2 stages, 1F1B on 3). Connected at
 * the start, every pair's messages then only wait for their match. */
static moe_status connect_stages(moe_trainer *t) {
    const moe_model_stage stage = moe_model_get_stage(t->model);
    const int peers[2] = {next_stage(&stage), prev_stage(&stage)};
    const int n_peers = peers[0] == peers[1] ? 1 : 2;
    float *buf = NULL;
    MOE_TRY(t->ops->alloc((void **)&buf, 4 * sizeof(float)));
    moe_comm_request reqs[4];
    moe_status st = MOE_OK;
    int n = 0;
    for (int i = 0; i < n_peers && st == MOE_OK; i++) {
        reqs[n] = (moe_comm_request)MOE_COMM_REQUEST_INIT;
        st = moe_comm_isend(stage.device_pipe, &reqs[n], buf + 2 * i, 1, MOE_COMM_F32, peers[i], TAG_FORWARD);
        if (st == MOE_OK) n++;
        reqs[n] = (moe_comm_request)MOE_COMM_REQUEST_INIT;
        if (st == MOE_OK)
            st = moe_comm_irecv(stage.device_pipe, &reqs[n], buf + 2 * i + 1, 1, MOE_COMM_F32, peers[i], TAG_FORWARD);
        if (st == MOE_OK) n++;
    }
    st = moe_comm_wait_all(reqs, n, st);
    t->ops->release(buf);
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "pipeline: connecting the stages: ");
}

/* Starts the running plan: no post made yet. */
static void start_plan(moe_trainer *t, const moe_pipe_plan *plan) {
    t->running = plan;
    t->next_post = t->sends_retired = 0;
}

/* The stages' shares of the step's statistics add up to the model's;
 * *idle, this stage's share of time spent waiting, becomes the stages'
 * mean. */
static moe_status pipeline_sum(moe_model *model, moe_model_stats *s, double *idle) {
    const moe_model_stage stage = moe_model_get_stage(model);
    if (!stage.pipe) return MOE_OK;
    double v[MOE_MODEL_STATS_FIELDS + 1];
    moe_model_stats_to(v, s);
    v[MOE_MODEL_STATS_FIELDS] = *idle;
    MOE_TRY(moe_comm_allreduce_sum(stage.pipe, v, (int64_t)MOE_MODEL_STATS_FIELDS + 1, MOE_COMM_F64));
    moe_model_stats_from(s, v);
    *idle = v[MOE_MODEL_STATS_FIELDS] / stage.count;
    return MOE_OK;
}

/* The step's expert load over every stage's layers into t->expert_load:
 * this stage's counts at its layers, the other stages' from them. */
static moe_status gather_load(moe_trainer *t) {
    const moe_model_stage stage = moe_model_get_stage(t->model);
    const moe_model_config *c = moe_model_get_config(t->model);
    const int64_t E = c->num_local_experts, n = c->num_hidden_layers * E;
    int64_t layers;
    const int64_t *layer = moe_model_layer_ids(t->model, &layers);
    moe_model_take_expert_load(t->model, t->stage_load);
    for (int64_t i = 0; i < n; i++) t->expert_load[i] = 0.0;
    for (int64_t i = 0; i < layers; i++)
        for (int64_t e = 0; e < E; e++) t->expert_load[layer[i] * E + e] = (double)t->stage_load[i * E + e];
    return stage.pipe ? moe_comm_allreduce_sum(stage.pipe, t->expert_load, n, MOE_COMM_F64) : MOE_OK;
}

/* This rank's expert rows sent so far, over the model and its twins. */
static int64_t exchange_bytes(const moe_trainer *t) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < t->n_instances; i++) bytes += moe_model_exchange_bytes(t->instances[i]);
    return bytes;
}

/* Every rank's busy seconds and exchange bytes into m: the most busy (and
 * whose), the median, the mean bytes. */
static moe_status gather_ranks(moe_trainer *t, double busy, double bytes, moe_step_metrics *m) {
    moe_comm *job = moe_model_job(t->model);
    const int n = job ? moe_comm_size(job) : 1;
    double *all = t->busy, *sorted = t->busy + 2 * n; /* all: [n, 2] */
    const double mine[2] = {busy, bytes};
    if (job)
        MOE_TRY(moe_comm_allgather(job, all, mine, 2, MOE_COMM_F64));
    else
        all[0] = busy, all[1] = bytes;
    int slowest = 0;
    double total = 0.0;
    for (int r = 0; r < n; r++) {
        if (all[2 * r] > all[2 * slowest]) slowest = r;
        total += all[2 * r + 1];
        sorted[r] = all[2 * r];
    }
    m->busy_s = busy;
    m->busy_max_s = all[2 * slowest];
    m->slowest_rank = slowest;
    m->busy_median_s = moe_sort_median(sorted, n);
    m->exchange_bytes = total / n;
    return MOE_OK;
}

moe_status moe_trainer_step(moe_trainer *t, moe_data *data, moe_step_metrics *metrics) {
    if (t && moe_model_inference(t->model))
        return moe_error(MOE_ERR_STATE, "moe_trainer_step: the model is an inference model "
                                        "(moe_model_parallel.inference), which evaluates only");
    if (!t || !data) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_step: NULL argument");
    t->batch_refused = t->diverged = false;
    moe_model *model = t->model;
    const moe_optim_config *c = &t->cfg;
    const moe_model_stage stage = moe_model_get_stage(model);
    const int64_t M = c->grad_accum;
    const float micro_scale = 1.0f / (float)M;
    moe_model_stats sum = {0};
    const double step_start = omp_get_wtime(), waits_start = moe_comm_wait_seconds();
    const int64_t bytes_start = exchange_bytes(t);

    MOE_TRY(read_step_batches(t, data));
    moe_model_take_expert_load(model, NULL); /* this step's forwards alone */
    const moe_pipe_op *ops = t->plan->ops;
    const int64_t n_ops = t->plan->n_ops;
    const double schedule_start = omp_get_wtime();
    t->waited = 0.0;
    start_plan(t, t->plan);
    for (int64_t i = 0; i < t->n_instances; i++) moe_model_set_training(t->instances[i], true);
    for (int64_t i = 0; i < t->n_instances * t->chunks; i++) t->held[i] = -1;
    /* Each chunk's last backward of the step sums its gradients. */
    int64_t last_backward[MOE_MODEL_CHUNKS_MAX];
    for (int64_t i = 0; i < n_ops; i++)
        if (ops[i].backward) last_backward[ops[i].chunk] = i;
    moe_status st = MOE_OK;
    for (int64_t i = 0; i < n_ops && st == MOE_OK; i++) {
        const int chunk = ops[i].chunk;
        st = post_messages(t, i);
        if (st != MOE_OK) break;
        if (!ops[i].backward) {
            moe_model_stats s;
            st = stage_forward(t, i, false, &s);
            if (st != MOE_OK) break;
            /* Zeroed after the first forward, whose token uploads would
             * otherwise wait for the device to finish it. */
            if (i == 0) moe_model_zero_grad(model);
            moe_model_stats_add(&sum, &s);
        } else {
            /* Sharded, every run with a group is reduce-scattered instead. */
            st = stage_backward(t, i, !t->sharded && i == last_backward[chunk], micro_scale);
        }
    }
    if (st == MOE_OK) st = post_messages(t, n_ops);
    /* Every send is done before its buffer is written again. */
    const double sends_start = omp_get_wtime();
    const double busy = sends_start - step_start - (moe_comm_wait_seconds() - waits_start);
    st = moe_comm_wait_all(t->requests, (int)t->next_post, st);
    MOE_TRY(st);
    /* Every stage's share over one span, to the moment the last stage is
     * done: a stage that finishes early waits for the others here. */
    if (stage.pipe) {
        double none = 0.0;
        MOE_TRY(moe_comm_allreduce_sum(stage.pipe, &none, 1, MOE_COMM_F64));
    }
    const double schedule_end = omp_get_wtime();
    t->waited += schedule_end - sends_start;
    double idle = t->waited / (schedule_end - schedule_start);
    /* Whichever instance ran the last backward has the sums in flight. */
    for (int64_t i = 1; i < t->n_instances; i++) MOE_TRY(moe_model_finish_grad_sync(t->instances[i]));
    /* After every micro-batch, so that all of them route with one bias. */
    MOE_TRY(moe_model_update_router_bias(model));

    MOE_TRY(moe_model_finish_grad_sync(model));
    if (t->sharded) MOE_TRY(scatter_grads(t));
    MOE_TRY(world_mean(model, &sum));
    MOE_TRY(pipeline_sum(model, &sum, &idle));
    MOE_TRY(gather_load(t));

    double sumsq;
    MOE_TRY(grad_sumsq(t, &sumsq));
    const double norm = sqrt(sumsq);
    /* The same run diverges again, bit for bit: a setting at fault, no bug. */
    t->diverged = !isfinite(norm);
    if (t->diverged)
        return moe_error(MOE_ERR_CONFIG, "step %lld: gradient norm is %g (the loss diverged; lower --lr)",
                         (long long)t->steps_done + 1, norm);
    /* Clipping scales the gradient by clip / norm; AdamW is not scale-free
     * because of eps, so the scaling applies to the gradients themselves,
     * inside AdamW's pass rather than in a pass of its own. */
    const float clip_scale = c->grad_clip > 0.0 && norm > c->grad_clip ? (float)(c->grad_clip / norm) : 1.0f;
    const double lr = moe_lr_at(c, t->steps_done);
    update(t, (float)lr, clip_scale);
    if (t->sharded) MOE_TRY(gather_params(t));
    MOE_TRY(t->ops->sync());
    t->steps_done++;
    moe_model_stats mean = sum;
    moe_model_stats_div(&mean, (double)c->grad_accum);
    moe_step_metrics m = {
        .step = t->steps_done, .loss = mean.loss, .ce_loss = mean.ce_loss, .aux_loss = mean.aux_loss,
        .logit_z_loss = mean.logit_z_loss, .seq_aux_loss = mean.seq_aux_loss, .z_loss = mean.z_loss, .lr = lr,
        .grad_norm = norm, .load_imbalance = mean.load_imbalance, .rank_imbalance = mean.rank_imbalance,
        .dropped_frac = mean.dropped_frac, .pipeline_idle = stage.pipe ? idle : 0.0};
    MOE_TRY(gather_ranks(t, busy, (double)(exchange_bytes(t) - bytes_start), &m));
    if (metrics) *metrics = m;
    return MOE_OK;
}

/* Forwards only of n_batches batches, which fill writes (NULL: read from
 * data, from its start), chunk after chunk, in eval mode, through the
 * first micro-batch's buffers: a send completes before the next batch
 * reuses its buffer. *total: the sum of this stage's cross-entropies. */
static moe_status forward_batches(moe_trainer *t, int64_t n_batches, moe_fill_fn fill, moe_data *data,
                                  moe_eval_fn on_batch, void *ctx, double *total) {
    moe_model *model = t->model;
    const int64_t BT = moe_model_batch_size(model) * moe_model_seq_len(model);
    moe_model_set_training(model, false);
    *total = 0.0;
    moe_status st = MOE_OK;
    for (int64_t b = 0; b < n_batches && st == MOE_OK; b++) {
        st = fill ? fill(ctx, b, t->tokens, t->tokens + BT) : read_batch(t, data, 0, "validation data");
        if (st != MOE_OK) break;
        start_plan(t, t->eval_plan);
        for (int64_t i = 0; i < t->eval_plan->n_ops && st == MOE_OK; i++) {
            moe_model_stats s;
            st = post_messages(t, i);
            if (st == MOE_OK) st = stage_forward(t, i, false, &s);
            if (st == MOE_OK) *total += s.ce_loss;
        }
        if (st == MOE_OK) st = post_messages(t, t->eval_plan->n_ops);
        st = moe_comm_wait_all(t->requests, (int)t->next_post, st);
        if (st == MOE_OK && on_batch) st = on_batch(ctx, model, t->tokens + BT, b);
    }
    moe_model_set_training(model, true);
    return st;
}

moe_status moe_trainer_forward_batches(moe_trainer *t, int64_t n_batches, moe_fill_fn fill, moe_eval_fn on_batch,
                                       void *ctx) {
    if (!t || !fill) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_forward_batches: NULL argument");
    double total;
    return forward_batches(t, n_batches, fill, NULL, on_batch, ctx, &total);
}

moe_status moe_trainer_eval(moe_trainer *t, moe_data *data, int64_t n_batches, double *val_loss, moe_eval_fn on_batch,
                            void *ctx) {
    if (!t || !data || !val_loss) return moe_error(MOE_ERR_INVALID_ARG, "moe_trainer_eval: NULL argument");
    if (n_batches <= 0) return moe_error(MOE_ERR_CONFIG, "--eval-batches %lld must be positive", (long long)n_batches);
    moe_model *model = t->model;
    const moe_data_position saved = moe_data_get_position(data);
    MOE_TRY(moe_data_set_position(data, (moe_data_position){0, 0}));
    double total;
    const moe_status st = forward_batches(t, n_batches, NULL, data, on_batch, ctx, &total);
    moe_status restore = moe_data_set_position(data, saved);
    if (st != MOE_OK) return st;
    MOE_TRY(restore);
    moe_model_stats sum = {.ce_loss = total};
    MOE_TRY(world_mean(model, &sum));
    double idle = 0.0;
    MOE_TRY(pipeline_sum(model, &sum, &idle));
    *val_loss = sum.ce_loss / (double)n_batches;
    return MOE_OK;
}
