/* bench_gemm.c: `moe-bench gemm`, the experts' grouped GEMMs on MoE shapes
 * with balanced and Zipf-skewed token counts, each against one dense GEMM
 * of the same FLOPs measured in the same run.
 *
 * On a GPU: bf16 storage, fp32 accumulation; our tensor-core kernel, the
 * loop of cuBLASLt GEMMs and cublasGemmGroupedBatchedEx, beside one dense
 * cuBLASLt GEMM [T*k, K] x [N, K]^T, for the experts' two GEMMs (up:
 * N = 2 ff, K = d; down: N = d, K = ff). Every algorithm's output is checked
 * against the loop's. On the CPU: the op table's experts_forward (fp32,
 * OpenBLAS) beside one cblas_sgemm of the same FLOPs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

#define CMD "gemm"
#define DEFAULT_ZIPF_S 1.0
#define DEFAULT_T_GPU 4096
#define DEFAULT_T_CPU 1024
/* The CPU runs the shapes with d and ff divided by this, so the default
 * run stays well under a minute on two cores. */
#define CPU_SHAPE_DIVISOR 4
#define MAX_EXPERTS 1024

typedef struct gemm_shape {
    const char *name;
    int64_t E, k, d, ff;
} gemm_shape;

/* Mixtral 8x7B, and a fine-grained MoE in the manner of DeepSeekMoE 16B. */
static const gemm_shape shapes[] = {
    {"mixtral", 8, 2, 4096, 14336},
    {"fine", 64, 6, 2048, 1408},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

typedef enum gemm_device { DEVICE_AUTO, DEVICE_CPU, DEVICE_CUDA } gemm_device;

/* The GPU's algorithms: our three kernels, the two cuBLAS baselines, then
 * the dense GEMM. */
enum { GPU_MMA, GPU_WGMMA, GPU_WGMMA_TMA, GPU_LOOP, GPU_BATCHED, GPU_DENSE, N_GPU_ALGOS };

static const char *const gpu_algo_names[N_GPU_ALGOS] = {
    "mma", "wgmma", "wgmma-tma", "cublaslt-loop", "cublas-grouped", "dense"};

typedef struct gemm_options {
    int64_t T; /* 0: the device's default */
    unsigned algos; /* bit a: run gpu_algo_names[a] */
    bool algos_set; /* --algos given */
    bench_routing routings[BENCH_MAX_ROUTINGS];
    int n_routings;
    int64_t warmup, iters, threads;
    gemm_device device;
    bool json;
    bool warmup_set, iters_set;
} gemm_options;

static const bench_column columns[] = {
    {"shape", "shape", BENCH_STR, -8, 0},
    {"routing", "routing", BENCH_STR, -9, 0},
    {"gemm", "gemm", BENCH_STR, -5, 0},
    {"algo", "algo", BENCH_STR, -15, 0},
    {"ms", "ms", BENCH_F64, 9, 3},
    {"rate", "rate", BENCH_F64, 9, 1}, /* TFLOP/s on the GPU, GFLOP/s on the CPU */
    {"vs_dense", "vs_dense", BENCH_F64, 8, 3},
    {"vs_best_cublas", "vs_cublas", BENCH_F64, 9, 3},
    {"max_err", "max_err", BENCH_F64, 8, 4},
    {"imbalance", "imbalance", BENCH_F64, 9, 2},
    {"device", NULL, BENCH_STR, 0, 0},
    {"rate_unit", NULL, BENCH_STR, 0, 0},
    {"T", NULL, BENCH_INT, 0, 0},
    {"E", NULL, BENCH_INT, 0, 0},
    {"top_k", NULL, BENCH_INT, 0, 0},
    {"M", NULL, BENCH_INT, 0, 0},
    {"N", NULL, BENCH_INT, 0, 0},
    {"K", NULL, BENCH_INT, 0, 0},
    {"flops", NULL, BENCH_F64, 0, 0},
    {"iters", NULL, BENCH_INT, 0, 0},
};
#define N_COLUMNS ((int)(sizeof columns / sizeof columns[0]))

static void print_help(FILE *f) {
    fprintf(f,
            "usage: moe-bench gemm [options]\n"
            "\n"
            "Grouped expert GEMMs with T*k rows split among E experts by the routing.\n"
            "\n"
            "On a GPU (bf16 storage, fp32 accumulation), for each shape, routing and GEMM\n"
            "(up: [rows, d] x [2ff, d]^T; down: [rows, ff] x [d, ff]^T):\n"
            "  mma             our tensor-core kernel (row counts read on the device)\n"
            "  wgmma           the same on Hopper's warpgroup MMA (compute capability 9.0)\n"
            "  wgmma-tma       the same, a TMA producer warpgroup feeding two consumers\n"
            "  cublaslt-loop   one cublasLtMatmul per expert, cached plans\n"
            "  cublas-grouped  one cublasGemmGroupedBatchedEx\n"
            "  dense           one cuBLASLt GEMM [T*k, K] x [N, K]^T: the same FLOPs\n"
            "rate is TFLOP/s (2 M N K / time); vs_dense = rate / dense rate; vs_cublas =\n"
            "rate / the better of the two cuBLAS baselines. max_err is the largest\n"
            "|out - loop's out| over max |loop's out|; above 0.02 the run exits with 1.\n"
            "The cuBLAS baselines copy the E+1 row offsets to the host and wait, once per\n"
            "call: that wait is part of their time, as it is in training.\n"
            "\n"
            "On the CPU: the op table's experts_forward (fp32: up, SwiGLU, down) against\n"
            "one cblas_sgemm [T*k, d] x [3ff, d]^T of the same FLOPs; rate is GFLOP/s. The\n"
            "CPU runs each shape with d and ff divided by %d.\n"
            "\n"
            "shapes:\n"
            "  mixtral   E=8  k=2 d=4096 ff=14336\n"
            "  fine      E=64 k=6 d=2048 ff=1408\n"
            "\n"
            "options:\n"
            "  --T N            tokens (default %d on a GPU, %d on the CPU)\n"
            "  --routing R      balanced | zipf | zipf:S | both (default both: balanced\n"
            "                   and zipf:%g). zipf:S gives expert e a share ~ 1/(e+1)^S of\n"
            "                   the rows, at most T (a token picks an expert once);\n"
            "                   imbalance = busiest expert's rows / mean.\n"
            "  --algos LIST     the GPU algorithms to run, comma-separated names from the\n"
            "                   list above (default all); the loop still computes the\n"
            "                   reference outputs\n"
            "  --device D       auto (default: cuda when a device answers, else cpu, with\n"
            "                   a line saying so) | cuda | cpu\n"
            "  -w, --warmup N   untimed iterations first (default 3 on a GPU, 1 on the CPU)\n"
            "  -n, --iters N    timed iterations; times are medians (default 10 / 3)\n"
            "  --threads N      OpenMP and OpenBLAS threads on the CPU\n"
            "  --json           one JSON object per row instead of the table\n"
            "  -h, --help       this text\n",
            CPU_SHAPE_DIVISOR, DEFAULT_T_GPU, DEFAULT_T_CPU, DEFAULT_ZIPF_S);
}

/* *mask = the algorithms named in list ("mma,dense"); false (saying why)
 * for an unknown or empty name. */
static bool parse_algos(unsigned *mask, const char *list) {
    *mask = 0;
    for (const char *p = list;; p++) {
        const size_t len = strcspn(p, ",");
        int a = 0;
        while (a < N_GPU_ALGOS &&
               (strlen(gpu_algo_names[a]) != len || strncmp(gpu_algo_names[a], p, len) != 0))
            a++;
        if (a == N_GPU_ALGOS) {
            fprintf(stderr, "moe-bench %s: --algos=%s: '%.*s' is none of mma, wgmma, wgmma-tma, "
                            "cublaslt-loop, cublas-grouped, dense\n",
                    CMD, list, (int)len, p);
            return false;
        }
        *mask |= 1u << a;
        p += len;
        if (*p == '\0') return true;
    }
}

/* Returns -1 when the run should go ahead, else the exit status. */
static int parse_options(gemm_options *o, int argc, char **argv) {
    *o = (gemm_options){.device = DEVICE_AUTO, .algos = (1u << N_GPU_ALGOS) - 1};
    o->n_routings = bench_parse_routing(o->routings, CMD, "both", DEFAULT_ZIPF_S);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *value = NULL;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            print_help(stdout);
            return 0;
        }
        if (strcmp(arg, "--json") == 0) {
            o->json = true;
            continue;
        }
        int found;
        if ((found = bench_option(argc, argv, &i, CMD, "T", &value)) != 0) {
            if (found < 0 || !bench_parse_i64(&o->T, CMD, "--T", value, 1, 1 << 24))
                return bench_usage_error(CMD);
        } else if ((found = bench_option(argc, argv, &i, CMD, "routing", &value)) != 0) {
            if (found < 0 || (o->n_routings = bench_parse_routing(o->routings, CMD, value, DEFAULT_ZIPF_S)) == 0)
                return bench_usage_error(CMD);
        } else if ((found = bench_option_or_short(argc, argv, &i, CMD, "-w", "warmup", &value)) != 0) {
            if (found < 0 || !bench_parse_i64(&o->warmup, CMD, "--warmup", value, 0, 1000000))
                return bench_usage_error(CMD);
            o->warmup_set = true;
        } else if ((found = bench_option_or_short(argc, argv, &i, CMD, "-n", "iters", &value)) != 0) {
            if (found < 0 || !bench_parse_i64(&o->iters, CMD, "--iters", value, 1, 1000000))
                return bench_usage_error(CMD);
            o->iters_set = true;
        } else if ((found = bench_option(argc, argv, &i, CMD, "threads", &value)) != 0) {
            if (found < 0 || !bench_parse_i64(&o->threads, CMD, "--threads", value, 1, 4096))
                return bench_usage_error(CMD);
        } else if ((found = bench_option(argc, argv, &i, CMD, "algos", &value)) != 0) {
            if (found < 0 || !parse_algos(&o->algos, value)) return bench_usage_error(CMD);
            o->algos_set = true;
        } else if ((found = bench_option(argc, argv, &i, CMD, "device", &value)) != 0) {
            if (found < 0) return bench_usage_error(CMD);
            if (strcmp(value, "auto") == 0)
                o->device = DEVICE_AUTO;
            else if (strcmp(value, "cuda") == 0)
                o->device = DEVICE_CUDA;
            else if (strcmp(value, "cpu") == 0)
                o->device = DEVICE_CPU;
            else {
                fprintf(stderr, "moe-bench %s: --device=%s: expected auto, cuda or cpu\n", CMD,
                        value);
                return bench_usage_error(CMD);
            }
        } else {
            return bench_unknown_argument(CMD, arg);
        }
    }
    return -1;
}

