/* bench_a2a.c: `moe-bench a2a`, the all-to-all-v of an expert-parallel
 * dispatch, in the manner of nccl-tests' alltoall_perf: for each size, the
 * communicator's all-to-all-v (moe_comm) beside a raw MPI_Alltoallv of the
 * same bytes, in interleaved iterations of one run, every received element
 * checked. Run under mpirun. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "comm/comm.h"
#include "common/rng.h"

#ifdef MOE_HAVE_MPI
#include <mpi.h>
#endif

#define CMD "a2a"
/* A row of a Mixtral-sized layer (d_model 4096) in fp32, the CPU path's
 * activation type. */
#define DEFAULT_ROW_BYTES 16384
#define DEFAULT_MIN_BYTES (64 << 10)
#define DEFAULT_MAX_BYTES (16 << 20)
#define DEFAULT_FACTOR 2
#define DEFAULT_WARMUP 5
#define DEFAULT_ITERS 20
#define DEFAULT_SEED 0x6d6f652d613261ull
#define MAX_SIZES 64
#define POISON (-1.0f) /* never a sent value, which are >= 0 */

typedef enum a2a_dist { DIST_UNIFORM, DIST_ZIPF, DIST_HOT } a2a_dist;
typedef enum a2a_mode { MODE_RAW, MODE_DISPATCH } a2a_mode;

typedef struct a2a_options {
    int64_t min_bytes, max_bytes, factor, warmup, iters, row_bytes;
    uint64_t seed;
    a2a_dist dist;
    double dist_param; /* zipf exponent S, or the hot fraction */
    char dist_label[32];
    a2a_mode mode;
    bool json;
} a2a_options;

static void print_help(FILE *f) {
    fprintf(f,
            "usage: mpirun -np N moe-bench a2a [options]\n"
            "\n"
            "The all-to-all-v of an expert-parallel MoE dispatch: each rank sends `size`\n"
            "bytes in whole rows, each row to a destination rank drawn from the routing\n"
            "distribution (deterministically from the seed and the rank), so per-peer\n"
            "counts are as uneven as a real dispatch's. Receivers learn their counts by\n"
            "an all-to-all of counts before the timed region. Each size is timed for the\n"
            "communicator's all-to-all-v (moe_comm, the path the MoE layer uses) and for a\n"
            "raw MPI_Alltoallv of the same bytes, in interleaved iterations, each started\n"
            "after a barrier. time is the median over iterations of the slowest rank;\n"
            "algbw = size / time; busbw = algbw * (n-1)/n (nccl-tests' definition);\n"
            "ratio = algbw / mpi_algbw. Every received element is checked against the\n"
            "value computed from (source rank, row, element); #wrong counts misses over\n"
            "all ranks, and any miss gives exit status 1.\n"
            "\n"
            "sizes (bytes sent per rank; K, M, G suffixes are powers of 1024):\n"
            "  -b, --minbytes N      smallest size (default 64K)\n"
            "  -e, --maxbytes N      largest size (default 16M)\n"
            "  -f, --stepfactor N    multiply the size by N each step (default %d)\n"
            "  --row-bytes N         bytes per row, a multiple of 4 (default %d: d_model\n"
            "                        4096 in fp32). Sizes round down to whole rows, at\n"
            "                        least one; a size giving the same rows as the one\n"
            "                        before is skipped.\n"
            "\n"
            "routing:\n"
            "  -d, --dist D          uniform (default): every rank equally likely;\n"
            "                        zipf:S: rank j with probability ~ 1/(j+1)^S;\n"
            "                        hot:F: a fraction F of rows to rank 0, the rest\n"
            "                        uniform. recv_imb is the busiest receiver's bytes\n"
            "                        over size.\n"
            "  --seed N              routing and data seed\n"
            "\n"
            "timing:\n"
            "  -w, --warmup_iters N  untimed iterations first (default %d)\n"
            "  -n, --iters N         timed iterations (default %d)\n"
            "\n"
            "mode:\n"
            "  --mode raw            the exchange alone (default)\n"
            "  --mode dispatch       the MoE layer's dispatch + combine path (not built yet)\n"
            "\n"
            "output:\n"
            "  --json                one JSON object per size on stdout instead of the table\n"
            "  -h, --help            this text\n",
            DEFAULT_FACTOR, DEFAULT_ROW_BYTES, DEFAULT_WARMUP, DEFAULT_ITERS);
}

