/* bench_layer.c: `moe-bench layer`, one MoE layer's forward and backward and
 * its grouped expert GEMMs alone, each against one plain sgemm of the
 * experts' forward FLOPs measured just before, for balanced and Zipf-skewed
 * routing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "common/status.h"
#include "engine/device.h"
#include "engine/moe_layer.h"
#include "kernels/ops.h"

#define CMD "layer"
#define DEFAULT_ZIPF_S 1.0
/* Sized so the default run (two shapes, two routings) stays near a minute on
 * two cores; the untimed forward that reads the routing warms up too. */
#define DEFAULT_WARMUP 1
#define DEFAULT_ITERS 3
#define ROUTING_SEED 0x6d6f652d6c617972ull
/* A device layer's y may differ from the CPU layer's by summation order:
 * within this share of the largest |y|. */
#define CHECK_TOLERANCE 1e-4

typedef struct layer_shape {
    const char *name;
    int64_t T, d, ff, E, k;
} layer_shape;

static const layer_shape mixtral_shape = {"mixtral", 4096, 512, 1408, 8, 2};
static const layer_shape fine_shape = {"fine", 4096, 512, 256, 32, 4};

typedef struct layer_options {
    layer_shape shapes[2];
    int n_shapes;
    bench_routing routings[BENCH_MAX_ROUTINGS];
    int n_routings;
    int64_t warmup, iters, threads; /* threads 0: leave the environment's */
    moe_device device;
    bool json;
} layer_options;

static const bench_column columns[] = {
    {"shape", "shape", BENCH_STR, -8, 0},
    {"routing", "routing", BENCH_STR, -10, 0},
    {"phase", "phase", BENCH_STR, -15, 0},
    {"ms", "ms", BENCH_F64, 9, 2},
    {"gflops", "GFLOP/s", BENCH_F64, 8, 1},
    {"sgemm_gflops", "sgemm_GFLOP/s", BENCH_F64, 13, 1},
    {"ratio", "ratio", BENCH_F64, 6, 3},
    {"imbalance", "imbalance", BENCH_F64, 9, 2},
    {"T", NULL, BENCH_INT, 0, 0},
    {"d_model", NULL, BENCH_INT, 0, 0},
    {"d_ff", NULL, BENCH_INT, 0, 0},
    {"n_experts", NULL, BENCH_INT, 0, 0},
    {"top_k", NULL, BENCH_INT, 0, 0},
    {"flops", NULL, BENCH_F64, 0, 0},
    {"iters", NULL, BENCH_INT, 0, 0},
    {"threads", NULL, BENCH_INT, 0, 0},
};
#define N_COLUMNS ((int)(sizeof columns / sizeof columns[0]))

static void print_help(FILE *f) {
    fprintf(f,
            "usage: moe-bench layer [options]\n"
            "\n"
            "Times one MoE layer (router, dispatch, SwiGLU experts, combine) forward and\n"
            "backward, and the grouped expert GEMMs alone (the op table's experts_forward /\n"
            "experts_backward on the row counts the router produced), against one plain\n"
            "fp32 GEMM of the same device with the experts' forward FLOPs (M = T*k, K = d,\n"
            "N = 3*ff), measured just before each group of rows. GFLOP/s count active FLOPs: router\n"
            "2*T*d*E plus experts 6*T*k*d*ff forward; backward counts twice the forward.\n"
            "ratio = GFLOP/s / sgemm_GFLOP/s. Times are medians over the iterations.\n"
            "On a device the first forward's y is checked against the CPU layer's on the\n"
            "same parameters and x (within 1e-4 of max |y|, else exit 1): a wrong kernel\n"
            "does not time as a fast one.\n"
            "\n"
            "shape (default: both shapes below; any of these flags selects one 'custom'\n"
            "shape whose other sizes are mixtral's):\n"
            "                                   mixtral    fine\n"
            "  --T N       tokens                  4096    4096\n"
            "  --d N       d_model                  512     512\n"
            "  --ff N      d_ff of each expert     1408     256\n"
            "  --E N       experts                    8      32\n"
            "  --k N       experts per token          2       4\n"
            "\n"
            "routing:\n"
            "  --routing R   balanced | zipf | zipf:S | both (default both: balanced and\n"
            "                zipf:%g). zipf:S sends a token's choices to expert e with\n"
            "                probability proportional to 1/(e+1)^S. Every row shows the\n"
            "                measured load imbalance (rows of the busiest expert / mean).\n"
            "\n"
            "timing:\n"
            "  --warmup N    untimed iterations first (default %d)\n"
            "  --iters N     timed iterations (default %d)\n"
            "  --threads N   OpenMP and OpenBLAS threads (default: OMP_NUM_THREADS, else\n"
            "                every core)\n"
            "  --device D    auto (default), cpu, cuda or cpu-strict, as moe-train's\n"
            "\n"
            "output:\n"
            "  --json        one JSON object per row on stdout instead of the table\n"
            "  -h, --help    this text\n",
            DEFAULT_ZIPF_S, DEFAULT_WARMUP, DEFAULT_ITERS);
}

