/* moe_bench.h: the harness shared by the moe-bench subcommands: the command
 * table, option parsing, timing, aligned buffers, table/JSON rows and the
 * plain sgemm baseline every GEMM-bound figure is divided by (DESIGN.md 8). */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/device.h"
#include "kernels/ops.h"
#include "moe.h"

/* ------------------------------------------------------------ subcommands */

/* A subcommand gets argv from its own name on (argv[0] = "layer") and returns
 * the process exit status. Adding one: a bench_<name>.c file with its run
 * function, declared here and listed in moe_bench.c's table. */
typedef struct bench_command {
    const char *name;
    const char *summary; /* one line for `moe-bench --help` */
    int (*run)(int argc, char **argv);
} bench_command;

int bench_a2a_run(int argc, char **argv);
int bench_layer_run(int argc, char **argv);
int bench_gemm_run(int argc, char **argv);
int bench_train_run(int argc, char **argv);
int bench_pipeline_run(int argc, char **argv);
int bench_gate_run(int argc, char **argv);
int bench_attention_run(int argc, char **argv);

/* Exit statuses: 1 for a failure while running, 2 for a bad command line. */
#define BENCH_EXIT_FAILURE 1
#define BENCH_EXIT_USAGE 2

/* Why a subcommand that runs under mpirun (a2a, pipeline) cannot run in a
 * build without MPI, and how to get one. */
#define BENCH_NO_MPI \
    "this build has no MPI (configure with -DMOE_MPI=ON after apt-get install libopenmpi-dev openmpi-bin)"

/* Prints "moe-bench <cmd>: <what>: <status string>: <last error>" to stderr
 * and returns true when status is not MOE_OK. */
bool bench_failed(const char *cmd, const char *what, moe_status status);

/* ---------------------------------------------------------------- options */

/* Matches argv[*i] against "--name value" or "--name=value". Returns 1 and
 * sets *value (advancing *i past a separate value) on a match, 0 when argv[*i]
 * is another option, -1 after printing an error when the value is missing. */
int bench_option(int argc, char **argv, int *i, const char *cmd, const char *name,
                 const char **value);

/* bench_option that also takes the short spelling "-b VALUE" (short_name
 * "-b", or NULL for none), as nccl-tests spells its flags. */
int bench_option_or_short(int argc, char **argv, int *i, const char *cmd, const char *short_name,
                          const char *name, const char **value);

/* Whole-string parses within [lo, hi]; print an error naming the flag and
 * return false on anything else. */
bool bench_parse_i64(int64_t *out, const char *cmd, const char *flag, const char *text, int64_t lo,
                     int64_t hi);
bool bench_parse_f64(double *out, const char *cmd, const char *flag, const char *text, double lo,
                     double hi);

/* Integer flags: argv[*i] against "--name value" of each, as bench_option
 * (1 with the value parsed within [lo, hi], 0 for another option, -1 after
 * printing an error). */
typedef struct bench_int_flag {
    const char *name;
    int64_t *value, lo, hi;
} bench_int_flag;
int bench_int_option(int argc, char **argv, int *i, const char *cmd, const bench_int_flag *flags, int n_flags);

/* --device NAME (auto, cpu, cuda, cpu-strict), as bench_option: 1 with
 * *device set on a match, 0 for another option, -1 after printing an error. */
int bench_device_option(int argc, char **argv, int *i, const char *cmd, moe_device *device);

/* Prints "moe-bench <cmd>: see moe-bench <cmd> --help" to stderr and returns
 * BENCH_EXIT_USAGE. */
int bench_usage_error(const char *cmd);

/* Says that arg ("--x" or a stray word) is none of cmd's, then as
 * bench_usage_error. */
int bench_unknown_argument(const char *cmd, const char *arg);

/* The command line of a subcommand that times one device's ops (attention,
 * gate, train) or a pipeline's steps (pipeline): one loop, so that they read
 * -h/--help, switches, --device, --gemm-math, text and integer flags alike
 * and refuse a bad one alike. */
typedef struct bench_switch {
    const char *name; /* "--json": given alone */
    bool *on;
} bench_switch;

typedef struct bench_text_flag {
    const char *name; /* without the "--" */
    const char **value; /* the argument itself */
} bench_text_flag;

typedef struct bench_flags {
    void (*usage)(void); /* prints the help text on stdout */
    const bench_switch *switches;
    int n_switches;
    moe_device *device;   /* --device; NULL where the subcommand has none */
    moe_gemm_math *math;  /* --gemm-math; NULL where the subcommand has none */
    const bench_text_flag *texts;
    int n_texts;
    const bench_int_flag *ints;
    int n_ints;
} bench_flags;

/* Returns -1 when the run should go ahead, else the exit status: 0 after
 * the help text, BENCH_EXIT_USAGE after printing what is wrong. */
int bench_parse_flags(const bench_flags *flags, const char *cmd, int argc, char **argv);

/* Opens --device in --gemm-math math (MOE_GEMM_FP32, the device's own, where
 * a subcommand has no --gemm-math); false after printing why, with nothing
 * left open. */
bool bench_open_device(moe_device_handle *dev, const char *cmd, moe_device device, moe_gemm_math math);

/* Expert routings to time: even, or Zipf-skewed with share ~ 1/(e+1)^s. */
#define BENCH_MAX_ROUTINGS 2
typedef struct bench_routing {
    char label[32];
    double zipf_s; /* 0: balanced */
} bench_routing;