static int usage_error(void) {
    fprintf(stderr, "moe-bench %s: see moe-bench %s --help\n", CMD, CMD);
    return BENCH_EXIT_USAGE;
}

/* "64K", "16M", "1G" or plain bytes, within [1, 2^40]. */
static bool parse_bytes(int64_t *out, const char *flag, const char *text) {
    char digits[32];
    size_t len = strlen(text);
    int64_t scale = 1;
    if (len > 0 && len < sizeof digits) {
        switch (text[len - 1]) {
        case 'K': case 'k': scale = INT64_C(1) << 10; break;
        case 'M': case 'm': scale = INT64_C(1) << 20; break;
        case 'G': case 'g': scale = INT64_C(1) << 30; break;
        default: break;
        }
    }
    if (len == 0 || len >= sizeof digits) {
        fprintf(stderr, "moe-bench %s: %s=%s: expected bytes such as 4096, 64K or 16M\n", CMD,
                flag, text);
        return false;
    }
    memcpy(digits, text, len + 1);
    if (scale > 1) digits[len - 1] = '\0';
    int64_t v;
    if (!bench_parse_i64(&v, CMD, flag, digits, 1, (INT64_C(1) << 40) / scale)) return false;
    *out = v * scale;
    return true;
}

static bool parse_dist(a2a_options *o, const char *text) {
    if (strcmp(text, "uniform") == 0) {
        o->dist = DIST_UNIFORM;
        o->dist_param = 0.0;
    } else if (strncmp(text, "zipf:", 5) == 0) {
        o->dist = DIST_ZIPF;
        if (!bench_parse_f64(&o->dist_param, CMD, "--dist zipf:S", text + 5, 0.0, 100.0))
            return false;
    } else if (strncmp(text, "hot:", 4) == 0) {
        o->dist = DIST_HOT;
        if (!bench_parse_f64(&o->dist_param, CMD, "--dist hot:F", text + 4, 0.0, 1.0))
            return false;
    } else {
        fprintf(stderr, "moe-bench %s: --dist=%s: expected uniform, zipf:S or hot:F\n", CMD, text);
        return false;
    }
    snprintf(o->dist_label, sizeof o->dist_label, "%s", text);
    return true;
}

/* A flag with a short and a long spelling and a separate value. */
typedef struct a2a_flag {
    const char *short_name, *long_name;
} a2a_flag;

/* Like bench_option, also accepting the short spelling "-b VALUE". */
static int match_flag(int argc, char **argv, int *i, const a2a_flag *flag, const char **value) {
    if (flag->short_name && strcmp(argv[*i], flag->short_name) == 0) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "moe-bench %s: %s needs a value\n", CMD, flag->short_name);
            return -1;
        }
        *i += 1;
        *value = argv[*i];
        return 1;
    }
    return bench_option(argc, argv, i, CMD, flag->long_name, value);
}

enum { F_MIN, F_MAX, F_FACTOR, F_WARMUP, F_ITERS, F_DIST, F_ROW, F_SEED, F_MODE, N_FLAGS };

static const a2a_flag flags[N_FLAGS] = {
    [F_MIN] = {"-b", "minbytes"},   [F_MAX] = {"-e", "maxbytes"},
    [F_FACTOR] = {"-f", "stepfactor"}, [F_WARMUP] = {"-w", "warmup_iters"},
    [F_ITERS] = {"-n", "iters"},    [F_DIST] = {"-d", "dist"},
    [F_ROW] = {NULL, "row-bytes"},  [F_SEED] = {NULL, "seed"},
    [F_MODE] = {NULL, "mode"},
};

