/* bench_pipeline.c: `moe-bench pipeline`, the pipeline schedules of one
 * grid side by side: GPipe, 1F1B and interleaved 1F1B (engine/trainer.h,
 * moe_pipe_schedule_ops), each a fresh grid, model and trainer on the same
 * data, timed as whole training steps, a step of each in turn, against
 * plain 1F1B measured in the same run. Beside each time: the bubble the
 * trainer measured and the one the theory gives. Run under mpirun. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "common/status.h"
#include "engine/grid.h"
#include "engine/run.h"
#include "engine/synthetic.h"
#include "engine/trainer.h"

#define CMD "pipeline"
/* Interleaved rows one --chunks list may ask for. */
#define MAX_CHUNK_ROWS 8
/* A row per interleaving, after the 1f1b baseline and gpipe. */
#define MAX_ROWS (2 + MAX_CHUNK_ROWS)

static void usage(void) {
    printf("usage: mpirun -np N moe-bench pipeline [options]\n\n"
           "Times whole training steps (forward, backward, AdamW) of moe-train's default\n"
           "model on a pipeline of S stages x N/S data-parallel ranks, on the CPU, under\n"
           "each schedule in one run: 1f1b (the baseline), gpipe, and interleaved 1F1B\n"
           "with V chunks per stage (1f1b-vV: the layers cut into S x V runs, stage s\n"
           "holding runs s, s + S, ..., as moe-train --pp-chunks V). Each row is a fresh\n"
           "grid, model and trainer on the synthetic corpus, from the same start; the\n"
           "rows take turns, a step each, so a change in the machine's load falls on all.\n"
           "  step_ms   median over the timed steps of the slowest rank's step, each step\n"
           "            started after a barrier\n"
           "  tokens/s  the global batch (N/S x B x T x M tokens) per step_ms\n"
           "  idle      median of the trainer's measured bubble: the stages' share of the\n"
           "            schedule's time spent waiting for another stage\n"
           "  theory    the bubble of stages of equal cost, (S-1) / (V M + S-1)\n"
           "  speedup   1f1b's step_ms / the row's\n"
           "  act_MB    the largest rank's activations (moe_trainer_activation_bytes)\n"
           "Run with OMP_NUM_THREADS=1 when ranks outnumber cores.\n\n"
           "grid and model:\n"
           "  --pp S          pipeline stages, dividing the ranks (default: every rank a stage)\n"
           "  --layers L      the model's layers (default 4 S)\n"
           "  --chunks LIST   the interleaved rows' V, comma-separated, each 2 to 64\n"
           "                  (default 2,4); a V with S x V above L is skipped\n\n"
           "batch:\n"
           "  --batch-size B  sequences per micro-batch and rank (default 8)\n"
           "  --seq-len T     tokens per sequence (default 64)\n"
           "  --grad-accum M  micro-batches per step (default 2 S); the interleaved rows need a\n"
           "                  multiple of S and are skipped otherwise\n\n"
           "timing:\n"
           "  --warmup N      untimed steps first, per row (default 2)\n"
           "  --steps N       timed steps per row (default 10)\n\n"
           "output:\n"
           "  --json          one JSON object per row\n"
           "  -h, --help      this text\n");
}

/* --chunks "2,4": each V within [2, MOE_MODEL_CHUNKS_MAX], at most MAX_CHUNK_ROWS
 * of them, none empty or repeated. Returns how many, or 0 after printing
 * an error. */
static int parse_chunks(int64_t *chunks, const char *text) {
    char list[128];
    if (strlen(text) >= sizeof list) {
        fprintf(stderr, "moe-bench %s: --chunks=%s: at most %zu characters\n", CMD, text, sizeof list - 1);
        return 0;
    }
    snprintf(list, sizeof list, "%s", text);
    int n = 0;
    for (char *v = list, *comma = list; comma; v = comma + 1) {
        /* Split by hand: an empty item is an error, not skipped. */
        if ((comma = strchr(v, ','))) *comma = '\0';
        if (n == MAX_CHUNK_ROWS) {
            fprintf(stderr, "moe-bench %s: --chunks=%s: at most %d values\n", CMD, text, MAX_CHUNK_ROWS);
            return 0;
        }
        if (!*v) {
            fprintf(stderr, "moe-bench %s: --chunks=%s: an empty value; expected a list such as 2,4\n", CMD, text);
            return 0;
        }
        if (!bench_parse_i64(&chunks[n], CMD, "--chunks", v, 2, MOE_MODEL_CHUNKS_MAX)) return 0;
        for (int i = 0; i < n; i++)
            if (chunks[i] == chunks[n]) {
                fprintf(stderr, "moe-bench %s: --chunks=%s: %lld twice\n", CMD, text, (long long)chunks[n]);
                return 0;
            }
        n++;
    }
    return n;
}

