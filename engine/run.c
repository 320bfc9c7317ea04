#define _XOPEN_SOURCE 700
/* run.c: a training or evaluation run (run.h): data, config, model,
 * trainer, the step loop, evaluation with the per-kind report, checkpoints,
 * run.json and metrics.jsonl. */
#include "engine/run.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <glob.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/rng.h"
#include "common/clock.h"
#include "common/median.h"
#include "common/shortest.h"
#include "common/status.h"
#include "engine/checkpoint.h"
#include "engine/corpus.h"
#include "engine/data.h"
#include "engine/fileio.h"
#include "engine/grid.h"
#include "engine/json.h"
#include "engine/mc_eval.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

#define RUN_PATH_BYTES 4096
#define RUN_DESC_BYTES 512
/* A synthetic training stream longer than this (144 MB with its kinds and
 * logp) is not generated: the reader goes around it again instead. */
#define RUN_SYNTH_MAX_TOKENS ((int64_t)1 << 24)
/* The synthetic validation stream is generated whole (9 bytes a token with
 * its kinds and logp): past this many tokens (1.2 GB) --eval-batches asks
 * for more than an evaluation should read. */
#define RUN_SYNTH_VAL_MAX_TOKENS ((int64_t)1 << 27)
/* Tokens per read when the validation tokens are checked at start-up. */
#define RUN_SCAN_TOKENS ((int64_t)1 << 20)
/* Streams of moe_rng_bits that derive the two synthetic seeds from --seed,
 * so no run's validation stream is another seed's training stream. */
#define RUN_SYNTH_TRAIN_STREAM 0x747261696eull /* "train" */
#define RUN_SYNTH_VAL_STREAM 0x76616c6964ull   /* "valid" */
/* And the stream of the shuffle's seed: a shuffle by --seed itself would
 * draw epoch e's order from the bits that drew tensor e's initial values. */
#define RUN_SHUFFLE_STREAM 0x73687566666c65ull /* "shuffle" */
#define RUN_CONFIG_MAX_BYTES ((size_t)1 << 20)
/* sgemm peak: square products of this size for about this long. */
/* The GEMM peak (MFU's denominator): square products from RUN_PEAK_N,
 * doubled up to RUN_PEAK_MAX_N until one takes RUN_PEAK_MIN_PRODUCT
 * seconds, then the best of RUN_PEAK_SECONDS of them. */
#define RUN_PEAK_N 1024
#define RUN_PEAK_MAX_N 8192
#define RUN_PEAK_MIN_PRODUCT 0.005
#define RUN_PEAK_SECONDS 0.3
#define RUN_PEAK_CHUNK ((int64_t)1 << 20)

#define N_KINDS MOE_SYNTH_KIND_COUNT

/* Two layers of d_model 64 with eight heads of 8: at 16 x 64 tokens a step
 * takes ~15-18 ms on two idle cores, and the synthetic corpus's kinds are
 * learned to within a few percent of their floor in ~2000 steps. */
void moe_run_default_config(moe_model_config *cfg, int64_t vocab_size) {
    moe_model_config_default_small(cfg, vocab_size);
    cfg->hidden_size = 64;
    cfg->intermediate_size = 128;
    cfg->num_hidden_layers = 2;
    cfg->num_attention_heads = 8;
    cfg->num_key_value_heads = 8;
    cfg->head_dim = 8;
}

void moe_run_options_init(moe_run_options *o) {
    *o = (moe_run_options){
        .data = MOE_RUN_SYNTHETIC,
        .batch_size = 16,
        .seq_len = 64,
        .steps = 2500,
        .lr = 5e-3,
        .min_lr = NAN,
        .warmup = 100,
        .lr_schedule = MOE_LR_COSINE,
        .decay_frac = NAN,
        .weight_decay = 0.1,
        .grad_clip = 1.0,
        .grad_accum = 1,
        .seed = 1337,
        .out_dir = "out",
        .eval_every = 500,
        .eval_batches = 16,
        .pp = 1,
        .pp_chunks = 1,
        .pp_schedule = MOE_PIPE_1F1B,
        .ep = 1,
        .comm_timeout = MOE_COMM_DEFAULT_TIMEOUT_SECONDS,
    };
}

/* The index of name among names [n] into *out, or an error naming flag
 * and the choices ("a, b or c"). */
static moe_status parse_choice(int *out, const char *const *names, size_t n, const char *name, const char *flag) {
    char choices[128];
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        if (name && strcmp(name, names[i]) == 0) {
            *out = (int)i;
            return MOE_OK;
        }
        len += (size_t)snprintf(choices + len, sizeof choices - len, "%s%s", i == 0 ? "" : i + 1 < n ? ", " : " or ",
                                names[i]);
        if (len >= sizeof choices) len = sizeof choices - 1;
    }
    return moe_error(MOE_ERR_CONFIG, "%s '%s': expected %s", flag, name ? name : "", choices);
}

#define N_CHOICES(names) (sizeof names / sizeof *names)
#define CHOICE_NAME(names, i) ((unsigned)(i) < N_CHOICES(names) ? names[i] : "?")

static const char *const schedule_names[] = {"cosine", "linear", "constant", "wsd"};
const char *moe_lr_schedule_name(moe_lr_schedule s) { return CHOICE_NAME(schedule_names, s); }
moe_status moe_lr_schedule_parse(moe_lr_schedule *s, const char *name) {
    int at = 0;
    MOE_TRY(parse_choice(&at, schedule_names, N_CHOICES(schedule_names), name, "--lr-schedule"));
    *s = (moe_lr_schedule)at;
    return MOE_OK;
}

static const char *const pipe_schedule_names[] = {"1f1b", "gpipe"};
#define N_PIPE_SCHEDULES N_CHOICES(pipe_schedule_names)
const char *moe_pipe_schedule_name(moe_pipe_schedule s) { return CHOICE_NAME(pipe_schedule_names, s); }
moe_status moe_pipe_schedule_parse(moe_pipe_schedule *s, const char *name) {
    int at = 0;
    MOE_TRY(parse_choice(&at, pipe_schedule_names, N_PIPE_SCHEDULES, name, "--pp-schedule"));
    *s = (moe_pipe_schedule)at;
    return MOE_OK;
}

static const char *const pp_balance_names[] = {"flops", "measured"};
const char *moe_pp_balance_name(moe_pp_balance b) { return CHOICE_NAME(pp_balance_names, b); }
moe_status moe_pp_balance_parse(moe_pp_balance *b, const char *name) {
    int at = 0;
    MOE_TRY(parse_choice(&at, pp_balance_names, N_CHOICES(pp_balance_names), name, "--pp-balance"));
    *b = (moe_pp_balance)at;
    return MOE_OK;
}

/* The optimizer's settings, defaults filled in: an --lr of its own scales
 * the final learning rate with it. */
static moe_optim_config optim_config_of(const moe_run_options *o) {
    moe_optim_config c = MOE_OPTIM_CONFIG_INIT;
    c.lr = o->lr;
    c.min_lr = isnan(o->min_lr) ? o->lr / 10.0 : o->min_lr;
    c.warmup = o->warmup;
    c.total_steps = o->steps;
    c.schedule = o->lr_schedule;
    if (!isnan(o->decay_frac)) c.decay_frac = o->decay_frac;
    c.weight_decay = o->weight_decay;
    c.grad_clip = o->grad_clip;
    c.zero = o->zero;
    /* An evaluation takes no step: its trainer needs only a schedule an
     * interleaved pipeline can run, whatever --grad-accum says. */
    c.grad_accum = !o->eval_only ? o->grad_accum : o->pp_chunks > 1 ? o->pp : 1;
    c.pipe_schedule = o->pp_schedule;
    return c;
}

static bool empty(const char *s) { return s == NULL || s[0] == '\0'; }

static bool is_synthetic(const char *spec) { return strcmp(spec, MOE_RUN_SYNTHETIC) == 0; }

typedef enum source_kind { SOURCE_SYNTHETIC, SOURCE_SHARDS, SOURCE_TEXT, SOURCE_BYTES } source_kind;

static source_kind kind_of(const moe_run_options *o, const char *spec);

/* moe_train_state's name for a kind. */
static const char *kind_name(source_kind kind) {
    static const char *const names[] = {"synthetic", "shards", "text", "bytes"};
    return names[kind];
}

/* moe_train_state's name for what spec reads. */
static const char *data_kind(const moe_run_options *o, const char *spec) { return kind_name(kind_of(o, spec)); }

/* Whether the validation stream is a synthetic one (run.h's rules). */
static bool synthetic_validation(const moe_run_options *o) {
    return is_synthetic(o->val_data ? o->val_data : o->data);
}

/* Token counts of a run on `ranks` data-parallel ranks, each short of the
 * one last target that a read of so many tokens also takes. */
typedef struct token_counts {
    int64_t batch; /* one global micro-batch: ranks x B x T */
    int64_t step;  /* one optimizer step: batch x grad_accum */
    int64_t run;   /* every step of the run: step x steps; 0 with --eval-only */
    int64_t eval;  /* one evaluation: batch x eval_batches */
} token_counts;

/* Fills n, refusing a product that overflows int64_t (with its one last
 * target) before any later count wraps, and a synthetic validation stream
 * too long to generate. */
static moe_status count_tokens(token_counts *n, const moe_run_options *o, int ranks) {
    int64_t bt;
    if (__builtin_mul_overflow(o->batch_size, o->seq_len, &bt) || __builtin_mul_overflow(bt, ranks, &n->batch) ||
        n->batch == INT64_MAX)
        return ranks > 1 ? moe_error(MOE_ERR_CONFIG, "--batch-size %lld x --seq-len %lld x %d data-parallel ranks "
                                                     "overflows a 64-bit token count",
                                     (long long)o->batch_size, (long long)o->seq_len, ranks)
                         : moe_error(MOE_ERR_CONFIG, "--batch-size %lld x --seq-len %lld overflows a 64-bit token count",
                                     (long long)o->batch_size, (long long)o->seq_len);
    if (__builtin_mul_overflow(n->batch, o->grad_accum, &n->step) || n->step == INT64_MAX)
        return moe_error(MOE_ERR_CONFIG, "--grad-accum %lld micro-batches of %lld tokens overflow a 64-bit count",
                         (long long)o->grad_accum, (long long)n->batch);
    n->run = 0;
    if (!o->eval_only && (__builtin_mul_overflow(n->step, o->steps, &n->run) || n->run == INT64_MAX))
        return moe_error(MOE_ERR_CONFIG, "--steps %lld of %lld tokens each overflow a 64-bit token count",
                         (long long)o->steps, (long long)n->step);
    if (__builtin_mul_overflow(n->batch, o->eval_batches, &n->eval) || n->eval == INT64_MAX)
        return moe_error(MOE_ERR_CONFIG, "--eval-batches %lld of %lld tokens each overflow a 64-bit token count",
                         (long long)o->eval_batches, (long long)n->batch);
    if (synthetic_validation(o) && n->eval + 1 > RUN_SYNTH_VAL_MAX_TOKENS)
        return moe_error(MOE_ERR_CONFIG, "--eval-batches %lld of %lld tokens each need a synthetic validation stream "
                                         "of %lld tokens, more than the %lld it may have",
                         (long long)o->eval_batches, (long long)n->batch, (long long)(n->eval + 1),
                         (long long)RUN_SYNTH_VAL_MAX_TOKENS);
    return MOE_OK;
}

moe_status moe_run_options_validate(const moe_run_options *o) {
    if (!o) return moe_error(MOE_ERR_INVALID_ARG, "moe_run_options_validate: NULL options");
    if (empty(o->data)) return moe_error(MOE_ERR_CONFIG, "--data must not be empty");
    if (o->val_data && o->val_data[0] == '\0') return moe_error(MOE_ERR_CONFIG, "--val-data must not be empty");
    if (o->eval_mc && o->eval_mc[0] == '\0') return moe_error(MOE_ERR_CONFIG, "--eval-mc must not be empty");
    if (o->tokenizer && o->tokenizer[0] == '\0') return moe_error(MOE_ERR_CONFIG, "--tokenizer must not be empty");
    if (o->val_tokens < 0)
        return moe_error(MOE_ERR_CONFIG, "--val-tokens %lld must not be negative", (long long)o->val_tokens);
    if (o->val_tokens > 0 && o->val_data)
        return moe_error(MOE_ERR_CONFIG, "--val-tokens holds out --data's last tokens for validation, and --val-data "
                                         "%s is the validation data: give one of them", o->val_data);
    if (o->val_tokens > 0 && is_synthetic(o->data))
        return moe_error(MOE_ERR_CONFIG, "--val-tokens holds out file data's last tokens; the synthetic corpus "
                                         "validates on a stream of its own");
    if (o->config && o->config[0] == '\0') return moe_error(MOE_ERR_CONFIG, "--config must not be empty");
    if (o->init_from && o->init_from[0] == '\0') return moe_error(MOE_ERR_CONFIG, "--init-from must not be empty");
    if (o->resume && o->resume[0] == '\0') return moe_error(MOE_ERR_CONFIG, "--resume must not be empty");
    if (empty(o->out_dir)) return moe_error(MOE_ERR_CONFIG, "--out must not be empty");
    if (o->batch_size <= 0)
        return moe_error(MOE_ERR_CONFIG, "--batch-size %lld must be positive", (long long)o->batch_size);
    if (o->seq_len <= 0) return moe_error(MOE_ERR_CONFIG, "--seq-len %lld must be positive", (long long)o->seq_len);
    if (o->threads < 0 || o->threads > MOE_RUN_THREADS_MAX)
        return moe_error(MOE_ERR_CONFIG, "--threads %d must lie in [0, %d] (this machine has %d cores)", o->threads,
                         MOE_RUN_THREADS_MAX, omp_get_num_procs());
    if (o->save_every < 0)
        return moe_error(MOE_ERR_CONFIG, "--save-every %lld must not be negative", (long long)o->save_every);
    if (!(o->logit_z_loss >= 0.0 && o->logit_z_loss <= 1e6))
        return moe_error(MOE_ERR_CONFIG, "--logit-z-loss %g must be finite and in [0, 1e+06]", o->logit_z_loss);
    if (o->keep_last < 0)
        return moe_error(MOE_ERR_CONFIG, "--keep-last %lld must not be negative", (long long)o->keep_last);
    if (o->eval_every < 0)
        return moe_error(MOE_ERR_CONFIG, "--eval-every %lld must not be negative", (long long)o->eval_every);
    if (o->eval_batches <= 0)
        return moe_error(MOE_ERR_CONFIG, "--eval-batches %lld must be positive", (long long)o->eval_batches);
    /* Below a MFLOP/s or past an EFLOP/s per device no machine runs, and
     * MFU, over a rate near 0, would overflow the log's numbers. */
    if (!(o->peak_gflops == 0.0 || (o->peak_gflops >= 1e-3 && o->peak_gflops <= 1e9)))
        return moe_error(MOE_ERR_CONFIG, "--peak-gflops %g must be in [0.001, 1e+09] (or 0 to measure)",
                         o->peak_gflops);
    if (o->pp <= 0) return moe_error(MOE_ERR_CONFIG, "--pp %d must be positive", o->pp);
    if ((unsigned)o->pp_schedule >= N_PIPE_SCHEDULES)
        return moe_error(MOE_ERR_CONFIG, "--pp-schedule %d unknown: expected 1f1b or gpipe", (int)o->pp_schedule);
    /* One stage has no pipeline to fill: GPipe would only recompute. */
    if (o->pp == 1 && o->pp_schedule != MOE_PIPE_1F1B)
        return moe_error(MOE_ERR_CONFIG, "--pp-schedule %s needs --pp > 1", moe_pipe_schedule_name(o->pp_schedule));
    /* An evaluation runs no micro-batches (moe_run's optimizer config). */
    MOE_TRY(moe_pipe_schedule_check(o->pp_schedule, o->pp, o->pp_chunks, o->eval_only ? o->pp : o->grad_accum));
    if (o->pp_balance != MOE_PP_BALANCE_FLOPS && o->pp_balance != MOE_PP_BALANCE_MEASURED)
        return moe_error(MOE_ERR_CONFIG, "--pp-balance %d unknown: expected flops or measured", (int)o->pp_balance);
    if (o->pp == 1 && o->pp_balance != MOE_PP_BALANCE_FLOPS)
        return moe_error(MOE_ERR_CONFIG, "--pp-balance %s needs --pp > 1", moe_pp_balance_name(o->pp_balance));
    if (o->ep <= 0) return moe_error(MOE_ERR_CONFIG, "--ep %d must be positive", o->ep);
    if (o->zero != 0 && o->zero != 1) return moe_error(MOE_ERR_CONFIG, "--zero %d: only 0 and 1 exist", o->zero);
    if (!isfinite(o->comm_timeout) || o->comm_timeout <= 0.0)
        return moe_error(MOE_ERR_CONFIG, "--comm-timeout %g must be a positive number of seconds", o->comm_timeout);
    if (!isfinite(o->max_time) || o->max_time < 0.0)
        return moe_error(MOE_ERR_CONFIG, "--max-time %g must be a number of seconds (0: none)", o->max_time);
    if (o->max_time > 0.0 && o->eval_only)
        return moe_error(MOE_ERR_CONFIG, "--max-time stops a training run, and --eval-only trains none");
    if (o->eval_only && !o->init_from)
        return moe_error(MOE_ERR_CONFIG, "--eval-only needs --init-from DIR: the weights to evaluate");
    if (o->upcycle && (!o->init_from || !o->config))
        return moe_error(MOE_ERR_CONFIG, "--upcycle needs --init-from DIR, the dense model, and --config FILE, the "
                                         "MoE to start from it");
    if (o->upcycle && o->eval_only)
        return moe_error(MOE_ERR_CONFIG, "--upcycle starts a MoE from a dense model for training, and --eval-only "
                                         "trains none (its routers would be untrained)");
    if (o->eval_only && o->profile)
        return moe_error(MOE_ERR_CONFIG, "--profile times training steps, and --eval-only runs none");
    if (o->eval_only && o->recompute)
        return moe_error(MOE_ERR_CONFIG, "--recompute saves the activations a backward reads, and --eval-only runs "
                                         "none (it keeps one layer's set already)");
    if (o->eval_only && o->save_every)
        return moe_error(MOE_ERR_CONFIG, "--save-every writes checkpoints, and --eval-only writes none");
    if (o->eval_only && o->shuffle)
        return moe_error(MOE_ERR_CONFIG, "--shuffle orders training batches, and --eval-only trains none");
    if (o->eval_only && o->keep_last)
        return moe_error(MOE_ERR_CONFIG, "--keep-last prunes a run's checkpoints, and --eval-only writes none");
    if (o->eval_only && o->overwrite)
        return moe_error(MOE_ERR_CONFIG, "--overwrite replaces a run in --out, and --eval-only writes none");
    if (o->eval_only && o->resume)
        return moe_error(MOE_ERR_CONFIG, "--eval-only and --resume exclude each other; evaluate a checkpoint "
                                         "with --eval-only --init-from DIR");
    const bool latest = o->resume && strcmp(o->resume, MOE_RUN_RESUME_LATEST) == 0;
    if (latest && o->overwrite)
        return moe_error(MOE_ERR_CONFIG, "--resume " MOE_RUN_RESUME_LATEST " continues the run in --out, and "
                                         "--overwrite would remove it");
    if (o->resume && !latest && o->init_from)
        return moe_error(MOE_ERR_CONFIG, "--resume and --init-from exclude each other: --resume loads the "
                                         "checkpoint's own weights");
    /* Flags a schedule would ignore are mistakes of the command line. */
    if (!isnan(o->min_lr) && o->lr_schedule == MOE_LR_CONSTANT)
        return moe_error(MOE_ERR_CONFIG, "--min-lr %g: --lr-schedule constant keeps --lr to the end", o->min_lr);
    if (!isnan(o->decay_frac) && o->lr_schedule != MOE_LR_WSD)
        return moe_error(MOE_ERR_CONFIG, "--decay-frac %g is wsd's, and --lr-schedule is %s", o->decay_frac,
                         moe_lr_schedule_name(o->lr_schedule));
    moe_optim_config c = optim_config_of(o);
    if (o->eval_only) c.total_steps = 1; /* --steps does not matter */
    MOE_TRY(moe_optim_config_validate(&c));
    token_counts n; /* on one rank here; open_data counts again on the job's */
    return count_tokens(&n, o, 1);
}

