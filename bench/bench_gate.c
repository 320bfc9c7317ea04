/* bench_gate.c: `moe-bench gate`: the fused gating pass (softmax or sigmoid,
 * top-k, renormalisation, per-expert counts, balancing sums and the z term
 * in one pass over the router logits) against a device-to-device copy of the
 * logits measured in the same run, as memory bandwidth: the pass reads the
 * logits once and writes the probabilities, the choices and the
 * logsumexp, so its floor is a copy's time. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "common/status.h"
#include "engine/device.h"
#include "kernels/ops.h"

#define CMD "gate"
#define DEFAULT_T 65536
#define DEFAULT_E 64
#define DEFAULT_K 8
#define DEFAULT_WARMUP 3
#define DEFAULT_ITERS 20
#define LOGIT_RANGE 4.0f
/* A device's routing weights may differ from the CPU's by rounding. */
#define CHECK_TOLERANCE 1e-5

static const bench_column columns[] = {
    {"gate", "gate", BENCH_STR, -13, 0},
    {"T", "T", BENCH_INT, 7, 0},
    {"E", "E", BENCH_INT, 4, 0},
    {"k", "k", BENCH_INT, 3, 0},
    {"us", "time(us)", BENCH_F64, 9, 1},
    {"gbps", "GB/s", BENCH_F64, 8, 1},
    {"copy_us", "copy(us)", BENCH_F64, 9, 1},
    {"copy_gbps", "copy_GB/s", BENCH_F64, 9, 1},
    {"ratio", "ratio", BENCH_F64, 6, 3},
    {"iters", NULL, BENCH_INT, 0, 0},
};
#define N_COLUMNS ((int)(sizeof columns / sizeof columns[0]))

static const struct {
    const char *name;
    moe_gate_kind kind;
} kinds[] = {
    {"softmax_topk", MOE_GATE_SOFTMAX_TOPK},
    {"topk_softmax", MOE_GATE_TOPK_SOFTMAX},
    {"sigmoid", MOE_GATE_SIGMOID},
};
#define N_KINDS ((int)(sizeof kinds / sizeof kinds[0]))

static void usage(void) {
    printf("usage: moe-bench gate [options]\n\n"
           "Times the op table's gate_forward (one pass per token: probabilities, top-k,\n"
           "renormalised weights, per-expert counts and probability sums, z term) for each\n"
           "gate kind, against a copy of the logits on the same device in the same run.\n"
           "GB/s counts the bytes the pass must move: logits read, probabilities, top-k\n"
           "indices and weights and logsumexp written; a copy moves its bytes twice (read\n"
           "and write). ratio = GB/s / copy_GB/s. Times are medians of samples of at\n"
           "least 1 ms each (as many calls back to back as that takes, per call). On a\n"
           "device each kind's choices and weights are then checked against the CPU's\n"
           "gate (weights within 1e-5; a tie of logits may go either way), else exit 1.\n\n"
           "  --T N         tokens (default %d)\n"
           "  --E N         experts (default %d)\n"
           "  --k N         experts per token (default %d)\n"
           "  --device D    auto (default), cpu, cuda or cpu-strict\n"
           "  --warmup N    untimed iterations first (default %d)\n"
           "  --iters N     timed iterations (default %d)\n"
           "  --threads N   OpenMP and OpenBLAS threads on the CPU (default: OMP_NUM_THREADS,\n"
           "                else every core)\n"
           "  --json        one JSON object per row\n"
           "  -h, --help    this text\n",
           DEFAULT_T, DEFAULT_E, DEFAULT_K, DEFAULT_WARMUP, DEFAULT_ITERS);
}

typedef struct gate_buffers {
    float *logits, *prob, *topk_w, *lse, *copy; /* [T, E], [T, E], [T, k], [T], [T, E] */
    int32_t *topk_idx;                          /* [T, k] */
    int64_t *assigned;                          /* [E] */
    double *prob_sum, *z_sum, *chunks;          /* [E], [1], [chunks, 2E + 1] */
} gate_buffers;

/* Each buffer its own piece of backend memory; NULL pieces stay NULL. */
static moe_status alloc_buffers(const moe_ops *ops, gate_buffers *b, int64_t T, int64_t E, int64_t k) {
    const int64_t chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;
    struct {
        void **ptr;
        size_t bytes;
    } pieces[] = {
        {(void **)&b->logits, (size_t)(T * E) * sizeof(float)},
        {(void **)&b->prob, (size_t)(T * E) * sizeof(float)},
        {(void **)&b->topk_w, (size_t)(T * k) * sizeof(float)},
        {(void **)&b->lse, (size_t)T * sizeof(float)},
        {(void **)&b->copy, (size_t)(T * E) * sizeof(float)},
        {(void **)&b->topk_idx, (size_t)(T * k) * sizeof(int32_t)},
        {(void **)&b->assigned, (size_t)E * sizeof(int64_t)},
        {(void **)&b->prob_sum, (size_t)E * sizeof(double)},
        {(void **)&b->z_sum, sizeof(double)},
        {(void **)&b->chunks, (size_t)(chunks * (2 * E + 1)) * sizeof(double)},
    };
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) MOE_TRY(ops->alloc(pieces[i].ptr, pieces[i].bytes));
    return MOE_OK;
}