/* The command line; 0 in pp, layers and grad_accum until the world size
 * gives their defaults. */
typedef struct pipe_options {
    int64_t pp, layers, batch_size, seq_len, grad_accum, warmup, steps;
    const char *chunks_text;
    int64_t chunks[MAX_CHUNK_ROWS];
    int n_chunks;
    bool json;
} pipe_options;

#ifdef MOE_HAVE_MPI

static const bench_column columns[] = {
    {"schedule", "schedule", BENCH_STR, -9, 0},
    {"chunks", "V", BENCH_INT, 3, 0},
    {"step_ms", "step_ms", BENCH_F64, 9, 1},
    {"tokens_per_s", "tokens/s", BENCH_F64, 9, 0},
    {"idle", "idle", BENCH_F64, 6, 3},
    {"theory", "theory", BENCH_F64, 6, 3},
    {"speedup", "speedup", BENCH_F64, 7, 2},
    {"activation_mb", "act_MB", BENCH_F64, 7, 1},
    {"pp", NULL, BENCH_INT, 0, 0},
    {"dp", NULL, BENCH_INT, 0, 0},
    {"layers", NULL, BENCH_INT, 0, 0},
    {"batch_size", NULL, BENCH_INT, 0, 0},
    {"seq_len", NULL, BENCH_INT, 0, 0},
    {"grad_accum", NULL, BENCH_INT, 0, 0},
    {"steps", NULL, BENCH_INT, 0, 0},
};
#define N_COLUMNS ((int)(sizeof columns / sizeof columns[0]))

typedef struct pipe_row {
    char name[24];
    moe_pipe_schedule kind;
    int chunks; /* V */
    moe_grid grid;
    moe_model *model;
    moe_trainer *trainer;
    moe_data *data;
    double *mine; /* [steps + 1]: this rank's step times (ms), then its activation bytes */
    double *idle; /* [steps]: the trainer's measured bubble of each step */
} pipe_row;

typedef struct pipe_run {
    moe_comm *world;
    int rank, P;
    int64_t S, DP, L, B, T, M, warmup, steps;
    moe_model_config cfg;
    const moe_synth_stream *stream;
    double *all; /* [P, steps + 1]: every rank's mine of one row */
    const bench_table *table;
} pipe_run;

/* Ends the job on a failure: the other ranks wait in a collective this
 * rank will not join. */
static void must(moe_comm *world, const char *what, moe_status st) {
    if (bench_failed(CMD, what, st)) moe_comm_abort(world, BENCH_EXIT_FAILURE);
}

/* Frees the communicator and finalises MPI, every rank alike. */
static int end_run(moe_comm *world, int status) {
    moe_comm_free(world);
    if (bench_failed(CMD, "moe_comm_mpi_finalize", moe_comm_mpi_finalize())) return BENCH_EXIT_FAILURE;
    return status;
}

/* A fresh grid, model and trainer for row's schedule, and its own reader
 * of the corpus from the start, so every row trains on the same batches. */
static void open_row(const pipe_run *r, pipe_row *row) {
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    oc.total_steps = r->warmup + r->steps;
    oc.grad_accum = r->M;
    oc.pipe_schedule = row->kind;
    must(r->world, "moe_grid_create",
         moe_grid_create(&row->grid, r->world, 1, (int)r->S, row->chunks, r->L, moe_grid_flop_costs(&r->cfg, r->T)));
    const moe_model_parallel par = moe_grid_model_parallel(&row->grid);
    must(r->world, "model", moe_model_create_parallel(&row->model, &r->cfg, r->B, r->T, 1, &par));
    must(r->world, "trainer", moe_trainer_create(&row->trainer, row->model, &oc));
    must(r->world, "data",
         moe_data_from_tokens(&row->data, r->stream->tokens, r->stream->n, MOE_SYNTH_VOCAB_SIZE, "synthetic"));
}