/* Fills a backend array [n] with a fixed pattern, RUN_PEAK_CHUNK values at a
 * time: no host array of the whole size. */
static moe_status fill_pattern(const moe_ops *ops, float *dst, int64_t n, float *chunk) {
    for (int64_t i = 0; i < RUN_PEAK_CHUNK; i++) chunk[i] = (float)(i % 7) * 0.125f - 0.375f;
    for (int64_t at = 0; at < n; at += RUN_PEAK_CHUNK) {
        const int64_t len = n - at < RUN_PEAK_CHUNK ? n - at : RUN_PEAK_CHUNK;
        MOE_TRY(ops->upload(dst + at, chunk, (size_t)len * sizeof(float)));
    }
    return MOE_OK;
}

/* The best of RUN_PEAK_SECONDS of n x n x n products in GFLOP/s, or 0 when
 * one product takes under RUN_PEAK_MIN_PRODUCT seconds (too short to time
 * well) and a larger n may still be tried. */
static moe_status time_products(const moe_ops *ops, int64_t n, bool last, double *gflops, float *chunk) {
    float *a = NULL;
    MOE_TRY(ops->alloc((void **)&a, (size_t)(3 * n * n) * sizeof(float)));
    float *b = a + n * n, *c = b + n * n;
    moe_status st = fill_pattern(ops, a, 2 * n * n, chunk);
    /* The first product pays for thread start-up, page faults and plans. */
    if (st == MOE_OK) ops->gemm(c, a, b, n, n, n, n, n, n, false, true, 1.0f, 0.0f);
    if (st == MOE_OK) st = ops->sync();
    double best = INFINITY;
    const double start = moe_monotonic_seconds();
    while (st == MOE_OK) {
        const double t0 = moe_monotonic_seconds();
        ops->gemm(c, a, b, n, n, n, n, n, n, false, true, 1.0f, 0.0f);
        st = ops->sync();
        const double t1 = moe_monotonic_seconds();
        if (t1 - t0 < best) best = t1 - t0;
        if ((best < RUN_PEAK_MIN_PRODUCT && !last) || t1 - start >= RUN_PEAK_SECONDS) break;
    }
    ops->release(a);
    /* The best product, not the mean: the machine may be shared, and the
     * peak is what an uncontended device can do. */
    *gflops = best < RUN_PEAK_MIN_PRODUCT && !last ? 0.0 : 2.0 * (double)n * n * n / best * 1e-9;
    return st;
}

moe_status moe_measure_gemm_gflops(const moe_ops *ops, double *gflops) {
    float *chunk = malloc(RUN_PEAK_CHUNK * sizeof *chunk);
    if (!chunk) return moe_error(MOE_ERR_OUT_OF_MEMORY, "gemm peak: staging");
    moe_status st = MOE_OK;
    *gflops = 0.0;
    /* A GPU needs far larger products than a CPU core to reach its peak. */
    for (int64_t n = RUN_PEAK_N; st == MOE_OK && *gflops == 0.0 && n <= RUN_PEAK_MAX_N; n *= 2)
        st = time_products(ops, n, 2 * n > RUN_PEAK_MAX_N, gflops, chunk);
    free(chunk);
    if (st != MOE_OK) return moe_error_prefix(st, "gemm peak on %s: ", ops->name);
    return MOE_OK;
}

/* ----------------------------------------------------------------- sources */

typedef struct run_source {
    moe_data *data;
    moe_synth_stream synth; /* tokens = NULL unless synthetic */
    char desc[RUN_DESC_BYTES];
    int32_t shard_magic; /* read at byte level, but it begins with this llm.c shard's magic; 0: not */
} run_source;

/* The llm.c shard magic (little-endian) file path begins with; 0: none. */
static int32_t shard_magic_of(const char *path) {
    unsigned char head[4];
    FILE *f = fopen(path, "rb");
    const bool read = f && fread(head, 1, sizeof head, f) == sizeof head;
    if (f) fclose(f);
    const int32_t magic = read ? (int32_t)moe_get_le32(head) : 0;
    return moe_data_is_shard_magic(magic) ? magic : 0;
}

static bool is_bin_name(const char *spec) {
    const size_t n = strlen(spec);
    return n >= 4 && strcmp(spec + n - 4, ".bin") == 0;
}

/* Shards: a .bin name, or a glob; a regular file of that very name,
 * wildcards and all, is read as what its name says. */
static bool is_shard_glob(const char *spec) {
    struct stat sb;
    return is_bin_name(spec) || (strpbrk(spec, "*?[") != NULL && !(stat(spec, &sb) == 0 && S_ISREG(sb.st_mode)));
}

/* Whether the first file glob spec matches begins as a shard does. */
static bool first_match_is_shard(const char *spec) {
    glob_t g;
    if (glob(spec, 0, NULL, &g) != 0) return false;
    const bool shard = g.gl_pathc > 0 && shard_magic_of(g.gl_pathv[0]) != 0;
    globfree(&g);
    return shard;
}

/* What spec reads (run.h's rules). Under --tokenizer, a file or glob that
 * is neither synthetic nor shards (a .bin name, or a glob whose first file
 * begins as a shard does) is text it encodes. */
static source_kind kind_of(const moe_run_options *o, const char *spec) {
    if (is_synthetic(spec)) return SOURCE_SYNTHETIC;
    const bool shards = is_shard_glob(spec);
    if (o->tokenizer && !is_bin_name(spec) && !(shards && first_match_is_shard(spec))) return SOURCE_TEXT;
    return shards ? SOURCE_SHARDS : SOURCE_BYTES;
}

/* Opens spec (run.h's rules) for the flag named in errors. A synthetic
 * source is n_synth tokens from synth_seed; shards, and text (spec is
 * text that tokenizer encodes when tokenizer is not NULL), are checked
 * against vocab. */
static moe_status open_source(run_source *s, const char *spec, const char *flag, uint64_t synth_seed,
                              int64_t n_synth, int64_t vocab, const char *tokenizer) {
    moe_status st;
    if (is_synthetic(spec)) {
        const moe_synth_params params = moe_synth_default_params();
        st = moe_synth_generate(&s->synth, &params, synth_seed, n_synth);
        if (st == MOE_OK)
            st = moe_data_from_tokens(&s->data, s->synth.tokens, s->synth.n, MOE_SYNTH_VOCAB_SIZE, spec);
        snprintf(s->desc, sizeof s->desc, "synthetic corpus");
    } else if (tokenizer) {
        int32_t *tokens;
        int64_t n;
        st = moe_corpus_encode(&tokens, &n, tokenizer, spec);
        if (st == MOE_OK) {
            st = moe_data_from_tokens(&s->data, tokens, n, vocab, spec);
            free(tokens);
        }
        snprintf(s->desc, sizeof s->desc, "text %s encoded by %s", spec, tokenizer);
    } else if (is_shard_glob(spec)) {
        st = moe_data_open_shards(&s->data, spec, vocab);
        snprintf(s->desc, sizeof s->desc, "llm.c shards %s", spec);
    } else {
        st = moe_data_open_bytes(&s->data, spec);
        snprintf(s->desc, sizeof s->desc, "bytes of %s", spec);
        s->shard_magic = st == MOE_OK ? shard_magic_of(spec) : 0;
    }
    if (st != MOE_OK) return moe_error_prefix(st, "%s: ", flag); /* the reader names the file */
    const size_t len = strlen(s->desc);
    snprintf(s->desc + len, sizeof s->desc - len, " (%lld tokens, vocab %lld)",
             (long long)moe_data_token_count(s->data), (long long)moe_data_vocab_size(s->data));
    return MOE_OK;
}

/* Narrows a source of n tokens to its tokens [begin, end), said in its
 * description. */
static moe_status narrow_source(run_source *s, int64_t begin, int64_t end, const char *what) {
    MOE_TRY(moe_data_restrict(s->data, begin, end));
    const size_t len = strlen(s->desc);
    snprintf(s->desc + len, sizeof s->desc - len, ", %s: %lld tokens", what, (long long)(end - begin));
    return MOE_OK;
}

/* --val-tokens of --data's n tokens held out: the training reader's
 * stream ends before them. */
static moe_status hold_out(run_source *train, const moe_run_options *o) {
    const int64_t n = moe_data_token_count(train->data), held = o->val_tokens;
    if (held >= n)
        return moe_error(MOE_ERR_CONFIG, "--val-tokens %lld holds out every token of --data %s (%lld): none would "
                                         "train",
                         (long long)held, o->data, (long long)n);
    return narrow_source(train, 0, n - held, "less the --val-tokens held out");
}

static void close_source(run_source *s) {
    moe_data_close(s->data);
    moe_synth_stream_free(&s->synth);
}

/* --------------------------------------------------------------------- run */

typedef struct run {
    const moe_run_options *o;
    const moe_run_callbacks *cb;
    moe_model_config cfg;
    run_source train, val;
    moe_mc_eval *mc;       /* --eval-mc's examples; NULL: none */
    moe_checkpoint_files companions; /* the source's tokenizer and generation files, for every checkpoint */
    source_kind data_source;          /* what --data reads, decided once (open_data) */
    char *tokenizer_text;             /* --tokenizer's bytes [tokenizer_bytes] until companions take them */
    size_t tokenizer_bytes;
    int64_t tokenizer_tokens;         /* its ids; 0 without it */
    moe_synth_floor floor; /* of the validation targets, when synthetic */
    double entropy_floor;  /* floor.nats or NAN */
    moe_comm *world;       /* every rank; NULL on one process */
    moe_grid grid;         /* made once the model config is known (build_model); zero on one process */
    int rank, ranks;       /* in world: who prints, and MFU's peak over every rank */
    int dp_rank, dp_size;  /* in this stage's data-parallel ranks, which read the global batch */
    token_counts tokens;   /* on the ranks */
    moe_train_state resumed; /* --resume: the checkpoint's metadata, read before the data is opened */
    moe_device_handle device; /* the backend the model runs on */
    /* For its memory across ranks (NCCL); NULL: the grid's dp, ep and pipe. */
    moe_comm *device_world, *device_ep, *device_pipe;
    moe_model *model;
    moe_trainer *trainer;
    double peak_gflops;
    double step_flops;     /* of one optimizer step */
    int lock_fd;         /* rank 0's OUT/.lock (lock_out_dir) for the whole run; -1 when not held */
    FILE *metrics;       /* opened by the first line logged */
    int64_t start_step;  /* the checkpoint's step when resumed: metrics.jsonl keeps the lines up to it */
    char metrics_path[RUN_PATH_BYTES];
    char last_checkpoint[RUN_PATH_BYTES];
    /* The per-kind report of the last evaluation. */
    double kind_loss_sum[N_KINDS];
    int64_t kind_tokens[N_KINDS];
    int64_t *route_counts; /* [L, N_KINDS, E] */
    double *routing;       /* [L + 1, N_KINDS, E] */
    moe_run_kind_report kinds;
    moe_op_time *profile; /* [moe_profile_op_count()] with --profile */
    int64_t *slowest;     /* [ranks] the steps each rank was the slowest */
    moe_stage_costs stage_costs; /* what the pipeline's partition balanced */
    bool stage_costs_resumed;    /* the measured costs --resume's checkpoint recorded */
    uint64_t shuffle_seed;       /* of --shuffle's order: the checkpoint's when resumed */
} run;