/* Rows per expert: R = T*k split evenly (zipf_s 0) or in shares ~ 1/(e+1)^s
 * by largest remainders, then capped at T (a token picks an expert at most
 * once) with the excess handed to the least loaded experts in turn. */
static void route_counts(int64_t *counts, int64_t T, int64_t k, int64_t E, double zipf_s) {
    const int64_t R = T * k;
    double share[MAX_EXPERTS], total = 0.0, frac[MAX_EXPERTS];
    for (int64_t e = 0; e < E; e++) total += share[e] = pow((double)(e + 1), -zipf_s);
    int64_t given = 0;
    for (int64_t e = 0; e < E; e++) {
        const double want = (double)R * share[e] / total;
        counts[e] = (int64_t)floor(want);
        frac[e] = want - (double)counts[e];
        given += counts[e];
    }
    for (; given < R; given++) { /* largest remainder first, lower index on ties */
        int64_t best = 0;
        for (int64_t e = 1; e < E; e++)
            if (frac[e] > frac[best]) best = e;
        counts[best]++;
        frac[best] = -1.0;
    }
    int64_t excess = 0;
    for (int64_t e = 0; e < E; e++)
        if (counts[e] > T) excess += counts[e] - T, counts[e] = T;
    while (excess > 0) {
        int64_t low = 0;
        for (int64_t e = 1; e < E; e++)
            if (counts[e] < counts[low]) low = e;
        counts[low]++;
        excess--;
    }
}

