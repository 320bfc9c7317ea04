/* bench_train.c: `moe-bench train`: whole training steps (forward, backward,
 * AdamW) of the MoE transformer on the synthetic corpus: tokens/s and MFU,
 * the model FLOPs per second over the GEMM rate (in --gemm-math) of the
 * same device measured in the same run, right before each model's steps. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "engine/run.h"
#include "engine/synthetic.h"
#include "engine/trainer.h"
#if defined(MOE_HAVE_CUDA)
#include "kernels/cuda/cuda_ops.h"
#endif

#define CMD "train"

typedef struct train_shape {
    const char *name;
    int64_t d, ff, layers, heads, kv_heads, experts, top_k, B, T;
    bool on_request; /* run only when --model names it; a GPU's: refused on the CPU, whose memory it outgrows */
} train_shape;

/* The driver's default model, a larger one whose GEMMs are big enough to
 * run near a CPU's sgemm rate, and a ~1.2B-parameter one (327M active) for
 * a GPU. */
static const train_shape default_shapes[] = {
    {"default", 0, 0, 0, 0, 0, 0, 0, 16, 64, false},
    {"d512-l8", 512, 1408, 8, 8, 8, 8, 2, 8, 256, false},
    {"1b", 1024, 2816, 16, 16, 8, 8, 2, 8, 1024, true},
};

static void usage(void) {
    printf("usage: moe-bench train [options]\n\n"
           "Times whole training steps (forward, backward, AdamW) on the synthetic corpus\n"
           "and reports tokens/s and MFU: model FLOPs per second (6 per active parameter\n"
           "and token, plus attention) over the device's GEMM rate (in --gemm-math)\n"
           "measured in the same run just before each model. Times are medians over the\n"
           "steps.\n\n"
           "models (default: default and d512-l8):\n"
           "  --model NAME    default (moe-train's built-in model, B 16 x T 64),\n"
           "                  d512-l8 (d_model 512, ff 1408, 8 layers, 8 heads, 8 experts,\n"
           "                  top-2, B 8 x T 256) or 1b (d_model 1024, ff 2816, 16 layers,\n"
           "                  16 heads (8 KV), 8 experts, top-2, B 8 x T 1024: 1.2B\n"
           "                  parameters, for a GPU)\n"
           "  --device D      auto (default), cpu, cuda or cpu-strict, as moe-train's\n"
           "  --gemm-math M   fp32 (default), tf32 or bf16, as moe-train's; MFU is then\n"
           "                  against the GEMM rate in the same math; on a GPU, bf16 adds\n"
           "                  MFU_bf16, against a GEMM on bf16 operands (the rate the\n"
           "                  tensor cores give bf16 storage)\n\n"
           "timing:\n"
           "  --warmup N      untimed steps first (default 2)\n"
           "  --steps N       timed steps (default 5)\n"
           "  --threads N     OpenMP and OpenBLAS threads (default: OMP_NUM_THREADS, else\n"
           "                  every core)\n\n"
           "output:\n"
           "  --recompute     recompute each layer's forward in its backward, as\n"
           "                  moe-train --recompute (MFU counts the model's FLOPs only)\n"
           "  --json          one JSON object per row\n"
           "  --profile       also time each op of the timed steps (on a GPU: events in its\n"
           "                  stream) and print the largest to stderr; the step times then\n"
           "                  include the marks' cost\n"
           "  -h, --help      this text\n");
}