static void warn(const moe_run_callbacks *cb, const char *fmt, ...) MOE_PRINTF(2, 3);
static void warn(const moe_run_callbacks *cb, const char *fmt, ...) {
    if (!cb->on_warning) return;
    char msg[RUN_PATH_BYTES + 1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cb->on_warning(cb->ctx, msg);
}

static moe_status path_join(char *out, const char *dir, const char *name) {
    int n = snprintf(out, RUN_PATH_BYTES, "%s/%s", dir, name);
    if (n < 0 || n >= RUN_PATH_BYTES) return moe_error(MOE_ERR_CONFIG, "--out %s: path too long", dir);
    return MOE_OK;
}

/* A config field's value as a message gives it. */
static void field_text(char *buf, size_t size, const moe_agree_field *f, double value) {
    if (f->name_of) {
        snprintf(buf, size, "%s", f->name_of((int)value));
        return;
    }
    moe_shortest(buf, size, value); /* two that differ print apart */
}

/* Whether the JSON object in path has a model_type key. */
static bool names_model_type(const char *path) {
    moe_json_doc *doc;
    if (moe_json_parse_file(&doc, path, MOE_MODEL_CONFIG_MAX_BYTES) != MOE_OK) return true; /* said otherwise */
    const moe_json *root = moe_json_root(doc);
    const bool named = root->type != MOE_JSON_OBJECT || moe_json_get(root, "model_type") != NULL;
    moe_json_free(doc);
    return named;
}

/* --upcycle's dense model against --config's MoE: the dense model's
 * config.json (when DIR has one), read as its model type's config class
 * reads it (a llama, mistral, qwen2 or qwen3 one, or any type's model of
 * dense MLP layers only), must give the function the MoE starts from: its
 * sizes (its MLPs' width the experts'), RoPE, rms_norm_eps, window, head
 * tying, q and k norm (a qwen3's, which the MoE must have too:
 * moe_qk_norm) and q, k and v biases (a qwen2's: moe_qkv_bias), or shapes
 * alone would let 32 heads of 128 pass for 64 of 64, or another
 * rope_theta. The token ids --config does not give are taken from the
 * dense model's, whose tokenizer the MoE keeps. */
static moe_status check_dense_config(moe_model_config *moe, const moe_run_options *o, moe_warn_fn on_warn,
                                     void *warn_ctx) {
    char path[RUN_PATH_BYTES];
    MOE_TRY(path_join(path, o->init_from, "config.json"));
    struct stat sb;
    if (stat(path, &sb) != 0) return MOE_OK;
    moe_model_config dense;
    moe_status st = moe_model_config_load(&dense, path, on_warn, warn_ctx);
    if (st != MOE_OK && !names_model_type(path))
        return moe_error(st, "--upcycle: %s (%s has no model_type, which makes it a Mixtral's: a dense model's "
                             "names its type, llama, mistral, qwen2 or qwen3)",
                         moe_last_error(), path);
    if (st != MOE_OK) return moe_error_prefix(st, "--upcycle: ");
    if (moe_model_config_has_moe_layer(&dense))
        return moe_error(MOE_ERR_CONFIG, "--upcycle: %s is an MoE (model_type %s, %lld of its %lld layers MoE layers): "
                                         "--upcycle starts from a dense model",
                         path, moe_model_config_model_type(&dense),
                         (long long)(dense.num_hidden_layers - moe_model_config_dense_layer_count(&dense)),
                         (long long)dense.num_hidden_layers);
    const char *const fn = "the MoE would not start from the dense model's function";
    static const char *const shared[] = {"vocab_size",  "hidden_size",    "intermediate_size",
                                         "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                         "head_dim",    "rope_theta",     "rms_norm_eps", "sliding_window"};
    moe_agree_field theirs[MOE_CONFIG_AGREE_FIELDS], mine[MOE_CONFIG_AGREE_FIELDS];
    const int n = moe_config_agree_fields(theirs, &dense);
    moe_config_agree_fields(mine, moe);
    for (int i = 0; i < n; i++) {
        size_t k = 0;
        while (k < sizeof shared / sizeof *shared && strcmp(theirs[i].name, shared[k]) != 0) k++;
        if (k == sizeof shared / sizeof *shared || theirs[i].value == mine[i].value) continue;
        char a[64], b[64];
        field_text(a, sizeof a, &theirs[i], theirs[i].value);
        field_text(b, sizeof b, &mine[i], mine[i].value);
        return moe_error(MOE_ERR_CONFIG, "--upcycle: %s has %s=%s, and --config %s has %s=%s: %s", path,
                         theirs[i].name, a, o->config, mine[i].name, b, fn);
    }
    if (!moe_rope_scaling_equal(&dense.rope_scaling, &moe->rope_scaling)) {
        char theirs[256], mine[256];
        moe_rope_scaling_describe(theirs, sizeof theirs, &dense.rope_scaling);
        moe_rope_scaling_describe(mine, sizeof mine, &moe->rope_scaling);
        return moe_error(MOE_ERR_CONFIG, "--upcycle: %s scales RoPE as %s, and --config %s as %s: %s", path, theirs,
                         o->config, mine, fn);
    }
    if (dense.tie_word_embeddings != moe->tie_word_embeddings)
        return moe_error(MOE_ERR_CONFIG, "--upcycle: %s %s the embedding and the head (tie_word_embeddings %s), and "
                                         "--config %s %s: set tie_word_embeddings %s in it",
                         path, dense.tie_word_embeddings ? "ties" : "keeps apart",
                         dense.tie_word_embeddings ? "true" : "false", o->config,
                         dense.tie_word_embeddings ? "does not" : "does", dense.tie_word_embeddings ? "true" : "false");
    if (dense.moe_qk_norm != moe->moe_qk_norm)
        return moe_error(MOE_ERR_CONFIG, "--upcycle: %s's attention %s, and --config %s has moe_qk_norm \"%s\"%s: %s",
                         path,
                         dense.moe_qk_norm == MOE_QK_NORM_PER_HEAD     ? "normalises q and k per head (a qwen3's)"
                         : dense.moe_qk_norm == MOE_QK_NORM_ACROSS_HEADS ? "normalises q and k across heads"
                                                                         : "does not normalise q and k",
                         o->config, moe_qk_norm_kind_name(moe->moe_qk_norm),
                         dense.moe_qk_norm == MOE_QK_NORM_PER_HEAD ? " (model_type qwen3_moe normalises them per head)"
                                                                   : "",
                         fn);
    if (dense.moe_qkv_bias != moe->moe_qkv_bias)
        return moe_error(MOE_ERR_CONFIG, "--upcycle: %s's q, k and v projections %s, and --config %s has moe_qkv_bias "
                                         "%s: %s",
                         path, dense.moe_qkv_bias ? "have biases (a qwen2's)" : "have no biases", o->config,
                         moe->moe_qkv_bias ? "true" : "false", fn);
    /* The tokenizer stays the dense model's, and so do its ids. */
    moe_token_ids *const ids[] = {&moe->bos_token_id, &moe->eos_token_id, &moe->pad_token_id};
    const moe_token_ids *const dense_ids[] = {&dense.bos_token_id, &dense.eos_token_id, &dense.pad_token_id};
    for (int i = 0; i < 3; i++)
        if (ids[i]->form == MOE_TOKEN_ID_ABSENT) *ids[i] = *dense_ids[i];
    return MOE_OK;
}

/* The model config: --config, else the checkpoint's, else the default one
 * (whose vocabulary comes from the training data, so *known says whether
 * cfg is final yet). */
static moe_status load_config(run *r, bool *known) {
    const moe_run_options *o = r->o;
    moe_warn_fn on_warn = r->cb->on_warning;
    *known = true;
    if (o->config) {
        moe_status st = moe_model_config_load(&r->cfg, o->config, on_warn, r->cb->ctx);
        if (st != MOE_OK) return moe_error_prefix(st, "--config: ");
        if (o->upcycle && !moe_model_config_has_moe_layer(&r->cfg))
            return moe_error(MOE_ERR_CONFIG, "--upcycle: --config %s has no MoE layer (every layer a dense MLP): "
                                             "nothing to upcycle; --init-from alone loads the dense model",
                             o->config);
        return o->upcycle ? check_dense_config(&r->cfg, o, on_warn, r->cb->ctx) : MOE_OK;
    }
    if (o->init_from || o->resume) {
        const char *dir = o->init_from ? o->init_from : o->resume;
        moe_status st = moe_checkpoint_load_config(&r->cfg, dir, o->resume != NULL, on_warn, r->cb->ctx);
        if (st != MOE_OK) return moe_error_prefix(st, "%s %s: ", o->init_from ? "--init-from" : "--resume", dir);
        return MOE_OK;
    }
    *known = false;
    return MOE_OK;
}

static moe_status check_vocab(const run *r, const run_source *s, const char *flag) {
    const int64_t v = moe_data_vocab_size(s->data);
    if (v > r->cfg.vocab_size)
        return moe_error(MOE_ERR_CONFIG, "%s: the data has tokens up to %lld but the model's vocab_size is %lld",
                         flag, (long long)(v - 1), (long long)r->cfg.vocab_size);
    return MOE_OK;
}

/* A source's tokens against what the run reads of it: an error names flag,
 * what is short and why. */
static moe_status check_length(const run_source *s, const char *flag, const char *spec, int64_t need,
                               const char *reader) {
    const int64_t have = moe_data_token_count(s->data);
    if (have >= need) return MOE_OK;
    return moe_error(MOE_ERR_CONFIG, "%s %s holds %lld tokens, fewer than the %lld that %s reads", flag, spec,
                     (long long)have, (long long)need, reader);
}

/* Reads every token an evaluation reads, so that a shard token outside the
 * vocabulary fails at start-up rather than after the training (bytes and
 * the synthetic corpus are inside it by construction, which check_vocab
 * holds to the model's). The eval_batches batches of ranks x B rows cover
 * the same tokens as one batch of all their rows at position 0, read here a
 * chunk of rows at a time. */
static moe_status scan_validation(run *r) {
    const moe_run_options *o = r->o;
    const int64_t T = o->seq_len, rows = r->tokens.eval / T;
    const int64_t chunk = RUN_SCAN_TOKENS / T > 0 ? RUN_SCAN_TOKENS / T : 1;
    const int64_t chunk_rows = chunk < rows ? chunk : rows;
    int32_t *inputs = malloc((size_t)(2 * chunk_rows * T) * sizeof *inputs); /* [chunk_rows, T] twice */
    if (!inputs) return moe_error(MOE_ERR_OUT_OF_MEMORY, "validation check: %lld tokens", (long long)(chunk_rows * T));
    moe_status st = MOE_OK;
    for (int64_t first = 0; first < rows && st == MOE_OK; first += chunk_rows) {
        const int64_t n = rows - first < chunk_rows ? rows - first : chunk_rows;
        st = moe_data_set_position(r->val.data, (moe_data_position){0, 0});
        if (st == MOE_OK) st = moe_data_next_batch(r->val.data, inputs, inputs + n * T, rows, first, n, T);
    }
    free(inputs);
    MOE_TRY(st);
    return moe_data_set_position(r->val.data, (moe_data_position){0, 0});
}

/* This rank's rows of the first step's micro-batches, read from start and
 * put back, so that a token outside the vocabulary there is refused before
 * anything is written (--overwrite would have removed the run in --out). A
 * peer that finds one stops before the ranks agree on the options, which
 * keeps every rank from writing. Later batches are checked as they are
 * read: all of them up front would be a pass over the whole corpus. */
static moe_status scan_first_step(run *r, moe_data_position start) {
    const moe_run_options *o = r->o;
    const int64_t T = o->seq_len, B = o->batch_size, rows = (int64_t)r->dp_size * B;
    int32_t *tokens = malloc((size_t)(2 * B * T) * sizeof *tokens); /* inputs, then targets */
    if (!tokens) return moe_error(MOE_ERR_OUT_OF_MEMORY, "first step's data: %lld tokens", (long long)(B * T));
    moe_status st = MOE_OK; /* the reader is at start */
    for (int64_t m = 0; m < o->grad_accum && st == MOE_OK; m++)
        st = moe_data_next_batch(r->train.data, tokens, tokens + B * T, rows, (int64_t)r->dp_rank * B, B, T);
    free(tokens);
    MOE_TRY(st);
    return moe_data_set_position(r->train.data, start);
}

static bool checkpoint_name(const char *name);

/* The training state of checkpoint dir (flag's), whose step must be the one
 * its name says when it is named like a checkpoint: a state that
 * disagrees was damaged or moved by hand, and resuming it would skip or
 * repeat steps. */
static moe_status read_checkpoint_state(moe_train_state *state, const char *flag, const char *dir) {
    moe_status st = moe_checkpoint_read_state(state, dir);
    if (st != MOE_OK) return moe_error_prefix(st, "%s %s: ", flag, dir);
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    size_t start = len;
    while (start > 0 && dir[start - 1] != '/') start--;
    char name[NAME_MAX + 1];
    snprintf(name, sizeof name, "%.*s", (int)(len - start), dir + start);
    const int64_t named = moe_checkpoint_step_of_name(name);
    if (named >= 0 && named != state->step)
        return moe_error(MOE_ERR_FORMAT, "%s %s: its train_state.safetensors says step %lld, its name another: "
                                         "the state was damaged or the checkpoint renamed",
                         flag, dir, (long long)state->step);
    return MOE_OK;
}

/* --resume: the checkpoint's metadata, checked against the options before
 * anything is built from them. The seed chose the synthetic streams, the
 * shuffle order and the jitter noise; the shuffle and its chunk (one global
 * micro-batch) chose which tokens each position reads. A checkpoint that
 * never recorded its stream (data_tokens 0) is taken as it always was. */
static moe_status read_resume_state(run *r) {
    const moe_run_options *o = r->o;
    const moe_train_state *s = &r->resumed;
    MOE_TRY(read_checkpoint_state(&r->resumed, "--resume", o->resume));
    if (s->seed != o->seed)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint was trained with --seed %llu; pass the same "
                                         "--seed (got %llu)",
                         o->resume, (unsigned long long)s->seed, (unsigned long long)o->seed);
    if (s->step >= o->steps)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint is at step %lld, --steps %lld leaves nothing "
                                         "to do",
                         o->resume, (long long)s->step, (long long)o->steps);
    if (s->data_kind[0] && strcmp(s->data_kind, kind_name(r->data_source)) != 0)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint read %s data; --data %s is %s data", o->resume,
                         s->data_kind, o->data, kind_name(r->data_source));
    const int64_t chunk = o->shuffle ? r->tokens.batch : 0;
    /* A shuffled epoch is read in whole chunks: a position between two is
     * another batch shape's, and the reader would refuse it only at the
     * first step, after the run's files were rewritten. */
    const bool read_shuffled = s->data_tokens == 0 || s->data_chunk != 0; /* or not recorded */
    if (o->shuffle && read_shuffled && s->data.token % chunk != 0)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint's shuffled position %lld is not a multiple of "
                                         "this run's micro-batch of %lld tokens (--batch-size x --seq-len x data-parallel "
                                         "ranks): resume it with the batch shape it was written with",
                         o->resume, (long long)s->data.token, (long long)chunk);
    if (s->data_tokens == 0 || s->data_chunk == chunk) return MOE_OK;
    if (s->data_chunk == 0)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint read its training data in order; resume it "
                                         "without --shuffle",
                         o->resume);
    if (!o->shuffle)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint read its training data shuffled; resume it "
                                         "with --shuffle",
                         o->resume);
    return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint shuffled its training data in chunks of %lld tokens, "
                                     "this run's micro-batch has %lld (--batch-size x --seq-len x data-parallel ranks): "
                                     "resume it with the batch shape it was written with",
                     o->resume, (long long)s->data_chunk, (long long)chunk);
}

/* Data of another tokenization than the model's reads as valid token ids
 * and gives a loss, but a meaningless one: said when validation reads
 * another kind of data than training, and for an --init-from model when
 * its checkpoint recorded another kind than this run reads, or, from
 * another trainer (no train state), when the data's ids are not its
 * vocabulary (the synthetic corpus's 54, bytes' 256). A fresh model is
 * made for its data, and --resume refuses another kind. */
static void warn_other_tokens(const run *r) {
    const moe_run_options *o = r->o;
    const char *read = o->eval_only ? (o->val_data ? o->val_data : o->data) : o->data;
    const char *flag = o->eval_only && o->val_data ? "--val-data" : "--data";
    if (!o->eval_only && o->val_data && strcmp(data_kind(o, o->val_data), data_kind(o, o->data)) != 0)
        warn(r->cb, "--val-data %s is %s data and --data %s is %s data: the model is evaluated on other tokens than it "
                    "trains on",
             o->val_data, data_kind(o, o->val_data), o->data, data_kind(o, o->data));
    if (!o->init_from) return;
    moe_train_state s; /* none (another trainer's model), or one that cannot be read: judged by the vocabulary */
    if (moe_checkpoint_read_state(&s, o->init_from) == MOE_OK && s.data_kind[0]) {
        if (strcmp(s.data_kind, data_kind(o, read)) != 0)
            warn(r->cb, "--init-from %s was trained on %s data, and %s %s is %s data", o->init_from, s.data_kind, flag,
                 read, data_kind(o, read));
        return;
    }
    const int64_t ids = is_synthetic(read)                       ? MOE_SYNTH_VOCAB_SIZE
                        : kind_of(o, read) != SOURCE_BYTES    ? 0
                                                              : MOE_BYTE_VOCAB_SIZE;
    if (ids && r->cfg.vocab_size != ids)
        warn(r->cb, "%s %s is %s data of %lld token ids, and the vocabulary of --init-from %s has %lld: the model "
                    "was made for other data",
             flag, read, data_kind(o, read), (long long)ids, o->init_from, (long long)r->cfg.vocab_size);
}

/* The synthetic training stream's length. A fresh run generates its whole
 * stream up to a cap (past it the reader goes around again), and at least
 * one batch. A resumed run reads the checkpoint's stream: shuffled, it is
 * generated at the very length the checkpoint recorded, because an epoch's
 * chunk order depends on it, so a larger --steps goes on into the next
 * epoch of that corpus, reshuffled; in order, the corpus of n tokens is the
 * first n of any longer one, so the longer of the two serves both. */
static moe_status synthetic_train_tokens(const run *r, int64_t *n_synth) {
    const token_counts *n = &r->tokens;
    int64_t own = n->run + 1 < RUN_SYNTH_MAX_TOKENS ? n->run + 1 : RUN_SYNTH_MAX_TOKENS;
    if (own < n->batch + 1) own = n->batch + 1;
    const int64_t was = r->resumed.data_tokens; /* 0 unless recorded by the checkpoint */
    if (was > 0 && was < n->batch + 1)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint records a synthetic stream of %lld tokens, "
                                         "fewer than one batch of this run (%lld)",
                         r->o->resume, (long long)was, (long long)(n->batch + 1));
    if (was > RUN_SYNTH_MAX_TOKENS && was > own)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint's synthetic stream has %lld tokens, more than "
                                         "the %lld a run generates",
                         r->o->resume, (long long)was, (long long)RUN_SYNTH_MAX_TOKENS);
    *n_synth = was > 0 && (r->o->shuffle || was > own) ? was : own;
    return MOE_OK;
}

/* The stream the checkpoint's position counts in: data that changed
 * length since (a shard added, removed or rewritten) is another stream, in
 * order too, and a shuffled order depends on the length as well (data.h).
 * A synthetic stream's length is the run's own choice
 * (synthetic_train_tokens), read in order the same tokens. An older
 * checkpoint does not say, and a shuffled synthetic stream is then this
 * run's length, as it always was. */
static moe_status check_resumed_stream(const run *r) {
    const moe_run_options *o = r->o;
    const int64_t was = r->resumed.data_tokens, now = moe_data_token_count(r->train.data);
    char held[64] = "";
    if (o->val_tokens) snprintf(held, sizeof held, " less --val-tokens %lld", (long long)o->val_tokens);
    if (was > 0 && was != now && !o->shuffle && !is_synthetic(o->data))
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint's training stream held %lld tokens, --data %s%s "
                                         "holds %lld: the data (or the tokens held out) changed since (a shard "
                                         "added, removed or rewritten), so the position it records may read other "
                                         "tokens, and its epoch ends elsewhere",
                         o->resume, (long long)was, o->data, held, (long long)now);
    if (!o->shuffle) return MOE_OK;
    if (was == 0) {
        if (is_synthetic(o->data))
            warn(r->cb, "--resume %s: the checkpoint does not record its training stream (an older version wrote it); "
                        "its shuffled order goes on only if --steps (%lld here), --batch-size, --seq-len, "
                        "--grad-accum and the data-parallel rank count are those it was written with",
                 o->resume, (long long)o->steps);
        else
            warn(r->cb, "--resume %s: the checkpoint does not record its training stream (an older version wrote it); "
                        "its shuffled order goes on only if --data %s has the length it had then",
                 o->resume, o->data);
        return MOE_OK;
    }
    if (was != now)
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the checkpoint's shuffled stream held %lld tokens, --data %s%s "
                                         "holds %lld: a shuffled order depends on the length",
                         o->resume, (long long)was, o->data, held, (long long)now);
    return MOE_OK;
}

/* Opens the sources and checks, before anything is written, that they hold
 * what the run reads: one batch of training data (the reader goes around
 * it), and every evaluation token, each inside the vocabulary. */
/* A file read at byte level that begins as a token shard does is most
 * likely one whose name lacks .bin: its header would train as text. */
static void warn_shard_as_bytes(const run *r, const run_source *s, const char *flag, const char *spec) {
    if (s->shard_magic)
        warn(r->cb, "%s %s begins with llm.c's shard magic %d but is read at byte level (vocab 256): name it *.bin, or "
                    "give a glob, to read it as token shards",
             flag, spec, s->shard_magic);
}

/* --tokenizer, read whole for the checkpoints to keep, and opened to check
 * it and count its ids: the model's vocabulary must hold them, and
 * without a config they are the default model's. It is the shards'
 * tokenizer, or encodes data given as text; the synthetic corpus has
 * tokens of its own. */
static moe_status read_tokenizer(run *r, bool known) {
    const moe_run_options *o = r->o;
    if (is_synthetic(o->data))
        return moe_error(MOE_ERR_CONFIG, "--tokenizer %s encodes text, or names the tokens of shards, and --data %s "
                                         "is the synthetic corpus, of tokens of its own",
                         o->tokenizer, o->data);
    MOE_TRY(moe_file_read_all(&r->tokenizer_text, &r->tokenizer_bytes, o->tokenizer, MOE_TOKENIZER_JSON_MAX_BYTES));
    if (!moe_tokenizer_file_is_json(o->tokenizer))
        return moe_error(MOE_ERR_CONFIG, "--tokenizer %s is no tokenizer.json (llm.c's tokenizer file, which "
                                         "checkpoints do not keep, is one for moe-generate --tokenizer)",
                         o->tokenizer);
    moe_tokenizer *t;
    MOE_TRY(moe_tokenizer_open(&t, o->tokenizer));
    r->tokenizer_tokens = moe_tokenizer_count(t);
    moe_tokenizer_close(t);
    if (known && r->tokenizer_tokens > r->cfg.vocab_size)
        return moe_error(MOE_ERR_CONFIG, "--tokenizer %s knows ids up to %lld, and the model's vocab_size is %lld",
                         o->tokenizer, (long long)r->tokenizer_tokens - 1, (long long)r->cfg.vocab_size);
    return MOE_OK;
}

/* --tokenizer among the files every checkpoint keeps, where the model's
 * source has no tokenizer of its own, or the same tokenizer.json (a resume
 * of a run with it); another would leave the model beside a tokenizer it
 * was not trained with, or beside two. */
static moe_status keep_tokenizer(run *r) {
    moe_checkpoint_files *f = &r->companions;
    const char *dir = r->o->resume ? r->o->resume : r->o->init_from;
    const char *own = NULL;
    for (int i = 0; i < f->count; i++) {
        if (strcmp(f->name[i], MOE_CHECKPOINT_TOKENIZER_FILE) == 0) {
            if (f->size[i] == r->tokenizer_bytes && memcmp(f->data[i], r->tokenizer_text, f->size[i]) == 0)
                return MOE_OK;
            return moe_error(MOE_ERR_CONFIG, "--tokenizer %s differs (byte for byte) from %s/%s, the tokenizer of "
                                             "the model in %s, which its checkpoints keep",
                             r->o->tokenizer, dir, MOE_CHECKPOINT_TOKENIZER_FILE, dir);
        }
        if (strcmp(f->name[i], MOE_CHECKPOINT_GENERATION_FILE) != 0) own = f->name[i];
    }
    if (own)
        return moe_error(MOE_ERR_CONFIG, "--tokenizer %s: %s holds a tokenizer of its own (%s), which its "
                                         "checkpoints keep",
                         r->o->tokenizer, dir, own);
    f->name[f->count] = MOE_CHECKPOINT_TOKENIZER_FILE;
    f->data[f->count] = r->tokenizer_text;
    f->size[f->count++] = r->tokenizer_bytes;
    r->tokenizer_text = NULL;
    return MOE_OK;
}