static double imbalance_of(const int64_t *counts, int64_t E) {
    int64_t max = 0, sum = 0;
    for (int64_t e = 0; e < E; e++) {
        sum += counts[e];
        if (counts[e] > max) max = counts[e];
    }
    return sum > 0 ? (double)max * (double)E / (double)sum : 0.0;
}

typedef struct row_ctx {
    const bench_table *table;
    const char *device, *rate_unit;
    double rate_scale; /* FLOP/s to the unit */
    const gemm_shape *shape;
    const bench_routing *routing;
    int64_t T, M, N, K, iters;
    double imbalance;
} row_ctx;

static void print_row(const row_ctx *c, const char *gemm, const char *algo, double seconds,
                      double flops, double dense_rate, double best_cublas_rate, double max_err) {
    const double rate = flops / seconds * c->rate_scale;
    bench_value v[N_COLUMNS] = {
        {.s = c->shape->name},
        {.s = c->routing->label},
        {.s = gemm},
        {.s = algo},
        {.f = seconds * 1e3},
        {.f = rate},
        {.f = rate / dense_rate},
        {.f = rate / best_cublas_rate},
        {.f = max_err},
        {.f = c->imbalance},
        {.s = c->device},
        {.s = c->rate_unit},
        {.i = c->T},
        {.i = c->shape->E},
        {.i = c->shape->k},
        {.i = c->M},
        {.i = c->N},
        {.i = c->K},
        {.f = flops},
        {.i = c->iters},
    };
    bench_table_row(c->table, v);
}

