/* moe_bench.c: `moe-bench`, its subcommand dispatch and the shared harness. */
#include "bench/moe_bench.h"
#include "kernels/cpu/blas.h"

#include <cblas.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const bench_command commands[] = {
    {"a2a", "expert-parallel all-to-all-v (run under mpirun) vs raw MPI_Alltoallv", bench_a2a_run},
    {"layer", "one MoE layer forward/backward and its expert GEMMs vs one plain GEMM",
     bench_layer_run},
    {"gemm", "grouped expert GEMMs (GPU: ours and cuBLAS; CPU: OpenBLAS) vs one dense GEMM",
     bench_gemm_run},
    {"train", "whole training steps of the MoE transformer: tokens/s and MFU vs the device's GEMM",
     bench_train_run},
    {"pipeline", "pipeline schedules (run under mpirun): GPipe and interleaved 1F1B vs plain 1F1B",
     bench_pipeline_run},
    {"gate", "the fused gating pass as memory bandwidth vs a copy on the same device", bench_gate_run},
    {"attention", "causal attention forward and backward vs the device's GEMM (GPU: fused vs batched)",
     bench_attention_run},
};
#define N_COMMANDS ((int)(sizeof commands / sizeof commands[0]))

/* ------------------------------------------------------------ subcommands */

bool bench_failed(const char *cmd, const char *what, moe_status status) {
    if (status == MOE_OK) return false;
    fprintf(stderr, "moe-bench %s: %s: %s: %s\n", cmd, what, moe_status_string(status),
            moe_last_error());
    return true;
}

static void print_usage(FILE *f) {
    fprintf(f,
            "usage: moe-bench <command> [options]\n"
            "       moe-bench <command> --help\n"
            "\n"
            "Benchmarks of libmoe %s. Each figure is reported beside a baseline\n"
            "measured in the same run, so the ratio survives a noisy machine.\n"
            "\n"
            "commands:\n",
            moe_version_string());
    for (int c = 0; c < N_COMMANDS; c++)
        fprintf(f, "  %-10s %s\n", commands[c].name, commands[c].summary);
    fprintf(f,
            "\n"
            "options:\n"
            "  -h, --help     this list\n"
            "  --version      the library version\n"
            "\n"
            "environment:\n"
            "  OMP_NUM_THREADS    OpenMP and OpenBLAS threads when --threads is not given\n"
            "  OPENBLAS_CORETYPE  OpenBLAS's kernels; unset, where OpenBLAS takes the CPU for a\n"
            "                     Prescott, moe-bench sets it by the CPU's instructions and runs again\n");
}

int main(int argc, char **argv) {
    moe_blas_refit(argv);
    if (argc < 2) {
        print_usage(stderr);
        return BENCH_EXIT_USAGE;
    }
    const char *name = argv[1];
    if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0) {
        print_usage(stdout);
        return 0;
    }
    if (strcmp(name, "--version") == 0) {
        printf("moe-bench %s\n", moe_version_string());
        return 0;
    }
    for (int c = 0; c < N_COMMANDS; c++)
        if (strcmp(name, commands[c].name) == 0) return commands[c].run(argc - 1, argv + 1);
    fprintf(stderr, "moe-bench: unknown command '%s' (see moe-bench --help)\n", name);
    return BENCH_EXIT_USAGE;
}

/* ---------------------------------------------------------------- options */

/* Whether an argument is a flag ("--x", "-x") rather than a value, which
 * may be a negative number. */
static bool is_flag(const char *arg) {
    return arg[0] == '-' && (arg[1] == '-' || isalpha((unsigned char)arg[1]));
}

int bench_option(int argc, char **argv, int *i, const char *cmd, const char *name,
                 const char **value) {
    const char *arg = argv[*i];
    if (strncmp(arg, "--", 2) != 0) return 0;
    size_t len = strlen(name);
    if (strncmp(arg + 2, name, len) != 0) return 0;
    if (arg[2 + len] == '=') {
        *value = arg + 3 + len;
        return 1;
    }
    if (arg[2 + len] != '\0') return 0;
    /* The next option is not this one's value (a negative number is). */
    if (*i + 1 >= argc || is_flag(argv[*i + 1])) {
        fprintf(stderr, "moe-bench %s: --%s needs a value\n", cmd, name);
        return -1;
    }
    *i += 1;
    *value = argv[*i];
    return 1;
}