static moe_status open_data(run *r) {
    const moe_run_options *o = r->o;
    MOE_TRY(count_tokens(&r->tokens, o, r->dp_size));
    const token_counts *n = &r->tokens;
    bool known;
    MOE_TRY(load_config(r, &known));
    char shape[160];
    int len = snprintf(shape, sizeof shape, "--batch-size %lld x --seq-len %lld", (long long)o->batch_size,
                       (long long)o->seq_len);
    if (r->dp_size > 1)
        snprintf(shape + len, sizeof shape - (size_t)len, " on each of %d %sranks", r->dp_size,
                 o->pp > 1 ? "data-parallel " : "");
    /* Before any data is built, which a shape this model cannot take would
     * make in vain. */
    if (known) {
        moe_status st = moe_model_check_shape(&r->cfg, o->batch_size, o->seq_len);
        if (st != MOE_OK)
            return moe_error_prefix(st, "%s, with the model of %s%s: ", shape,
                                    o->config ? o->config : o->init_from ? o->init_from : o->resume,
                                    o->config ? "" : "/config.json");
    }
    if (o->tokenizer) MOE_TRY(read_tokenizer(r, known));
    r->data_source = kind_of(o, o->data);
    if (!o->eval_only) {
        if (o->resume) MOE_TRY(read_resume_state(r));
        int64_t n_synth = 0;
        if (is_synthetic(o->data)) MOE_TRY(synthetic_train_tokens(r, &n_synth));
        const int64_t shard_vocab = known ? r->cfg.vocab_size
                                    : r->tokenizer_tokens ? r->tokenizer_tokens
                                                          : MOE_GPT2_VOCAB_SIZE;
        MOE_TRY(open_source(&r->train, o->data, "--data", moe_rng_bits(o->seed, RUN_SYNTH_TRAIN_STREAM, 0),
                            n_synth, shard_vocab, r->data_source == SOURCE_TEXT ? o->tokenizer : NULL));
        warn_shard_as_bytes(r, &r->train, "--data", o->data);
        if (o->val_tokens) MOE_TRY(hold_out(&r->train, o));
        if (!known) moe_run_default_config(&r->cfg, moe_data_vocab_size(r->train.data));
        MOE_TRY(check_vocab(r, &r->train, "--data"));
        char reader[256];
        snprintf(reader, sizeof reader, "one batch of %s (plus the last target)", shape);
        MOE_TRY(check_length(&r->train, o->val_tokens ? "--data (less --val-tokens)" : "--data", o->data,
                             n->batch + 1, reader));
        /* An epoch reads whole batches, each taking one token past its last
         * input (the last target), so the tokens after the last whole one
         * are never trained on, in order or shuffled: said when they are a
         * share worth knowing (a stream of exactly k batches loses one). */
        const int64_t tokens = moe_data_token_count(r->train.data);
        const int64_t unread = tokens - 1 - (tokens - 1) / n->batch * n->batch;
        if (unread * 10 >= tokens)
            warn(r->cb, "--data %s: its last %lld of %lld tokens (%.0f%%) are never trained on: an epoch reads whole "
                        "batches of %s (%lld tokens, plus one for the last target)",
                 o->data, (long long)unread, (long long)tokens, 100.0 * (double)unread / (double)tokens, shape,
                 (long long)n->batch);
        if (o->resume) MOE_TRY(check_resumed_stream(r));
        r->shuffle_seed = o->resume ? r->resumed.data_shuffle_seed : moe_rng_bits(o->seed, RUN_SHUFFLE_STREAM, 0);
        if (o->shuffle) moe_data_set_shuffle(r->train.data, 1, r->shuffle_seed);
        const moe_data_position start = o->resume ? r->resumed.data : (moe_data_position){0, 0};
        moe_status st = moe_data_set_position(r->train.data, start);
        if (st != MOE_OK) return moe_error_prefix(st, "--resume %s: data position: ", o->resume);
        st = scan_first_step(r, start);
        if (st != MOE_OK) return moe_error_prefix(st, "training data (the first step's): ");
    }
    /* A second handle even on the same file: evaluation reads from the
     * start, unshuffled, whatever the training reader does. */
    const char *val_spec = o->val_data ? o->val_data : o->data;
    const char *val_flag = o->val_data ? "--val-data" : o->val_tokens ? "--val-tokens of --data" : "validation data (--data)";
    MOE_TRY(open_source(&r->val, val_spec, val_flag, moe_rng_bits(o->seed, RUN_SYNTH_VAL_STREAM, 0), n->eval + 1,
                        r->cfg.vocab_size, kind_of(o, val_spec) == SOURCE_TEXT ? o->tokenizer : NULL));
    if (o->val_data) warn_shard_as_bytes(r, &r->val, "--val-data", val_spec);
    if (o->val_tokens) {
        const int64_t all = moe_data_token_count(r->val.data);
        if (o->val_tokens > all)
            return moe_error(MOE_ERR_CONFIG, "--val-tokens %lld exceeds the %lld tokens of --data %s",
                             (long long)o->val_tokens, (long long)all, o->data);
        MOE_TRY(narrow_source(&r->val, all - o->val_tokens, all, "its last"));
    }
    MOE_TRY(check_vocab(r, &r->val, val_flag));
    char reader[256];
    snprintf(reader, sizeof reader, "--eval-batches %lld of %s (plus the last target)", (long long)o->eval_batches,
             shape);
    MOE_TRY(check_length(&r->val, val_flag, val_spec, n->eval + 1, reader));
    if (kind_of(o, val_spec) == SOURCE_SHARDS) {
        const moe_status st = scan_validation(r);
        if (st != MOE_OK) return moe_error_prefix(st, "%s: ", val_flag);
    }
    if (o->eval_mc) {
        const moe_status st = moe_mc_eval_open(&r->mc, o->eval_mc, r->cfg.vocab_size, o->seq_len, o->batch_size);
        if (st != MOE_OK) return moe_error_prefix(st, "--eval-mc: ");
        if (moe_model_config_drops_pairs(&r->cfg))
            warn(r->cb, "--eval-mc %s: moe_capacity_factor %g drops tokens by what else a batch holds, its "
                        "padding included, so the scores depend on --batch-size and --seq-len",
                 o->eval_mc, r->cfg.moe_capacity_factor);
    }
    if (!o->eval_only && !o->val_data && !o->val_tokens && !is_synthetic(o->data))
        warn(r->cb, "no --val-data: evaluating on --data %s from its start, which the model also trains on "
                    "(--val-tokens N holds out its last N tokens instead)", o->data);
    warn_other_tokens(r);
    r->entropy_floor = NAN;
    if (r->val.synth.tokens) {
        MOE_TRY(moe_synth_floor_of(&r->floor, &r->val.synth, o->eval_batches, r->dp_size * o->batch_size,
                                   o->seq_len));
        r->entropy_floor = r->floor.nats;
    }
    return MOE_OK;
}

/* The options' enums by name, for a disagreement between ranks. */
static const char *device_name(int v) { return moe_device_name((moe_device)v); }
static const char *gemm_math_name(int v) { return moe_gemm_math_name((moe_gemm_math)v); }
static const char *schedule_name(int v) { return moe_lr_schedule_name((moe_lr_schedule)v); }
static const char *pipe_schedule_name(int v) { return moe_pipe_schedule_name((moe_pipe_schedule)v); }
static const char *pp_balance_name(int v) { return moe_pp_balance_name((moe_pp_balance)v); }

/* Timed forwards and backwards of the cost measurement. */
#define RUN_COST_REPS 3

/* The median seconds of one forward and backward of a one-rank model of
 * the run's config cut to `layers` layers, MoE layers up to dense_from and
 * dense MLP layers from there, at the run's batch shape on the run's
 * device, after one untimed. */
static moe_status time_layers(run *r, int64_t layers, int64_t dense_from, double *seconds) {
    const moe_run_options *o = r->o;
    moe_model_config c = r->cfg;
    c.num_hidden_layers = layers;
    memset(c.moe_dense_layers, 0, sizeof c.moe_dense_layers);
    for (int64_t l = dense_from; l < layers; l++) moe_layer_set_add(c.moe_dense_layers, l);
    if (dense_from >= layers) c.moe_dense_intermediate_size = 0;
    const int64_t N = o->batch_size * o->seq_len;
    int32_t *tokens = malloc((size_t)(2 * N) * sizeof *tokens); /* inputs, then targets */
    if (!tokens) return moe_error(MOE_ERR_OUT_OF_MEMORY, "--pp-balance measured: %lld tokens", (long long)N);
    for (int64_t i = 0; i < 2 * N; i++) tokens[i] = (int32_t)(moe_rng_bits(o->seed, 0, (uint64_t)i) % (uint64_t)c.vocab_size);
    moe_model *m = NULL;
    moe_status st = moe_model_create_parallel(&m, &c, o->batch_size, o->seq_len, o->seed,
                                              &(moe_model_parallel){.ops = r->device.ops});
    double t[RUN_COST_REPS];
    for (int rep = -1; rep < RUN_COST_REPS && st == MOE_OK; rep++) {
        const double start = moe_monotonic_seconds();
        moe_model_zero_grad(m);
        st = moe_model_forward(m, tokens, tokens + N, NULL);
        if (st == MOE_OK) st = moe_model_backward(m, 1.0f); /* which waits for the device */
        if (rep >= 0) t[rep] = moe_monotonic_seconds() - start;
    }
    moe_model_destroy(m);
    free(tokens);
    if (st != MOE_OK) return moe_error_prefix(st, "--pp-balance measured: a model of %lld layers: ", (long long)layers);
    *seconds = moe_sort_median(t, RUN_COST_REPS);
    return MOE_OK;
}

/* The partition's costs: FLOPs, or times measured on every rank's device
 * and averaged over the ranks (so all cut the layers alike): an MoE layer
 * is the difference between models of two MoE layers and of one, a dense
 * layer (when the model has any) between one of an MoE and a dense layer
 * and the one, the head and embedding the rest of the one-layer model. A
 * model of dense layers only times dense layers alone, and its MoE layer
 * (which none is) costs a dense one, so that a resume finds it measured. A
 * resume takes the times its checkpoint's run measured, when it did, and
 * so cuts as that run did: timings vary, and another cut would round apart. */
static moe_status stage_costs(run *r, moe_stage_costs *costs) {
    const moe_run_options *o = r->o;
    *costs = moe_grid_flop_costs(&r->cfg, o->seq_len);
    if (o->pp_balance != MOE_PP_BALANCE_MEASURED) return MOE_OK;
    const bool dense = costs->dense_layers != NULL;
    if (o->resume && r->resumed.pipe_layer_seconds > 0.0) {
        costs->layer = r->resumed.pipe_layer_seconds;
        costs->dense_layer = r->resumed.pipe_dense_layer_seconds;
        costs->head = r->resumed.pipe_head_seconds;
        r->stage_costs_resumed = true;
        if (!dense || costs->dense_layer > 0.0) return MOE_OK;
        r->stage_costs_resumed = false; /* a checkpoint of before the model had dense layers: measured again */
    }
    const bool dense_only = !moe_model_config_has_moe_layer(&r->cfg);
    const int64_t dense_from = dense_only ? 0 : 2;
    double one, two, mixed = 0.0;
    MOE_TRY(time_layers(r, 1, dense_from, &one));
    MOE_TRY(time_layers(r, 2, dense_from, &two));
    if (dense && !dense_only) MOE_TRY(time_layers(r, 2, 1, &mixed));
    /* Noise can make two layers look no slower than one. */
    const double layer = fmax(two - one, 1e-3 * one);
    double v[3] = {layer, dense_only ? layer : dense ? fmax(mixed - one, 1e-3 * one) : 0.0, 0.0};
    v[2] = one - v[0] > 0.0 ? one - v[0] : 0.0;
    if (r->world) MOE_TRY(moe_comm_allreduce_sum(r->world, v, 3, MOE_COMM_F64));
    costs->layer = v[0] / r->ranks;
    costs->dense_layer = v[1] / r->ranks;
    costs->head = v[2] / r->ranks;
    return MOE_OK;
}

/* The grid of stages and groups over world, its layers split by
 * --pp-balance's costs; every communicator it makes waits --comm-timeout. */
static moe_status make_grid(run *r) {
    const moe_run_options *o = r->o;
    MOE_TRY(stage_costs(r, &r->stage_costs));
    MOE_TRY(moe_grid_create(&r->grid, r->world, o->ep, o->pp, o->pp_chunks, r->cfg.num_hidden_layers,
                            r->stage_costs));
    moe_comm *const made[] = {r->grid.dp, r->grid.pipe, r->grid.ep};
    for (size_t i = 0; i < sizeof made / sizeof *made; i++)
        if (made[i]) MOE_TRY(moe_comm_set_timeout(made[i], o->comm_timeout));
    return MOE_OK;
}

/* name made absolute against the working directory into buf [PATH_MAX]
 * ("" for NULL), without resolving links: the same path on every node
 * compares alike though it leads to each node's own copy (node-local
 * disks, a --out not made yet on some). */
static const char *absolute_name(char *buf, const char *name) {
    char cwd[PATH_MAX];
    if (!name) return "";
    if (name[0] == '/' || !getcwd(cwd, sizeof cwd) || snprintf(buf, PATH_MAX, "%s/%s", cwd, name) >= PATH_MAX)
        return name;
    return buf;
}

/* The file the run's weights come from, --init-from's or --resume's
 * checkpoint, with its flag into *flag; NULL when the run draws them. */
static const char *loaded_weights(const moe_run_options *o, const char **flag) {
    *flag = o->init_from ? "--init-from" : "--resume";
    return o->init_from ? o->init_from : o->resume;
}

static moe_status build_model(run *r) {
    const moe_run_options *o = r->o;
    if (r->world) {
        /* Everything that shapes the run must be the same on every rank;
         * the data by the names given (-1: no --val-data). */
        const moe_optim_config optim = optim_config_of(o);
        const moe_agree_field options[] = {
            {"--batch-size", (double)o->batch_size, NULL}, {"--seq-len", (double)o->seq_len, NULL},
            {"--steps", (double)o->steps, NULL},           {"--grad-accum", (double)o->grad_accum, NULL},
            /* A double holds 53 bits: the seed goes in two halves. */
            {"--seed (high 32 bits)", (double)(o->seed >> 32), NULL},
            {"--seed (low 32 bits)", (double)(o->seed & 0xFFFFFFFFu), NULL},
            {"--ep", (double)o->ep, NULL},                 {"--pp", (double)o->pp, NULL},
            {"--pp-schedule", (double)o->pp_schedule, pipe_schedule_name},
            {"--pp-chunks", (double)o->pp_chunks, NULL},
            {"--pp-balance", (double)o->pp_balance, pp_balance_name},
            {"--zero", (double)o->zero, NULL},             {"--lr", o->lr, NULL},
            /* A rank that recomputes runs its expert-parallel exchanges
             * again; one that overlaps sums its weight gradients apart. */
            {"--recompute", (double)o->recompute, NULL},   {"--overlap", (double)o->overlap, NULL},
            {"--eval-every", (double)o->eval_every, NULL}, {"--eval-batches", (double)o->eval_batches, NULL},
            {"--save-every", (double)o->save_every, NULL}, {"--shuffle", (double)o->shuffle, NULL},
            {"--keep-last", (double)o->keep_last, NULL},
            {"--device", (double)o->device, device_name},
            {"--gemm-math", (double)o->gemm_math, gemm_math_name},
            {"--warmup", (double)o->warmup, NULL},         {"--min-lr", optim.min_lr, NULL},
            {"--lr-schedule", (double)o->lr_schedule, schedule_name},
            {"--decay-frac", optim.decay_frac, NULL},
            {"--weight-decay", o->weight_decay, NULL},
            {"--grad-clip", o->grad_clip, NULL},           {"--eval-only", (double)o->eval_only, NULL},
            {"--logit-z-loss", o->logit_z_loss, NULL},
            {"--val-tokens", (double)o->val_tokens, NULL},
            /* One name may open other files on other nodes (a shard missing
             * from a local copy): a global batch of unrelated rows. */
            {"--data (tokens)", r->train.data ? (double)moe_data_token_count(r->train.data) : -1.0, NULL},
            {"validation data (tokens)", (double)moe_data_token_count(r->val.data), NULL},
            {"--upcycle", (double)o->upcycle, NULL},
            {"--max-time", o->max_time, NULL},
        };
        /* Where the weights come from and the run goes, after the build
         * and before the config: a rank that found no checkpoint in its
         * --out (node-local storage) differs in its config only as a
         * consequence. Paths made absolute, so that a relative and an
         * absolute name of one agree; the data by the names given. Ranks
         * that loaded other weights would train a mixture. */
        char resume[PATH_MAX], init_from[PATH_MAX], out[PATH_MAX];
        const char *const names[] = {"--resume", "--init-from", "--out",      "--data",
                                     "--val-data", "--eval-mc",   "--tokenizer"};
        const char *const texts[] = {absolute_name(resume, o->resume), absolute_name(init_from, o->init_from),
                                     absolute_name(out, o->out_dir), o->data, o->val_data ? o->val_data : "",
                                     o->eval_mc ? o->eval_mc : "", o->tokenizer ? o->tokenizer : ""};
        MOE_TRY(moe_grid_agree(r->world, NULL, 0));
        MOE_TRY(moe_grid_agree_texts(r->world, names, texts, (int)(sizeof names / sizeof names[0])));
        moe_agree_field fields[MOE_CONFIG_AGREE_FIELDS + sizeof options / sizeof options[0]];
        int n = moe_config_agree_fields(fields, &r->cfg);
        for (size_t i = 0; i < sizeof options / sizeof options[0]; i++) fields[n++] = options[i];
        MOE_TRY(moe_grid_agree(r->world, fields, n));
        MOE_TRY(make_grid(r));
    }
    MOE_TRY(moe_device_comms(&r->device, &r->grid, &r->device_world, &r->device_ep, &r->device_pipe));
    if (r->device_world && o->overlap)
        return moe_error(MOE_ERR_CONFIG, "--overlap posts each source's returns as it finishes, which NCCL's in-order "
                                         "matching cannot take: leave it off with --device %s on several ranks",
                         moe_device_name(o->device));
    moe_model_parallel par = moe_grid_model_parallel(&r->grid);
    par.ops = r->device.ops;
    par.device_world = r->device_world;
    par.device_ep = r->device_ep;
    par.device_pipe = r->device_pipe;
    /* Evaluation alone keeps no gradients, no AdamW state and one set of
     * activations: what the forwards need, as generation does. */
    par.inference = o->eval_only;
    par.recompute = o->recompute;
    MOE_TRY(moe_model_create_parallel(&r->model, &r->cfg, o->batch_size, o->seq_len, o->seed, &par));
    moe_model_set_overlap(r->model, o->overlap);
    moe_model_set_logit_z_loss(r->model, o->logit_z_loss);
    const char *flag, *weights = loaded_weights(o, &flag);
    if (weights) {
        moe_status st = o->upcycle && o->init_from ? moe_checkpoint_upcycle_weights(r->model, weights)
                                                   : moe_checkpoint_load_weights(r->model, weights);
        if (st != MOE_OK) return moe_error_prefix(st, "%s %s: ", flag, weights);
    }
    moe_optim_config oc = optim_config_of(o);
    if (o->eval_only) oc.total_steps = 1;
    MOE_TRY(moe_trainer_create(&r->trainer, r->model, &oc));
    /* The model's FLOPs are the whole model's, every stage's. */
    r->step_flops = moe_model_step_flops(r->model) * (double)o->grad_accum * (double)r->dp_size;
    if (!o->resume) return MOE_OK;

    /* read_resume_state checked this metadata against the options. */
    moe_train_state state;
    moe_status st = moe_checkpoint_load_state(r->trainer, r->model, &state, o->resume);
    if (st != MOE_OK) return moe_error_prefix(st, "--resume %s: ", o->resume);
    /* The checkpoint restored the step count and the jitter counter; the
     * data reader is the run's. */
    st = moe_data_set_position(r->train.data, state.data);
    if (st != MOE_OK) return moe_error_prefix(st, "--resume %s: data position: ", o->resume);
    return MOE_OK;
}

