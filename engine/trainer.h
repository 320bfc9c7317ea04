/* trainer.h: AdamW, the learning-rate schedule, gradient accumulation and
 * clipping, and evaluation, over a moe_model and moe_data sources. */
#ifndef MOE_ENGINE_TRAINER_H
#define MOE_ENGINE_TRAINER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/data.h"
#include "engine/model.h"
#include "moe.h"

typedef enum moe_lr_schedule {
    MOE_LR_COSINE = 0,
    MOE_LR_LINEAR,
    MOE_LR_CONSTANT,
    /* Warm-up, stable at lr, then a linear decay to min_lr over the last
     * decay_frac of the steps after warm-up (MiniCPM's WSD): a run stopped
     * before its decay is a checkpoint to decay from, or to continue. */
    MOE_LR_WSD,
} moe_lr_schedule;

/* The order of a pipeline's micro-batches (moe_model_stage): GPipe runs
 * every forward, then every backward, the last micro-batch's first; 1F1B
 * starts the backwards as soon as the last stage can, so a stage holds at
 * most (stages - stage) forwards in flight without interleaving (more with
 * chunks: moe_pipe_schedule_ops). On one stage 1F1B is the plain
 * forward, backward, forward, ... and GPipe keeps every micro-batch's
 * forward until the end (recomputing their activations: moe_trainer_step). */
typedef enum moe_pipe_schedule {
    MOE_PIPE_1F1B = 0,
    MOE_PIPE_GPIPE,
} moe_pipe_schedule;

/* One op of a stage's schedule: micro-batch micro's forward or backward
 * through the stage's chunk (moe_model_stage_forward). */
typedef struct moe_pipe_op {
    bool backward;
    int chunk;
    int64_t micro;
} moe_pipe_op;

/* Whether a pipeline of stages x chunks can run M micro-batches under
 * kind: chunks 1 to MOE_MODEL_CHUNKS_MAX, more than 1 only interleaving
 * 1F1B on several stages, with M a multiple of stages; the error names the
 * flags (MOE_ERR_CONFIG). */
moe_status moe_pipe_schedule_check(moe_pipe_schedule kind, int stages, int chunks, int64_t M);

/* Stage `stage` of `stages`' order of its 2 x chunks x M ops, into ops
 * [2 chunks M]. With chunks > 1, 1F1B interleaves them as Megatron-LM's
 * virtual pipeline does: the forwards go chunk by chunk in groups of
 * `stages` micro-batches (the backwards the other way round), and each
 * stage first runs the forwards that fill the pipeline below it,
 * 2 (stages - stage - 1) + (chunks - 1) x stages of them; the bubble is then about
 * 1 / chunks of plain 1F1B's, for more forwards in flight. Fails as
 * moe_pipe_schedule_check. */
moe_status moe_pipe_schedule_ops(moe_pipe_op *ops, moe_pipe_schedule kind, int stage, int stages, int chunks,
                                 int64_t M);

/* A message between two virtual stages as one stage posts it: the output
 * of one of its ops for a neighbour, or the input of one from a
 * neighbour (a forward's activations, a backward's gradient). */
typedef struct moe_pipe_post {
    int64_t op;     /* the stage's op (moe_pipe_plan.ops) that sends it or receives it */
    bool send;
    int from;       /* the virtual stage that sends it, chunk x stages + stage */
    int64_t at;     /* when the op that makes it ends on the plan's timeline */
    int64_t before; /* posted before the stage's op `before` (n_ops: after the last) */
    int64_t slot;   /* a receive's buffer: forward inputs and gradients are numbered apart */
} moe_pipe_post;