/* Returns -1 when the run should go ahead, else the exit status. */
static int parse_options(layer_options *o, int argc, char **argv) {
    layer_shape custom = mixtral_shape;
    custom.name = "custom";
    bool custom_shape = false;
    *o = (layer_options){.warmup = DEFAULT_WARMUP, .iters = DEFAULT_ITERS};
    o->n_routings = bench_parse_routing(o->routings, CMD, "both", DEFAULT_ZIPF_S);

    /* Any of these selects the custom shape. */
    const bench_int_flag shape_flags[] = {
        {"T", &custom.T, 1, INT32_MAX}, {"d", &custom.d, 1, INT32_MAX}, {"ff", &custom.ff, 1, INT32_MAX},
        {"E", &custom.E, 1, 1 << 20},   {"k", &custom.k, 1, 1 << 20},
    };
    const bench_int_flag run_flags[] = {
        {"warmup", &o->warmup, 0, 1000000},
        {"iters", &o->iters, 1, 1000000},
        {"threads", &o->threads, 1, 4096},
    };

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            print_help(stdout);
            return 0;
        }
        if (strcmp(arg, "--json") == 0) {
            o->json = true;
            continue;
        }
        const char *value = NULL;
        int found = bench_device_option(argc, argv, &i, CMD, &o->device);
        if (found < 0) return bench_usage_error(CMD);
        if (found) continue;
        found = bench_option(argc, argv, &i, CMD, "routing", &value);
        if (found < 0) return bench_usage_error(CMD);
        if (found) {
            if ((o->n_routings = bench_parse_routing(o->routings, CMD, value, DEFAULT_ZIPF_S)) == 0)
                return bench_usage_error(CMD);
            continue;
        }
        found = bench_int_option(argc, argv, &i, CMD, shape_flags, (int)(sizeof shape_flags / sizeof shape_flags[0]));
        custom_shape |= found > 0;
        if (found == 0)
            found = bench_int_option(argc, argv, &i, CMD, run_flags, (int)(sizeof run_flags / sizeof run_flags[0]));
        if (found < 0) return bench_usage_error(CMD);
        if (found == 0) return bench_unknown_argument(CMD, arg);
    }

    if (custom_shape) {
        moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
        cfg.d_model = custom.d;
        cfg.d_ff = custom.ff;
        cfg.n_experts = custom.E;
        cfg.top_k = custom.k;
        if (bench_failed(CMD, "shape", moe_layer_config_validate(&cfg))) return bench_usage_error(CMD);
        /* The routing construction spends E + 1 input features on the router. */
        if (custom.d <= custom.E) {
            fprintf(stderr, "moe-bench %s: --d=%lld must exceed --E=%lld to steer the routing\n",
                    CMD, (long long)custom.d, (long long)custom.E);
            return bench_usage_error(CMD);
        }
        /* The baseline's M = T*k and N = 3*ff are 32-bit BLAS dimensions. */
        if (custom.T * custom.k > INT32_MAX || 3 * custom.ff > INT32_MAX) {
            fprintf(stderr, "moe-bench %s: T*k=%lld and 3*ff=%lld must fit in 32 bits\n", CMD,
                    (long long)(custom.T * custom.k), (long long)(3 * custom.ff));
            return bench_usage_error(CMD);
        }
        o->shapes[0] = custom;
        o->n_shapes = 1;
    } else {
        o->shapes[0] = mixtral_shape;
        o->shapes[1] = fine_shape;
        o->n_shapes = 2;
    }
    return -1;
}