/* ----------------------------------------------------------- files */

/* Copies a parsed JSON value into a writer. */
static void json_copy(moe_json_writer *w, const moe_json *v) {
    int64_t i64;
    switch (v->type) {
    case MOE_JSON_NULL: moe_json_null(w); break;
    case MOE_JSON_BOOL: moe_json_bool(w, v->boolean); break;
    case MOE_JSON_NUMBER:
        if (strpbrk(v->number.text, ".eE") == NULL && moe_json_int64(v, &i64) == MOE_OK)
            moe_json_int(w, i64);
        else
            moe_json_number(w, v->number.value);
        break;
    case MOE_JSON_STRING: moe_json_string_n(w, v->string.data, v->string.len); break;
    case MOE_JSON_ARRAY:
        moe_json_begin_array(w);
        for (size_t i = 0; i < v->array.count; i++) json_copy(w, &v->array.items[i]);
        moe_json_end_array(w);
        break;
    case MOE_JSON_OBJECT:
        moe_json_begin_object(w);
        for (size_t i = 0; i < v->object.count; i++) {
            moe_json_key(w, v->object.members[i].key);
            json_copy(w, &v->object.members[i].value);
        }
        moe_json_end_object(w);
        break;
    }
}

/* Paths and the command line come from the OS and need not be UTF-8: bytes
 * that are not become U+FFFD. */
static void json_opt_string(moe_json_writer *w, const char *key, const char *s) {
    moe_json_key(w, key);
    if (s)
        moe_json_string_lossy(w, s);
    else
        moe_json_null(w);
}

static void write_options(moe_json_writer *w, const moe_run_options *o) {
    moe_json_begin_object(w);
    json_opt_string(w, "config", o->config);
    json_opt_string(w, "init_from", o->init_from);
    moe_json_key(w, "upcycle");
    moe_json_bool(w, o->upcycle);
    json_opt_string(w, "data", o->data);
    json_opt_string(w, "val_data", o->val_data);
    json_opt_string(w, "eval_mc", o->eval_mc);
    json_opt_string(w, "tokenizer", o->tokenizer);
    moe_json_key(w, "val_tokens");
    moe_json_int(w, o->val_tokens);
    moe_json_key(w, "shuffle");
    moe_json_bool(w, o->shuffle);
    moe_json_key(w, "batch_size");
    moe_json_int(w, o->batch_size);
    moe_json_key(w, "seq_len");
    moe_json_int(w, o->seq_len);
    moe_json_key(w, "steps");
    moe_json_int(w, o->steps);
    moe_json_key(w, "lr");
    moe_json_number(w, o->lr);
    const moe_optim_config optim = optim_config_of(o);
    moe_json_key(w, "min_lr");
    moe_json_number(w, optim.min_lr);
    moe_json_key(w, "warmup");
    moe_json_int(w, o->warmup);
    json_opt_string(w, "lr_schedule", moe_lr_schedule_name(o->lr_schedule));
    moe_json_key(w, "decay_frac");
    moe_json_number(w, optim.decay_frac);
    json_opt_string(w, "device", moe_device_name(o->device));
    json_opt_string(w, "gemm_math", moe_gemm_math_name(o->gemm_math));
    moe_json_key(w, "weight_decay");
    moe_json_number(w, o->weight_decay);
    moe_json_key(w, "grad_clip");
    moe_json_number(w, o->grad_clip);
    moe_json_key(w, "logit_z_loss");
    moe_json_number(w, o->logit_z_loss);
    moe_json_key(w, "grad_accum");
    moe_json_int(w, o->grad_accum);
    moe_json_key(w, "seed");
    moe_json_uint(w, o->seed);
    moe_json_key(w, "threads");
    moe_json_int(w, o->threads);
    json_opt_string(w, "out", o->out_dir);
    moe_json_key(w, "save_every");
    moe_json_int(w, o->save_every);
    moe_json_key(w, "keep_last");
    moe_json_int(w, o->keep_last);
    json_opt_string(w, "resume", o->resume);
    moe_json_key(w, "eval_every");
    moe_json_int(w, o->eval_every);
    moe_json_key(w, "eval_batches");
    moe_json_int(w, o->eval_batches);
    moe_json_key(w, "peak_gflops");
    moe_json_number(w, o->peak_gflops);
    moe_json_key(w, "pp");
    moe_json_int(w, o->pp);
    json_opt_string(w, "pp_schedule", moe_pipe_schedule_name(o->pp_schedule));
    moe_json_key(w, "pp_chunks");
    moe_json_int(w, o->pp_chunks);
    json_opt_string(w, "pp_balance", moe_pp_balance_name(o->pp_balance));
    moe_json_key(w, "ep");
    moe_json_int(w, o->ep);
    moe_json_key(w, "zero");
    moe_json_int(w, o->zero);
    moe_json_key(w, "comm_timeout");
    moe_json_number(w, o->comm_timeout);
    moe_json_key(w, "max_time");
    moe_json_number(w, o->max_time);
    moe_json_key(w, "overlap");
    moe_json_bool(w, o->overlap);
    moe_json_key(w, "overwrite");
    moe_json_bool(w, o->overwrite);
    moe_json_key(w, "recompute");
    moe_json_bool(w, o->recompute);
    moe_json_key(w, "profile");
    moe_json_bool(w, o->profile);
    moe_json_end_object(w);
}

static moe_status write_run_json(run *r, const moe_run_summary *s, const moe_json *config) {
    moe_json_writer w;
    moe_json_writer_init(&w, 2);
    moe_json_begin_object(&w);
    moe_json_key(&w, "moe_version");
    moe_json_string(&w, moe_version_string());
    json_opt_string(&w, "command_line", r->o->command_line);
    moe_json_key(&w, "options");
    write_options(&w, r->o);
    moe_json_key(&w, "config");
    json_copy(&w, config);
    moe_json_key(&w, "params");
    moe_json_int(&w, s->params);
    moe_json_key(&w, "active_params");
    moe_json_int(&w, s->active_params);
    moe_json_key(&w, "start_step");
    moe_json_int(&w, s->start_step);
    moe_json_key(&w, "tokens_per_step");
    moe_json_int(&w, s->tokens_per_step);
    moe_json_key(&w, "step_flops");
    moe_json_number(&w, s->step_flops);
    moe_json_key(&w, "peak_gflops");
    moe_json_number(&w, s->peak_gflops);
    moe_json_key(&w, "peak_measured");
    moe_json_bool(&w, s->peak_measured);
    moe_json_key(&w, "threads");
    moe_json_int(&w, s->threads);
    json_opt_string(&w, "device", s->device);
    json_opt_string(&w, "placement", s->placement);
    moe_json_key(&w, "ranks");
    moe_json_int(&w, s->ranks);
    moe_json_key(&w, "optimizer_bytes_per_rank");
    moe_json_int(&w, s->optimizer_bytes);
    moe_json_key(&w, "optimizer_bytes_least_per_rank");
    moe_json_int(&w, s->optimizer_bytes_least);
    moe_json_key(&w, "optimizer_bytes_most_per_rank");
    moe_json_int(&w, s->optimizer_bytes_most);
    moe_json_key(&w, "activation_bytes_least_per_rank");
    moe_json_int(&w, s->activation_bytes_least);
    moe_json_key(&w, "activation_bytes_most_per_rank");
    moe_json_int(&w, s->activation_bytes_most);
    json_opt_string(&w, "train_data", s->train_data);
    json_opt_string(&w, "val_data", s->val_data);
    if (!isnan(s->entropy_floor)) {
        moe_json_key(&w, "entropy_floor");
        moe_json_number(&w, s->entropy_floor);
    }
    moe_json_end_object(&w);
    moe_status st = moe_json_writer_finish(&w);
    char path[RUN_PATH_BYTES];
    if (st == MOE_OK) st = path_join(path, r->o->out_dir, "run.json");
    if (st == MOE_OK) {
        w.buf[w.len] = '\n'; /* the writer keeps room for its terminator */
        st = moe_file_write_atomic_buffer(path, w.buf, w.len + 1);
    }
    moe_json_writer_free(&w);
    return st;
}

/* How many line numbers a warning about damaged metrics.jsonl lines names. */
#define RUN_BAD_LINES_NAMED 8

/* The step a metrics.jsonl line [len] begins with, {"step":N, as every
 * record of a step (or of its evaluation) does; -1 for any other line. */
static int64_t record_step(const char *line, size_t len) {
    static const char key[] = "{\"step\":";
    if (len <= sizeof key - 1 || memcmp(line, key, sizeof key - 1) != 0 || !isdigit((unsigned char)line[sizeof key - 1]))
        return -1;
    return strtoll(line + sizeof key - 1, NULL, 10);
}

/* Where a resumed run cuts metrics.jsonl: before its first whole line of a
 * step past the checkpoint's (or a last line cut off), which the resumed
 * run logs again; every line before stays. */
typedef struct metrics_cut {
    int64_t bytes;                   /* kept from the file's start */
    int64_t bad_kept;                /* lines before the cut that do not parse */
    int64_t bad[RUN_BAD_LINES_NAMED]; /* the numbers (from 1) of the first lines that do not parse */
} metrics_cut;

static moe_status find_metrics_cut(metrics_cut *cut, FILE *in, const char *path, int64_t last_step) {
    *cut = (metrics_cut){0};
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int64_t number = 0;
    while ((len = getline(&line, &cap, in)) > 0 && line[len - 1] == '\n') { /* a last line cut off goes */
        number++;
        int64_t step = -1;
        moe_json_doc *doc;
        const bool damaged = moe_json_parse(&doc, line, (size_t)len - 1, path) != MOE_OK;
        if (!damaged) {
            const moe_json *v = moe_json_get(moe_json_root(doc), "step");
            if (v && moe_json_int64(v, &step) != MOE_OK) step = -1;
            moe_json_free(doc);
        } else {
            /* A damaged line whose start is whole still says its step; of
             * one that does not, the step is unknown, and the line stays. */
            step = record_step(line, (size_t)len - 1);
        }
        if (step > last_step) break;
        cut->bytes += len;
        if (damaged && cut->bad_kept < RUN_BAD_LINES_NAMED) cut->bad[cut->bad_kept] = number;
        cut->bad_kept += damaged;
    }
    const bool failed = ferror(in);
    free(line);
    return failed ? moe_error(MOE_ERR_IO, "%s: reading it failed", path) : MOE_OK;
}

typedef struct metrics_head {
    FILE *in;      /* the old metrics.jsonl */
    int64_t bytes; /* of it to keep */
} metrics_head;

static moe_status write_metrics_head(void *ctx, FILE *out) {
    const metrics_head *h = ctx;
    char buf[1 << 16];
    if (fseek(h->in, 0, SEEK_SET) != 0)
        return moe_error(MOE_ERR_IO, "reading the old file failed: %s", strerror(errno));
    for (int64_t left = h->bytes; left > 0;) {
        const size_t n = fread(buf, 1, left < (int64_t)sizeof buf ? (size_t)left : sizeof buf, h->in);
        if (n == 0) return moe_error(MOE_ERR_IO, "reading the old file failed: it ended early");
        MOE_TRY(moe_file_write_bytes(out, buf, n));
        left -= (int64_t)n;
    }
    return MOE_OK;
}

/* A run's metrics.jsonl for reading into *f, or NULL when there is none. */
static moe_status read_metrics(FILE **f, int64_t *size, const char *path) {
    struct stat sb;
    *f = NULL;
    if (lstat(path, &sb) != 0 && errno == ENOENT) return MOE_OK;
    return moe_file_open_read(f, size, path);
}

/* A resumed run's metrics.jsonl keeps the records up to the checkpoint's
 * step and none after it, which the resumed run logs again: only that end
 * is cut, and what comes before stays byte for byte, a line damaged there
 * (which no step's record can replace) included, with a warning. */
static moe_status trim_metrics(run *r) {
    metrics_head h;
    int64_t size;
    MOE_TRY(read_metrics(&h.in, &size, r->metrics_path));
    if (!h.in) return MOE_OK;
    metrics_cut cut;
    moe_status st = find_metrics_cut(&cut, h.in, r->metrics_path, r->start_step);
    h.bytes = cut.bytes;
    if (st == MOE_OK && cut.bytes < size) st = moe_file_write_atomic(r->metrics_path, write_metrics_head, &h);
    fclose(h.in);
    if (st != MOE_OK || cut.bad_kept == 0) return st;
    char lines[RUN_BAD_LINES_NAMED * 24] = "";
    const int64_t named = cut.bad_kept < RUN_BAD_LINES_NAMED ? cut.bad_kept : RUN_BAD_LINES_NAMED;
    for (int64_t i = 0, used = 0; i < named; i++)
        used += snprintf(lines + used, sizeof lines - (size_t)used, "%s%lld", i ? ", " : "", (long long)cut.bad[i]);
    warn(r->cb, "%s: %lld line%s before step %lld's checkpoint do%s not parse, kept as written (the resumed run logs "
                "only the steps after it): line %s%s",
         r->metrics_path, (long long)cut.bad_kept, cut.bad_kept > 1 ? "s" : "", (long long)r->start_step,
         cut.bad_kept > 1 ? "" : "es", lines, cut.bad_kept > named ? ", ..." : "");
    return MOE_OK;
}

/* OUT/config.json, then run.json with that file's contents as its config. */
static moe_status write_run_files(run *r, const moe_run_summary *s) {
    char path[RUN_PATH_BYTES];
    MOE_TRY(moe_mkdir_p(r->o->out_dir));
    MOE_TRY(path_join(path, r->o->out_dir, "config.json"));
    MOE_TRY(moe_model_config_save(&r->cfg, path));
    moe_json_doc *doc;
    MOE_TRY(moe_json_parse_file(&doc, path, RUN_CONFIG_MAX_BYTES));
    moe_status st = write_run_json(r, s, moe_json_root(doc));
    moe_json_free(doc);
    MOE_TRY(st);
    r->start_step = s->start_step;
    return path_join(r->metrics_path, r->o->out_dir, "metrics.jsonl");
}

/* metrics.jsonl is opened (and, resumed, trimmed) for its first line, so a
 * run that fails before it has anything to log leaves the old file whole. */
static moe_status open_metrics(run *r) {
    if (r->o->resume) MOE_TRY(trim_metrics(r));
    r->metrics = fopen(r->metrics_path, r->o->resume ? "a" : "w");
    if (!r->metrics)
        return moe_error(MOE_ERR_IO, "%s: cannot open for writing: %s", r->metrics_path, strerror(errno));
    return MOE_OK;
}

static moe_status append_metrics(run *r, moe_json_writer *w) {
    moe_status st = moe_json_writer_finish(w);
    if (st == MOE_OK && !r->metrics) st = open_metrics(r);
    errno = 0;
    if (st == MOE_OK && (fprintf(r->metrics, "%s\n", w->buf) < 0 || fflush(r->metrics) != 0))
        st = moe_error(MOE_ERR_IO, "%s: write failed: %s", r->metrics_path,
                       errno != 0 ? strerror(errno) : "short write");
    moe_json_writer_free(w);
    return st;
}

static moe_status log_step(run *r, const moe_run_step *s) {
    const moe_step_metrics *m = &s->metrics;
    moe_json_writer w;
    moe_json_writer_init(&w, 0);
    moe_json_begin_object(&w);
    /* routing: a value of the MoE layers, null in a model without one. */
    const struct {
        const char *key;
        double value;
        bool routing;
    } fields[] = {
        {"loss", m->loss, false},
        {"ce_loss", m->ce_loss, false},
        {"logit_z_loss", m->logit_z_loss, false},
        {"aux_loss", m->aux_loss, true},
        {"seq_aux_loss", m->seq_aux_loss, true},
        {"z_loss", m->z_loss, true},
        {"lr", m->lr, false},
        {"grad_norm", m->grad_norm, false},
        {"tokens_per_s", s->tokens_per_s, false},
        {"mfu", s->mfu, false},
        {"load_imbalance", m->load_imbalance, true},
        {"dropped_frac", m->dropped_frac, true},
        {"pipeline_idle", m->pipeline_idle, false},
        {"busy_s", m->busy_s, false},
        {"busy_max_s", m->busy_max_s, false},
        {"busy_median_s", m->busy_median_s, false},
        {"exchange_bytes", m->exchange_bytes, true},
        {"rank_imbalance", m->rank_imbalance, true},
    };
    const bool routes = moe_model_config_has_moe_layer(&r->cfg);
    moe_json_key(&w, "step");
    moe_json_int(&w, m->step);
    moe_json_key(&w, "slowest_rank"); /* a rank, an index */
    moe_json_int(&w, m->slowest_rank);
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
        moe_json_key(&w, fields[i].key);
        if (fields[i].routing && !routes)
            moe_json_null(&w);
        else
            moe_json_number(&w, fields[i].value);
    }
    /* Per MoE layer, the pairs each expert kept in the step; null for a dense one. */
    const moe_model_config *c = &r->cfg;
    const double *load = moe_trainer_expert_load(r->trainer);
    moe_json_key(&w, "expert_load");
    moe_json_begin_array(&w);
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        if (moe_model_config_layer_is_dense(c, l)) { /* it has no experts */
            moe_json_null(&w);
            continue;
        }
        moe_json_begin_array(&w);
        for (int64_t e = 0; e < c->num_local_experts; e++)
            moe_json_int(&w, (int64_t)load[l * c->num_local_experts + e]);
        moe_json_end_array(&w);
    }
    moe_json_end_array(&w);
    moe_json_end_object(&w);
    return append_metrics(r, &w);
}