static const bench_column columns[] = {
    {"model", "model", BENCH_STR, -8, 0},
    {"params_m", "params(M)", BENCH_F64, 10, 2},
    {"active_m", "active(M)", BENCH_F64, 10, 2},
    {"tokens_per_step", "tokens", BENCH_INT, 7, 0},
    {"step_ms", "step_ms", BENCH_F64, 9, 1},
    {"tokens_per_s", "tokens/s", BENCH_F64, 10, 0},
    {"gflops", "GFLOP/s", BENCH_F64, 8, 1},
    {"gemm_gflops", "gemm_GFLOP/s", BENCH_F64, 12, 1},
    {"mfu", "MFU", BENCH_F64, 6, 3},
    {"bf16_gemm_gflops", "bf16_GFLOP/s", BENCH_F64, 12, 1},
    {"mfu_bf16", "MFU_bf16", BENCH_F64, 8, 3},
    {"activation_mb", "act_MB", BENCH_F64, 9, 1},
    {"gemm_math", NULL, BENCH_STR, 0, 0},
    {"recompute", NULL, BENCH_INT, 0, 0},
};

/* GPU bf16 math: the rate of one square cuBLASLt GEMM on bf16 operands
 * (fp32 sums), which is what the tensor cores give a model whose GEMMs read
 * bf16, above the fp32-operand GEMM that --gemm-math bf16 rounds inside
 * (the MFU column's rate). MFU_bf16 is over this one. NaN elsewhere. */
#define BF16_PEAK_N 8192
#define BF16_PEAK_RUNS 5

static moe_status bf16_storage_gflops(const moe_device_handle *dev, moe_gemm_math math, double *gflops) {
    *gflops = NAN;
#if defined(MOE_HAVE_CUDA)
    moe_cuda_ctx *ctx = dev->cuda;
    if (!ctx || math != MOE_GEMM_BF16) return MOE_OK;
    const int64_t n = BF16_PEAK_N;
    const size_t bytes = (size_t)(n * n) * 2;
    const size_t pieces[3] = {bytes, bytes, bytes};
    moe_cuda_arena arena = {0};
    void *a = NULL, *b = NULL, *c = NULL;
    double sec[BF16_PEAK_RUNS];
    moe_status st = moe_cuda_arena_create(&arena, moe_cuda_arena_bytes(pieces, 3), ctx);
    if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &a, bytes);
    if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &b, bytes);
    if (st == MOE_OK) st = moe_cuda_arena_alloc(&arena, &c, bytes);
    if (st == MOE_OK) st = moe_cuda_fill_uniform(a, n * n, MOE_CUDA_BF16, 1.0f, 1, ctx);
    if (st == MOE_OK) st = moe_cuda_fill_uniform(b, n * n, MOE_CUDA_BF16, 1.0f, 2, ctx);
    /* One untimed run first: the plan and cuBLASLt's own start-up. */
    for (int i = -1; st == MOE_OK && i < BF16_PEAK_RUNS; i++) {
        st = moe_cuda_sync(ctx);
        const double t0 = bench_now_seconds();
        if (st == MOE_OK)
            st = moe_cuda_gemm_ex(c, MOE_CUDA_BF16, a, b, MOE_CUDA_BF16, n, n, n, n, n, n, false, true,
                                  1.0f, 0.0f, ctx);
        if (st == MOE_OK) st = moe_cuda_sync(ctx);
        if (i >= 0) sec[i] = bench_now_seconds() - t0;
    }
    if (st == MOE_OK) *gflops = 2.0 * (double)n * (double)n * (double)n / bench_median(sec, BF16_PEAK_RUNS) * 1e-9;
    moe_cuda_arena_destroy(&arena);
    return st;
#else
    (void)dev, (void)math;
    return MOE_OK;
#endif
}

/* The ops that took the most of the timed steps, one line each. */
#define PROFILE_LINES 16

static int print_profile(const train_shape *s, int64_t steps, double steps_ms) {
    moe_op_time rows[PROFILE_LINES];
    int64_t n = 0;
    if (bench_failed(CMD, "profile", moe_profile_read(rows, PROFILE_LINES, &n))) return BENCH_EXIT_FAILURE;
    fprintf(stderr, "moe-bench %s: profile of %s, %lld steps, %.1f ms:\n", CMD, s->name, (long long)steps, steps_ms);
    for (int64_t i = 0; i < n; i++)
        fprintf(stderr, "moe-bench %s:   %-22s %8lld calls %10.2f ms %6.1f%%\n", CMD, rows[i].op,
                (long long)rows[i].calls, 1e3 * rows[i].seconds, 100.0 * 1e3 * rows[i].seconds / steps_ms);
    return 0;
}