static void close_row(pipe_row *row) {
    moe_data_close(row->data);
    moe_trainer_destroy(row->trainer);
    moe_model_destroy(row->model);
    moe_grid_destroy(&row->grid);
}

/* Step i of row, started after a barrier; timed from the warm-up's end. */
static void step_row(const pipe_run *r, pipe_row *row, int64_t i) {
    moe_step_metrics m;
    must(r->world, "barrier", moe_comm_barrier(r->world));
    const double t0 = bench_now_seconds();
    must(r->world, "step", moe_trainer_step(row->trainer, row->data, &m));
    if (i < r->warmup) return;
    row->mine[i - r->warmup] = 1e3 * (bench_now_seconds() - t0);
    row->idle[i - r->warmup] = m.pipeline_idle;
}

/* Prints row (rank 0); returns its step_ms. baseline_ms: 1f1b's, or NaN
 * for the 1f1b row itself. */
static double report_row(const pipe_run *r, pipe_row *row, double baseline_ms) {
    /* pipeline_idle is already the mean over this rank's pipeline's stages;
     * the data-parallel pipelines run the same schedule, so rank 0's speaks
     * for them. */
    const double median_idle = bench_median(row->idle, (int)r->steps);
    row->mine[r->steps] = (double)moe_trainer_activation_bytes(row->trainer);
    const int64_t n = r->steps + 1;
    must(r->world, "gathering the step times", moe_comm_allgather(r->world, r->all, row->mine, n, MOE_COMM_F64));
    /* A step ends when its slowest rank does; the memory that counts is
     * the fullest rank's. */
    for (int p = 1; p < r->P; p++)
        for (int64_t i = 0; i < n; i++) r->all[i] = fmax(r->all[i], r->all[p * n + i]);
    const double step_ms = bench_median(r->all, (int)r->steps);
    if (r->rank == 0) {
        const double V = row->chunks, bubble = (double)(r->S - 1);
        const bench_value v[N_COLUMNS] = {
            {.s = row->name},
            {.i = row->chunks},
            {.f = step_ms},
            {.f = (double)(r->DP * r->B * r->T * r->M) / (step_ms * 1e-3)},
            {.f = median_idle},
            {.f = bubble / (V * (double)r->M + bubble)},
            {.f = isnan(baseline_ms) ? 1.0 : baseline_ms / step_ms},
            {.f = r->all[r->steps] * 1e-6},
            {.i = r->S},
            {.i = r->DP},
            {.i = r->L},
            {.i = r->B},
            {.i = r->T},
            {.i = r->M},
            {.i = r->steps},
        };
        bench_table_row(r->table, v);
    }
    return step_ms;
}

/* Ranks given other flags would build other grids and wait in other
 * collectives: every rank compares them first, --chunks value by value. */
static moe_status agree_options(moe_comm *world, const pipe_options *o) {
    static const char *const chunk_names[MAX_CHUNK_ROWS] = {
        "--chunks (1st)", "--chunks (2nd)", "--chunks (3rd)", "--chunks (4th)",
        "--chunks (5th)", "--chunks (6th)", "--chunks (7th)", "--chunks (8th)"};
    moe_agree_field fields[8 + MAX_CHUNK_ROWS] = {
        {"--pp", (double)o->pp, NULL},
        {"--layers", (double)o->layers, NULL},
        {"--batch-size", (double)o->batch_size, NULL},
        {"--seq-len", (double)o->seq_len, NULL},
        {"--grad-accum", (double)o->grad_accum, NULL},
        {"--warmup", (double)o->warmup, NULL},
        {"--steps", (double)o->steps, NULL},
        {"--chunks (values)", (double)o->n_chunks, NULL},
    };
    int n = 8;
    for (int c = 0; c < MAX_CHUNK_ROWS; c++)
        fields[n++] = (moe_agree_field){chunk_names[c], c < o->n_chunks ? (double)o->chunks[c] : 0.0, NULL};
    return moe_grid_agree(world, fields, n);
}