/* Sets x [T, d] and gate.weight wg [E, d] so that token t's router logits are
 * log p_e + G[t, e] with G independent Gumbel(0, 1) noise: by the Gumbel-max
 * trick the top-1 expert is then a draw from p, and the top k are k draws
 * from p without replacement, so the measured load follows the chosen Zipf
 * law rather than a top-k of near-constant logits (which would send every
 * token to the same k experts). Features 0..E-1 carry the noise through an
 * identity block, feature E is the constant 1 whose weights are log p, and
 * the rest are ordinary inputs the router ignores. */
static void set_routing(float *x, float *wg, const layer_shape *s, double zipf_s) {
    bench_rng rng = {ROUTING_SEED};
    memset(wg, 0, (size_t)(s->E * s->d) * sizeof *wg);
    for (int64_t e = 0; e < s->E; e++) {
        wg[e * s->d + e] = 1.0f;
        wg[e * s->d + s->E] = (float)(-zipf_s * log((double)(e + 1))); /* log p_e + const */
    }
    for (int64_t t = 0; t < s->T; t++) {
        float *xt = x + t * s->d;
        for (int64_t j = 0; j < s->E; j++) xt[j] = (float)-log(-log(bench_rng_uniform(&rng)));
        xt[s->E] = 1.0f;
        bench_fill_uniform(xt + s->E + 1, (size_t)(s->d - s->E - 1), 1.0f, &rng);
    }
}

/* What one iteration times; times[] holds iters of each, in this order. */
enum {
    TIME_SGEMM,
    TIME_LAYER_FWD,
    TIME_LAYER_BWD,
    TIME_LAYER_ALL,
    TIME_EXPERTS_FWD,
    TIME_EXPERTS_BWD,
    TIME_EXPERTS_ALL,
    N_TIMERS
};

/* The rows printed per routing; backward does twice the forward's FLOPs. */
static const struct {
    const char *name;
    int timer;
    double fwd_multiple;
    bool experts; /* the expert GEMM FLOPs, else the whole layer's */
} phases[] = {
    {"layer.fwd", TIME_LAYER_FWD, 1.0, false},
    {"layer.bwd", TIME_LAYER_BWD, 2.0, false},
    {"layer.fwd+bwd", TIME_LAYER_ALL, 3.0, false},
    {"experts.fwd", TIME_EXPERTS_FWD, 1.0, true},
    {"experts.bwd", TIME_EXPERTS_BWD, 2.0, true},
    {"experts.fwd+bwd", TIME_EXPERTS_ALL, 3.0, true},
};
#define N_PHASES ((int)(sizeof phases / sizeof phases[0]))

/* Buffers of one shape, carved from one allocation. */
typedef struct layer_buffers {
    float *x, *y, *dy, *dx;                 /* [T, d] layer input, output, grads */
    float *xp, *yp, *dyp, *dxp;             /* [T*k, d] expert rows */
    float *h, *dh;                          /* [T*k, 2ff] */
    float *g;                               /* [T*k, ff] */
    float *w13, *dw13;                      /* [E, 2ff, d] */
    float *w2, *dw2;                        /* [E, d, ff] */
    float *sg_a, *sg_b, *sg_c;              /* sgemm [T*k, d], [3ff, d], [T*k, 3ff] */
} layer_buffers;

typedef struct layer_row_ctx {
    const bench_table *table;
    const layer_shape *shape;
    const bench_routing *routing;
    const layer_options *opts;
    double sgemm_gflops;
    double imbalance;
} layer_row_ctx;