int bench_option_or_short(int argc, char **argv, int *i, const char *cmd, const char *short_name,
                          const char *name, const char **value) {
    if (short_name && strcmp(argv[*i], short_name) == 0) {
        if (*i + 1 >= argc || is_flag(argv[*i + 1])) {
            fprintf(stderr, "moe-bench %s: %s needs a value\n", cmd, short_name);
            return -1;
        }
        *i += 1;
        *value = argv[*i];
        return 1;
    }
    return bench_option(argc, argv, i, cmd, name, value);
}

int bench_usage_error(const char *cmd) {
    fprintf(stderr, "moe-bench %s: see moe-bench %s --help\n", cmd, cmd);
    return BENCH_EXIT_USAGE;
}

int bench_unknown_argument(const char *cmd, const char *arg) {
    fprintf(stderr, "moe-bench %s: unknown %s '%s'\n", cmd, arg[0] == '-' ? "option" : "argument", arg);
    return bench_usage_error(cmd);
}

int bench_parse_routing(bench_routing *routings, const char *cmd, const char *text, double default_s) {
    const bench_routing balanced = {"balanced", 0.0};
    bench_routing zipf = {"", default_s};
    int n = 0;
    if (strcmp(text, "balanced") == 0 || strcmp(text, "both") == 0) routings[n++] = balanced;
    if (strcmp(text, "balanced") == 0) return n;
    if (strncmp(text, "zipf:", 5) == 0) {
        if (!bench_parse_f64(&zipf.zipf_s, cmd, "--routing zipf:S", text + 5, 0.0, 100.0)) return 0;
    } else if (strcmp(text, "zipf") != 0 && strcmp(text, "both") != 0) {
        fprintf(stderr, "moe-bench %s: --routing=%s: expected balanced, zipf, zipf:S or both\n", cmd, text);
        return 0;
    }
    snprintf(zipf.label, sizeof zipf.label, "zipf:%g", zipf.zipf_s);
    routings[n++] = zipf;
    return n;
}

bool bench_parse_i64(int64_t *out, const char *cmd, const char *flag, const char *text, int64_t lo,
                     int64_t hi) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (end == text || *end != '\0' || errno == ERANGE || v < lo || v > hi) {
        fprintf(stderr, "moe-bench %s: %s=%s: expected an integer in [%lld, %lld]\n", cmd, flag,
                text, (long long)lo, (long long)hi);
        return false;
    }
    *out = (int64_t)v;
    return true;
}

bool bench_parse_f64(double *out, const char *cmd, const char *flag, const char *text, double lo,
                     double hi) {
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end != '\0' || errno == ERANGE || !(v >= lo && v <= hi)) {
        fprintf(stderr, "moe-bench %s: %s=%s: expected a number in [%g, %g]\n", cmd, flag, text, lo,
                hi);
        return false;
    }
    *out = v;
    return true;
}