static moe_status log_eval(run *r, const moe_run_eval *e) {
    moe_json_writer w;
    moe_json_writer_init(&w, 0);
    moe_json_begin_object(&w);
    moe_json_key(&w, "step");
    moe_json_int(&w, e->step);
    moe_json_key(&w, "val_loss");
    moe_json_number(&w, e->val_loss);
    if (!isnan(e->entropy_floor)) {
        moe_json_key(&w, "entropy_floor");
        moe_json_number(&w, e->entropy_floor);
    }
    if (e->mc_examples) {
        moe_json_key(&w, "mc_correct");
        moe_json_int(&w, e->mc_correct);
        moe_json_key(&w, "mc_examples");
        moe_json_int(&w, e->mc_examples);
        moe_json_key(&w, "mc_accuracy");
        moe_json_number(&w, (double)e->mc_correct / (double)e->mc_examples);
    }
    moe_json_end_object(&w);
    return append_metrics(r, &w);
}

static moe_status log_profile(run *r, const moe_run_end *e) {
    moe_json_writer w;
    moe_json_writer_init(&w, 0);
    moe_json_begin_object(&w);
    moe_json_key(&w, "profile_steps");
    moe_json_int(&w, e->profile_steps);
    moe_json_key(&w, "profile_seconds");
    moe_json_number(&w, e->profile_seconds);
    moe_json_key(&w, "ops");
    moe_json_begin_array(&w);
    for (int64_t i = 0; i < e->profile_ops; i++) {
        moe_json_begin_object(&w);
        moe_json_key(&w, "op");
        moe_json_string(&w, e->profile[i].op);
        moe_json_key(&w, "calls");
        moe_json_int(&w, e->profile[i].calls);
        moe_json_key(&w, "seconds");
        moe_json_number(&w, e->profile[i].seconds);
        moe_json_end_object(&w);
    }
    moe_json_end_array(&w);
    moe_json_end_object(&w);
    return append_metrics(r, &w);
}

/* -------------------------------------------------------------- evaluation */

/* Target i of this rank's rows of batch b is stream token (b * DP + d) *
 * B*T + i + 1 (moe_synth_floor_of) on data-parallel rank d of DP. On a
 * pipeline every stage reads the batch; the last stage alone has the
 * losses, and so counts the tokens (once per data-parallel rank), and each
 * stage counts the routing of its own layers, so that finish_kinds's sums
 * over every rank count each thing once. */
static moe_status accumulate_kinds(void *ctx, moe_model *model, const int32_t *targets, int64_t batch) {
    run *r = ctx;
    const int64_t BT = moe_model_batch_size(model) * moe_model_seq_len(model);
    const int64_t E = r->kinds.n_experts, k = r->kinds.top_k;
    const moe_model_stage stage = moe_model_get_stage(model);
    int64_t layers;
    const int64_t *layer = moe_model_layer_ids(model, &layers);
    const uint8_t *kinds = r->val.synth.kinds + (batch * r->dp_size + r->dp_rank) * BT + 1;
    if (stage.last) {
        const float *losses = moe_model_last_losses(model);
        for (int64_t i = 0; i < BT; i++) {
            if (targets[i] < 0) continue;
            r->kind_loss_sum[kinds[i]] += losses[i];
            r->kind_tokens[kinds[i]]++;
        }
    }
    for (int64_t li = 0; li < layers; li++) {
        const int64_t l = layer[li];
        const int32_t *topk; /* [BT, k] */
        if (moe_model_config_layer_is_dense(&r->cfg, l)) continue;
        MOE_TRY(moe_model_last_topk(model, l, &topk));
        int64_t *counts = r->route_counts + l * N_KINDS * E;
        for (int64_t i = 0; i < BT; i++) {
            if (targets[i] < 0) continue;
            for (int64_t j = 0; j < k; j++) counts[kinds[i] * E + topk[i * k + j]]++;
        }
    }
    return MOE_OK;
}

/* Sums every rank's share of the report, then turns counts into shares. */
static moe_status finish_kinds(run *r) {
    const int64_t L = r->kinds.n_layers, E = r->kinds.n_experts;
    if (r->world) {
        MOE_TRY(moe_comm_allreduce_sum(r->world, r->kind_loss_sum, N_KINDS, MOE_COMM_F64));
        MOE_TRY(moe_comm_allreduce_sum(r->world, r->kind_tokens, N_KINDS, MOE_COMM_I64));
        MOE_TRY(moe_comm_allreduce_sum(r->world, r->route_counts, L * N_KINDS * E, MOE_COMM_I64));
    }
    for (int kind = 0; kind < N_KINDS; kind++) {
        r->kinds.tokens[kind] = r->kind_tokens[kind];
        r->kinds.loss[kind] = r->kind_tokens[kind] ? r->kind_loss_sum[kind] / (double)r->kind_tokens[kind] : 0.0;
        r->kinds.floor[kind] = r->floor.kind_nats[kind];
        for (int64_t l = 0; l <= L; l++) {
            int64_t total = 0;
            for (int64_t e = 0; e < E; e++) {
                int64_t c = 0;
                if (l < L)
                    c = r->route_counts[(l * N_KINDS + kind) * E + e];
                else
                    for (int64_t m = 0; m < L; m++) c += r->route_counts[(m * N_KINDS + kind) * E + e];
                r->routing[(l * N_KINDS + kind) * E + e] = (double)c;
                total += c;
            }
            for (int64_t e = 0; e < E; e++) r->routing[(l * N_KINDS + kind) * E + e] /= total > 0 ? (double)total : 1.0;
        }
    }
    return MOE_OK;
}

/* out = {least, most} of value over the ranks. */
static moe_status range_over_ranks(run *r, int64_t value, int64_t out[2]) {
    out[0] = out[1] = value;
    if (!r->world) return MOE_OK;
    int64_t *all = malloc((size_t)r->ranks * sizeof *all);
    if (!all) return moe_error(MOE_ERR_OUT_OF_MEMORY, "byte counts of %d ranks", r->ranks);
    moe_status st = moe_comm_allgather(r->world, all, &value, 1, MOE_COMM_I64);
    for (int q = 0; st == MOE_OK && q < r->ranks; q++) {
        if (all[q] < out[0]) out[0] = all[q];
        if (all[q] > out[1]) out[1] = all[q];
    }
    free(all);
    return st;
}

/* Weights the loader took (finite, each of them) can still overflow the
 * model: one flipped exponent bit makes a weight 1e38. A loss on them as
 * loaded that is not finite puts their file at fault. */
static moe_status check_loaded_loss(const run *r, double loss) {
    const char *flag, *weights = loaded_weights(r->o, &flag);
    if (isfinite(loss) || !weights) return MOE_OK;
    return moe_error(MOE_ERR_FORMAT, "%s %s: its weights give a validation loss of %g: a weight is damaged (finite, "
                                     "but large enough to overflow the model)",
                     flag, weights, loss);
}

/* Loaded weights, one forward of the first validation batch before the
 * run writes anything in --out, where --overwrite would remove the run
 * they were to replace; --eval-only's evaluation is the check itself. */
static moe_status check_loaded_weights(run *r) {
    const char *flag;
    if (r->o->eval_only || !loaded_weights(r->o, &flag)) return MOE_OK;
    double loss;
    MOE_TRY(moe_trainer_eval(r->trainer, r->val.data, 1, &loss, NULL, NULL));
    return check_loaded_loss(r, loss);
}

/* A first step on loaded weights that diverges may owe it to them, not to
 * --lr: a weight that the check's forward took can still overflow a
 * gradient. */
static moe_status blame_loaded_weights(const run *r, moe_status st, bool first) {
    const char *flag, *weights = loaded_weights(r->o, &flag);
    if (!first || !weights || !moe_trainer_diverged(r->trainer)) return st;
    return moe_error_prefix(st, "%s %s: the first step on its weights diverged, and they may be at fault (a weight "
                                "large enough to overflow the gradients) rather than --lr: ",
                            flag, weights);
}

/* --eval-mc's examples, split over the data-parallel ranks as llm.c
 * splits them over its ranks (a share each, ceil(count / ranks)), each
 * share through its rank's pipeline; every rank runs as many forwards as
 * the busiest (an expert-parallel group exchanges in each). The last
 * stages count, and the job sums. */
static moe_status score_mc(run *r, moe_run_eval *e) {
    const int64_t n = moe_mc_eval_count(r->mc), share = (n + r->dp_size - 1) / r->dp_size, B = r->o->batch_size;
    int64_t batches = 0;
    for (int rank = 0; rank < r->dp_size; rank++) {
        const int64_t first = rank * share < n ? rank * share : n, end = first + share < n ? first + share : n;
        const int64_t b = moe_mc_eval_batches(r->mc, first, end, B);
        batches = b > batches ? b : batches;
    }
    const int64_t first = r->dp_rank * share < n ? r->dp_rank * share : n, end = first + share < n ? first + share : n;
    int64_t correct = 0;
    moe_status st = moe_mc_eval_run(r->mc, r->trainer, first, end, batches, &correct);
    if (st == MOE_OK && r->world) st = moe_comm_allreduce_sum(r->world, &correct, 1, MOE_COMM_I64);
    if (st != MOE_OK) return moe_error_prefix(st, "--eval-mc %s: ", r->o->eval_mc);
    e->mc_examples = n;
    e->mc_correct = correct;
    return MOE_OK;
}

static moe_status evaluate(run *r, int64_t step, double *val_loss) {
    const bool synthetic = r->val.synth.tokens != NULL;
    if (synthetic) {
        memset(r->kind_loss_sum, 0, sizeof r->kind_loss_sum);
        memset(r->kind_tokens, 0, sizeof r->kind_tokens);
        memset(r->route_counts, 0, (size_t)(r->kinds.n_layers * N_KINDS * r->kinds.n_experts) * sizeof *r->route_counts);
    }
    MOE_TRY(moe_trainer_eval(r->trainer, r->val.data, r->o->eval_batches, val_loss,
                             synthetic ? accumulate_kinds : NULL, r));
    /* Evaluated as loaded, the file is at fault; after steps, the training. */
    if (r->o->eval_only) MOE_TRY(check_loaded_loss(r, *val_loss));
    if (!isfinite(*val_loss))
        return moe_error(MOE_ERR_CONFIG, "step %lld: validation loss is %g (the loss diverged; lower --lr)",
                         (long long)step, *val_loss);
    if (synthetic) MOE_TRY(finish_kinds(r));
    moe_run_eval e = {.step = step, .val_loss = *val_loss, .entropy_floor = r->entropy_floor};
    if (r->mc) MOE_TRY(score_mc(r, &e));
    if (r->metrics_path[0]) MOE_TRY(log_eval(r, &e));
    if (r->cb->on_eval) r->cb->on_eval(r->cb->ctx, &e);
    return MOE_OK;
}

/* Examples of each synthetic task the end of a run tries. */
#define RUN_TASK_EXAMPLES 32

static moe_status solve_tasks(run *r) {
    if (r->ranks > 1 || moe_model_config_drops_pairs(&r->cfg)) return MOE_OK;
    const moe_status st = moe_synth_tasks_solve(&r->kinds.tasks, r->model, &r->val.synth, RUN_TASK_EXAMPLES);
    if (st != MOE_OK) return moe_error_prefix(st, "the trained model's greedy answers: ");
    r->kinds.tasks_measured = true;
    return MOE_OK;
}

/* The jitter noise's counter of the stages that route: a stage of dense
 * MLP layers only counts none (moe_model_jitter_counter). Collective over
 * the pipeline. */
static moe_status jitter_counter(run *r, uint64_t *counter) {
    const moe_model_stage stage = moe_model_get_stage(r->model);
    *counter = moe_model_jitter_counter(r->model);
    if (!stage.pipe) return MOE_OK;
    uint64_t *all = malloc((size_t)stage.count * sizeof *all);
    if (!all) return moe_error(MOE_ERR_OUT_OF_MEMORY, "the jitter counters of %d stages", stage.count);
    const moe_status st = moe_comm_allgather(stage.pipe, all, counter, 1, MOE_COMM_I64);
    for (int s = 0; st == MOE_OK && s < stage.count; s++)
        if (all[s] > *counter) *counter = all[s];
    free(all);
    return st;
}

static moe_status save_checkpoint(run *r) {
    /* The log reaches the checkpoint's step on disk first, so that a crash
     * of the machine cannot leave a checkpoint past it (which --resume
     * latest refuses: the log would miss its last steps). */
    if (r->metrics && fsync(fileno(r->metrics)) != 0)
        return moe_error(MOE_ERR_IO, "%s: cannot sync it to disk: %s", r->metrics_path, strerror(errno));
    moe_train_state state = {
        .step = moe_trainer_steps_done(r->trainer),
        .seed = r->o->seed,
        .data = moe_data_get_position(r->train.data),
        .data_tokens = moe_data_token_count(r->train.data),
        .data_chunk = r->o->shuffle ? r->tokens.batch : 0,
        .data_shuffle_seed = r->shuffle_seed,
    };
    MOE_TRY(jitter_counter(r, &state.jitter_counter));
    snprintf(state.data_kind, sizeof state.data_kind, "%s", kind_name(r->data_source));
    state.companions = &r->companions;
    if (r->o->pp_balance == MOE_PP_BALANCE_MEASURED) {
        state.pipe_layer_seconds = r->stage_costs.layer;
        state.pipe_dense_layer_seconds = r->stage_costs.dense_layer;
        state.pipe_head_seconds = r->stage_costs.head;
    }
    MOE_TRY(moe_checkpoint_save(r->last_checkpoint, sizeof r->last_checkpoint, r->o->out_dir, r->model, r->trainer,
                                &state));
    if (r->cb->on_checkpoint) r->cb->on_checkpoint(r->cb->ctx, state.step, r->last_checkpoint);
    return MOE_OK;
}

static bool due(int64_t step, int64_t every, int64_t last) { return step == last || (every > 0 && step % every == 0); }

static void prune_checkpoints(const run *r, int64_t saved);

/* A step's failure st. When its batch failed the checks, the steps since
 * the last checkpoint (saved_step) are saved before the run ends with the
 * error: a bad token deep in the data costs no work, and the run resumes
 * once the data are fixed. */
static moe_status keep_steps(run *r, moe_status st, int64_t saved_step) {
    const int64_t done = moe_trainer_steps_done(r->trainer);
    if (!moe_trainer_batch_refused(r->trainer) || done <= saved_step) return st;
    char why[1024];
    snprintf(why, sizeof why, "%s", moe_last_error());
    const moe_status saved = save_checkpoint(r);
    if (saved != MOE_OK)
        return moe_error(st, "%s (saving step %lld before it failed too: %s)", why, (long long)done, moe_last_error());
    if (r->rank == 0) prune_checkpoints(r, done);
    return moe_error(st, "%s (the steps before it are saved in %s)", why, r->last_checkpoint);
}

/* ------------------------------------------------------------------ --out */

/* step- and six or more digits: a checkpoint's name. */
static bool checkpoint_name(const char *name) { return moe_checkpoint_step_of_name(name) >= 0; }

/* Whether a and b name one file (both exist). */
static bool same_path(const char *a, const char *b) {
    char ra[PATH_MAX], rb[PATH_MAX];
    return a && b && realpath(a, ra) && realpath(b, rb) && strcmp(ra, rb) == 0;
}

/* Whether directory dir (flag's) lies directly in --out (links resolved). */
static moe_status lies_in_out(bool *inside, const char *flag, const char *dir, const char *out_dir) {
    char at[PATH_MAX], out[PATH_MAX];
    *inside = false;
    if (!realpath(dir, at)) return moe_error(MOE_ERR_IO, "%s %s: %s", flag, dir, strerror(errno));
    if (!realpath(out_dir, out)) return moe_error(MOE_ERR_IO, "--out %s: %s", out_dir, strerror(errno));
    char *slash = strrchr(at, '/');
    if (slash == at)
        slash[1] = '\0';
    else
        *slash = '\0';
    *inside = strcmp(at, out) == 0;
    return MOE_OK;
}

/* Whether --resume's checkpoint lies in --out (links resolved), the run it
 * continues; then *step: the step its training state records (and its
 * name, when it is named like a checkpoint). */
static moe_status resumes_in_place(const moe_run_options *o, bool *in_place, int64_t *step) {
    *in_place = false;
    if (!o->resume) return MOE_OK;
    bool inside;
    MOE_TRY(lies_in_out(&inside, "--resume", o->resume, o->out_dir));
    if (!inside) return MOE_OK;
    moe_train_state state;
    MOE_TRY(read_checkpoint_state(&state, "--resume", o->resume));
    *in_place = true;
    *step = state.step;
    return MOE_OK;
}

typedef struct checkpoint_entry {
    int64_t step;
    char name[NAME_MAX + 1];
} checkpoint_entry;

static int by_step_descending(const void *a, const void *b) {
    const int64_t x = ((const checkpoint_entry *)a)->step, y = ((const checkpoint_entry *)b)->step;
    return (x < y) - (x > y);
}

/* The checkpoints in out_dir, newest first, into *found [*n] (the
 * caller's to free; none when out_dir does not exist). */
static moe_status list_checkpoints(checkpoint_entry **found, size_t *n, const char *out_dir) {
    *found = NULL;
    *n = 0;
    DIR *dir = opendir(out_dir);
    if (!dir) return errno == ENOENT ? MOE_OK : moe_error(MOE_ERR_IO, "--out %s: cannot read it: %s", out_dir, strerror(errno));
    size_t cap = 0;
    moe_status st = MOE_OK;
    for (struct dirent *e; st == MOE_OK && (e = readdir(dir));) {
        if (!checkpoint_name(e->d_name)) continue;
        if (*n == cap) {
            checkpoint_entry *more = realloc(*found, (cap = cap ? 2 * cap : 16) * sizeof **found);
            if (!more) {
                st = moe_error(MOE_ERR_OUT_OF_MEMORY, "--out %s: listing its checkpoints", out_dir);
                break;
            }
            *found = more;
        }
        (*found)[*n].step = moe_checkpoint_step_of_name(e->d_name);
        snprintf((*found)[*n].name, sizeof (*found)[*n].name, "%s", e->d_name);
        (*n)++;
    }
    closedir(dir);
    if (st == MOE_OK && *n > 1) qsort(*found, *n, sizeof **found, by_step_descending);
    return st;
}

