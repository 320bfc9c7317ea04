/* bench_attention.c: `moe-bench attention`: causal grouped-query attention,
 * forward and backward, through the op table, beside the same device's GEMM
 * rate measured in the same run. On a GPU under bf16 math it times the
 * fused kernels against the batched cuBLAS path in the same run, in
 * alternation, and gives the speed-up. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "common/status.h"
#include "engine/model_config.h"
#include "engine/run.h"
#if defined(MOE_HAVE_CUDA)
#include "kernels/cuda/cuda_ops.h"
#endif

#define CMD "attention"
#define DEFAULT_WARMUP 2
#define DEFAULT_ITERS 10

typedef struct attn_shape {
    int64_t B, T, Hq, Hkv, hd, window;
} attn_shape;

/* The 1b training model's attention (moe-bench train --model 1b), for a
 * GPU, and moe-train's built-in model's, for a CPU. */
static const attn_shape shape_1b = {8, 1024, 16, 8, 64, 0};
static const attn_shape shape_default = {16, 64, 8, 8, 8, 0};

static const bench_column columns[] = {
    {"path", "path", BENCH_STR, -8, 0},
    {"B", "B", BENCH_INT, 4, 0},
    {"T", "T", BENCH_INT, 6, 0},
    {"Hq", "Hq", BENCH_INT, 4, 0},
    {"Hkv", "Hkv", BENCH_INT, 4, 0},
    {"hd", "hd", BENCH_INT, 4, 0},
    {"window", "window", BENCH_INT, 6, 0},
    {"fwd_ms", "fwd_ms", BENCH_F64, 9, 3},
    {"bwd_ms", "bwd_ms", BENCH_F64, 9, 3},
    {"gflops", "GFLOP/s", BENCH_F64, 10, 1},
    {"gemm_gflops", "gemm_GFLOP/s", BENCH_F64, 12, 1},
    {"vs_gemm", "vs_gemm", BENCH_F64, 8, 3},
    {"speedup", "speedup", BENCH_F64, 8, 2},
    {"gemm_math", NULL, BENCH_STR, 0, 0},
};
#define N_COLUMNS ((int)(sizeof columns / sizeof columns[0]))

static void usage(void) {
    printf("usage: moe-bench attention [options]\n\n"
           "Times the op table's causal attention, forward and backward (medians of\n"
           "samples of at least 1 ms each), beside one plain GEMM of the device in the\n"
           "same --gemm-math measured in the same run. GFLOP/s counts the model's\n"
           "work: q k^T and p v over the causal triangle forward, four such products\n"
           "backward (12 hd flops per query and key it sees, per head); vs_gemm =\n"
           "GFLOP/s / gemm_GFLOP/s. On a GPU under bf16 math, the fused kernels (when\n"
           "they take the shape) and the batched cuBLAS path run in alternation, and\n"
           "speedup = the batched path's time over the fused one's.\n\n"
           "  --B N --T N --heads N --kv-heads N --head-dim N\n"
           "                the shape (default on a GPU: B 8, T 1024, 16 heads, 8 kv heads,\n"
           "                head dim 64, moe-bench train's 1b model; on a CPU: B 16, T 64,\n"
           "                8 heads, 8 kv heads, head dim 8, moe-train's built-in model)\n"
           "  --window N    a sliding window: each query sees N keys, itself and those\n"
           "                before it (config.json's sliding_window); 0 = all (default)\n"
           "  --device D    auto (default), cpu, cuda or cpu-strict\n"
           "  --gemm-math M fp32 (default), tf32 or bf16, as moe-train's\n"
           "  --warmup N    untimed samples first (default %d)\n"
           "  --iters N     timed samples (default %d)\n"
           "  --threads N   OpenMP and OpenBLAS threads on the CPU (default: OMP_NUM_THREADS,\n"
           "                else every core)\n"
           "  --json        one JSON object per row\n"
           "  -h, --help    this text\n",
           DEFAULT_WARMUP, DEFAULT_ITERS);
}