/* When a stage posts its messages, so that no backend's matching can make
 * two stages wait on each other. NCCL pairs a sender's sends with its
 * peer's receives in the order posted, without tags; a send (or receive)
 * completes only once its peer's receive (send) is posted; and an NCCL
 * group holds up what follows it on its stream until all of its messages
 * are through. The plan takes every stage's schedule through one
 * timeline (each op as soon as its input is there and the one before it
 * done; a backward costing two forwards) and gives each message the time
 * its op ends there. Before each op a stage posts, as one group, the
 * messages due by that op's start there, in order of time: a message
 * then waits for nothing but messages of earlier times, and the stages
 * keep the timeline's order whatever their speeds, once every pair of
 * neighbours is connected (the trainer exchanges one message each way
 * first: NCCL connects a pair at its first message, in a launch that
 * waits for the peer). On a stream of their own the messages keep the
 * timeline's bubble too; on the compute's stream a receive posted early
 * would hold up the ops before it.
 * Receive buffers are reused once the op that reads them is done (under
 * GPipe a forward's input is kept for its replay). forward_only: chunks
 * x M forwards, micro-batch by micro-batch, as an evaluation runs them. */
typedef struct moe_pipe_plan {
    int64_t n_ops;        /* 2 chunks M, or chunks M forward_only */
    moe_pipe_op *ops;     /* [n_ops] the stage's order */
    int64_t n_posts;
    moe_pipe_post *posts; /* [n_posts] in the order posted */
    int64_t *input;       /* [n_ops] the post that receives op i's input; -1: none */
    int64_t *forward;     /* [M chunks] where micro-batch m's forward through chunk c is among ops, at m chunks + c */
    int64_t slots[2];     /* receive buffers used: forward inputs, gradients */
} moe_pipe_plan;

moe_status moe_pipe_plan_create(moe_pipe_plan **plan, moe_pipe_schedule kind, bool forward_only, int stage, int stages,
                                int chunks, int64_t M);
void moe_pipe_plan_destroy(moe_pipe_plan *plan);

typedef struct moe_optim_config {
    double lr;          /* peak learning rate */
    double min_lr;      /* reached at total_steps by cosine and linear */
    int64_t warmup;     /* steps of linear warm-up from lr / warmup */
    int64_t total_steps;
    moe_lr_schedule schedule;
    double decay_frac;  /* MOE_LR_WSD's decay, a share of the steps after warm-up, in (0, 1] */
    double weight_decay; /* decoupled, on every matrix, none on norms */
    double beta1, beta2, eps;
    double grad_clip;   /* global L2 norm; 0 = off */
    int64_t grad_accum; /* micro-batches per step, which a pipeline's stages run in order */
    moe_pipe_schedule pipe_schedule;
    int zero;           /* 1: AdamW state sharded across each run's group (ZeRO stage 1); 0: replicated */
} moe_optim_config;

/* PyTorch AdamW defaults with beta2 = 0.95, as LLM training uses. */
#define MOE_OPTIM_CONFIG_INIT                                                                       \
    {                                                                                               \
        .lr = 3e-4, .min_lr = 3e-5, .warmup = 0, .total_steps = 1, .schedule = MOE_LR_COSINE,      \
        .decay_frac = 0.2,                                                                          \
        .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .grad_clip = 1.0,            \
        .grad_accum = 1, .pipe_schedule = MOE_PIPE_1F1B, .zero = 0                                  \
    }

moe_status moe_optim_config_validate(const moe_optim_config *cfg);

/* The learning rate of step s (0-based): lr * (s + 1) / warmup during the
 * warm-up, then lr decaying to min_lr, which the last step (total_steps - 1)
 * gets, for cosine and linear. A warm-up that fills the whole run never
 * decays (moe_run warns about it). */
double moe_lr_at(const moe_optim_config *cfg, int64_t step);

typedef struct moe_trainer moe_trainer;

/* The trainer uses (does not own) the model and reads its batches of the
 * model's B x T shape.
 *
 * zero = 1 shards the AdamW state as ZeRO stage 1 does: each run of the
 * model's arrays (moe_model_run) is cut into equal blocks, one per rank of
 * the run's group (the dense run across the world, the stage's data-parallel
 * ranks, the experts across their replicas); a rank keeps the moments of its block only. A step then
 * reduce-scatters each run's gradients (one non-blocking reduce-scatter per
 * run after the backward: a block spans many layers, so its sum cannot start
 * before the run's last layer is done, and a reduce-scatter plus the
 * all-gather below move the bytes of the all-reduce they replace), takes
 * the global norm from the blocks, updates its block and all-gathers the
 * parameters. A run whose group is one rank stays whole. The loss curve is
 * that of zero = 0 up to float summation order.
 *
 * On an inference model (moe_model_parallel.inference), which has no
 * gradients, the trainer evaluates only (moe_trainer_eval): it keeps no
 * AdamW state, and moe_trainer_step refuses. */