static int bench_shape(const train_shape *s, const moe_device_handle *dev, moe_gemm_math math,
                       const moe_synth_stream *stream, int64_t warmup, int64_t steps, bool profile, bool recompute,
                       const bench_table *table) {
    const moe_ops *ops = dev->ops;
    moe_model_config cfg;
    moe_run_default_config(&cfg, MOE_SYNTH_VOCAB_SIZE);
    if (s->d) {
        cfg.hidden_size = s->d;
        cfg.intermediate_size = s->ff;
        cfg.num_hidden_layers = s->layers;
        cfg.num_attention_heads = s->heads;
        cfg.num_key_value_heads = s->kv_heads;
        cfg.head_dim = s->d / s->heads;
        cfg.num_local_experts = s->experts;
        cfg.num_experts_per_tok = s->top_k;
    }
    moe_model *model = NULL;
    moe_trainer *trainer = NULL;
    moe_data *data = NULL;
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    oc.total_steps = warmup + steps;
    double *ms = calloc((size_t)steps, sizeof *ms), peak = 0.0, bf16_peak = NAN;
    int rc = BENCH_EXIT_FAILURE;
    if (!ms) return rc;
    const moe_model_parallel on = {.ops = ops, .recompute = recompute};
    if (bench_failed(CMD, "model", moe_model_create_parallel(&model, &cfg, s->B, s->T, 1, &on)) ||
        bench_failed(CMD, "trainer", moe_trainer_create(&trainer, model, &oc)) ||
        bench_failed(CMD, "data", moe_data_from_tokens(&data, stream->tokens, stream->n, MOE_SYNTH_VOCAB_SIZE,
                                                       "synthetic")) ||
        bench_failed(CMD, "gemm peak", moe_measure_gemm_gflops(ops, &peak)) ||
        bench_failed(CMD, "bf16 gemm peak", bf16_storage_gflops(dev, math, &bf16_peak)))
        goto done;
    for (int64_t i = 0; i < warmup + steps; i++) {
        moe_step_metrics m;
        if (profile && i == warmup) moe_profile_reset();
        double t0 = bench_now_seconds();
        if (bench_failed(CMD, "step", moe_trainer_step(trainer, data, &m))) goto done;
        if (i >= warmup) ms[i - warmup] = 1e3 * (bench_now_seconds() - t0);
    }
    const double step_ms = bench_median(ms, (int)steps), tokens = (double)(s->B * s->T);
    const double gflops = moe_model_step_flops(model) / (step_ms * 1e-3) * 1e-9;
    const bench_value row[] = {
        {.s = s->name},
        {.f = (double)moe_model_param_count(model) * 1e-6},
        {.f = (double)moe_model_active_param_count(model) * 1e-6},
        {.i = s->B * s->T},
        {.f = step_ms},
        {.f = tokens / (step_ms * 1e-3)},
        {.f = gflops},
        {.f = peak},
        {.f = gflops / peak},
        {.f = bf16_peak},
        {.f = gflops / bf16_peak},
        {.f = (double)moe_trainer_activation_bytes(trainer) * 1e-6},
        {.s = moe_gemm_math_name(math)},
        {.i = recompute},
    };
    bench_table_row(table, row);
    double total_ms = 0.0;
    for (int64_t i = 0; i < steps; i++) total_ms += ms[i];
    rc = profile ? print_profile(s, steps, total_ms) : 0;
done:
    moe_data_close(data);
    moe_trainer_destroy(trainer);
    moe_model_destroy(model);
    free(ms);
    return rc;
}