typedef struct attn_buffers {
    float *q, *k, *v, *dout;                /* random in [-1, 1) */
    float *out, *att, *datt, *dq, *dk, *dv; /* zeros */
    void *arena;                            /* all of them: one backend allocation */
} attn_buffers;

#define ATTN_FILLED 4 /* q, k, v, dout: the first buffers of alloc_buffers's list */

static moe_status alloc_buffers(const moe_ops *ops, attn_buffers *b, const attn_shape *s, float *host) {
    const size_t nq = (size_t)(s->B * s->T * s->Hq * s->hd), nk = (size_t)(s->B * s->T * s->Hkv * s->hd);
    const size_t na = (size_t)(s->B * s->Hq * s->T * s->T);
    bench_buffer bufs[] = {
        {&b->q, nq},   {&b->k, nk},    {&b->v, nk},  {&b->dout, nq}, {&b->out, nq},
        {&b->att, na}, {&b->datt, na}, {&b->dq, nq}, {&b->dk, nk},   {&b->dv, nk},
    };
    b->arena = bench_alloc_backend_buffers(ops, bufs, (int)(sizeof bufs / sizeof bufs[0]));
    if (!b->arena)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%zu bytes of %s memory for the attention buffers",
                         bench_buffers_bytes(bufs, (int)(sizeof bufs / sizeof bufs[0])), ops->name);
    bench_rng rng = {0x6174746eull};
    for (int i = 0; i < ATTN_FILLED; i++) {
        bench_fill_uniform(host, bufs[i].count, 1.0f, &rng);
        MOE_TRY(ops->upload(*bufs[i].ptr, host, bufs[i].count * sizeof(float)));
    }
    return MOE_OK;
}

typedef struct attn_job {
    const moe_ops *ops;
    const attn_buffers *b;
    const attn_shape *s;
} attn_job;

static void forward(const void *arg) {
    const attn_job *j = arg;
    const attn_buffers *b = j->b;
    const attn_shape *s = j->s;
    j->ops->attention_forward(b->out, b->att, b->q, b->k, b->v, s->B, s->T, s->Hq, s->Hkv, s->hd, s->window);
}

/* Adds into dq, dk, dv each call: their values do not matter here. */
static void backward(const void *arg) {
    const attn_job *j = arg;
    const attn_buffers *b = j->b;
    const attn_shape *s = j->s;
    j->ops->attention_backward(b->dq, b->dk, b->dv, b->datt, b->dout, b->q, b->k, b->v, b->att, s->B, s->T, s->Hq,
                               s->Hkv, s->hd, s->window);
}

/* The paths a run compares: the table's own choice, and on a GPU under
 * bf16 math the batched path beside the fused one. */
typedef struct attn_path {
    const char *name;
    int cuda_path; /* moe_cuda_attention_path, or -1 off CUDA */
} attn_path;

static void set_path(const moe_device_handle *dev, const attn_path *p) {
#if defined(MOE_HAVE_CUDA)
    if (dev->cuda && p->cuda_path >= 0) moe_cuda_set_attention_path(dev->cuda, (moe_cuda_attention_path)p->cuda_path);
#else
    (void)dev, (void)p;
#endif
}

static int paths_for(attn_path *paths, const moe_device_handle *dev, const attn_shape *s) {
#if defined(MOE_HAVE_CUDA)
    if (dev->cuda) {
        moe_cuda_set_attention_path(dev->cuda, MOE_CUDA_ATTENTION_AUTO);
        int n = 0;
        if (moe_cuda_attention_fused(s->T, s->Hq, s->hd, dev->cuda))
            paths[n++] = (attn_path){"fused", MOE_CUDA_ATTENTION_AUTO};
        paths[n++] = (attn_path){"batched", MOE_CUDA_ATTENTION_BATCHED};
        return n;
    }
#else
    (void)s;
#endif
    paths[0] = (attn_path){dev->ops->name, -1};
    return 1;
}