static void print_row(const layer_row_ctx *c, const char *phase, double seconds, double flops) {
    double gflops = flops / seconds * 1e-9;
    bench_value v[N_COLUMNS] = {
        {.s = c->shape->name},
        {.s = c->routing->label},
        {.s = phase},
        {.f = seconds * 1e3},
        {.f = gflops},
        {.f = c->sgemm_gflops},
        {.f = gflops / c->sgemm_gflops},
        {.f = c->imbalance},
        {.i = c->shape->T},
        {.i = c->shape->d},
        {.i = c->shape->ff},
        {.i = c->shape->E},
        {.i = c->shape->k},
        {.f = flops},
        {.i = c->opts->iters},
        {.i = bench_omp_threads()},
    };
    bench_table_row(c->table, v);
}

/* Points each expert's group at its slice of the rows, in expert order;
 * counts [E] must sum to at most T*k, the rows the buffers hold. */
static void build_groups(moe_expert_group *groups, const layer_buffers *b,
                            const int64_t *counts, const layer_shape *s) {
    int64_t off = 0;
    for (int64_t e = 0; e < s->E; e++) {
        const int64_t f = s->ff, d = s->d;
        groups[e] = (moe_expert_group){
            .rows = counts[e],
            .d_ff = f,
            .x = b->xp + off * d,
            .w13 = b->w13 + e * 2 * f * d,
            .w2 = b->w2 + e * d * f,
            .h = b->h + off * 2 * f,
            .g = b->g + off * f,
            .y = b->yp + off * d,
            .dy = b->dyp + off * d,
            .dh = b->dh + off * 2 * f,
            .dx = b->dxp + off * d,
            .dw13 = b->dw13 + e * 2 * f * d,
            .dw2 = b->dw2 + e * d * f,
        };
        off += counts[e];
    }
}

/* Fills every parameter with U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the scale
 * that keeps activations of order one through the experts: drawn on the
 * host, uploaded to the backend. */
static moe_status init_params(moe_layer *layer, const moe_ops *ops) {
    bench_rng rng = {1};
    int64_t n = moe_layer_tensor_count(layer);
    moe_status st = MOE_OK;
    for (int64_t i = 0; st == MOE_OK && i < n; i++) {
        moe_tensor_view v;
        st = moe_layer_tensor(layer, i, &v);
        float *draws = st == MOE_OK ? malloc((size_t)(v.rows * v.cols) * sizeof *draws) : NULL;
        if (st == MOE_OK && !draws) st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: initial values", v.name);
        if (st == MOE_OK) {
            bench_fill_uniform(draws, (size_t)(v.rows * v.cols), 1.0f / sqrtf((float)v.cols), &rng);
            st = ops->upload(v.param, draws, (size_t)(v.rows * v.cols) * sizeof *draws);
        }
        free(draws);
    }
    return st;
}

/* The buffers of one shape, pointing into b; bufs has room for LAYER_BUFS. */
#define LAYER_BUFS 18
static int layer_bufs(bench_buffer *bufs, layer_buffers *b, const layer_shape *s) {
    const int64_t T = s->T, d = s->d, f = s->ff, E = s->E, rows = s->T * s->k;
    const bench_buffer all[] = {
        {&b->x, (size_t)(T * d)},        {&b->y, (size_t)(T * d)},
        {&b->dy, (size_t)(T * d)},       {&b->dx, (size_t)(T * d)},
        {&b->xp, (size_t)(rows * d)},    {&b->yp, (size_t)(rows * d)},
        {&b->dyp, (size_t)(rows * d)},   {&b->dxp, (size_t)(rows * d)},
        {&b->h, (size_t)(rows * 2 * f)}, {&b->dh, (size_t)(rows * 2 * f)},
        {&b->g, (size_t)(rows * f)},     {&b->w13, (size_t)(E * 2 * f * d)},
        {&b->dw13, (size_t)(E * 2 * f * d)}, {&b->w2, (size_t)(E * d * f)},
        {&b->dw2, (size_t)(E * d * f)},  {&b->sg_a, (size_t)(rows * d)},
        {&b->sg_b, (size_t)(3 * f * d)}, {&b->sg_c, (size_t)(rows * 3 * f)},
    };
    _Static_assert(sizeof all / sizeof all[0] == LAYER_BUFS, "LAYER_BUFS counts the buffers of a shape");
    memcpy(bufs, all, sizeof all);
    return LAYER_BUFS;
}

/* On a device, the forward's y (on the backend) against the CPU layer's on
 * the same parameters and x, as max |diff| / max |y| in *err: a wrong
 * kernel must not time as a fast one. */