void bench_set_threads(int n) {
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

int bench_omp_threads(void) { return omp_get_max_threads(); }

int bench_blas_threads(void) { return openblas_get_num_threads(); }

const char *bench_blas_kernels(void) {
    static char kernels[160];
    moe_blas_describe(kernels, sizeof kernels);
    return kernels;
}

/* ----------------------------------------------------------------- timing */

double bench_now_seconds(void) { return omp_get_wtime(); }

static int compare_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, compare_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void bench_error_add(bench_error *e, double got, double want) {
    const double d = fabs(got - want);
    if (d > e->diff || isnan(d)) e->diff = d;
    if (fabs(want) > e->scale) e->scale = fabs(want);
}

double bench_error_relative(const bench_error *e) { return e->scale > 0.0 ? e->diff / e->scale : e->diff; }

double bench_timed_calls(const moe_ops *ops, void (*fn)(const void *job), const void *job, int64_t reps) {
    const double t0 = bench_now_seconds();
    for (int64_t r = 0; r < reps; r++) fn(job);
    if (ops->sync() != MOE_OK) return -1.0;
    return (bench_now_seconds() - t0) / (double)reps;
}

#define SAMPLE_SECONDS 1e-3
#define MAX_REPS 1000

int64_t bench_reps_for(const moe_ops *ops, void (*fn)(const void *job), const void *job) {
    if (bench_timed_calls(ops, fn, job, 1) < 0.0) return 0;
    int64_t reps = 1;
    for (;;) {
        const double each = bench_timed_calls(ops, fn, job, reps);
        if (each < 0.0) return 0;
        if (each * (double)reps >= SAMPLE_SECONDS || reps >= MAX_REPS) return reps;
        /* Toward the count this sample says, ten times this one at most,
         * so that one short sample cannot make a sample of seconds. */
        const double want = ceil(SAMPLE_SECONDS / (each > 1e-9 ? each : 1e-9));
        const double next = want > 10.0 * (double)reps ? 10.0 * (double)reps : want;
        reps = next >= MAX_REPS ? MAX_REPS : next > (double)reps ? (int64_t)next : 2 * reps;
    }
}

/* ---------------------------------------------------------------- buffers */

static size_t round_up_bytes(size_t bytes) {
    return (bytes + BENCH_ALIGN_BYTES - 1) / BENCH_ALIGN_BYTES * BENCH_ALIGN_BYTES;
}

size_t bench_buffers_bytes(const bench_buffer *bufs, int n_bufs) {
    size_t total = BENCH_ALIGN_BYTES; /* aligned_alloc rejects a size of 0 */
    for (int b = 0; b < n_bufs; b++) {
        if (bufs[b].count > (SIZE_MAX / 2) / sizeof(float)) return 0;
        total += round_up_bytes(bufs[b].count * sizeof(float));
    }
    return total;
}

/* Points bufs into base, each on an aligned boundary. */
static void carve_buffers(char *base, bench_buffer *bufs, int n_bufs) {
    size_t off = 0;
    for (int b = 0; b < n_bufs; b++) {
        *bufs[b].ptr = (float *)(base + off);
        off += round_up_bytes(bufs[b].count * sizeof(float));
    }
}

void *bench_alloc_buffers(bench_buffer *bufs, int n_bufs) {
    const size_t total = bench_buffers_bytes(bufs, n_bufs);
    char *base = total ? aligned_alloc(BENCH_ALIGN_BYTES, total) : NULL;
    if (!base) return NULL;
    /* Touching every page now keeps first-touch faults out of the timings. */
    memset(base, 0, total);
    carve_buffers(base, bufs, n_bufs);
    return base;
}

void *bench_alloc_backend_buffers(const moe_ops *ops, bench_buffer *bufs, int n_bufs) {
    const size_t total = bench_buffers_bytes(bufs, n_bufs);
    void *base = NULL;
    if (!total || ops->alloc(&base, total) != MOE_OK) return NULL;
    carve_buffers(base, bufs, n_bufs);
    return base;
}

void bench_free(void *base) { free(base); }

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double bench_rng_uniform(bench_rng *rng) {
    /* 53 random bits, offset by half a step, lie strictly inside (0, 1). */
    return ((double)(splitmix64(&rng->state) >> 11) + 0.5) * 0x1.0p-53;
}

void bench_fill_uniform(float *p, size_t n, float scale, bench_rng *rng) {
    for (size_t i = 0; i < n; i++) p[i] = scale * (float)(2.0 * bench_rng_uniform(rng) - 1.0);
}

/* ----------------------------------------------------------- table / JSON */

void bench_table_header(const bench_table *t) {
    if (t->json) return;
    for (int c = 0; c < t->n_cols; c++)
        if (t->cols[c].header) printf("%*s ", t->cols[c].width, t->cols[c].header);
    printf("\n");
    fflush(stdout);
}

static void print_json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

void bench_table_row(const bench_table *t, const bench_value *values) {
    if (t->json) {
        printf("{\"bench\":");
        print_json_string(t->bench);
        for (int c = 0; c < t->n_cols; c++) {
            const bench_column *col = &t->cols[c];
            printf(",");
            print_json_string(col->key);
            printf(":");
            if (col->kind == BENCH_STR)
                print_json_string(values[c].s);
            else if (col->kind == BENCH_INT)
                printf("%lld", (long long)values[c].i);
            else if (isfinite(values[c].f))
                printf("%.6g", values[c].f);
            else
                printf("null");
        }
        printf("}\n");
    } else {
        for (int c = 0; c < t->n_cols; c++) {
            const bench_column *col = &t->cols[c];
            if (!col->header) continue;
            if (col->kind == BENCH_STR)
                printf("%*s ", col->width, values[c].s);
            else if (col->kind == BENCH_INT)
                printf("%*lld ", col->width, (long long)values[c].i);
            else if (isfinite(values[c].f))
                printf("%*.*f ", col->width, col->precision, values[c].f);
            else
                printf("%*s ", col->width, "-");
        }
        printf("\n");
    }
    /* Rows appear as they are measured, also when piped. */
    fflush(stdout);
}

void bench_table_note(const bench_table *t, const char *fmt, ...) {
    if (t->json) return;
    va_list ap;
    va_start(ap, fmt);
    printf("# ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

/* ---------------------------------------------------------- sgemm baseline */

double bench_sgemm_flops(const bench_sgemm *g) { return 2.0 * (double)g->m * g->n * g->k; }

int bench_int_option(int argc, char **argv, int *i, const char *cmd, const bench_int_flag *flags, int n_flags) {
    for (int f = 0; f < n_flags; f++) {
        const char *v = NULL;
        const int found = bench_option(argc, argv, i, cmd, flags[f].name, &v);
        if (found <= 0) {
            if (found < 0) return -1;
            continue;
        }
        char flag[64];
        snprintf(flag, sizeof flag, "--%s", flags[f].name);
        return bench_parse_i64(flags[f].value, cmd, flag, v, flags[f].lo, flags[f].hi) ? 1 : -1;
    }
    return 0;
}

int bench_device_option(int argc, char **argv, int *i, const char *cmd, moe_device *device) {
    const char *value = NULL;
    const int found = bench_option(argc, argv, i, cmd, "device", &value);
    if (found <= 0) return found;
    if (moe_device_parse(device, value) != MOE_OK) {
        fprintf(stderr, "moe-bench %s: %s\n", cmd, moe_last_error());
        return -1;
    }
    return 1;
}

int bench_parse_flags(const bench_flags *flags, const char *cmd, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            flags->usage();
            return 0;
        }
        int found = 0;
        for (int s = 0; s < flags->n_switches && !found; s++)
            if (strcmp(argv[i], flags->switches[s].name) == 0) *flags->switches[s].on = true, found = 1;
        if (found == 0 && flags->device) found = bench_device_option(argc, argv, &i, cmd, flags->device);
        const char *v = NULL;
        if (found == 0 && flags->math && (found = bench_option(argc, argv, &i, cmd, "gemm-math", &v)) > 0 &&
            moe_gemm_math_parse(flags->math, v) != MOE_OK) {
            fprintf(stderr, "moe-bench %s: %s\n", cmd, moe_last_error());
            found = -1;
        }
        for (int t = 0; t < flags->n_texts && found == 0; t++)
            found = bench_option(argc, argv, &i, cmd, flags->texts[t].name, flags->texts[t].value);
        if (found == 0) found = bench_int_option(argc, argv, &i, cmd, flags->ints, flags->n_ints);
        if (found < 0) return BENCH_EXIT_USAGE;
        if (found == 0) return bench_unknown_argument(cmd, argv[i]);
    }
    return -1;
}

bool bench_open_device(moe_device_handle *dev, const char *cmd, moe_device device, moe_gemm_math math) {
    if (bench_failed(cmd, "device", moe_device_open(dev, device, 1))) return false;
    if (bench_failed(cmd, "gemm math", moe_device_set_gemm_math(dev, math))) {
        moe_device_close(dev);
        return false;
    }
    return true;
}

double bench_ops_gemm_run(const moe_ops *ops, const bench_sgemm *g) {
    double t0 = bench_now_seconds();
    ops->gemm(g->c, g->a, g->b, g->m, g->n, g->k, g->k, g->k, g->n, false, true, 1.0f, 0.0f);
    if (ops->sync() != MOE_OK) return -1.0;
    return bench_now_seconds() - t0;
}

