/* run.h: one training or evaluation run, from options to checkpoints and
 * metrics: what `moe-train` does, as a library call, so the driver only
 * parses flags and prints.
 *
 * moe_run builds the data sources, the model config, the model (optionally
 * its weights from a checkpoint), the trainer, and then steps, evaluates and
 * saves. It never prints: everything a user sees arrives through the
 * callbacks, and everything it keeps goes to files under out_dir:
 *   OUT/run.json          the options, the command line, the full model
 *                         config, parameter counts, the sgemm peak, and for
 *                         the synthetic corpus the validation entropy floor
 *   OUT/config.json       the model config (Hugging Face Mixtral)
 *   OUT/metrics.jsonl     one JSON object per step (step, loss, ce_loss,
 *                         aux_loss, z_loss, lr, grad_norm, tokens_per_s, mfu,
 *                         load_imbalance, dropped_frac, pipeline_idle) and one per
 *                         evaluation (step, val_loss, entropy_floor)
 *   OUT/step-NNNNNN/      checkpoints (checkpoint.h)
 * A fresh run starts metrics.jsonl over when it logs its first line. A run
 * resumed from step N, at that moment, first rewrites it (atomically)
 * keeping only the lines that parse as JSON with an integer "step" <= N, so
 * no step is logged twice after a crash (a profile line, which has no step,
 * goes too), then appends; a run that fails before its first line leaves
 * the file as it was.
 * --eval-only writes nothing.
 *
 * Data: "synthetic" (the default) trains on one seeded stream of the
 * built-in corpus and validates on another (seeds derived from --seed);
 * anything else is a file read at byte level, or, when it ends in ".bin"
 * or holds a glob character (* ? [), a glob of llm.c token shards; a
 * regular file of that very name comes first (a byte file
 * "notes[v2].txt", one shard "x[1].bin"), what else the glob matches does
 * not count. Under a tokenizer, a file or glob that is not shards (a .bin
 * name, or a glob whose first file begins as a shard does) is text it
 * encodes at the start (corpus.h's moe_corpus_encode: the stream
 * moe-tokenize's shards of it hold).
 * Without val_data a non-synthetic run validates on the last val_tokens
 * tokens of its data, which the training reader then stops before (a
 * held-out split), or with val_tokens 0 on the training data itself, read
 * from its start, and says so through on_warning.
 *
 * Under mpirun (or with ep, pp or zero set) every rank runs moe_run with the
 * same options: the ranks form pp pipeline stages (engine/grid.h: rank r is
 * stage r / DP), each holding a contiguous range of the layers (pp_chunks
 * of them, interleaved, under --pp-chunks), of DP = ranks
 * / pp data-parallel ranks each, whose global batch is DP x batch_size rows
 * (data-parallel rank d reads rows d*B .. d*B + B - 1, so N such ranks read
 * what one rank with batch N*B reads), and each stage's ranks are split into
 * expert-parallel groups of ep consecutive ones. Every rank checks at
 * start-up that all agree on the build, the model config and the options
 * that shape the run. */
#ifndef MOE_ENGINE_RUN_H
#define MOE_ENGINE_RUN_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/device.h"
#include "engine/model_config.h"
#include "engine/synth_tasks.h"
#include "engine/synthetic.h"
#include "engine/trainer.h"
#include "kernels/ops.h"
#include "kernels/profile.h"
#include "moe.h"

#define MOE_RUN_SYNTHETIC "synthetic"
/* --resume's value that continues the run in --out from its newest
 * checkpoint, or starts it when there is none. */
#define MOE_RUN_RESUME_LATEST "latest"
/* llm.c's shards hold GPT-2 tokens: the vocabulary of the default model
 * when shards are read without a config. */
#define MOE_GPT2_VOCAB_SIZE 50257
#define MOE_RUN_THREADS_MAX 1024

/* What the pipeline's layer partition balances (moe_grid_partition):
 * each layer's and the head's training FLOPs, or their times measured at
 * start-up, one forward and backward of a model of one layer and of two on
 * each rank's device, averaged over the ranks. */
typedef enum moe_pp_balance { MOE_PP_BALANCE_FLOPS = 0, MOE_PP_BALANCE_MEASURED } moe_pp_balance;