/* ------------------------------------------------------------------- CPU */

static int run_cpu_shape(const gemm_shape *full, const gemm_options *o, const bench_table *table) {
    const gemm_shape s = {full->name, full->E, full->k, full->d / CPU_SHAPE_DIVISOR,
                          full->ff / CPU_SHAPE_DIVISOR};
    const int64_t T = o->T ? o->T : DEFAULT_T_CPU, E = s.E, d = s.d, f = s.ff, R = T * s.k;
    const int warmup = (int)(o->warmup_set ? o->warmup : 1),
              iters = (int)(o->iters_set ? o->iters : 3);
    int rc = BENCH_EXIT_FAILURE;
    float *xp, *w13, *w2, *h, *g, *y, *sa, *sb, *sc;
    bench_buffer bufs[] = {
        {&xp, (size_t)(R * d)},    {&w13, (size_t)(E * 2 * f * d)}, {&w2, (size_t)(E * d * f)},
        {&h, (size_t)(R * 2 * f)}, {&g, (size_t)(R * f)},           {&y, (size_t)(R * d)},
        {&sa, (size_t)(R * d)},    {&sb, (size_t)(3 * f * d)},      {&sc, (size_t)(R * 3 * f)},
    };
    void *arena = bench_alloc_buffers(bufs, (int)(sizeof bufs / sizeof bufs[0]));
    double *times = malloc(2 * (size_t)iters * sizeof *times);
    moe_expert_group *groups = malloc((size_t)E * sizeof *groups);
    if (!arena || !times || !groups) {
        fprintf(stderr, "moe-bench %s: %s: out of memory for the CPU buffers\n", CMD, s.name);
        goto done;
    }
    bench_rng rng = {3};
    bench_fill_uniform(xp, (size_t)(R * d), 1.0f, &rng);
    bench_fill_uniform(w13, (size_t)(E * 2 * f * d), 1.0f / sqrtf((float)d), &rng);
    bench_fill_uniform(w2, (size_t)(E * d * f), 1.0f / sqrtf((float)f), &rng);
    bench_fill_uniform(sa, (size_t)(R * d), 1.0f, &rng);
    bench_fill_uniform(sb, (size_t)(3 * f * d), 1.0f / sqrtf((float)d), &rng);
    const bench_sgemm sg = {.m = R, .n = 3 * f, .k = d, .a = sa, .b = sb, .c = sc};
    const double flops = bench_sgemm_flops(&sg); /* = 6 R d f, the experts' forward */
    bench_table_note(
        table,
        "%s on the CPU: T=%lld E=%lld k=%lld d=%lld ff=%lld (d, ff / %d); %.2f GFLOP per forward",
        s.name, (long long)T, (long long)E, (long long)s.k, (long long)d, (long long)f,
        CPU_SHAPE_DIVISOR, flops * 1e-9);

    for (int r = 0; r < o->n_routings; r++) {
        int64_t counts[MAX_EXPERTS];
        route_counts(counts, T, s.k, E, o->routings[r].zipf_s);
        int64_t off = 0;
        for (int64_t e = 0; e < E; e++) {
            groups[e] = (moe_expert_group){.rows = counts[e],
                                           .d_ff = f,
                                           .x = xp + off * d,
                                           .w13 = w13 + e * 2 * f * d,
                                           .w2 = w2 + e * d * f,
                                           .h = h + off * 2 * f,
                                           .g = g + off * f,
                                           .y = y + off * d};
            off += counts[e];
        }
        /* Baseline and experts take turns, so a neighbour's load on a shared
         * machine falls on both alike. */
        for (int it = 0; it < warmup + iters; it++) {
            const double t_sg = bench_ops_gemm_run(moe_cpu_ops(), &sg);
            const double t0 = bench_now_seconds();
            moe_cpu_ops()->experts_forward(groups, E, d);
            const double t_ex = bench_now_seconds() - t0;
            if (it >= warmup) times[it - warmup] = t_sg, times[iters + it - warmup] = t_ex;
        }
        const double t_sg = bench_median(times, iters), t_ex = bench_median(times + iters, iters);
        const row_ctx c = {.table = table, .device = "cpu", .rate_unit = "GFLOP/s",
                           .rate_scale = 1e-9, .shape = &s, .routing = &o->routings[r], .T = T,
                           .M = R, .N = 3 * f, .K = d, .iters = iters,
                           .imbalance = imbalance_of(counts, E)};
        const double dense_rate = flops / t_sg * 1e-9;
        print_row(&c, "fwd", "cpu-experts", t_ex, flops, dense_rate, NAN, NAN);
        print_row(&c, "fwd", "dense-sgemm", t_sg, flops, dense_rate, NAN, NAN);
    }
    rc = 0;
done:
    free(groups);
    free(times);
    bench_free(arena);
    return rc;
}