/* --keep-last after the checkpoint of step saved: removes this run's
 * checkpoints in --out but the newest keep_last up to that step. Later
 * ones are neither removed nor counted; the one --resume started from is
 * counted when it is among the newest and kept when it is not, so that a
 * command line that names it still finds it. Each is renamed aside
 * first, so that no half-removed checkpoint is left under a checkpoint's
 * name; a failure is a warning: the training goes on. */
static void prune_checkpoints(const run *r, int64_t saved) {
    const moe_run_options *o = r->o;
    if (o->keep_last == 0) return;
    checkpoint_entry *found;
    size_t n;
    if (list_checkpoints(&found, &n, o->out_dir) != MOE_OK) {
        warn(r->cb, "--keep-last: %s", moe_last_error());
        return;
    }
    char path[RUN_PATH_BYTES], aside[RUN_PATH_BYTES], hidden[NAME_MAX + 32];
    int64_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        if (found[i].step > saved || path_join(path, o->out_dir, found[i].name) != MOE_OK ||
            kept++ < o->keep_last || same_path(path, o->resume))
            continue;
        snprintf(hidden, sizeof hidden, ".%s.pruned-%ld", found[i].name, (long)getpid());
        if (path_join(aside, o->out_dir, hidden) != MOE_OK) continue;
        if (rename(path, aside) != 0) {
            warn(r->cb, "--keep-last: cannot move %s aside: %s", path, strerror(errno));
            continue;
        }
        if (moe_remove_tree(aside) != MOE_OK) warn(r->cb, "--keep-last: %s", moe_last_error());
    }
    free(found);
}

/* --out must not hold another run (run.json, metrics.jsonl, checkpoints):
 * a new run, or one resumed from elsewhere, would replace its files, even
 * on failing, and leave its checkpoints among the new run's. It is
 * refused unless --overwrite, under which remove deletes them. --resume of
 * a checkpoint in --out continues that run, whose log it cuts back to the
 * checkpoint; its later checkpoints are refused the same way, those it
 * would write again too: removed at the start, they were lost to a run
 * that died before their steps came, and kept, they stood among this
 * run's for --resume latest to take. So nothing in --out goes without
 * --overwrite. An --out holding a model (a checkpoint's or a download's),
 * or --init-from's checkpoint, is refused outright, as is an entry named
 * like a checkpoint that is not a directory: the run's save would fail at
 * its end. */
static moe_status clear_out_dir(const moe_run_options *o, bool remove) {
    if (o->eval_only) return MOE_OK; /* it writes nothing there */
    DIR *dir = opendir(o->out_dir);
    if (!dir) {
        if (errno == ENOENT) return MOE_OK;
        return moe_error(MOE_ERR_IO, "--out %s: cannot read it: %s", o->out_dir, strerror(errno));
    }
    /* Another run's weights among this run's checkpoints: a save of its
     * step, now or once resumed further, would replace them, and --resume
     * latest could take them for this run's. */
    bool inside = false;
    moe_status st = o->init_from ? lies_in_out(&inside, "--init-from", o->init_from, o->out_dir) : MOE_OK;
    if (st == MOE_OK && inside)
        st = moe_error(MOE_ERR_CONFIG, "--init-from %s lies in --out %s, where this run's checkpoints go: copy it "
                                       "out of --out first",
                       o->init_from, o->out_dir);
    if (st != MOE_OK) {
        closedir(dir);
        return st;
    }
    int64_t resumed_step = 0;
    bool in_place;
    st = resumes_in_place(o, &in_place, &resumed_step);
    /* The log an in-place resume cuts must be readable before anything goes. */
    char metrics[RUN_PATH_BYTES];
    FILE *log_file = NULL;
    int64_t log_bytes;
    if (st == MOE_OK && in_place && (st = path_join(metrics, o->out_dir, "metrics.jsonl")) == MOE_OK)
        st = read_metrics(&log_file, &log_bytes, metrics);
    if (log_file) fclose(log_file);
    if (st != MOE_OK) {
        closedir(dir);
        return st;
    }
    char found[NAME_MAX + 1] = "", path[RUN_PATH_BYTES];
    int64_t found_step = -1;
    for (struct dirent *e; st == MOE_OK && (e = readdir(dir));) {
        if (strcmp(e->d_name, "model.safetensors") == 0 || strcmp(e->d_name, "train_state.safetensors") == 0 ||
            strcmp(e->d_name, "model.safetensors.index.json") == 0) {
            st = moe_error(MOE_ERR_CONFIG, "--out %s holds a model (%s), not a run: write the run to another --out",
                           o->out_dir, e->d_name);
            break;
        }
        const int64_t at = moe_checkpoint_step_of_name(e->d_name);
        const bool step = at >= 0;
        if (!step && strcmp(e->d_name, "run.json") != 0 && strcmp(e->d_name, "metrics.jsonl") != 0) continue;
        st = path_join(path, o->out_dir, e->d_name);
        struct stat sb;
        if (st == MOE_OK && step && (lstat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)))
            st = moe_error(MOE_ERR_IO, "--out %s: %s is not a directory, and a checkpoint would go there", o->out_dir,
                           path);
        if (st != MOE_OK) continue;
        /* In place, the run's own files stay and its checkpoints up to the
         * one resumed; later ones are of the trajectory the resume cuts (as
         * it cuts the log). */
        if (in_place && (!step || at <= resumed_step)) continue;
        /* The error names the earliest, whatever order the directory lists. */
        if (!found[0] || (step && (found_step < 0 || at < found_step))) {
            snprintf(found, sizeof found, "%s", e->d_name);
            found_step = at;
        }
        if (!remove || !o->overwrite || same_path(path, o->resume)) continue;
        st = step ? moe_remove_tree(path) : (unlink(path) == 0 ? MOE_OK : moe_error(MOE_ERR_IO, "cannot remove %s: %s",
                                                                                  path, strerror(errno)));
    }
    closedir(dir);
    MOE_TRY(st);
    if (found[0] && !o->overwrite && in_place)
        return moe_error(MOE_ERR_CONFIG, "--out %s holds %s, later than the checkpoint --resume continues, which the "
                         "resumed run would replace or leave beside its own: resume the latest, or pass --overwrite "
                         "to remove the later ones", o->out_dir, found);
    if (found[0] && !o->overwrite)
        return moe_error(MOE_ERR_CONFIG, "--out %s holds another run (%s%s): continue it with --resume %s/step-NNNNNN, "
                         "write to another --out, or pass --overwrite to replace it",
                         o->out_dir, found, o->resume ? ", and --resume's checkpoint is not in it" : "", o->out_dir);
    return MOE_OK;
}

/* --out's lock file, which rank 0 holds (flock) from just before the run
 * writes or removes anything there to its end (taken sooner, it would
 * create --out for a run refused later): a second run into the same
 * --out (a --resume latest while the first is still at work) would take
 * the first's save in progress for a dead one's and remove it, and log
 * beside it. The kernel drops the lock with its process, so a killed run
 * holds nothing; the file stays, as removing it would let a third run
 * lock a new file while a second holds the old one. */
#define RUN_LOCK_NAME ".lock"

/* Opens --out's lock file at path into *fd: flags add to O_NOFOLLOW and
 * O_CLOEXEC, and anything but a regular file (a directory, a symbolic
 * link, whose target a run would overwrite) is refused. *fd is -1 when
 * there is none and flags do not create it. */
static moe_status open_lock(int *fd, const char *path, int flags) {
    *fd = open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0644);
    struct stat sb;
    if (*fd < 0 && errno == ENOENT && !(flags & O_CREAT)) return MOE_OK;
    if (*fd < 0 && errno != EISDIR && errno != ELOOP)
        return moe_error(MOE_ERR_IO, "%s: cannot open it: %s", path, strerror(errno));
    if (*fd >= 0 && fstat(*fd, &sb) == 0 && S_ISREG(sb.st_mode)) return MOE_OK;
    if (*fd >= 0) close(*fd);
    *fd = -1;
    return moe_error(MOE_ERR_CONFIG, "%s is not a regular file (a directory or a symbolic link?): remove it", path);
}

/* Locks fd (shared or exclusive, never waiting). Held by another run: the
 * refusal, naming the pid it wrote there. A file system without flock
 * (Lustre without -o flock, some FUSE mounts) keeps no runs apart: the run
 * goes on unlocked, with a warning once. */
static moe_status take_lock(int fd, int how, const char *path, const moe_run_options *o,
                            const moe_run_callbacks *cb) {
    if (flock(fd, how | LOCK_NB) == 0) return MOE_OK;
    const int err = errno;
    if (err == ENOSYS || err == EOPNOTSUPP || err == ENOLCK) {
        if (how == LOCK_EX)
            warn(cb, "%s: the file system takes no lock (%s): nothing keeps a second run out of --out %s", path,
                 strerror(err), o->out_dir);
        return MOE_OK;
    }
    if (err != EWOULDBLOCK) return moe_error(MOE_ERR_IO, "%s: cannot lock it: %s", path, strerror(err));
    char holder[32] = "";
    const ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
    holder[n > 0 ? n : 0] = '\0';
    holder[strcspn(holder, "\n")] = '\0';
    return moe_error(MOE_ERR_CONFIG, "--out %s is in use by another run (pid %s, which holds %s): wait for it to end, "
                                     "or write to another --out",
                     o->out_dir, holder[0] ? holder : "not yet written", path);
}

/* Before a run reads --out (its checkpoints, its log), every rank checks
 * that no other run holds the lock, by a shared lock taken and dropped:
 * the ranks of one job do not exclude each other, and a live run's
 * exclusive one refuses them all, before anything is read or written.
 * Rank 0 locks after collectives that every rank joins, so after every
 * rank's check. */
static moe_status check_out_unlocked(const moe_run_options *o, const moe_run_callbacks *cb) {
    char path[RUN_PATH_BYTES];
    int fd;
    if (o->eval_only) return MOE_OK;
    MOE_TRY(path_join(path, o->out_dir, RUN_LOCK_NAME));
    MOE_TRY(open_lock(&fd, path, O_RDONLY));
    if (fd < 0) return MOE_OK; /* no run has locked this --out yet */
    const moe_status st = take_lock(fd, LOCK_SH, path, o, cb);
    close(fd);
    return st;
}

/* Takes --out's lock into r->lock_fd, writing this pid there for a refused
 * run to name; refused (touching nothing) while another process holds it. */
static moe_status lock_out_dir(run *r) {
    const char *out = r->o->out_dir;
    char path[RUN_PATH_BYTES];
    MOE_TRY(path_join(path, out, RUN_LOCK_NAME));
    MOE_TRY(moe_mkdir_p(out));
    int fd;
    MOE_TRY(open_lock(&fd, path, O_RDWR | O_CREAT));
    moe_status st = take_lock(fd, LOCK_EX, path, r->o, r->cb);
    char pid[32];
    const int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    errno = 0;
    if (st == MOE_OK && (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len))
        st = moe_error(MOE_ERR_IO, "%s: cannot write this run's pid there: %s", path, errno ? strerror(errno) : "short write");
    if (st != MOE_OK) {
        close(fd);
        return st;
    }
    r->lock_fd = fd;
    return MOE_OK;
}

/* Whether process pid (decimal digits, the tail of a save's name) lives on
 * this host: its save is under way, not dead. A dead save whose pid was
 * reused since stays until a start after that process; one of a process
 * on another host that shares --out is not seen (the lock is). */
static bool pid_alive(const char *digits) {
    errno = 0;
    const long long pid = strtoll(digits, NULL, 10);
    /* This process has saved nothing yet: its own pid is an earlier
     * process's (a container's moe-train is pid 1 at every start). */
    if (errno != 0 || pid <= 0 || pid > INT_MAX || pid == (long long)getpid()) return false;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* The kind of what a save or a pruning that died left in --out
 * (moe_checkpoint_save, prune_checkpoints): ".step-N.tmp-PID" a checkpoint
 * half written, ".step-N.pruned-PID" one half removed, ".step-N.old-PID"
 * the earlier copy a save set aside for its replacement; the checkpoint's
 * name, step-N, into step, and where PID begins in name into *pid. */
typedef enum dead_save { NOT_A_SAVE, SAVE_TMP, SAVE_PRUNED, SAVE_OLD } dead_save;

static dead_save dead_save_of(const char *name, char *step, size_t step_size, const char **pid) {
    static const char *const tails[] = {[SAVE_TMP] = ".tmp-", [SAVE_PRUNED] = ".pruned-", [SAVE_OLD] = ".old-"};
    if (name[0] != '.' || strncmp(name + 1, "step-", 5) != 0) return NOT_A_SAVE;
    const size_t len = 6 + strspn(name + 6, "0123456789");
    for (int kind = SAVE_TMP; kind <= SAVE_OLD; kind++) {
        const size_t tail = strlen(tails[kind]);
        if (strncmp(name + len, tails[kind], tail) != 0) continue;
        *pid = name + len + tail;
        if (!**pid || (*pid)[strspn(*pid, "0123456789")] != '\0' || len - 1 >= step_size) return NOT_A_SAVE;
        snprintf(step, step_size, "%.*s", (int)(len - 1), name + 1);
        return checkpoint_name(step) ? (dead_save)kind : NOT_A_SAVE;
    }
    return NOT_A_SAVE;
}

/* Where PID begins in name when name is what a write of run.json,
 * metrics.jsonl or config.json that died left, moe_file_write_atomic's
 * "<file>.tmp.PID"; NULL otherwise. */
static const char *dead_write_of_run_file(const char *name) {
    static const char *const files[] = {"run.json.tmp.", "metrics.jsonl.tmp.", "config.json.tmp."};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        const size_t len = strlen(files[i]);
        if (strncmp(name, files[i], len) == 0 && name[len] && name[len + strspn(name + len, "0123456789")] == '\0')
            return name + len;
    }
    return NULL;
}

/* Clears what saves and prunings that died left in --out, once this run
 * owns it (its start, on the rank that writes, before later checkpoints
 * are cut): each is as large as a checkpoint, and no later save of another
 * pid would ever remove it. A half-written or half-removed checkpoint goes
 * (unless --resume reads it); a set-aside copy goes when its checkpoint
 * stands, and otherwise is that step's only copy: kept, and said. What a
 * process still alive is writing is no dead save: it stays. */
static moe_status clear_dead_saves(const run *r) {
    const moe_run_options *o = r->o;
    DIR *dir = opendir(o->out_dir);
    if (!dir) return errno == ENOENT ? MOE_OK : moe_error(MOE_ERR_IO, "--out %s: cannot read it: %s", o->out_dir,
                                                         strerror(errno));
    moe_status st = MOE_OK;
    char step[NAME_MAX + 1], path[RUN_PATH_BYTES], final[RUN_PATH_BYTES];
    for (struct dirent *e; st == MOE_OK && (e = readdir(dir));) {
        const char *pid = dead_write_of_run_file(e->d_name);
        if (pid) {
            if (pid_alive(pid)) continue;
            st = path_join(path, o->out_dir, e->d_name);
            if (st == MOE_OK && unlink(path) != 0 && errno != ENOENT)
                st = moe_error(MOE_ERR_IO, "cannot remove %s: %s", path, strerror(errno));
            continue;
        }
        const dead_save kind = dead_save_of(e->d_name, step, sizeof step, &pid);
        if (kind == NOT_A_SAVE || pid_alive(pid)) continue;
        st = path_join(path, o->out_dir, e->d_name);
        if (st == MOE_OK) st = path_join(final, o->out_dir, step);
        if (st != MOE_OK) break;
        struct stat sb;
        if (same_path(path, o->resume)) continue;
        if (kind == SAVE_OLD && stat(final, &sb) != 0) {
            warn(r->cb, "%s is the only copy of %s, set aside by a save that did not finish: rename it to %s to use it",
                 path, step, final);
            continue;
        }
        st = moe_remove_tree(path);
    }
    closedir(dir);
    return st;
}

/* Why the run stops after this step, or NULL: a stop request
 * (moe_run_callbacks.stop) or --max-time, seen by any rank (one
 * all-reduce a step under mpirun, so that every rank stops at the same
 * step). */
static moe_status stop_reason(const run *r, double start, const char **reason) {
    int seen[2] = {r->cb->stop && *r->cb->stop,
                   r->o->max_time > 0.0 && moe_monotonic_seconds() - start >= r->o->max_time};
    if (r->world) MOE_TRY(moe_comm_allreduce_sum(r->world, seen, 2, MOE_COMM_I32));
    *reason = seen[0] ? "a stop request" : seen[1] ? "--max-time" : NULL;
    return MOE_OK;
}