static void release_buffers(const moe_ops *ops, gate_buffers *b) {
    void *all[] = {b->logits, b->prob, b->topk_w, b->lse, b->copy, b->topk_idx, b->assigned, b->prob_sum, b->z_sum,
                   b->chunks};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ops->release(all[i]);
}

/* What a timed call runs: the gating pass for call, or a copy of the
 * logits (copy_bytes). */
typedef struct gate_job {
    const moe_ops *ops;
    const gate_buffers *b;
    moe_gate_params params;
    int64_t T;
    size_t copy_bytes;
} gate_job;

static void run_gate(const void *arg) {
    const gate_job *j = arg;
    const gate_buffers *b = j->b;
    moe_gate_totals totals = {.assigned = b->assigned, .prob_sum = b->prob_sum, .z_sum = b->z_sum,
                              .chunk_scratch = b->chunks};
    j->ops->gate_forward(b->topk_idx, b->topk_w, b->prob, b->lse, &totals, b->logits, NULL, &j->params, j->T);
}

static void run_copy(const void *arg) {
    const gate_job *j = arg;
    j->ops->copy(j->b->copy, j->b->logits, j->copy_bytes);
}

static int by_value(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* On a device, the pass's choices (as the logits they chose, so that tied
 * logits may go either way) and weights, each token's in value order,
 * against the CPU's gate on the same logits: how many tokens differ. */
static moe_status check_against_cpu(int64_t *wrong, const gate_job *j, const float *logits) {
    const int64_t T = j->T, E = j->params.n_experts, k = j->params.top_k;
    const int64_t chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;
    const size_t floats = (size_t)(T * E + T + 2 * T * k + 2 * k), doubles = (size_t)(E + 1 + chunks * (2 * E + 1));
    float *f = malloc(floats * sizeof *f);
    double *d = malloc(doubles * sizeof *d);
    int32_t *idx = malloc((size_t)(2 * T * k) * sizeof *idx);
    int64_t *assigned = malloc((size_t)E * sizeof *assigned);
    moe_status st = MOE_OK;
    if (!f || !d || !idx || !assigned)
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "the CPU gate's check: T=%lld x E=%lld", (long long)T, (long long)E);
    if (st == MOE_OK) {
        /* a and b: one token's k values of each side, sorted. */
        float *prob = f, *lse = prob + T * E, *w = lse + T, *got_w = w + T * k, *a = got_w + T * k, *b = a + k;
        int32_t *got_idx = idx + T * k;
        moe_gate_totals totals = {.assigned = assigned, .prob_sum = d, .z_sum = d + E, .chunk_scratch = d + E + 1};
        moe_cpu_ops()->gate_forward(idx, w, prob, lse, &totals, logits, NULL, &j->params, T);
        st = j->ops->download(got_idx, j->b->topk_idx, (size_t)(T * k) * sizeof *got_idx);
        if (st == MOE_OK) st = j->ops->download(got_w, j->b->topk_w, (size_t)(T * k) * sizeof *got_w);
        *wrong = 0;
        for (int64_t t = 0; st == MOE_OK && t < T; t++) {
            bool same = true;
            for (int pass = 0; pass < 2; pass++) {
                for (int64_t s = 0; s < k; s++) {
                    const int32_t want_e = idx[t * k + s], got_e = got_idx[t * k + s];
                    if (got_e < 0 || got_e >= E) same = false;
                    a[s] = pass ? w[t * k + s] : logits[t * E + want_e];
                    b[s] = pass ? got_w[t * k + s] : same ? logits[t * E + got_e] : NAN;
                }
                qsort(a, (size_t)k, sizeof *a, by_value);
                qsort(b, (size_t)k, sizeof *b, by_value);
                for (int64_t s = 0; s < k; s++)
                    same = same && (pass ? fabsf(a[s] - b[s]) <= CHECK_TOLERANCE : a[s] == b[s]);
            }
            *wrong += !same;
        }
    }
    free(f);
    free(d);
    free(idx);
    free(assigned);
    return st;
}