static bool apply_flag(a2a_options *o, int f, const char *value) {
    char name[32];
    snprintf(name, sizeof name, "--%s", flags[f].long_name);
    int64_t v;
    switch (f) {
    case F_MIN: return parse_bytes(&o->min_bytes, name, value);
    case F_MAX: return parse_bytes(&o->max_bytes, name, value);
    case F_FACTOR: return bench_parse_i64(&o->factor, CMD, name, value, 2, 1024);
    case F_WARMUP: return bench_parse_i64(&o->warmup, CMD, name, value, 0, 1000000);
    case F_ITERS: return bench_parse_i64(&o->iters, CMD, name, value, 1, 1000000);
    case F_DIST: return parse_dist(o, value);
    case F_ROW:
        if (!parse_bytes(&o->row_bytes, name, value)) return false;
        if (o->row_bytes % 4 != 0) {
            fprintf(stderr, "moe-bench %s: --row-bytes=%s: must be a multiple of 4 (fp32)\n", CMD,
                    value);
            return false;
        }
        return true;
    case F_SEED:
        if (!bench_parse_i64(&v, CMD, name, value, 0, INT64_MAX)) return false;
        o->seed = (uint64_t)v;
        return true;
    case F_MODE:
        if (strcmp(value, "raw") == 0) {
            o->mode = MODE_RAW;
            return true;
        }
        if (strcmp(value, "dispatch") == 0) {
            o->mode = MODE_DISPATCH;
            return true;
        }
        fprintf(stderr, "moe-bench %s: --mode=%s: expected raw or dispatch\n", CMD, value);
        return false;
    }
    return false;
}

/* Returns -1 when the run should go ahead, else the exit status. */
static int parse_options(a2a_options *o, int argc, char **argv) {
    *o = (a2a_options){.min_bytes = DEFAULT_MIN_BYTES,
                       .max_bytes = DEFAULT_MAX_BYTES,
                       .factor = DEFAULT_FACTOR,
                       .warmup = DEFAULT_WARMUP,
                       .iters = DEFAULT_ITERS,
                       .row_bytes = DEFAULT_ROW_BYTES,
                       .seed = DEFAULT_SEED,
                       .mode = MODE_RAW};
    parse_dist(o, "uniform");
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
        int found = 0;
        for (int f = 0; f < N_FLAGS && !found; f++) {
            const char *value = NULL;
            found = match_flag(argc, argv, &i, &flags[f], &value);
            if (found < 0 || (found && !apply_flag(o, f, value))) return usage_error();
        }
        if (!found) {
            fprintf(stderr, "moe-bench %s: unknown %s '%s'\n", CMD,
                    arg[0] == '-' ? "option" : "argument", arg);
            return usage_error();
        }
    }
    if (o->min_bytes > o->max_bytes) {
        fprintf(stderr, "moe-bench %s: --minbytes=%lld exceeds --maxbytes=%lld\n", CMD,
                (long long)o->min_bytes, (long long)o->max_bytes);
        return usage_error();
    }
    return -1;
}

#ifdef MOE_HAVE_MPI

static const bench_column columns[] = {
    {"size_bytes", "size(B)", BENCH_INT, 11, 0},
    {"count", "count", BENCH_INT, 10, 0},
    {"rows", NULL, BENCH_INT, 0, 0},
    {"time_us", "time(us)", BENCH_F64, 10, 1},
    {"algbw_gbps", "algbw", BENCH_F64, 7, 2},
    {"busbw_gbps", "busbw", BENCH_F64, 7, 2},
    {"wrong", "#wrong", BENCH_INT, 6, 0},
    {"mpi_time_us", "mpi(us)", BENCH_F64, 10, 1},
    {"mpi_algbw_gbps", "algbw", BENCH_F64, 7, 2},
    {"mpi_busbw_gbps", "busbw", BENCH_F64, 7, 2},
    {"mpi_wrong", "#wrong", BENCH_INT, 6, 0},
    {"ratio", "ratio", BENCH_F64, 6, 3},
    {"recv_imbalance", "recv_imb", BENCH_F64, 8, 2},
    {"ranks", NULL, BENCH_INT, 0, 0},
    {"dist", NULL, BENCH_STR, 0, 0},
    {"row_bytes", NULL, BENCH_INT, 0, 0},
    {"iters", NULL, BENCH_INT, 0, 0},
    {"mode", NULL, BENCH_STR, 0, 0},
};
#define N_COLUMNS ((int)(sizeof columns / sizeof columns[0]))

/* The element a rank sends: exact in fp32 (24 bits) and never POISON. */
static float sent_value(uint64_t seed, int src, int dst, int64_t index) {
    uint64_t stream = ((uint64_t)src << 32) | (uint64_t)dst;
    return (float)(moe_rng_bits(seed, stream, (uint64_t)index) >> 40);
}

/* rows[P]: how many of this rank's R rows go to each rank, each row's
 * destination drawn from the distribution. cdf [P] is scratch. */