typedef struct moe_run_options {
    /* Model */
    const char *config;    /* --config FILE; NULL: --init-from's or --resume's config.json, else the default */
    const char *init_from; /* --init-from DIR: start from these weights */
    bool upcycle;          /* --upcycle: --init-from holds a dense model whose MLPs start every expert
                              (moe_checkpoint_upcycle_weights); --config gives the MoE */
    /* Data */
    const char *data;      /* --data: "synthetic", a file, or a shard glob */
    const char *val_data;  /* --val-data; NULL: see the top of this file */
    int64_t val_tokens;    /* --val-tokens N: without val_data, --data's last N tokens validate and
                              do not train; 0: none held out */
    const char *eval_mc;   /* --eval-mc FILE: llm.c's multiple-choice eval file (mc_eval.h), scored
                              at every evaluation; NULL: none */
    const char *tokenizer; /* --tokenizer FILE: the tokenizer.json of data's token shards, kept with
                              every checkpoint; without a config its ids size the default model */
    bool shuffle;          /* --shuffle the training batches (seeded by --seed) */
    int64_t batch_size;    /* --batch-size B, sequences per micro-batch */
    int64_t seq_len;       /* --seq-len T */
    /* Optimization */
    int64_t steps;         /* --steps: optimizer steps of the whole run */
    double lr;             /* --lr */
    double min_lr;         /* --min-lr; NaN (the default): lr / 10. Refused with a constant schedule */
    int64_t warmup;        /* --warmup steps */
    moe_lr_schedule lr_schedule;
    double decay_frac;     /* --decay-frac: wsd's decay, a share of the steps after warm-up; NaN (the
                              default): MOE_OPTIM_CONFIG_INIT's. Refused with another schedule */
    double weight_decay;   /* --weight-decay */
    double grad_clip;      /* --grad-clip; 0 = off */
    double logit_z_loss;   /* --logit-z-loss: the logits' z-loss coefficient (moe_model_set_logit_z_loss); 0 = off */
    int64_t grad_accum;    /* --grad-accum micro-batches per step */
    uint64_t seed;         /* --seed: initial weights, synthetic streams, shuffle, jitter */
    int threads;           /* --threads; 0: OpenMP's default (OMP_NUM_THREADS, else every core);
                              at most MOE_RUN_THREADS_MAX, past any machine's cores, where OpenMP
                              would fail to start them */
    /* Evaluation and output */
    const char *out_dir;   /* --out */
    int64_t save_every;    /* --save-every steps; 0: the last step only */
    int64_t keep_last;     /* --keep-last: the run's newest checkpoints kept in --out; 0: all */
    /* --resume DIR: a checkpoint of this run to continue; MOE_RUN_RESUME_LATEST:
     * --out's newest no later than its metrics.jsonl's last step, whose
     * config --config must then match (moe_run does nothing when it is at
     * --steps), or none (a new run, from --config or --init-from, replacing a
     * failed start's run.json and metrics.jsonl) when --out has no checkpoint */
    const char *resume;
    bool overwrite;        /* --overwrite: an earlier run in out_dir is removed, not refused */
    int64_t eval_every;    /* --eval-every steps; 0: at the end only */
    int64_t eval_batches;  /* --eval-batches */
    bool eval_only;        /* --eval-only: evaluate --init-from and stop */
    double peak_gflops;    /* --peak-gflops for MFU; 0: measure sgemm at start-up */
    /* Parallelism (under mpirun: every rank runs the same command) */
    int pp;                /* --pp S: pipeline stages, each a contiguous range of layers (pp_chunks of them under
                              --pp-chunks); divides the ranks */
    int pp_chunks;         /* --pp-chunks V: each stage V ranges of layers, interleaved (1F1B); 1: one range */
    moe_pipe_schedule pp_schedule; /* --pp-schedule: the stages' order of micro-batches */
    moe_pp_balance pp_balance;     /* --pp-balance: what the layer partition balances */
    int ep;                /* --ep P: experts split over groups of P consecutive data-parallel ranks */
    int zero;              /* --zero 1: AdamW state sharded over each parameter's replicas */
    double comm_timeout;   /* --comm-timeout seconds a collective may wait for a peer */
    /* --max-time: the run stops after the first step that ends this many
     * seconds or more after moe_run began, as when moe_run_callbacks.stop
     * is set (a job under a wall-time limit); 0: none */
    double max_time;
    bool overlap;          /* --overlap: experts start on half the sources' tokens */
    bool recompute;        /* --recompute: layers keep their inputs only; backwards recompute the rest */
    moe_device device;     /* --device */
    moe_gemm_math gemm_math; /* --gemm-math: the GPU's tensor cores for fp32 GEMMs */
    bool profile;          /* --profile: time each op of the steps after the first */
    const char *command_line; /* recorded in run.json; may be NULL */
} moe_run_options;