/* Parses --routing: balanced | zipf | zipf:S | both (balanced, then zipf);
 * plain zipf takes default_s. Returns how many routings it wrote (at most
 * BENCH_MAX_ROUTINGS), or 0 after printing an error. */
int bench_parse_routing(bench_routing *routings, const char *cmd, const char *text, double default_s);

/* Sets the OpenMP and the OpenBLAS thread counts together, so the layer and
 * the baseline GEMM run on the same number of cores. */
void bench_set_threads(int n);
int bench_omp_threads(void);
int bench_blas_threads(void);
/* The OpenBLAS kernels the CPU runs, and who chose them (blas.h). */
const char *bench_blas_kernels(void);

/* ----------------------------------------------------------------- timing */

double bench_now_seconds(void);

/* Median of v[0..n) (n > 0); sorts v in place. */
double bench_median(double *v, int n);

/* A result checked against its reference element by element: the largest
 * |got - want| (NaN once any is, so that no tolerance passes it) and the
 * largest |want|. */
typedef struct bench_error {
    double diff, scale;
} bench_error;
void bench_error_add(bench_error *e, double got, double want);
/* diff / scale, or diff when the reference is all zeros. */
double bench_error_relative(const bench_error *e);

/* Seconds per call of fn(job) over reps calls between two waits of ops (a
 * device queues them back to back, so one launch and one wait are spread
 * over them); negative on a backend failure. */
double bench_timed_calls(const moe_ops *ops, void (*fn)(const void *job), const void *job, int64_t reps);

/* Calls of fn(job) per timed sample: enough for 1 ms, so that a pass of
 * microseconds on a GPU is not mostly its launch and wait; 1 for a call
 * that long already, at most 1000, and 0 on a backend failure. Measured
 * after an untimed call (a GPU's first loads the kernel's module, a CPU's
 * faults its pages in), growing the count until a sample takes 1 ms. */
int64_t bench_reps_for(const moe_ops *ops, void (*fn)(const void *job), const void *job);

/* Tokens of the synthetic corpus that whole training steps read (train,
 * pipeline): far more than a model's steps take, so none reads a batch
 * twice. */
#define BENCH_SYNTH_TOKENS 2000000

/* ---------------------------------------------------------------- buffers */

#define BENCH_ALIGN_BYTES 64

/* One float buffer to carve out of a shared allocation. */
typedef struct bench_buffer {
    float **ptr;  /* where to store the buffer's address */
    size_t count; /* floats */
} bench_buffer;

/* One zeroed, BENCH_ALIGN_BYTES-aligned allocation holding every buffer of
 * bufs, each starting on an aligned boundary. Returns the allocation (free it
 * with bench_free) or NULL when it cannot be had. */
void *bench_alloc_buffers(bench_buffer *bufs, int n_bufs);
void bench_free(void *base);

/* Deterministic generator (splitmix64) so every run times the same data. */
typedef struct bench_rng {
    uint64_t state;
} bench_rng;

/* Uniform in the open interval (0, 1): never 0, so log(u) is finite. */
double bench_rng_uniform(bench_rng *rng);

/* p[i] uniform in [-scale, scale). */
void bench_fill_uniform(float *p, size_t n, float scale, bench_rng *rng);

/* ----------------------------------------------------------- table / JSON */

typedef enum bench_kind { BENCH_STR, BENCH_INT, BENCH_F64 } bench_kind;

typedef struct bench_column {
    const char *key;    /* JSON key */
    const char *header; /* table header; NULL: JSON only */
    bench_kind kind;
    int width;     /* table width; negative left-aligns */
    int precision; /* BENCH_F64 digits after the point in the table */
} bench_column;

/* One cell; the member matching the column's kind is read. A NaN F64 prints
 * as "-" in the table and null in JSON. */
typedef struct bench_value {
    const char *s;
    int64_t i;
    double f;
} bench_value;

typedef struct bench_table {
    const char *bench; /* written as "bench" in every JSON object */
    const bench_column *cols;
    int n_cols;
    bool json; /* one JSON object per row instead of aligned columns */
} bench_table;

/* The header line (table mode only). */
void bench_table_header(const bench_table *t);
/* values[n_cols], in column order. */
void bench_table_row(const bench_table *t, const bench_value *values);
/* A "# ..." line in table mode; nothing in JSON mode, which stays one
 * object per line. */
void bench_table_note(const bench_table *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---------------------------------------------------------- sgemm baseline */

/* c = a b^T with a [m, k], b [n, k], c [m, n]: one plain fp32 GEMM in the
 * layout the experts use (weights stored [out, in]). */
typedef struct bench_sgemm {
    int64_t m, n, k;
    float *a; /* [m, k] */
    float *b; /* [n, k] */
    float *c; /* [m, n] */
} bench_sgemm;

double bench_sgemm_flops(const bench_sgemm *g);

/* One product through a backend's op table (a, b, c its memory; on the
 * CPU one cblas_sgemm), waited for: its seconds, or a negative value when
 * the backend failed (moe_last_error says why). */
double bench_ops_gemm_run(const moe_ops *ops, const bench_sgemm *g);

/* Bytes bench_alloc_buffers takes for bufs. */
size_t bench_buffers_bytes(const bench_buffer *bufs, int n_bufs);

/* bench_alloc_buffers's layout in a backend's memory (ops->alloc, zeroed):
 * the same offsets, so a host arena of the same bufs uploads onto it in one
 * copy. Returns the allocation (ops->release it) or NULL. */
void *bench_alloc_backend_buffers(const moe_ops *ops, bench_buffer *bufs, int n_bufs);

#endif /* MOE_BENCH_H */