static moe_status check_against_cpu(double *err, const moe_layer_config *cfg, const float *params, const moe_ops *ops,
                                    const float *x, const float *y, int64_t T) {
    const int64_t n_params = moe_layer_config_param_count(cfg, 1), router = cfg->n_experts * cfg->d_model;
    const int64_t n = T * cfg->d_model;
    float *host = malloc((size_t)(n_params + 2 * n) * sizeof *host);
    if (!host) return moe_error(MOE_ERR_OUT_OF_MEMORY, "the CPU layer's check: %lld floats", (long long)n_params);
    float *want = host + n_params, *got = want + n;
    moe_layer *cpu = NULL;
    const moe_layer_memory mem = {.ops = moe_cpu_ops(), .router = host, .experts = host + router};
    moe_status st = moe_layer_create_in(&cpu, cfg, &mem, NULL, NULL);
    /* After create, which draws initial values into the memory. */
    if (st == MOE_OK) st = ops->download(host, params, (size_t)n_params * sizeof *host);
    if (st == MOE_OK) st = ops->download(got, y, (size_t)n * sizeof *got);
    if (st == MOE_OK) st = moe_layer_forward(cpu, want, x, T, NULL);
    bench_error e = {0};
    for (int64_t i = 0; st == MOE_OK && i < n; i++) bench_error_add(&e, got[i], want[i]);
    *err = bench_error_relative(&e);
    if (cpu) moe_layer_destroy(cpu);
    free(host);
    return st;
}