/* The built-in default run: moe_run_default_config's model on the synthetic
 * corpus, 2500 steps of 16 x 64 tokens, ending a few percent above the
 * entropy floor in well under three minutes on two cores. */
void moe_run_options_init(moe_run_options *opts);

/* The model a run builds when no config is given. */
void moe_run_default_config(moe_model_config *cfg, int64_t vocab_size);

/* Checks every option; the error names the flag: "--batch-size 0 must be
 * positive". Token counts (batch, step, run, evaluation) must fit int64_t on
 * one rank; moe_run counts again on the job's ranks, and checks that the
 * training data holds one batch and the validation data every token that
 * --eval-batches reads (inside the vocabulary), before it writes anything. */
moe_status moe_run_options_validate(const moe_run_options *opts);

/* "cosine", "linear", "constant". */
const char *moe_lr_schedule_name(moe_lr_schedule schedule);
moe_status moe_lr_schedule_parse(moe_lr_schedule *schedule, const char *name);

/* "1f1b", "gpipe". */
const char *moe_pipe_schedule_name(moe_pipe_schedule schedule);
moe_status moe_pipe_schedule_parse(moe_pipe_schedule *schedule, const char *name);

/* "flops", "measured". */
const char *moe_pp_balance_name(moe_pp_balance balance);
moe_status moe_pp_balance_parse(moe_pp_balance *balance, const char *name);

/* The fp32 GEMM rate of a backend in GFLOP/s through its op table: the best
 * of ~0.3 s of square products, large enough to time (all OpenMP threads on
 * the CPU). */
moe_status moe_measure_gemm_gflops(const moe_ops *ops, double *gflops);

/* ------------------------------------------------------------- reports */

typedef struct moe_run_summary {
    const moe_model_config *config;
    const moe_run_options *options;
    int64_t params, active_params; /* of the whole model, every stage's, each expert once */
    int64_t start_step;      /* > 0 when resumed */
    int64_t tokens_per_step; /* B * T * grad_accum * data-parallel ranks */
    double step_flops;       /* model FLOPs of one optimizer step */
    double peak_gflops;      /* the MFU denominator; NAN for --eval-only without --peak-gflops */
    bool peak_measured;      /* false when given by --peak-gflops or not needed */
    double entropy_floor;    /* of the validation targets; NAN unless synthetic */
    int threads;
    const char *device;      /* the backend the model runs on: "cpu", "cuda: NVIDIA H200 (sm_90, 132 SMs)" */
    const char *device_note; /* why --device auto chose the CPU, or NULL */
    const char *placement;   /* where this rank's GPU sits and what was bound, or NULL */
    int rank, ranks, ep, pp; /* this process in the grid; 0, 1, 1, 1 on one process */
    /* [pp x pp_chunks + 1]: stage s's chunk c holds layers [stage_layers[v],
     * stage_layers[v + 1]), v = c pp + s; NULL without a pipeline. */
    const int64_t *stage_layers;
    moe_stage_costs stage_costs; /* what the partition balanced: FLOPs per token, or seconds (--pp-balance) */
    bool stage_costs_resumed;    /* the seconds --resume's checkpoint measured, not this run */
    int64_t optimizer_bytes; /* AdamW state held by this rank */
    int64_t optimizer_bytes_least, optimizer_bytes_most; /* over the ranks: stages hold different layers */
    int64_t activation_bytes_least, activation_bytes_most; /* moe_trainer_activation_bytes over the ranks */
    const char *train_data;  /* what was opened */
    const char *val_data;
    int64_t tokenizer_tokens; /* ids options->tokenizer knows; 0 without it */
} moe_run_summary;

typedef struct moe_run_step {
    int rank;                 /* every rank gets every callback; one prints */
    moe_step_metrics metrics; /* metrics.step counts steps done */
    int64_t total_steps;
    double seconds;           /* this step's wall time */
    double tokens_per_s;
    double mfu;               /* step FLOPs / seconds / peak */
    double elapsed_seconds;   /* steps of this process so far */
    int64_t steps_timed;      /* how many steps elapsed_seconds covers */
} moe_run_step;