/* ------------------------------------------------------------------- GPU */

#if defined(MOE_HAVE_CUDA)

#define MAX_ERR_LIMIT 0.02
static const moe_cuda_grouped_algo gpu_algos[GPU_DENSE] = {
    MOE_CUDA_GROUPED_MMA, MOE_CUDA_GROUPED_WGMMA, MOE_CUDA_GROUPED_WGMMA_TMA,
    MOE_CUDA_GROUPED_LT_LOOP, MOE_CUDA_GROUPED_BATCHED};

/* One GEMM of the experts on the device: c [R, n] = a [R, k] b_e [n, k]^T. */
typedef struct gpu_gemm {
    const char *name;
    int64_t n, k;
    void *a, *b, *c, *c_ref;
    const int64_t *offsets;
    int64_t E, R;
} gpu_gemm;

static moe_status run_algo(const gpu_gemm *g, int algo, void *c, moe_cuda_ctx *ctx) {
    if (algo == GPU_DENSE) /* every row against expert 0's weights */
        return moe_cuda_gemm_ex(c, MOE_CUDA_BF16, g->a, g->b, MOE_CUDA_BF16, g->R, g->n, g->k, g->k,
                                g->k, g->n, false, true, 1.0f, 0.0f, ctx);
    return moe_cuda_grouped_gemm(c, MOE_CUDA_BF16, g->a, g->b, MOE_CUDA_BF16, g->offsets, g->E,
                                 g->R, g->n, g->k, gpu_algos[algo], ctx);
}