int bench_train_run(int argc, char **argv) {
    int64_t warmup = 2, steps = 5, threads = 0;
    const char *only = NULL;
    moe_device device = MOE_DEVICE_AUTO;
    moe_gemm_math math = MOE_GEMM_FP32;
    bool json = false, profile = false, recompute = false;
    const bench_switch switches[] = {{"--json", &json}, {"--profile", &profile}, {"--recompute", &recompute}};
    const bench_text_flag texts[] = {{"model", &only}};
    const bench_int_flag ints[] = {
        {"warmup", &warmup, 0, 1000}, {"steps", &steps, 1, 100000}, {"threads", &threads, 1, 4096}};
    const bench_flags flags = {.usage = usage, .switches = switches,
                               .n_switches = (int)(sizeof switches / sizeof switches[0]), .device = &device,
                               .math = &math, .texts = texts, .n_texts = 1, .ints = ints,
                               .n_ints = (int)(sizeof ints / sizeof ints[0])};
    const int parsed = bench_parse_flags(&flags, CMD, argc, argv);
    if (parsed >= 0) return parsed;
    const int n_shapes = (int)(sizeof default_shapes / sizeof default_shapes[0]);
    bool known = only == NULL;
    for (int s = 0; s < n_shapes; s++) known = known || strcmp(only, default_shapes[s].name) == 0;
    if (!known) {
        fprintf(stderr, "moe-bench %s: --model %s: expected default, d512-l8 or 1b\n", CMD, only);
        return BENCH_EXIT_USAGE;
    }
    if (threads) bench_set_threads((int)threads);

    moe_device_handle dev;
    if (!bench_open_device(&dev, CMD, device, math)) return BENCH_EXIT_FAILURE;
    if (profile && bench_failed(CMD, "profile", moe_profile_open(&dev.ops, dev.ops))) {
        moe_device_close(&dev);
        return BENCH_EXIT_FAILURE;
    }
    if (dev.note[0]) fprintf(stderr, "moe-bench %s: %s\n", CMD, dev.note);
    if (dev.placement[0]) fprintf(stderr, "moe-bench %s: %s\n", CMD, dev.placement);
    for (int s = 0; s < n_shapes && !dev.cuda && only; s++)
        if (default_shapes[s].on_request && strcmp(only, default_shapes[s].name) == 0) {
            fprintf(stderr, "moe-bench %s: --model %s is for a GPU (its parameters, gradients, AdamW state and "
                            "activations outgrow a CPU's memory), and this run is on %s\n",
                    CMD, only, dev.desc);
            moe_device_close(&dev);
            return BENCH_EXIT_USAGE;
        }
    moe_synth_params sp = moe_synth_default_params();
    moe_synth_stream stream = {0};
    if (bench_failed(CMD, "synthetic corpus", moe_synth_generate(&stream, &sp, 1, BENCH_SYNTH_TOKENS))) {
        moe_device_close(&dev);
        return BENCH_EXIT_FAILURE;
    }
    const bench_table table = {.bench = "train", .cols = columns,
                               .n_cols = (int)(sizeof columns / sizeof columns[0]), .json = json};
    bench_table_note(&table, "moe-bench train: %s, %s GEMMs, %d threads%s%s, %lld warm-up + %lld timed steps per model%s",
                     dev.desc, moe_gemm_math_name(math), bench_omp_threads(), dev.cuda ? "" : ", ",
                     dev.cuda ? "" : bench_blas_kernels(), (long long)warmup, (long long)steps,
                     recompute ? ", layers recomputed" : "");
    bench_table_header(&table);
    int rc = 0;
    for (int s = 0; s < n_shapes && rc == 0; s++)
        if (only ? strcmp(only, default_shapes[s].name) == 0 : !default_shapes[s].on_request)
            rc = bench_shape(&default_shapes[s], &dev, math, &stream, warmup, steps, profile, recompute, &table);
    moe_synth_stream_free(&stream);
    if (profile) moe_profile_close(); /* its marks are the device's */
    moe_device_close(&dev);
    return rc;
}