static int run_shape(const layer_shape *s, const layer_options *o, const moe_ops *ops, const bench_table *table) {
    const int64_t T = s->T, d = s->d, f = s->ff, E = s->E, rows = s->T * s->k;
    const int warmup = (int)o->warmup, iters = (int)o->iters;
    int rc = BENCH_EXIT_FAILURE;
    moe_layer *layer = NULL;
    void *arena = NULL, *dev_arena = NULL; /* the buffers drawn on the host, and on the backend */
    float *params = NULL, *grads = NULL, *wg = NULL;
    double *times = NULL;
    int64_t *counts = NULL;
    moe_expert_group *groups = NULL;

    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = d;
    cfg.d_ff = f;
    cfg.n_experts = E;
    cfg.top_k = s->k;
    /* The router's rows, then every expert's, in the backend's memory. */
    const int64_t n_params = moe_layer_config_param_count(&cfg, 1), router = E * d;
    if (bench_failed(CMD, "parameters", ops->alloc((void **)&params, (size_t)n_params * sizeof(float))) ||
        bench_failed(CMD, "gradients", ops->alloc((void **)&grads, (size_t)n_params * sizeof(float))))
        goto done;
    const moe_layer_memory mem = {.ops = ops, .router = params, .router_grad = grads,
                                  .experts = params + router, .experts_grad = grads + router};
    if (bench_failed(CMD, "moe_layer_create_in", moe_layer_create_in(&layer, &cfg, &mem, NULL, NULL))) goto done;
    if (bench_failed(CMD, "init_params", init_params(layer, ops))) goto done;
    moe_tensor_view gate;
    if (bench_failed(CMD, "gate.weight", moe_layer_tensor_by_name(layer, "gate.weight", &gate)))
        goto done;

    layer_buffers hb, b; /* host, backend */
    bench_buffer host_bufs[LAYER_BUFS], dev_bufs[LAYER_BUFS];
    const int n_bufs = layer_bufs(host_bufs, &hb, s);
    layer_bufs(dev_bufs, &b, s);
    const size_t arena_bytes = bench_buffers_bytes(host_bufs, n_bufs);
    arena = bench_alloc_buffers(host_bufs, n_bufs);
    dev_arena = bench_alloc_backend_buffers(ops, dev_bufs, n_bufs);
    times = malloc(N_TIMERS * (size_t)iters * sizeof *times);
    counts = malloc((size_t)E * sizeof *counts);
    groups = malloc((size_t)E * sizeof *groups);
    wg = malloc((size_t)(E * d) * sizeof *wg);
    if (!arena || !dev_arena || !times || !counts || !groups || !wg) {
        fprintf(stderr, "moe-bench %s: %s: out of memory for the buffers\n", CMD, s->name);
        goto done;
    }

    bench_rng rng = {2};
    bench_fill_uniform(hb.dy, (size_t)(T * d), 1.0f, &rng);
    bench_fill_uniform(hb.xp, (size_t)(rows * d), 1.0f, &rng);
    bench_fill_uniform(hb.dyp, (size_t)(rows * d), 1.0f, &rng);
    bench_fill_uniform(hb.w13, (size_t)(E * 2 * f * d), 1.0f / sqrtf((float)d), &rng);
    bench_fill_uniform(hb.w2, (size_t)(E * d * f), 1.0f / sqrtf((float)f), &rng);
    bench_fill_uniform(hb.sg_a, (size_t)(rows * d), 1.0f, &rng);
    bench_fill_uniform(hb.sg_b, (size_t)(3 * f * d), 1.0f / sqrtf((float)d), &rng);
    const bench_sgemm sg = {.m = rows, .n = 3 * f, .k = d, .a = b.sg_a, .b = b.sg_b, .c = b.sg_c};

    const double layer_flops = moe_layer_forward_flops(&cfg, T);
    bench_table_note(table,
                     "%s: T=%lld d=%lld ff=%lld E=%lld k=%lld; layer forward %.2f GFLOP active; "
                     "sgemm baseline M=%lld K=%lld N=%lld, %.2f GFLOP",
                     s->name, (long long)T, (long long)d, (long long)f, (long long)E,
                     (long long)s->k, layer_flops * 1e-9, (long long)sg.m, (long long)sg.k,
                     (long long)sg.n, bench_sgemm_flops(&sg) * 1e-9);

    for (int r = 0; r < o->n_routings; r++) {
        const bench_routing *routing = &o->routings[r];
        set_routing(hb.x, wg, s, routing->zipf_s);
        if (bench_failed(CMD, "gate.weight", ops->upload(gate.param, wg, (size_t)(E * d) * sizeof *wg)) ||
            bench_failed(CMD, "buffers", ops->upload(dev_arena, arena, arena_bytes)))
            goto done;

        /* The routing depends only on x and gate.weight, which the loop below
         * leaves alone, so one forward fixes the expert phase's row counts. */
        moe_layer_stats stats = {.tokens_per_expert = counts};
        if (bench_failed(CMD, "moe_layer_forward", moe_layer_forward(layer, b.y, b.x, T, &stats)))
            goto done;
        int64_t expert_rows = 0;
        for (int64_t e = 0; e < E; e++) expert_rows += counts[e];
        if (expert_rows != rows) {
            fprintf(stderr,
                    "moe-bench %s: %s %s: the router kept %lld (token, slot) pairs, expected "
                    "T*k=%lld with no capacity limit\n",
                    CMD, s->name, routing->label, (long long)expert_rows, (long long)rows);
            goto done;
        }
        if (ops != moe_cpu_ops()) {
            double err = 0.0;
            if (bench_failed(CMD, "the CPU layer's check", check_against_cpu(&err, &cfg, params, ops, hb.x, b.y, T)))
                goto done;
            if (!(err <= CHECK_TOLERANCE)) {
                fprintf(stderr, "moe-bench %s: %s %s: y is %.3g of max |y| from the CPU layer's, past %.0e: a kernel "
                                "is wrong\n",
                        CMD, s->name, routing->label, err, CHECK_TOLERANCE);
                goto done;
            }
            bench_table_note(table, "%s %s: y within %.2g of max |y| of the CPU layer's", s->name, routing->label,
                             err);
        }
        build_groups(groups, &b, counts, s);

        /* The baseline, the layer and the expert phase take turns within each
         * iteration, so a neighbour's load on this shared machine falls on
         * all three alike and the ratios stay meaningful. */
        for (int it = 0; it < warmup + iters; it++) {
            double sec[N_TIMERS];
            sec[TIME_SGEMM] = bench_ops_gemm_run(ops, &sg);
            if (sec[TIME_SGEMM] < 0.0 && bench_failed(CMD, "gemm baseline", MOE_ERR_INTERNAL)) goto done;
            if (bench_failed(CMD, "moe_layer_zero_grad", moe_layer_zero_grad(layer))) goto done;
            /* The layer returns with its ops queued: each pass ends at a sync. */
            double t0 = bench_now_seconds();
            if (bench_failed(CMD, "moe_layer_forward", moe_layer_forward(layer, b.y, b.x, T, &stats)) ||
                bench_failed(CMD, "moe_layer_forward", ops->sync()))
                goto done;
            double t1 = bench_now_seconds();
            if (bench_failed(CMD, "moe_layer_backward", moe_layer_backward(layer, b.dx, b.dy, b.x)) ||
                bench_failed(CMD, "moe_layer_backward", ops->sync()))
                goto done;
            double t2 = bench_now_seconds();
            ops->experts_forward(groups, E, d);
            if (bench_failed(CMD, "experts_forward", ops->sync())) goto done;
            double t3 = bench_now_seconds();
            ops->experts_backward(groups, E, d);
            if (bench_failed(CMD, "experts_backward", ops->sync())) goto done;
            double t4 = bench_now_seconds();
            sec[TIME_LAYER_FWD] = t1 - t0;
            sec[TIME_LAYER_BWD] = t2 - t1;
            sec[TIME_LAYER_ALL] = t2 - t0;
            sec[TIME_EXPERTS_FWD] = t3 - t2;
            sec[TIME_EXPERTS_BWD] = t4 - t3;
            sec[TIME_EXPERTS_ALL] = t4 - t2;
            if (it >= warmup)
                for (int p = 0; p < N_TIMERS; p++) times[p * iters + it - warmup] = sec[p];
        }

        if (!table->json) {
            char line[1024];
            int len = 0;
            for (int64_t e = 0; e < E && len < (int)sizeof line; e++)
                len += snprintf(line + len, sizeof line - (size_t)len, " %lld",
                                (long long)counts[e]);
            bench_table_note(table, "%s %s: rows per expert:%s", s->name, routing->label, line);
        }
        const double expert_flops = 6.0 * (double)expert_rows * (double)d * (double)f;
        layer_row_ctx ctx = {
            .table = table,
            .shape = s,
            .routing = routing,
            .opts = o,
            .sgemm_gflops = bench_sgemm_flops(&sg) / bench_median(times, iters) * 1e-9,
            .imbalance = stats.load_imbalance,
        };
        for (int p = 0; p < N_PHASES; p++)
            print_row(&ctx, phases[p].name,
                      bench_median(times + phases[p].timer * iters, iters),
                      phases[p].fwd_multiple * (phases[p].experts ? expert_flops : layer_flops));
    }
    rc = 0;

done:
    free(wg);
    free(groups);
    free(counts);
    free(times);
    bench_free(arena);
    if (layer) moe_layer_destroy(layer);
    ops->release(dev_arena);
    ops->release(params);
    ops->release(grads);
    return rc;
}

int bench_layer_run(int argc, char **argv) {
    layer_options o;
    int rc = parse_options(&o, argc, argv);
    if (rc >= 0) return rc;
    if (o.threads > 0) bench_set_threads((int)o.threads);

    moe_device_handle dev;
    if (!bench_open_device(&dev, CMD, o.device, MOE_GEMM_FP32)) return BENCH_EXIT_FAILURE;
    if (dev.note[0]) fprintf(stderr, "moe-bench %s: %s\n", CMD, dev.note);
    const bench_table table = {.bench = CMD, .cols = columns, .n_cols = N_COLUMNS, .json = o.json};
    bench_table_note(&table,
                     "moe-bench layer, libmoe %s on %s: %d OpenMP / %d OpenBLAS threads, %s, %lld warmup + "
                     "%lld timed iterations, medians",
                     moe_version_string(), dev.desc, bench_omp_threads(), bench_blas_threads(), bench_blas_kernels(),
                     (long long)o.warmup, (long long)o.iters);
    bench_table_header(&table);
    rc = 0;
    for (int i = 0; i < o.n_shapes && rc == 0; i++) rc = run_shape(&o.shapes[i], &o, dev.ops, &table);
    moe_device_close(&dev);
    return rc;
}