/* Median seconds of iters runs after warmup, each between two syncs. */
static moe_status time_algo(double *seconds, const gpu_gemm *g, int algo, int warmup, int iters,
                            double *scratch, moe_cuda_ctx *ctx) {
    for (int it = 0; it < warmup + iters; it++) {
        moe_status st = moe_cuda_sync(ctx);
        const double t0 = bench_now_seconds();
        if (st == MOE_OK) st = run_algo(g, algo, g->c, ctx);
        if (st == MOE_OK) st = moe_cuda_sync(ctx);
        if (st != MOE_OK) return st;
        if (it >= warmup) scratch[it - warmup] = bench_now_seconds() - t0;
    }
    *seconds = bench_median(scratch, iters);
    return MOE_OK;
}

/* max |c - c_ref| / max |c_ref| over R x n bf16 values, on the host. */
static moe_status max_error(double *err, const gpu_gemm *g, uint16_t *host, uint16_t *host_ref,
                            moe_cuda_ctx *ctx) {
    const size_t n = (size_t)(g->R * g->n);
    moe_status st = moe_cuda_download(host, g->c, n * 2, ctx);
    if (st == MOE_OK) st = moe_cuda_download(host_ref, g->c_ref, n * 2, ctx);
    if (st != MOE_OK) return st;
    bench_error e = {0};
    for (size_t i = 0; i < n; i++) {
        union {
            uint32_t u;
            float f;
        } a = {.u = (uint32_t)host[i] << 16}, b = {.u = (uint32_t)host_ref[i] << 16};
        bench_error_add(&e, a.f, b.f);
    }
    *err = bench_error_relative(&e);
    return MOE_OK;
}