moe_status moe_trainer_create(moe_trainer **trainer, moe_model *model, const moe_optim_config *cfg);
void moe_trainer_destroy(moe_trainer *trainer);

typedef struct moe_step_metrics {
    int64_t step;          /* steps done after this one */
    double loss, ce_loss, logit_z_loss, aux_loss, seq_aux_loss, z_loss;
    double lr;
    double grad_norm;      /* before clipping */
    double load_imbalance;
    double rank_imbalance; /* of this rank's expert-parallel group (moe_layer_stats) */
    double dropped_frac;
    /* The pipeline's bubble as measured: the stages' mean share of the
     * schedule's wall time, from a stage's first forward to the moment the
     * last stage is done, spent waiting for another stage (0 on one
     * stage). With stages of equal cost the ideal is (stages - 1) /
     * (grad_accum + stages - 1) under either schedule. */
    double pipeline_idle;
    /* Stragglers: each rank's busy time, its wall time from the step's
     * start to the end of its last backward less the time it spent waiting
     * in communicator calls (moe_comm_wait_seconds: for other stages, for
     * the routing totals every MoE layer gathers, for expert-parallel rows),
     * gathered over every rank of the grid. A slow rank is one whose own
     * work takes longer; its peers wait for it. busy_s is this rank's;
     * slowest_rank is the rank of the grid with the most, busy_max_s (the
     * lowest such rank on a tie); busy_median_s the ranks' median, the
     * lower middle one of an even count (so that one slow rank of two
     * stands against the other, not against their mean). */
    double busy_s, busy_max_s, busy_median_s;
    int slowest_rank;
    /* Bytes of expert rows a rank sent to the others in the step (both
     * directions of every exchange, forward and backward), the ranks'
     * mean; 0 without expert parallelism. */
    double exchange_bytes;
} moe_step_metrics;

/* One optimizer step over grad_accum micro-batches of data. On a pipeline
 * (moe_model_stage) every stage reads the same micro-batches, the first
 * stage's inputs and the last's targets, and runs the schedule: a chunk
 * receives each forward's input from the virtual stage before, sends its
 * output to the one after (round the ring of stages when they
 * interleave), and the gradients flow back the same way, posted as the
 * plan says (moe_pipe_plan_create); sends are non-blocking, each from its
 * own buffer, and complete before the step ends. Under 1F1B a stage keeps the
 * activations of each forward in flight (at most stages - stage of them
 * without interleaving), each on an instance of the model of its own (the
 * model and its twins, moe_model_create_twin, a twin holding the chunks
 * that keep that many in flight), and recomputes nothing. GPipe keeps one
 * micro-batch's activations, as the GPipe paper does: a backward whose
 * forward is not the last one run recomputes it first from the input it
 * kept (its jitter noise drawn again, no load counted twice), so every
 * stage recomputes all forwards but the last (the backwards run last
 * micro-batch first). A stage also keeps, per micro-batch of the step,
 * 2 x chunks messages to send, and the plan's receive buffers, B*T x
 * hidden each. The metrics are the whole model's, on every stage. */
/* The last step's expert load, [num_hidden_layers, E]: per layer, the
 * (token, slot) pairs each expert kept over the global batch, its
 * micro-batches summed; every stage's layers, on every rank. Zeros before
 * the first step. */
const double *moe_trainer_expert_load(const moe_trainer *trainer);

moe_status moe_trainer_step(moe_trainer *trainer, moe_data *data, moe_step_metrics *metrics);

/* Whether the last step failed because a rank's share of its batch failed
 * its checks (moe_model_check_batch, the data's own): then every rank
 * failed before any work, the data position is back where the step found
 * it, and the model and optimizer are the previous step's, for a
 * checkpoint to save. */