/* Whether the query heads are a multiple of the KV heads; says why not. */
static bool heads_divide(const attn_shape *s) {
    if (s->Hq % s->Hkv == 0) return true;
    fprintf(stderr, "moe-bench %s: --heads %lld is not a multiple of --kv-heads %lld\n", CMD, (long long)s->Hq,
            (long long)s->Hkv);
    return false;
}

/* Whether the buffers of shape s (4 of B*T*heads*hd floats, 4 of
 * B*T*kv-heads*hd, 2 of the B*heads*T*T scores) can be counted in bytes:
 * the flags' own limits allow products past 2^64. */
static bool sizes_fit(const attn_shape *s) {
    int64_t nq, nk, na, total; /* floats; each factor pair is far below 2^63 */
    const bool fit = !__builtin_mul_overflow(s->B * s->T, s->Hq * s->hd, &nq) &&
                     !__builtin_mul_overflow(s->B * s->T, s->Hkv * s->hd, &nk) &&
                     !__builtin_mul_overflow(s->B * s->Hq, s->T * s->T, &na) && !__builtin_add_overflow(nq, nk, &total) &&
                     !__builtin_mul_overflow(total, 4, &total) && !__builtin_add_overflow(total, na, &total) &&
                     !__builtin_add_overflow(total, na, &total) && total <= INT64_MAX / (int64_t)sizeof(float);
    if (!fit)
        fprintf(stderr, "moe-bench %s: --B %lld x --T %lld x --heads %lld x --head-dim %lld: the buffers' sizes "
                        "overflow; lower them\n",
                CMD, (long long)s->B, (long long)s->T, (long long)s->Hq, (long long)s->hd);
    return fit;
}