int bench_gate_run(int argc, char **argv) {
    int64_t T = DEFAULT_T, E = DEFAULT_E, k = DEFAULT_K, warmup = DEFAULT_WARMUP, iters = DEFAULT_ITERS;
    int64_t threads = 0;
    moe_device device = MOE_DEVICE_AUTO;
    bool json = false;
    const bench_int_flag int_flags[] = {
        {"T", &T, 1, INT32_MAX},         {"E", &E, 1, MOE_EXPERTS_MAX}, {"k", &k, 1, MOE_EXPERTS_MAX},
        {"warmup", &warmup, 0, 1000},    {"iters", &iters, 1, 100000}, {"threads", &threads, 1, 4096},
    };
    const bench_switch switches[] = {{"--json", &json}};
    const bench_flags flags = {.usage = usage, .switches = switches, .n_switches = 1, .device = &device,
                               .ints = int_flags, .n_ints = (int)(sizeof int_flags / sizeof int_flags[0])};
    const int parsed = bench_parse_flags(&flags, CMD, argc, argv);
    if (parsed >= 0) return parsed;
    if (k > E) {
        fprintf(stderr, "moe-bench %s: --k %lld exceeds --E %lld\n", CMD, (long long)k, (long long)E);
        return BENCH_EXIT_USAGE;
    }

    if (threads > 0) bench_set_threads((int)threads);
    moe_device_handle dev;
    if (!bench_open_device(&dev, CMD, device, MOE_GEMM_FP32)) return BENCH_EXIT_FAILURE;
    if (dev.note[0]) fprintf(stderr, "moe-bench %s: %s\n", CMD, dev.note);
    const moe_ops *ops = dev.ops;
    gate_buffers b = {0};
    double *times = malloc((size_t)(2 * iters) * sizeof *times);
    float *host = malloc((size_t)(T * E) * sizeof *host);
    int rc = BENCH_EXIT_FAILURE;
    if (!times || !host) {
        fprintf(stderr, "moe-bench %s: out of memory for T=%lld x E=%lld logits\n", CMD, (long long)T, (long long)E);
        goto done;
    }
    if (bench_failed(CMD, "buffers", alloc_buffers(ops, &b, T, E, k))) goto done;
    bench_rng rng = {0x67617465ull};
    bench_fill_uniform(host, (size_t)(T * E), LOGIT_RANGE, &rng);
    if (bench_failed(CMD, "logits", ops->upload(b.logits, host, (size_t)(T * E) * sizeof *host))) goto done;

    const bench_table table = {.bench = CMD, .cols = columns, .n_cols = N_COLUMNS, .json = json};
    bench_table_note(&table, "moe-bench gate on %s: T=%lld E=%lld k=%lld, %lld warmup + %lld timed iterations, medians",
                     dev.desc, (long long)T, (long long)E, (long long)k, (long long)warmup, (long long)iters);
    bench_table_header(&table);
    const size_t logit_bytes = (size_t)(T * E) * sizeof(float);
    /* Logits in, probabilities out, k indices and weights and one logsumexp per token out. */
    const double gate_bytes = 2.0 * (double)logit_bytes + (double)(T * k) * 8.0 + (double)T * 4.0;
    for (int g = 0; g < N_KINDS; g++) {
        const gate_job job = {.ops = ops,
                              .b = &b,
                              .params = {.n_experts = E, .top_k = k, .kind = kinds[g].kind, .renormalize = true,
                                         .routed_scale = 1.0f},
                              .T = T,
                              .copy_bytes = logit_bytes};
        const int64_t gate_reps = bench_reps_for(ops, run_gate, &job), copy_reps = bench_reps_for(ops, run_copy, &job);
        if (gate_reps == 0 || copy_reps == 0) {
            bench_failed(CMD, kinds[g].name, ops->sync());
            goto done;
        }
        for (int64_t it = 0; it < warmup + iters; it++) {
            /* Alternating which goes first cancels any advantage of the order. */
            const bool copy_first = it % 2 == 1;
            double copy_s = copy_first ? bench_timed_calls(ops, run_copy, &job, copy_reps) : 0.0;
            const double gate_s = bench_timed_calls(ops, run_gate, &job, gate_reps);
            if (!copy_first) copy_s = bench_timed_calls(ops, run_copy, &job, copy_reps);
            if (gate_s < 0.0 || copy_s < 0.0) {
                bench_failed(CMD, kinds[g].name, ops->sync());
                goto done;
            }
            if (it >= warmup) {
                times[it - warmup] = gate_s;
                times[iters + it - warmup] = copy_s;
            }
        }
        if (ops != moe_cpu_ops()) {
            int64_t wrong = 0;
            if (bench_failed(CMD, "the CPU gate's check", check_against_cpu(&wrong, &job, host))) goto done;
            if (wrong) {
                fprintf(stderr, "moe-bench %s: %s: %lld of %lld tokens chose other experts or weights (past %.0e) than "
                                "the CPU's gate: a kernel is wrong\n",
                        CMD, kinds[g].name, (long long)wrong, (long long)T, CHECK_TOLERANCE);
                goto done;
            }
        }
        const double gate_s = bench_median(times, (int)iters), copy_s = bench_median(times + iters, (int)iters);
        const double gbps = gate_bytes / gate_s * 1e-9, copy_gbps = 2.0 * (double)logit_bytes / copy_s * 1e-9;
        const bench_value row[N_COLUMNS] = {
            {.s = kinds[g].name}, {.i = T},          {.i = E},          {.i = k},
            {.f = gate_s * 1e6},  {.f = gbps},       {.f = copy_s * 1e6}, {.f = copy_gbps},
            {.f = gbps / copy_gbps}, {.i = iters},
        };
        bench_table_row(&table, row);
    }
    rc = 0;
done:
    release_buffers(ops, &b);
    free(times);
    free(host);
    moe_device_close(&dev);
    return rc;
}