/* Why interleaving V chunks cannot run on r's grid, or NULL when it can. */
static const char *skip_reason(const pipe_run *r, int64_t V) {
    if (r->S * V > r->L) return "S x V exceeds the layers, and each chunk needs one";
    if (r->M % r->S != 0) return "--grad-accum is not a multiple of the stages, which interleaving takes in groups";
    return NULL;
}

/* The rows to time: 1f1b first (the baseline), gpipe, then each V of
 * --chunks that can run. Every check here sees the same options and world
 * size on every rank, so all refuse together, before any of them builds a
 * grid; rank 0 says why. */
static bool plan_rows(pipe_row *rows, int *n_rows, const pipe_run *r, const pipe_options *o) {
    char why[160] = "";
    if (r->S < 2)
        snprintf(why, sizeof why, "--pp %lld: one stage has no pipeline to time (run with more ranks, or --pp 2 or more)",
                 (long long)r->S);
    else if (r->P % r->S != 0)
        snprintf(why, sizeof why, "--pp %lld must divide the %d ranks", (long long)r->S, r->P);
    else if (r->L < r->S)
        snprintf(why, sizeof why, "--layers %lld: each of the %lld stages needs a layer", (long long)r->L,
                 (long long)r->S);
    else if (moe_model_check_shape(&r->cfg, r->B, r->T) != MOE_OK)
        snprintf(why, sizeof why, "--batch-size %lld --seq-len %lld: %s", (long long)r->B, (long long)r->T,
                 moe_last_error());
    rows[0] = (pipe_row){.name = "1f1b", .kind = MOE_PIPE_1F1B, .chunks = 1};
    rows[1] = (pipe_row){.name = "gpipe", .kind = MOE_PIPE_GPIPE, .chunks = 1};
    *n_rows = 2;
    for (int c = 0; c < o->n_chunks && !why[0]; c++) {
        if (skip_reason(r, o->chunks[c])) continue;
        pipe_row *row = &rows[(*n_rows)++];
        *row = (pipe_row){.kind = MOE_PIPE_1F1B, .chunks = (int)o->chunks[c]};
        snprintf(row->name, sizeof row->name, "1f1b-v%d", row->chunks);
    }
    if (why[0] && r->rank == 0) fprintf(stderr, "moe-bench %s: %s\n", CMD, why);
    return why[0] == '\0';
}