static void route_rows(int64_t *rows, double *cdf, int64_t R, int P, int rank,
                       const a2a_options *o) {
    double total = 0.0;
    for (int j = 0; j < P; j++) {
        double p = 1.0 / P;
        if (o->dist == DIST_ZIPF) p = pow(j + 1.0, -o->dist_param);
        if (o->dist == DIST_HOT) p = (1.0 - o->dist_param) / P + (j == 0 ? o->dist_param : 0.0);
        total += p;
        cdf[j] = total;
        rows[j] = 0;
    }
    for (int64_t r = 0; r < R; r++) {
        double u = (double)moe_rng_uniform(o->seed, 0x726f757465ull + (uint64_t)rank,
                                           (uint64_t)r) * total;
        int j = 0;
        while (j < P - 1 && u >= cdf[j]) j++;
        rows[j]++;
    }
}

/* One size's exchange, in rows (counts) and in elements (what MPI takes). */
typedef struct a2a_plan {
    int64_t R;                 /* rows this rank sends */
    int64_t *send_rows;        /* [P] */
    int64_t *recv_rows;        /* [P] */
    int64_t recv_total;        /* rows this rank receives */
} a2a_plan;

typedef struct a2a_run {
    const a2a_options *o;
    moe_comm *comm;
    int rank, P;
    int64_t row_floats;
    float *send, *recv_moe, *recv_mpi;  /* [max send rows, rf], [max recv rows, rf] x 2 */
    int64_t *sc, *sd, *rc, *rd;         /* [P] element counts and displacements */
    int *isc, *isd, *irc, *ird;         /* [P] the same as MPI's int */
    double *times;                      /* [2, iters] */
} a2a_run;

/* Aborts the job: the other ranks are inside a collective this rank left. */
static _Noreturn void fail_job(a2a_run *r, const char *what, moe_status st) {
    bench_failed(CMD, what, st);
    moe_comm_abort(r->comm, BENCH_EXIT_FAILURE);
}

static _Noreturn void fail_memory(a2a_run *r, const char *what) {
    fprintf(stderr, "moe-bench %s: rank %d: out of memory for %s\n", CMD, r->rank, what);
    moe_comm_abort(r->comm, BENCH_EXIT_FAILURE);
}

static int64_t count_wrong(const a2a_run *r, const float *recv, const a2a_plan *plan) {
    int64_t wrong = 0, row = 0;
    for (int s = 0; s < r->P; s++)
        for (int64_t k = 0; k < plan->recv_rows[s]; k++, row++) {
            const float *x = recv + row * r->row_floats;
            for (int64_t e = 0; e < r->row_floats; e++)
                wrong += x[e] != sent_value(r->o->seed, s, r->rank, k * r->row_floats + e);
        }
    return wrong;
}

/* Times one exchange, started after a barrier; returns this rank's seconds. */
static double time_moe(a2a_run *r) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = bench_now_seconds();
    moe_status st = moe_comm_alltoallv(r->comm, r->recv_moe, r->rc, r->rd, r->send, r->sc, r->sd,
                                       MOE_COMM_F32);
    double t1 = bench_now_seconds();
    if (st != MOE_OK) fail_job(r, "moe_comm_alltoallv", st);
    return t1 - t0;
}

static double time_mpi(a2a_run *r) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = bench_now_seconds();
    int code = MPI_Alltoallv(r->send, r->isc, r->isd, MPI_FLOAT, r->recv_mpi, r->irc, r->ird,
                             MPI_FLOAT, MPI_COMM_WORLD);
    double t1 = bench_now_seconds();
    if (code != MPI_SUCCESS) {
        fprintf(stderr, "moe-bench %s: rank %d: MPI_Alltoallv failed with code %d\n", CMD, r->rank,
                code);
        moe_comm_abort(r->comm, BENCH_EXIT_FAILURE);
    }
    return t1 - t0;
}