bool moe_trainer_batch_refused(const moe_trainer *trainer);

/* Whether the last step failed because its gradient norm was not finite
 * (MOE_ERR_CONFIG: the loss diverged), having updated nothing. */
bool moe_trainer_diverged(const moe_trainer *trainer);

/* Steps taken so far. */
int64_t moe_trainer_steps_done(const moe_trainer *trainer);
/* The model it trains (moe_trainer_create's). */
moe_model *moe_trainer_model(const moe_trainer *trainer);
void moe_trainer_set_steps_done(moe_trainer *trainer, int64_t steps);

/* AdamW's moments [param_count] each, indexed like the parameters, when no
 * run is sharded (zero = 0, or every group one rank); NULL otherwise (see
 * moe_trainer_shard). */
float *moe_trainer_adam_m(moe_trainer *trainer);
float *moe_trainer_adam_v(moe_trainer *trainer);

/* The moments live in the model's backend memory; adam_m, adam_v and the
 * m, v of moe_trainer_shard are their host view: the arrays themselves on a
 * host-visible backend, else a copy that pull refreshes (NULL before the
 * first pull) and push writes back. */
moe_status moe_trainer_pull(moe_trainer *trainer);
moe_status moe_trainer_push(moe_trainer *trainer);

/* The AdamW state this rank keeps for one run of the model's arrays: the
 * moments of parameters [begin, end). Unsharded, that is the whole run, and
 * every rank of the run's group keeps the same (shared); sharded, this rank's
 * block: blocks are padded / group size long, in rank order, the last ones
 * cut at the end of the run (possibly empty). */
typedef struct moe_optim_shard {
    int64_t begin, end; /* into the model's parameter array */
    float *m, *v;       /* [end - begin] */
    bool shared;        /* the whole run, replicated on every rank of its group */
} moe_optim_shard;

moe_optim_shard moe_trainer_shard(moe_trainer *trainer, moe_model_run_id run);

/* Bytes of AdamW moments this rank holds, for the start-up report: with
 * zero = 1 about 1/W of the dense run's and 1/R of the experts' (W ranks, R
 * replicas of each expert) of what zero = 0 holds. */
int64_t moe_trainer_optimizer_bytes(const moe_trainer *trainer);

/* Backend bytes of this rank's activations: the model's and its twins'
 * (moe_model_activation_bytes) and the pipeline's messages in flight. */
int64_t moe_trainer_activation_bytes(const moe_trainer *trainer);

/* Called after each evaluation batch with that batch's targets [B*T], the
 * batch index, and the model (whose last per-token losses and router
 * choices describe the batch); a failure ends the evaluation. */
typedef moe_status (*moe_eval_fn)(void *ctx, moe_model *model, const int32_t *targets, int64_t batch);

/* Mean cross-entropy over n_batches batches of data read from its start, in
 * eval mode (no jitter). data's position is restored afterwards. */
moe_status moe_trainer_eval(moe_trainer *trainer, moe_data *data, int64_t n_batches, double *val_loss,
                            moe_eval_fn on_batch, void *ctx);

/* Writes batch `batch` of a moe_trainer_forward_batches into this rank's
 * inputs and targets [B*T] (targets < 0 count for nothing); every rank of
 * a pipeline fills it (the first stage reads the inputs, the last the
 * targets). A failure ends the forwards. */
typedef moe_status (*moe_fill_fn)(void *ctx, int64_t batch, int32_t *inputs, int32_t *targets);

/* The forwards of n_batches batches that fill writes, as moe_trainer_eval
 * runs them (through the pipeline, in eval mode), on_batch (may be NULL)
 * after each: on the last stage the model's last per-token losses are the
 * batch's. Collective over the grid. */
moe_status moe_trainer_forward_batches(moe_trainer *trainer, int64_t n_batches, moe_fill_fn fill, moe_eval_fn on_batch,
                                       void *ctx);

#endif /* MOE_ENGINE_TRAINER_H */