static moe_status run_body(run *r, double start) {
    const moe_run_options *o = r->o;
    MOE_TRY(clear_out_dir(o, false));
    if (o->overlap && o->ep == 1)
        warn(r->cb, "--overlap runs the experts on half the source ranks' tokens while the rest are in flight, and "
                    "under --ep 1 there are no other sources: it changes nothing");
    if (o->zero && r->dp_size == 1)
        warn(r->cb, "--zero 1 shards AdamW's state over a parameter's data-parallel replicas, and with one rank a "
                    "stage there are none: it changes nothing");
    if (!o->eval_only && o->warmup >= o->steps) {
        const moe_optim_config c = optim_config_of(o);
        warn(r->cb, "--warmup %lld >= --steps %lld: every step is in the warm-up, which ends at lr %g (--lr %g)%s",
             (long long)o->warmup, (long long)o->steps, moe_lr_at(&c, o->steps - 1), o->lr,
             o->lr_schedule == MOE_LR_CONSTANT ? "" : ", and the learning rate never decays toward --min-lr");
    }
    MOE_TRY(open_data(r));
    /* Read once, before any step: a file that cannot be read is left out
     * of the checkpoints with a warning, never found missing at a save. */
    if (!o->eval_only || r->tokenizer_text) /* under --eval-only, only to hold --tokenizer to the model's */
        MOE_TRY(moe_checkpoint_read_companions(&r->companions, o->resume ? o->resume : o->init_from,
                                               r->cb->on_warning, r->cb->ctx));
    if (r->tokenizer_text) MOE_TRY(keep_tokenizer(r));
    MOE_TRY(moe_device_open(&r->device, o->device, r->ranks));
    if (o->device == MOE_DEVICE_AUTO) MOE_TRY(moe_device_agree(&r->device, r->world));
    MOE_TRY(moe_device_set_gemm_math(&r->device, o->gemm_math));
    if (o->profile) {
        r->profile = calloc((size_t)moe_profile_op_count(), sizeof *r->profile);
        if (!r->profile) return moe_error(MOE_ERR_OUT_OF_MEMORY, "--profile: the table of ops");
        MOE_TRY(moe_profile_open(&r->device.ops, r->device.ops));
    }
    MOE_TRY(build_model(r));
    MOE_TRY(check_loaded_weights(r));
    const int64_t L = r->cfg.num_hidden_layers, E = r->cfg.num_local_experts;
    r->kinds = (moe_run_kind_report){.n_layers = L, .n_experts = E, .top_k = r->cfg.num_experts_per_tok,
                                     .last_moe_layer = L - 1};
    while (moe_model_config_layer_is_dense(&r->cfg, r->kinds.last_moe_layer)) r->kinds.last_moe_layer--;
    r->route_counts = calloc((size_t)(L * N_KINDS * E), sizeof *r->route_counts);
    r->routing = calloc((size_t)((L + 1) * N_KINDS * E), sizeof *r->routing);
    r->slowest = calloc((size_t)r->ranks, sizeof *r->slowest);
    if (!r->route_counts || !r->routing || !r->slowest) return moe_error(MOE_ERR_OUT_OF_MEMORY, "run: routing histogram");
    r->kinds.routing = r->routing;

    /* Evaluation alone reports no MFU, so it does not pay for measuring. */
    r->peak_gflops = o->peak_gflops;
    if (o->peak_gflops == 0.0) {
        if (o->eval_only)
            r->peak_gflops = NAN;
        else
            MOE_TRY(moe_measure_gemm_gflops(r->device.ops, &r->peak_gflops));
    }
    /* MFU on a grid: the job's FLOPs over every rank's peak. */
    if (r->world && isfinite(r->peak_gflops))
        MOE_TRY(moe_comm_allreduce_sum(r->world, &r->peak_gflops, 1, MOE_COMM_F64));
    /* A rank holds its stage's dense run and 1/ep of its experts. */
    int64_t params = moe_model_get_run(r->model, MOE_RUN_DENSE).count +
                     moe_model_get_run(r->model, MOE_RUN_EXPERTS).count * o->ep;
    const moe_model_stage stage = moe_model_get_stage(r->model);
    if (stage.pipe) MOE_TRY(moe_comm_allreduce_sum(stage.pipe, &params, 1, MOE_COMM_I64));
    /* The AdamW state and the activations differ between stages (and ZeRO
     * blocks): their ranges over the ranks. */
    int64_t state_bytes[2], activation_bytes[2];
    MOE_TRY(range_over_ranks(r, moe_trainer_optimizer_bytes(r->trainer), state_bytes));
    MOE_TRY(range_over_ranks(r, moe_trainer_activation_bytes(r->trainer), activation_bytes));
    const moe_run_summary summary = {
        .config = &r->cfg,
        .options = o,
        .params = params,
        .active_params = moe_model_active_param_count(r->model),
        .start_step = moe_trainer_steps_done(r->trainer),
        .tokens_per_step = r->tokens.step,
        .step_flops = r->step_flops,
        .peak_gflops = r->peak_gflops,
        .peak_measured = o->peak_gflops == 0.0 && !o->eval_only,
        .entropy_floor = r->entropy_floor,
        .threads = omp_get_max_threads(),
        .device = r->device.desc,
        .device_note = r->device.note[0] ? r->device.note : NULL,
        .placement = r->device.placement[0] ? r->device.placement : NULL,
        .rank = r->rank,
        .ranks = r->ranks,
        .ep = o->ep,
        .pp = o->pp,
        .stage_layers = r->grid.stage_layers,
        .stage_costs = r->stage_costs,
        .stage_costs_resumed = r->stage_costs_resumed,
        .optimizer_bytes = moe_trainer_optimizer_bytes(r->trainer),
        .optimizer_bytes_least = state_bytes[0],
        .optimizer_bytes_most = state_bytes[1],
        .activation_bytes_least = activation_bytes[0],
        .activation_bytes_most = activation_bytes[1],
        .train_data = o->eval_only ? NULL : r->train.desc,
        .val_data = r->val.desc,
        .tokenizer_tokens = r->tokenizer_tokens,
    };
    if (!o->eval_only && r->rank == 0) {
        MOE_TRY(lock_out_dir(r));
        MOE_TRY(clear_dead_saves(r));
        /* It removes only under --overwrite; without, the check at the
         * start refused what stands in the way. */
        MOE_TRY(clear_out_dir(o, true));
        MOE_TRY(write_run_files(r, &summary));
    }
    if (r->cb->on_start) r->cb->on_start(r->cb->ctx, &summary);

    double val_loss = NAN;
    moe_run_end end = {.profile = r->profile};
    if (o->eval_only) {
        MOE_TRY(evaluate(r, 0, &val_loss));
    } else {
        double elapsed = 0.0;
        int64_t timed = 0, saved_step = summary.start_step;
        for (int64_t step = summary.start_step + 1; step <= o->steps; step++) {
            moe_run_step s = {.rank = r->rank, .total_steps = o->steps};
            const double t0 = moe_monotonic_seconds();
            const moe_status stepped = moe_trainer_step(r->trainer, r->train.data, &s.metrics);
            if (stepped != MOE_OK) return keep_steps(r, blame_loaded_weights(r, stepped, timed == 0), saved_step);
            s.seconds = moe_monotonic_seconds() - t0;
            elapsed += s.seconds;
            timed++;
            /* The first step's start-up (plans, first touches) is no step's. */
            if (o->profile && timed == 1) moe_profile_reset();
            if (o->profile && timed > 1) end.profile_steps++, end.profile_seconds += s.seconds;
            s.tokens_per_s = (double)summary.tokens_per_step / s.seconds;
            s.mfu = r->step_flops / s.seconds / (r->peak_gflops * 1e9);
            s.elapsed_seconds = elapsed;
            s.steps_timed = timed;
            if (s.metrics.busy_median_s > 0.0) {
                r->slowest[s.metrics.slowest_rank]++;
                end.straggler_excess += s.metrics.busy_max_s / s.metrics.busy_median_s - 1.0;
            }
            if (r->metrics_path[0]) MOE_TRY(log_step(r, &s));
            if (r->cb->on_step) r->cb->on_step(r->cb->ctx, &s);
            if (o->profile) moe_profile_pause(true);
            /* The evaluation before the step's checkpoint, which it changes
             * nothing of (eval mode: no jitter draw; the data position is
             * restored): a run killed between the two resumes from the
             * checkpoint before, so every checkpoint's step has its
             * evaluation in metrics.jsonl, the last one's included. */
            if (due(step, o->eval_every, o->steps)) MOE_TRY(evaluate(r, step, &val_loss));
            const char *stop = NULL;
            if (step < o->steps) MOE_TRY(stop_reason(r, start, &stop));
            if (due(step, o->save_every, o->steps) || stop) {
                MOE_TRY(save_checkpoint(r));
                saved_step = step;
                if (r->rank == 0) prune_checkpoints(r, step);
            }
            if (o->profile) moe_profile_pause(false);
            if (stop) {
                end.stopped_by = stop;
                break;
            }
        }
    }
    if (o->profile) {
        MOE_TRY(moe_profile_read(r->profile, moe_profile_op_count(), &end.profile_ops));
        if (r->metrics_path[0]) MOE_TRY(log_profile(r, &end));
    }
    if (r->val.synth.tokens && !end.stopped_by) MOE_TRY(solve_tasks(r));
    end.steps_done = moe_trainer_steps_done(r->trainer);
    for (int q = 0; q < r->ranks; q++) {
        end.straggler_steps += r->slowest[q];
        if (r->slowest[q] > r->slowest[end.straggler_rank]) end.straggler_rank = q;
    }
    end.straggler_count = r->slowest[end.straggler_rank];
    for (int q = end.straggler_rank + 1; q < r->ranks; q++) end.straggler_ties += r->slowest[q] == end.straggler_count;
    if (end.straggler_steps) end.straggler_excess /= (double)end.straggler_steps;
    end.val_loss = end.stopped_by ? NAN : val_loss;
    end.entropy_floor = r->entropy_floor;
    end.seconds = moe_monotonic_seconds() - start;
    end.kinds = r->val.synth.tokens && !end.stopped_by ? &r->kinds : NULL;
    end.last_checkpoint = r->last_checkpoint;
    if (r->cb->on_end) r->cb->on_end(r->cb->ctx, &end);
    return MOE_OK;
}

/* Whether this process was started by mpirun (Open MPI, MPICH or PMIx). */
static bool launched_by_mpi(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}


/* Bytes of metrics.jsonl's end that last_logged_step reads: dozens of
 * lines, each with a large model's expert load. */
#define RUN_LOG_TAIL (8 << 20)

/* The latest step of metrics.jsonl's whole lines with one (a step's or an
 * evaluation's) in its last RUN_LOG_TAIL bytes, in out_dir, into *step; -1
 * without such a line; *exists: whether there is a metrics.jsonl. */
static moe_status last_logged_step(const char *out_dir, int64_t *step, bool *exists) {
    *step = -1;
    char path[RUN_PATH_BYTES];
    MOE_TRY(path_join(path, out_dir, "metrics.jsonl"));
    FILE *f;
    int64_t size;
    MOE_TRY(read_metrics(&f, &size, path));
    *exists = f != NULL;
    if (!f) return MOE_OK;
    char *tail = NULL;
    size_t n = 0;
    if (fseek(f, size > RUN_LOG_TAIL ? (long)(size - RUN_LOG_TAIL) : 0, SEEK_SET) == 0 &&
        (tail = malloc(RUN_LOG_TAIL + 1)))
        n = fread(tail, 1, RUN_LOG_TAIL, f);
    const bool failed = !tail || ferror(f);
    fclose(f);
    if (failed) {
        free(tail);
        return moe_error(MOE_ERR_IO, "%s: cannot read its end", path);
    }
    /* Whole lines only: each starts after a newline (or at the file's
     * start), and ends at one; a NUL byte inside one ends nothing. */
    const char *stop = tail + n;
    const char *line = tail;
    if (size > RUN_LOG_TAIL && (line = memchr(tail, '\n', n)) != NULL) line++;
    /* The latest step logged, wherever a stray earlier line sits. */
    for (const char *end; line && (end = memchr(line, '\n', (size_t)(stop - line))) != NULL; line = end + 1) {
        const int64_t logged = record_step(line, (size_t)(end - line));
        if (logged > *step) *step = logged;
    }
    free(tail);
    return MOE_OK;
}

/* --resume into *out (the options otherwise o's; path [RUN_PATH_BYTES]
 * holds the checkpoint's), whose config must be --config's when that is
 * given (the command line that started the run, with --resume added),
 * with --config and --init-from then dropped. latest: the newest
 * checkpoint in --out, refused when it is later than the last step its
 * metrics.jsonl logged (a step is logged before its checkpoint is saved);
 * *done when it is at --steps already; with no checkpoint in --out, a new
 * run that replaces the files of a start that died before its first
 * checkpoint. */
static moe_status resolve_resume(moe_run_options *out, bool *done, char *path, const moe_run_options *o,
                                 const moe_run_callbacks *cb) {
    *out = *o;
    *done = false;
    if (!o->resume) return MOE_OK;
    const bool latest = strcmp(o->resume, MOE_RUN_RESUME_LATEST) == 0;
    const char *flag = latest ? "--resume " MOE_RUN_RESUME_LATEST ":" : "--resume";
    if (latest) {
        out->resume = NULL;
        checkpoint_entry *found;
        size_t n;
        int64_t logged;
        bool log_exists;
        MOE_TRY(list_checkpoints(&found, &n, o->out_dir));
        moe_status st = last_logged_step(o->out_dir, &logged, &log_exists);
        /* A checkpoint past the log (one cut off before any whole line
         * included) is not the run the log tells, and the restart may not
         * remove it (--overwrite would remove the run): the user picks. */
        char last[64] = "none (no whole line holds a step)";
        if (logged >= 0) snprintf(last, sizeof last, "%lld", (long long)logged);
        if (st == MOE_OK && n > 0 && log_exists && found[0].step > logged)
            st = moe_error(MOE_ERR_CONFIG, "%s --out %s holds %s, later than the last step its metrics.jsonl "
                                           "logged, %s: resume a checkpoint by name (one before it under "
                                           "--overwrite, which removes the later ones)",
                           flag, o->out_dir, found[0].name, last);
        if (st == MOE_OK && n > 0) st = path_join(path, o->out_dir, found[0].name);
        free(found);
        if (st != MOE_OK) return st;
        if (n == 0) {
            if (log_exists && logged >= 0)
                warn(cb, "%s --out %s holds no checkpoint: the run starts over, replacing its metrics.jsonl, which "
                         "logged steps up to %lld",
                     flag, o->out_dir, (long long)logged);
            else if (log_exists)
                warn(cb, "%s --out %s holds no checkpoint: the run starts over, replacing its metrics.jsonl, which "
                         "holds no whole line of a step",
                     flag, o->out_dir);
            out->overwrite = true;
            return MOE_OK;
        }
        moe_train_state state;
        MOE_TRY(read_checkpoint_state(&state, flag, path));
        *done = state.step == o->steps; /* past --steps, the run refuses it as an explicit --resume */
    } else if (snprintf(path, RUN_PATH_BYTES, "%s", o->resume) >= RUN_PATH_BYTES) {
        return moe_error(MOE_ERR_CONFIG, "--resume %s: the path is too long", o->resume);
    }
    if (o->config) {
        moe_model_config given, saved;
        moe_status st = moe_model_config_load(&given, o->config, NULL, NULL);
        if (st != MOE_OK) return moe_error_prefix(st, "--config: ");
        st = moe_checkpoint_load_config(&saved, path, true, NULL, NULL);
        if (st != MOE_OK) return moe_error_prefix(st, "%s %s: ", flag, path);
        moe_agree_field a[MOE_CONFIG_AGREE_FIELDS], b[MOE_CONFIG_AGREE_FIELDS];
        const int count = moe_config_agree_fields(a, &given);
        moe_config_agree_fields(b, &saved);
        for (int i = 0; i < count; i++) {
            if (a[i].value == b[i].value) continue;
            char was[64], now[64];
            field_text(was, sizeof was, &a[i], b[i].value);
            field_text(now, sizeof now, &a[i], a[i].value);
            return moe_error(MOE_ERR_CONFIG, "%s %s was trained with %s=%s, --config %s has %s", flag, path, a[i].name,
                             was, o->config, now);
        }
        /* The token ids shape nothing the run computes, but the run writes
         * the checkpoint's config again: another would be dropped unseen. */
        const moe_token_ids *given_ids[] = {&given.bos_token_id, &given.eos_token_id, &given.pad_token_id};
        const moe_token_ids *saved_ids[] = {&saved.bos_token_id, &saved.eos_token_id, &saved.pad_token_id};
        static const char *const id_keys[] = {"bos_token_id", "eos_token_id", "pad_token_id"};
        for (int i = 0; i < 3; i++)
            if (memcmp(given_ids[i], saved_ids[i], sizeof *given_ids[i]) != 0)
                return moe_error(MOE_ERR_CONFIG, "%s %s has another %s than --config %s (the run keeps the "
                                                 "checkpoint's config)",
                                 flag, path, id_keys[i], o->config);
    }
    out->resume = path;
    out->config = NULL;
    out->init_from = NULL;
    out->upcycle = false; /* the checkpoint is the MoE */
    return MOE_OK;
}

moe_status moe_run(const moe_run_options *given, const moe_run_callbacks *callbacks) {
    const double start = moe_monotonic_seconds();
    MOE_TRY(moe_run_options_validate(given));
    moe_run_options resolved;
    char resumed[RUN_PATH_BYTES];
    bool done;
    const moe_run_callbacks none = {0}, *cb = callbacks ? callbacks : &none;
    MOE_TRY(check_out_unlocked(given, cb));
    MOE_TRY(resolve_resume(&resolved, &done, resumed, given, cb));
    const moe_run_options *opts = &resolved;
    if (done) { /* a job restarted after it had finished */
        warn(cb, "--resume " MOE_RUN_RESUME_LATEST ": %s is at --steps %lld already: nothing to do", resumed,
             (long long)given->steps);
        return MOE_OK;
    }
    if (opts->threads > 0) omp_set_num_threads(opts->threads);
    run r = {.o = opts, .cb = cb, .ranks = 1, .dp_size = 1, .lock_fd = -1};
    moe_status st = MOE_OK;
    if (launched_by_mpi() || opts->ep > 1 || opts->pp > 1 || opts->zero > 0) {
        st = moe_comm_mpi_create(&r.world);
        if (st == MOE_OK) st = moe_comm_set_timeout(r.world, opts->comm_timeout);
        if (st == MOE_OK) {
            r.rank = moe_comm_rank(r.world);
            r.ranks = moe_comm_size(r.world);
        }
        /* The data is opened, and sized by the data-parallel ranks, before
         * the model config that the grid (build_model) needs is known:
         * its coordinates are taken here ahead of it. */
        moe_grid_coords at;
        if (st == MOE_OK) st = moe_grid_coords_of(&at, r.rank, r.ranks, opts->pp);
        if (st == MOE_OK) r.dp_size = at.dp_size, r.dp_rank = at.dp_rank;
    }
    if (st == MOE_OK) st = run_body(&r, start);
    if (r.metrics && fclose(r.metrics) != 0 && st == MOE_OK)
        st = moe_error(MOE_ERR_IO, "%s: close failed", r.metrics_path);
    free(r.route_counts);
    free(r.routing);
    free(r.slowest);
    free(r.profile);
    moe_trainer_destroy(r.trainer);
    moe_model_destroy(r.model);
    if (opts->profile) moe_profile_close(); /* its marks are the device's */
    if (r.device_pipe) moe_comm_free(r.device_pipe);
    if (r.device_ep) moe_comm_free(r.device_ep);
    if (r.device_world) moe_comm_free(r.device_world);
    moe_device_close(&r.device);
    close_source(&r.train);
    close_source(&r.val);
    moe_mc_eval_close(r.mc);
    moe_checkpoint_files_free(&r.companions);
    free(r.tokenizer_text);
    if (r.lock_fd >= 0) close(r.lock_fd); /* the lock goes last, once nothing more is written */
    if (r.world) {
        moe_grid_destroy(&r.grid);
        moe_comm_free(r.world);
        /* A failed collective may leave peers mid-operation: finalising
         * would wait for them, so only a clean run finalises. */
        if (st == MOE_OK) st = moe_comm_mpi_finalize();
    }
    return st;
}