/* Runs one size; returns the wrong elements over all ranks (both paths). */
static int64_t run_size(a2a_run *r, const a2a_plan *plan, const bench_table *table) {
    const a2a_options *o = r->o;
    const int P = r->P, iters = (int)o->iters;
    const int64_t rf = r->row_floats;
    int64_t soff = 0, roff = 0;
    for (int j = 0; j < P; j++) {
        r->sc[j] = plan->send_rows[j] * rf;
        r->sd[j] = soff;
        r->rc[j] = plan->recv_rows[j] * rf;
        r->rd[j] = roff;
        soff += r->sc[j];
        roff += r->rc[j];
        /* Totals fit int (checked when planning), so every entry does too. */
        r->isc[j] = (int)r->sc[j], r->isd[j] = (int)r->sd[j];
        r->irc[j] = (int)r->rc[j], r->ird[j] = (int)r->rd[j];
        for (int64_t i = 0; i < r->sc[j]; i++)
            r->send[r->sd[j] + i] = sent_value(o->seed, r->rank, j, i);
    }
    for (int64_t i = 0; i < roff; i++) r->recv_moe[i] = r->recv_mpi[i] = POISON;

    for (int it = 0; it < (int)o->warmup; it++) {
        time_moe(r);
        time_mpi(r);
    }
    /* Alternating which goes first cancels any advantage of the order. */
    for (int it = 0; it < iters; it++) {
        if (it % 2 == 0) {
            r->times[it] = time_moe(r);
            r->times[iters + it] = time_mpi(r);
        } else {
            r->times[iters + it] = time_mpi(r);
            r->times[it] = time_moe(r);
        }
    }

    int64_t local[2] = {count_wrong(r, r->recv_moe, plan), count_wrong(r, r->recv_mpi, plan)};
    int64_t wrong[2] = {0, 0}, max_recv = 0;
    MPI_Allreduce(local, wrong, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&plan->recv_total, &max_recv, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    /* An exchange ends when its slowest rank does. */
    MPI_Allreduce(MPI_IN_PLACE, r->times, 2 * iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

    if (r->rank == 0) {
        const double bytes = (double)(plan->R * o->row_bytes);
        const double t = bench_median(r->times, iters);
        const double t_mpi = bench_median(r->times + iters, iters);
        const double bus = P > 1 ? (double)(P - 1) / P : 0.0;
        const double algbw = bytes / t * 1e-9, mpi_algbw = bytes / t_mpi * 1e-9;
        bench_value v[N_COLUMNS] = {
            {.i = plan->R * o->row_bytes},
            {.i = plan->R * rf},
            {.i = plan->R},
            {.f = t * 1e6},
            {.f = algbw},
            {.f = algbw * bus},
            {.i = wrong[0]},
            {.f = t_mpi * 1e6},
            {.f = mpi_algbw},
            {.f = mpi_algbw * bus},
            {.i = wrong[1]},
            {.f = algbw / mpi_algbw},
            {.f = (double)max_recv / (double)plan->R},
            {.i = P},
            {.s = o->dist_label},
            {.i = o->row_bytes},
            {.i = o->iters},
            {.s = "raw"},
        };
        bench_table_row(table, v);
    }
    return wrong[0] + wrong[1];
}

static int run_raw(const a2a_options *o) {
    a2a_run r = {.o = o, .row_floats = o->row_bytes / 4};
    bench_failed(CMD, "moe_comm_mpi_create", moe_comm_mpi_create(&r.comm));
    if (!r.comm) return BENCH_EXIT_FAILURE;
    r.rank = moe_comm_rank(r.comm);
    r.P = moe_comm_size(r.comm);
    const int P = r.P;

    /* Every size's routing first, so the buffers are sized once. */
    a2a_plan plans[MAX_SIZES];
    int n_sizes = 0;
    int64_t max_send = 0, max_recv = 0;
    int64_t *rows = calloc((size_t)MAX_SIZES * 2 * (size_t)P, sizeof *rows);
    double *cdf = malloc((size_t)P * sizeof *cdf);
    if (!rows || !cdf)
        fail_memory(&r, "the routing tables");
    for (int64_t size = o->min_bytes; size <= o->max_bytes && n_sizes < MAX_SIZES;
         size *= o->factor) {
        int64_t R = size / o->row_bytes > 0 ? size / o->row_bytes : 1;
        if (n_sizes > 0 && plans[n_sizes - 1].R == R) continue;
        a2a_plan *p = &plans[n_sizes];
        *p = (a2a_plan){.R = R, .send_rows = rows + (size_t)n_sizes * 2 * P};
        p->recv_rows = p->send_rows + P;
        route_rows(p->send_rows, cdf, R, P, r.rank, o);
        moe_status st = moe_comm_alltoall(r.comm, p->recv_rows, p->send_rows, 1, MOE_COMM_I64);
        if (st != MOE_OK) fail_job(&r, "exchanging row counts", st);
        for (int j = 0; j < P; j++) p->recv_total += p->recv_rows[j];
        max_send = R > max_send ? R : max_send;
        max_recv = p->recv_total > max_recv ? p->recv_total : max_recv;
        n_sizes++;
    }
    free(cdf);
    /* MPI_Alltoallv's displacements are int elements. */
    int64_t need[2] = {max_send * r.row_floats, max_recv * r.row_floats}, worst[2];
    MPI_Allreduce(need, worst, 2, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    if (worst[0] > INT32_MAX || worst[1] > INT32_MAX) {
        if (r.rank == 0)
            fprintf(stderr,
                    "moe-bench %s: a rank would move %lld fp32 elements, past MPI's int "
                    "counts; lower --maxbytes\n",
                    CMD, (long long)(worst[0] > worst[1] ? worst[0] : worst[1]));
        free(rows);
        moe_comm_free(r.comm);
        moe_comm_mpi_finalize();
        return BENCH_EXIT_USAGE;
    }

    bench_buffer bufs[] = {
        {&r.send, (size_t)(max_send * r.row_floats)},
        {&r.recv_moe, (size_t)(max_recv * r.row_floats)},
        {&r.recv_mpi, (size_t)(max_recv * r.row_floats)},
    };
    void *arena = bench_alloc_buffers(bufs, 3);
    int64_t *counts = malloc((size_t)P * 4 * sizeof *counts);
    int *icounts = malloc((size_t)P * 4 * sizeof *icounts);
    r.times = malloc((size_t)o->iters * 2 * sizeof *r.times);
    if (!arena || !counts || !icounts || !r.times)
        fail_memory(&r, "the send and receive buffers");
    r.sc = counts, r.sd = counts + P, r.rc = counts + 2 * P, r.rd = counts + 3 * P;
    r.isc = icounts, r.isd = icounts + P, r.irc = icounts + 2 * P, r.ird = icounts + 3 * P;

    const bench_table table = {.bench = CMD, .cols = columns, .n_cols = N_COLUMNS, .json = o->json};
    if (r.rank == 0) {
        bench_table_note(&table,
                         "moe-bench a2a --mode raw, libmoe %s: %d ranks, dist %s, rows of %lld "
                         "B, seed %llu, %lld warmup + %lld timed iterations",
                         moe_version_string(), P, o->dist_label, (long long)o->row_bytes,
                         (unsigned long long)o->seed, (long long)o->warmup, (long long)o->iters);
        bench_table_note(&table,
                         "left: moe_comm_alltoallv; right: raw MPI_Alltoallv; time: median of "
                         "the slowest rank; GB/s");
        bench_table_header(&table);
    }
    int64_t wrong = 0;
    for (int s = 0; s < n_sizes; s++) wrong += run_size(&r, &plans[s], &table);

    free(r.times);
    free(icounts);
    free(counts);
    bench_free(arena);
    free(rows);
    moe_comm_free(r.comm);
    if (bench_failed(CMD, "moe_comm_mpi_finalize", moe_comm_mpi_finalize()))
        return BENCH_EXIT_FAILURE;
    if (wrong > 0) {
        if (r.rank == 0)
            fprintf(stderr, "moe-bench %s: %lld wrong elements received\n", CMD, (long long)wrong);
        return BENCH_EXIT_FAILURE;
    }
    return 0;
}

#endif /* MOE_HAVE_MPI */

int bench_a2a_run(int argc, char **argv) {
    a2a_options o;
    int rc = parse_options(&o, argc, argv);
    if (rc >= 0) return rc;
    if (o.mode == MODE_DISPATCH) {
        fprintf(stderr,
                "moe-bench %s: --mode dispatch: the MoE layer's expert-parallel dispatch + "
                "combine path is not built yet; --mode raw measures the exchange alone\n",
                CMD);
        return BENCH_EXIT_FAILURE;
    }
#ifdef MOE_HAVE_MPI
    return run_raw(&o);
#else
    fprintf(stderr,
            "moe-bench %s: this build has no MPI (configure with -DMOE_MPI=ON after apt-get "
            "install libopenmpi-dev openmpi-bin)\n",
            CMD);
    return BENCH_EXIT_FAILURE;
#endif
}