static int run_gpu_shape(const gemm_shape *s, const gemm_options *o, const bench_table *table,
                         moe_cuda_ctx *ctx, bool *wrong) {
    const int64_t T = o->T ? o->T : DEFAULT_T_GPU, E = s->E, R = T * s->k;
    const int warmup = (int)(o->warmup_set ? o->warmup : 3),
              iters = (int)(o->iters_set ? o->iters : 10);
    const int64_t dims[2][2] = {{2 * s->ff, s->d}, {s->d, s->ff}}; /* (n, k) of up and down */
    const char *gemm_names[2] = {"up", "down"};
    int rc = BENCH_EXIT_FAILURE;
    moe_cuda_arena arena = {0};
    double *scratch = malloc((size_t)iters * sizeof *scratch);
    size_t max_c = 0;
    for (int gi = 0; gi < 2; gi++)
        if ((size_t)(R * dims[gi][0]) > max_c) max_c = (size_t)(R * dims[gi][0]);
    uint16_t *host = malloc(max_c * 2), *host_ref = malloc(max_c * 2);
    if (!scratch || !host || !host_ref) {
        fprintf(stderr, "moe-bench %s: out of host memory\n", CMD);
        goto done;
    }
    size_t need = 0;
    for (int gi = 0; gi < 2; gi++) {
        const int64_t n = dims[gi][0], k = dims[gi][1];
        const size_t pieces[] = {(size_t)(E + 1) * 8, (size_t)(R * k) * 2, (size_t)(E * n * k) * 2,
                                 (size_t)(R * n) * 2, (size_t)(R * n) * 2};
        const size_t bytes = moe_cuda_arena_bytes(pieces, 5);
        if (bytes > need) need = bytes;
    }
    if (bench_failed(CMD, "device arena", moe_cuda_arena_create(&arena, need, ctx))) goto done;
    bench_table_note(
        table, "%s on %s: T=%lld E=%lld k=%lld d=%lld ff=%lld, bf16; %.2f GiB of device memory",
        s->name, moe_cuda_device_name(ctx), (long long)T, (long long)E, (long long)s->k,
        (long long)s->d, (long long)s->ff, (double)need / (1 << 30));

    for (int r = 0; r < o->n_routings; r++) {
        int64_t counts[MAX_EXPERTS], offsets[MAX_EXPERTS + 1] = {0};
        route_counts(counts, T, s->k, E, o->routings[r].zipf_s);
        for (int64_t e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
        for (int gi = 0; gi < 2; gi++) {
            const int64_t n = dims[gi][0], k = dims[gi][1];
            gpu_gemm g = {gemm_names[gi], n, k, NULL, NULL, NULL, NULL, NULL, E, R};
            void *off = NULL;
            moe_cuda_arena_reset(&arena);
            moe_status st = moe_cuda_arena_alloc(&arena, &off, (size_t)(E + 1) * 8);
            if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &g.a, (size_t)(R * k) * 2);
            if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &g.b, (size_t)(E * n * k) * 2);
            if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &g.c, (size_t)(R * n) * 2);
            if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &g.c_ref, (size_t)(R * n) * 2);
            if (st == MOE_OK) st = moe_cuda_upload(off, offsets, (size_t)(E + 1) * 8, ctx);
            if (st == MOE_OK)
                st = moe_cuda_fill_uniform(g.a, R * k, MOE_CUDA_BF16, 1.0f, 11 + (uint64_t)gi, ctx);
            if (st == MOE_OK)
                st = moe_cuda_fill_uniform(g.b, E * n * k, MOE_CUDA_BF16, 1.0f / sqrtf((float)k),
                                           23 + (uint64_t)gi, ctx);
            g.offsets = off;
            /* The reference output, from the loop of cuBLASLt GEMMs. */
            if (st == MOE_OK) st = run_algo(&g, GPU_LOOP, g.c_ref, ctx);
            if (bench_failed(CMD, "setup", st)) goto done;

            double sec[N_GPU_ALGOS], err[N_GPU_ALGOS];
            bool ran[N_GPU_ALGOS];
            for (int a = 0; a < N_GPU_ALGOS; a++) {
                ran[a] = false;
                if (!(o->algos >> a & 1u)) continue;
                /* NaN (0xFFFF in bf16) in every output row first, so that rows
                 * an algorithm leaves unwritten fail its check rather than
                 * pass on what an earlier run left there. */
                moe_status ta = moe_cuda_memset(g.c, 0xFF, (size_t)(R * n) * 2, ctx);
                if (ta == MOE_OK) ta = time_algo(&sec[a], &g, a, warmup, iters, scratch, ctx);
                ran[a] = ta == MOE_OK;
                err[a] = NAN;
                if (!ran[a]) {
                    /* One algorithm that cannot run (say, no kernel for this
                     * device) leaves the others' figures standing. */
                    if (table->json)
                        fprintf(stderr, "moe-bench %s: %s %s %s: %s: %s\n", CMD, s->name, g.name,
                                gpu_algo_names[a], moe_status_string(ta), moe_last_error());
                    else
                        bench_table_note(table, "%s %s %s: %s: %s", s->name, g.name,
                                         gpu_algo_names[a], moe_status_string(ta),
                                         moe_last_error());
                    continue;
                }
                if (a != GPU_DENSE &&
                    bench_failed(CMD, "check", max_error(&err[a], &g, host, host_ref, ctx)))
                    goto done;
                if (a != GPU_DENSE && !(err[a] <= MAX_ERR_LIMIT)) *wrong = true;
            }
            const double flops = 2.0 * (double)R * (double)n * (double)k;
            const double dense_rate = ran[GPU_DENSE] ? flops / sec[GPU_DENSE] * 1e-12 : NAN;
            double best_cublas = NAN;
            for (int a = GPU_LOOP; a <= GPU_BATCHED; a++)
                if (ran[a] && !(flops / sec[a] * 1e-12 <= best_cublas))
                    best_cublas = flops / sec[a] * 1e-12;
            const row_ctx c = {.table = table, .device = "cuda", .rate_unit = "TFLOP/s",
                               .rate_scale = 1e-12, .shape = s, .routing = &o->routings[r], .T = T,
                               .M = R, .N = n, .K = k, .iters = iters,
                               .imbalance = imbalance_of(counts, E)};
            for (int a = 0; a < N_GPU_ALGOS; a++)
                if (ran[a])
                    print_row(&c, g.name, gpu_algo_names[a], sec[a], flops, dense_rate, best_cublas,
                              err[a]);
        }
    }
    rc = 0;