typedef struct moe_run_eval {
    int64_t step;
    double val_loss;
    double entropy_floor; /* NAN unless the validation data is synthetic */
    /* --eval-mc: the examples scored and those chosen right (0 and 0 without it) */
    int64_t mc_examples, mc_correct;
} moe_run_eval;

/* Per kind of the synthetic corpus, over the validation targets of the last
 * evaluation: mean loss, the floor over the same targets, and where the
 * router sent that kind's tokens. */
typedef struct moe_run_kind_report {
    int64_t n_layers, n_experts, top_k;
    int64_t last_moe_layer; /* the model's last layer that routes (not a dense MLP layer); -1: none */
    int64_t tokens[MOE_SYNTH_KIND_COUNT];
    double loss[MOE_SYNTH_KIND_COUNT];
    double floor[MOE_SYNTH_KIND_COUNT];
    /* [n_layers + 1, MOE_SYNTH_KIND_COUNT, n_experts]: block l < n_layers is
     * layer l's share of the kind's (token, slot) assignments going to each
     * expert (each row sums to 1; 0s for a dense MLP layer); block n_layers is the same summed over
     * all layers' assignments. */
    const double *routing;
    /* Greedy sums and copies from the start of the validation stream
     * (synth_tasks.h), after the last evaluation, when tasks_measured: on
     * one process with dropless routing only (generation's terms). */
    bool tasks_measured;
    moe_synth_task_score tasks;
} moe_run_kind_report;

typedef struct moe_run_end {
    int64_t steps_done;
    /* Why the run stopped before --steps (moe_run_callbacks.stop, --max-time),
     * its last step checkpointed, val_loss NaN and kinds NULL (no final
     * evaluation); NULL when it ran them all. */
    const char *stopped_by;
    double val_loss;
    double entropy_floor;               /* NAN unless synthetic */
    double seconds;                     /* the whole call */
    const moe_run_kind_report *kinds;   /* NULL unless synthetic */
    const char *last_checkpoint;        /* "" when none was written */
    /* --profile: this rank's ops over the training steps after the first
     * (kernels/profile.h), largest time first; evaluations and checkpoints
     * are left out. NULL without --profile. */
    const moe_op_time *profile;
    int64_t profile_ops;     /* entries of profile */
    int64_t profile_steps;   /* steps it covers */
    double profile_seconds;  /* their wall time */
    /* Stragglers over the steps this call ran (moe_step_metrics' busy
     * times; ranks > 1): the rank most often the slowest, the steps it was
     * of straggler_steps, and the mean over them of the slowest rank's busy
     * time over the ranks' median, less 1; straggler_ties: the other ranks
     * as often the slowest (straggler_rank is the lowest of them). */
    int straggler_rank, straggler_ties;
    int64_t straggler_count, straggler_steps;
    double straggler_excess;
} moe_run_end;

/* Every callback may be NULL. Pointers passed are valid during the call.
 * Under mpirun every rank runs its callbacks (on_start says which rank it
 * is); files are written by rank 0 only. */
typedef struct moe_run_callbacks {
    void *ctx;
    void (*on_start)(void *ctx, const moe_run_summary *summary);
    void (*on_step)(void *ctx, const moe_run_step *step);
    void (*on_eval)(void *ctx, const moe_run_eval *eval);
    void (*on_checkpoint)(void *ctx, int64_t step, const char *path);
    void (*on_end)(void *ctx, const moe_run_end *end);
    void (*on_warning)(void *ctx, const char *message);
    /* Set (from a signal handler, say) to a non-zero value to stop the run
     * after the step in progress: its checkpoint is written, and on_end
     * says so (stopped_by) instead of evaluating; under mpirun the ranks
     * stop at the same step whichever of them saw it. NULL: none. */
    const volatile sig_atomic_t *stop;
} moe_run_callbacks;

/* The whole run. callbacks may be NULL. */
moe_status moe_run(const moe_run_options *opts, const moe_run_callbacks *callbacks);

/* A moe_run_kind_report's routing entry. */
static inline double moe_run_routing_at(const moe_run_kind_report *r, int64_t layer, int64_t kind, int64_t expert) {
    return r->routing[(layer * MOE_SYNTH_KIND_COUNT + kind) * r->n_experts + expert];
}

#endif /* MOE_ENGINE_RUN_H */