static int run(const pipe_options *o, moe_comm *world) {
    pipe_run r = {.world = world, .rank = moe_comm_rank(world), .P = moe_comm_size(world)};
    r.S = o->pp ? o->pp : r.P;
    r.DP = r.P / r.S;
    r.L = o->layers ? o->layers : 4 * r.S;
    r.M = o->grad_accum ? o->grad_accum : 2 * r.S;
    r.B = o->batch_size, r.T = o->seq_len, r.warmup = o->warmup, r.steps = o->steps;
    moe_run_default_config(&r.cfg, MOE_SYNTH_VOCAB_SIZE);
    r.cfg.num_hidden_layers = r.L;
    pipe_row rows[MAX_ROWS];
    int n_rows;
    if (!plan_rows(rows, &n_rows, &r, o)) return end_run(world, BENCH_EXIT_USAGE);

    /* One allocation: all [P, n], then each row's mine [n] and idle [steps]. */
    const size_t n = (size_t)r.steps + 1, per_row = n + (size_t)r.steps;
    double *times = malloc(((size_t)r.P * n + (size_t)n_rows * per_row) * sizeof *times);
    if (!times) must(world, "the step times", moe_error(MOE_ERR_OUT_OF_MEMORY, "%lld steps", (long long)r.steps));
    r.all = times;
    for (int k = 0; k < n_rows; k++) {
        rows[k].mine = times + (size_t)r.P * n + (size_t)k * per_row;
        rows[k].idle = rows[k].mine + n;
    }
    moe_synth_params sp = moe_synth_default_params();
    moe_synth_stream stream = {0};
    must(world, "synthetic corpus", moe_synth_generate(&stream, &sp, 1, BENCH_SYNTH_TOKENS));
    r.stream = &stream;

    const bench_table table = {.bench = CMD, .cols = columns, .n_cols = N_COLUMNS, .json = o->json};
    r.table = &table;
    if (r.rank == 0) {
        bench_table_note(&table,
                         "moe-bench pipeline, libmoe %s: %d ranks = %lld stages x %lld data-parallel, %lld "
                         "layers, B %lld x T %lld x %lld micro-batches per rank and step, %d threads, "
                         "%lld warm-up + %lld timed steps per row",
                         moe_version_string(), r.P, (long long)r.S, (long long)r.DP, (long long)r.L,
                         (long long)r.B, (long long)r.T, (long long)r.M, bench_omp_threads(),
                         (long long)r.warmup, (long long)r.steps);
        /* Under --json the notes are not printed: a skipped row goes to stderr. */
        for (int c = 0; c < o->n_chunks; c++) {
            const char *why = skip_reason(&r, o->chunks[c]);
            if (why && o->json) fprintf(stderr, "moe-bench %s: V=%lld skipped: %s\n", CMD, (long long)o->chunks[c], why);
            if (why) bench_table_note(&table, "V=%lld skipped: %s", (long long)o->chunks[c], why);
        }
        bench_table_header(&table);
    }
    for (int k = 0; k < n_rows; k++) open_row(&r, &rows[k]);
    /* The rows take turns, a step each, so a change in the machine's load
     * falls on all of them alike; the first of a turn rotates, spreading
     * whatever the row before leaves (a warm cache, a busy core) over all. */
    for (int64_t i = 0; i < r.warmup + r.steps; i++)
        for (int k = 0; k < n_rows; k++) step_row(&r, &rows[(i + k) % n_rows], i);
    double baseline_ms = NAN;
    for (int k = 0; k < n_rows; k++) {
        const double ms = report_row(&r, &rows[k], baseline_ms);
        if (k == 0) baseline_ms = ms;
    }
    for (int k = 0; k < n_rows; k++) close_row(&rows[k]);
    moe_synth_stream_free(&stream);
    free(times);
    return end_run(world, 0);
}

#endif /* MOE_HAVE_MPI */

int bench_pipeline_run(int argc, char **argv) {
    pipe_options o = {.batch_size = 8, .seq_len = 64, .warmup = 2, .steps = 10, .chunks_text = "2,4"};
    const bench_switch switches[] = {{"--json", &o.json}};
    const bench_text_flag texts[] = {{"chunks", &o.chunks_text}};
    const bench_int_flag ints[] = {
        {"pp", &o.pp, 1, 4096},
        {"layers", &o.layers, 1, 4096},
        {"batch-size", &o.batch_size, 1, 1 << 20},
        {"seq-len", &o.seq_len, 1, 1 << 20},
        {"grad-accum", &o.grad_accum, 1, 1 << 20},
        {"warmup", &o.warmup, 0, 1000},
        {"steps", &o.steps, 1, 100000},
    };
    const bench_flags flags = {.usage = usage, .switches = switches, .n_switches = 1, .texts = texts, .n_texts = 1,
                               .ints = ints, .n_ints = (int)(sizeof ints / sizeof ints[0])};
    const int parsed = bench_parse_flags(&flags, CMD, argc, argv);
    if (parsed >= 0) return parsed;
    o.n_chunks = parse_chunks(o.chunks, o.chunks_text);
    if (o.n_chunks == 0) return bench_usage_error(CMD);
#ifdef MOE_HAVE_MPI
    moe_comm *world = NULL;
    if (bench_failed(CMD, "moe_comm_mpi_create", moe_comm_mpi_create(&world))) return BENCH_EXIT_FAILURE;
    if (bench_failed(CMD, "the ranks' flags", agree_options(world, &o))) return end_run(world, BENCH_EXIT_FAILURE);
    return run(&o, world);
#else
    fprintf(stderr, "moe-bench %s: %s\n", CMD, BENCH_NO_MPI);
    return BENCH_EXIT_FAILURE;
#endif
}