done:
    if (arena.base) moe_cuda_arena_destroy(&arena);
    free(host_ref);
    free(host);
    free(scratch);
    return rc;
}

#endif /* MOE_HAVE_CUDA */

int bench_gemm_run(int argc, char **argv) {
    gemm_options o;
    int rc = parse_options(&o, argc, argv);
    if (rc >= 0) return rc;
    if (o.threads > 0) bench_set_threads((int)o.threads);

    bool use_cuda = false;
    char why[256] = "built without CUDA";
#if defined(MOE_HAVE_CUDA)
    if (o.device != DEVICE_CPU) use_cuda = moe_cuda_available(why, sizeof why);
#endif
    if (o.device == DEVICE_CUDA && !use_cuda) {
        fprintf(stderr, "moe-bench %s: --device=cuda: no usable GPU: %s\n", CMD, why);
        return BENCH_EXIT_FAILURE;
    }
    if (o.device == DEVICE_CPU) snprintf(why, sizeof why, "--device cpu");
    if (!use_cuda && o.algos_set) {
        fprintf(stderr, "moe-bench %s: --algos names GPU algorithms, and this run is on the CPU (%s)%s\n",
                CMD, why, o.device == DEVICE_CPU ? " (see --help)" : "");
        /* Asked for the CPU, the flags conflict; on auto, the machine lacks a GPU. */
        return o.device == DEVICE_CPU ? BENCH_EXIT_USAGE : BENCH_EXIT_FAILURE;
    }

    bench_column cols[N_COLUMNS];
    memcpy(cols, columns, sizeof cols);
    cols[5].header = use_cuda ? "TFLOP/s" : "GFLOP/s";
    const bench_table table = {.bench = CMD, .cols = cols, .n_cols = N_COLUMNS, .json = o.json};
    /* Said on stderr too, where a --json run's readers look. */
    if (o.device == DEVICE_AUTO && !use_cuda && o.json)
        fprintf(stderr, "moe-bench %s: no GPU (%s): the CPU comparison\n", CMD, why);
    else if (o.device == DEVICE_AUTO && !use_cuda)
        bench_table_note(&table, "no GPU (%s): the CPU comparison", why);
    bench_table_note(&table, "moe-bench gemm, libmoe %s, on the %s", moe_version_string(),
                     use_cuda ? "GPU" : "CPU");
    if (!use_cuda)
        bench_table_note(&table, "%d OpenMP / %d OpenBLAS threads, %s", bench_omp_threads(), bench_blas_threads(),
                         bench_blas_kernels());
    bench_table_header(&table);

    if (!use_cuda) {
        for (int i = 0; i < N_SHAPES; i++)
            if ((rc = run_cpu_shape(&shapes[i], &o, &table)) != 0) return rc;
        return 0;
    }
#if defined(MOE_HAVE_CUDA)
    moe_cuda_ctx *ctx = NULL;
    if (bench_failed(CMD, "moe_cuda_ctx_create", moe_cuda_ctx_create(&ctx, -1)))
        return BENCH_EXIT_FAILURE;
    bool wrong = false;
    rc = 0;
    for (int i = 0; i < N_SHAPES && rc == 0; i++)
        rc = run_gpu_shape(&shapes[i], &o, &table, ctx, &wrong);
    moe_cuda_ctx_destroy(ctx);
    if (rc != 0) return rc;
    if (wrong) {
        fprintf(stderr,
                "moe-bench %s: an algorithm's output differs from the cuBLASLt loop's by more than "
                "%g\n",
                CMD, MAX_ERR_LIMIT);
        return BENCH_EXIT_FAILURE;
    }
#endif
    return 0;
}