int bench_attention_run(int argc, char **argv) {
    attn_shape s = {0};
    int64_t warmup = DEFAULT_WARMUP, iters = DEFAULT_ITERS, threads = 0;
    moe_device device = MOE_DEVICE_AUTO;
    moe_gemm_math math = MOE_GEMM_FP32;
    bool json = false;
    const bench_int_flag int_flags[] = {
        {"B", &s.B, 1, 65535},          {"T", &s.T, 1, 1 << 20},        {"heads", &s.Hq, 1, 65535},
        {"kv-heads", &s.Hkv, 1, 65535}, {"head-dim", &s.hd, 1, 1 << 16}, {"window", &s.window, 0, 1 << 20},
        {"warmup", &warmup, 0, 1000},   {"iters", &iters, 1, 100000},   {"threads", &threads, 1, 4096},
    };
    const bench_switch switches[] = {{"--json", &json}};
    const bench_flags flags = {.usage = usage, .switches = switches, .n_switches = 1, .device = &device,
                               .math = &math, .ints = int_flags,
                               .n_ints = (int)(sizeof int_flags / sizeof int_flags[0])};
    const int parsed = bench_parse_flags(&flags, CMD, argc, argv);
    if (parsed >= 0) return parsed;

    /* Heads both given are checked before the device opens (a GPU's takes
     * seconds); one left to the device's default shape, after. */
    if (s.Hq && s.Hkv && !heads_divide(&s)) return BENCH_EXIT_USAGE;
    if (threads > 0) bench_set_threads((int)threads);
    moe_device_handle dev;
    if (!bench_open_device(&dev, CMD, device, math)) return BENCH_EXIT_FAILURE;
    if (dev.note[0]) fprintf(stderr, "moe-bench %s: %s\n", CMD, dev.note);
    /* Flags not given take the device's default shape. */
    const attn_shape *def = dev.cuda ? &shape_1b : &shape_default;
    if (!s.B) s.B = def->B;
    if (!s.T) s.T = def->T;
    if (!s.Hq) s.Hq = def->Hq;
    if (!s.Hkv) s.Hkv = def->Hkv;
    if (!s.hd) s.hd = def->hd;
    if (!heads_divide(&s) || !sizes_fit(&s)) {
        moe_device_close(&dev);
        return BENCH_EXIT_USAGE;
    }

    const moe_ops *ops = dev.ops;
    attn_buffers b = {0};
    attn_path paths[2];
    const int n_paths = paths_for(paths, &dev, &s);
    const size_t largest = (size_t)(s.B * s.T * s.Hq * s.hd);
    float *host = malloc(largest * sizeof *host);
    double *times = malloc((size_t)(4 * iters) * sizeof *times); /* [path][fwd, bwd][iters] */
    double gemm_gflops = 0.0, fwd[2] = {0}, bwd[2] = {0};
    int64_t fwd_reps[2], bwd_reps[2];
    int rc = BENCH_EXIT_FAILURE;
    if (!host || !times) {
        fprintf(stderr, "moe-bench %s: out of host memory\n", CMD);
        goto done;
    }
    if (bench_failed(CMD, "buffers", alloc_buffers(ops, &b, &s, host)) ||
        bench_failed(CMD, "gemm rate", moe_measure_gemm_gflops(ops, &gemm_gflops)))
        goto done;
    const attn_job job = {ops, &b, &s};
    for (int p = 0; p < n_paths; p++) {
        set_path(&dev, &paths[p]);
        fwd_reps[p] = bench_reps_for(ops, forward, &job);
        bwd_reps[p] = bench_reps_for(ops, backward, &job);
        if (fwd_reps[p] == 0 || bwd_reps[p] == 0) {
            bench_failed(CMD, paths[p].name, ops->sync());
            goto done;
        }
    }
    for (int64_t it = 0; it < warmup + iters; it++)
        for (int q = 0; q < n_paths; q++) {
            /* Alternating which path goes first cancels any advantage of the order. */
            const int p = (int)((q + it) % n_paths);
            set_path(&dev, &paths[p]);
            const double f = bench_timed_calls(ops, forward, &job, fwd_reps[p]);
            const double g = bench_timed_calls(ops, backward, &job, bwd_reps[p]);
            if (f < 0.0 || g < 0.0) {
                bench_failed(CMD, paths[p].name, ops->sync());
                goto done;
            }
            if (it >= warmup) {
                times[(2 * p) * iters + it - warmup] = f;
                times[(2 * p + 1) * iters + it - warmup] = g;
            }
        }
    for (int p = 0; p < n_paths; p++) {
        fwd[p] = bench_median(times + 2 * p * iters, (int)iters);
        bwd[p] = bench_median(times + (2 * p + 1) * iters, (int)iters);
    }

    const bench_table table = {.bench = CMD, .cols = columns, .n_cols = N_COLUMNS, .json = json};
    bench_table_note(&table, "moe-bench attention on %s, %s GEMMs: %lld warm-up + %lld timed samples, medians",
                     dev.desc, moe_gemm_math_name(math), (long long)warmup, (long long)iters);
    bench_table_header(&table);
    /* Per head: 2 hd flops per multiply-add, q k^T and p v forward and four
     * products backward, over the causal pairs (T (T + 1) / 2 without a
     * window). */
    const double flops = 12.0 * (double)s.hd * (double)(s.B * s.Hq) * moe_attention_pairs(s.T, s.window);
    for (int p = 0; p < n_paths; p++) {
        const double gflops = flops / (fwd[p] + bwd[p]) * 1e-9;
        const double speedup = n_paths == 2 && p == 0 ? (fwd[1] + bwd[1]) / (fwd[0] + bwd[0]) : NAN;
        const bench_value row[N_COLUMNS] = {
            {.s = paths[p].name}, {.i = s.B},          {.i = s.T},      {.i = s.Hq},
            {.i = s.Hkv},         {.i = s.hd},         {.i = s.window},     {.f = fwd[p] * 1e3}, {.f = bwd[p] * 1e3},
            {.f = gflops},        {.f = gemm_gflops},  {.f = gflops / gemm_gflops}, {.f = speedup},
            {.s = moe_gemm_math_name(math)},
        };
        bench_table_row(&table, row);
    }
    rc = 0;
done:
    set_path(&dev, &(attn_path){"auto", 0});
    if (b.arena) ops->release(b.arena);
    free(host);
    free(times);
    moe_device_close(&dev);
    return rc;
}
