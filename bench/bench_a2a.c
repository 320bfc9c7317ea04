/* bench_a2a.c: `moe-bench a2a`, the all-to-all-v of an expert-parallel
 * dispatch, in the manner of nccl-tests' alltoall_perf. Two modes, each
 * beside a raw MPI_Alltoallv of the same per-peer bytes in interleaved
 * iterations of one run, every received element checked:
 *  - raw: the communicator's all-to-all-v (moe_comm) alone;
 *  - dispatch: the MoE layer's whole dispatch + combine path (permute,
 *    the messages to the experts' ranks, and back, forward and backward),
 *    timed by the layer's own phase timers inside real forward/backward
 *    passes, its outputs and input gradients checked against a one-rank
 *    layer.
 * Run under mpirun. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/moe_bench.h"
#include "comm/comm.h"
#include "common/rng.h"
#include "engine/grid.h"
#include "engine/moe_layer.h"
#include "kernels/ops.h"

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
/* Dispatch mode: E = this many experts per rank unless --experts says;
 * a narrow d_ff keeps the expert GEMMs cheap next to the rows they move. */
#define DEFAULT_EXPERTS_PER_RANK 8
#define DEFAULT_TOP_K 2
#define DEFAULT_D_FF 16
#define MAX_SIZES 64
/* What a receive buffer or a layer output holds before each exchange or
 * step: equal to nothing, so never a sent value nor within any tolerance. */
#define POISON NAN

typedef enum a2a_dist { DIST_UNIFORM, DIST_ZIPF, DIST_HOT } a2a_dist;
typedef enum a2a_mode { MODE_RAW, MODE_DISPATCH } a2a_mode;

typedef struct a2a_options {
    int64_t min_bytes, max_bytes, factor, warmup, iters, row_bytes;
    int64_t experts; /* dispatch: E; 0 means DEFAULT_EXPERTS_PER_RANK per rank */
    int64_t top_k, d_ff;
    int64_t overlap; /* 1: the experts start on half the sources' tokens */
    int64_t rank_limit; /* > 0: each token's experts on at most this many ranks */
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
            "counts are as uneven as a real dispatch's. Each size is timed beside a raw\n"
            "MPI_Alltoallv of the same per-peer bytes, in interleaved iterations, each\n"
            "started after a barrier. time is the median over iterations of the slowest\n"
            "rank; algbw = size / time, the rows a rank keeps for itself included as in\n"
            "nccl-tests; busbw = algbw * (n-1)/n (nccl-tests' definition); ratio = algbw /\n"
            "mpi_algbw. #wrong counts wrong elements over all ranks and iterations, the\n"
            "warm-up included: before each exchange (or step) what it writes is poisoned,\n"
            "after it every element is checked, both outside the timed region, so an\n"
            "exchange that moves nothing counts however often it ran right before. Any\n"
            "wrong element gives exit 1.\n"
            "Run with OMP_NUM_THREADS=1 when ranks outnumber cores.\n"
            "\n"
            "--mode raw (default): the communicator's all-to-all-v (moe_comm, the call the\n"
            "  MoE layer makes) alone. Receivers learn their counts by an all-to-all of\n"
            "  counts before the timed region; every received element is checked against\n"
            "  the value computed from (source rank, row, element), after every exchange.\n"
            "\n"
            "--mode dispatch: the MoE layer's dispatch + combine path inside real forward\n"
            "  and backward passes, expert-parallel over all N ranks: d_model = row-bytes/4,\n"
            "  E experts (E/N per rank), top-k, SwiGLU experts of width d-ff, dropless.\n"
            "  Each rank holds T = size/row-bytes/k tokens (at least 1; a size giving the\n"
            "  T of the one before is skipped), T*k (token, expert) pairs = size bytes;\n"
            "  a dispatch sends each token once to each rank holding any of its experts.\n"
            "  The router is steered: gate.weight is the identity on the first E input\n"
            "  columns, which hold log p_e + Gumbel noise, so each token's top-k is a draw\n"
            "  without replacement from p, p_e being the weight of the expert's rank under\n"
            "  -d spread over its E/N experts. A step (forward + backward) makes 4\n"
            "  exchanges: rows out, outputs back, output gradients out, input gradients\n"
            "  back. time = the layer's exchange_seconds of a step / 4 (permute, one\n"
            "  message per rank each way, combine, unpermute;\n"
            "  not the experts, not the all-gather of routing counts), in which a rank\n"
            "  waiting for a slower one counts. mpi = the same 4 exchanges as\n"
            "  MPI_Alltoallv's of the same per-peer counts (the returns send back what\n"
            "  arrived), each after a barrier, / 4.\n"
            "  xbw       the layer's exchange_bytes (sent to other ranks) / exchange time\n"
            "  recv_imb  the busiest rank's received rows / T*k, as routed (below 1 where\n"
            "            tokens have several experts on one rank)\n"
            "  fast      time of the rank whose exchange took least (the least waiting)\n"
            "  copy      one memcpy of size bytes on every rank at once: the unit of the\n"
            "            memory-bound permute and combine passes mpi does not make\n"
            "  exch%%     the exchange's share of a step; experts: the grouped GEMMs of a step\n"
            "  #wrong    y and dx of every token on every rank after every step against a\n"
            "            one-rank layer with the same parameters on the same tokens\n"
            "            (|got - want| > 1e-5 max|want| + 1e-5 |want|); steps alternate\n"
            "            between two sets of tokens that route alike and carry different\n"
            "            values, so rows left over from the step before show; mpi: both\n"
            "            directions of every exchange against what was sent\n"
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
            "layer (dispatch mode):\n"
            "  --experts N           E, a multiple of the rank count, at most d_model\n"
            "                        (default %d per rank)\n"
            "  --top-k N             experts per token (default %d)\n"
            "  --rank-limit M        each token's experts on at most M ranks: group-limited\n"
            "                        routing with a group per rank (DeepSeek-V3's node\n"
            "                        limit; default 0: none); a token still travels once\n"
            "                        per rank\n"
            "  --d-ff N              each expert's intermediate size (default %d)\n"
            "  --overlap 0|1         1: the tokens of a rank's own half of the ranks go\n"
            "                        through its experts as soon as they are in,\n"
            "                        overlapping the other half's messages (default 0:\n"
            "                        every source awaited first)\n"
            "\n"
            "timing:\n"
            "  -w, --warmup_iters N  untimed iterations first (default %d)\n"
            "  -n, --iters N         timed iterations (default %d)\n"
            "\n"
            "mode:\n"
            "  --mode raw            the exchange alone (default)\n"
            "  --mode dispatch       the MoE layer's dispatch + combine path\n"
            "\n"
            "output:\n"
            "  --json                one JSON object per size on stdout instead of the table\n"
            "  -h, --help            this text\n",
            DEFAULT_FACTOR, DEFAULT_ROW_BYTES, DEFAULT_EXPERTS_PER_RANK, DEFAULT_TOP_K,
            DEFAULT_D_FF, DEFAULT_WARMUP, DEFAULT_ITERS);
}

/* "64K", "16M", "1G" or plain bytes, within [1, 2^40]; an error quotes the
 * value as given, with the range in bytes. */
static bool parse_bytes(int64_t *out, const char *flag, const char *text) {
    const int64_t max = INT64_C(1) << 40;
    char *end = NULL;
    errno = 0;
    const long long v = isdigit((unsigned char)text[0]) ? strtoll(text, &end, 10) : 0;
    int64_t scale = 1;
    if (end && end != text) {
        switch (*end) {
        case 'K': case 'k': scale = INT64_C(1) << 10, end++; break;
        case 'M': case 'm': scale = INT64_C(1) << 20, end++; break;
        case 'G': case 'g': scale = INT64_C(1) << 30, end++; break;
        default: break;
        }
    }
    if (!end || *end != '\0' || errno != 0 || v < 1 || v > max / scale) {
        fprintf(stderr, "moe-bench %s: %s=%s: expected 1 to %lld bytes, written as 4096, 64K or 16M\n", CMD,
                flag, text, (long long)max);
        return false;
    }
    *out = (int64_t)v * scale;
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
    if (strlen(text) >= sizeof o->dist_label) {
        fprintf(stderr, "moe-bench %s: --dist=%s: at most %zu characters\n", CMD, text, sizeof o->dist_label - 1);
        return false;
    }
    snprintf(o->dist_label, sizeof o->dist_label, "%s", text);
    return true;
}

/* A flag with a short and a long spelling and a separate value. */
typedef struct a2a_flag {
    const char *short_name, *long_name;
} a2a_flag;

enum {
    F_MIN, F_MAX, F_FACTOR, F_WARMUP, F_ITERS, F_DIST, F_ROW, F_SEED, F_MODE,
    F_EXPERTS, F_TOPK, F_DFF, F_OVERLAP, F_RANK_LIMIT, N_FLAGS
};

static const a2a_flag flags[N_FLAGS] = {
    [F_MIN] = {"-b", "minbytes"},   [F_MAX] = {"-e", "maxbytes"},
    [F_FACTOR] = {"-f", "stepfactor"}, [F_WARMUP] = {"-w", "warmup_iters"},
    [F_ITERS] = {"-n", "iters"},    [F_DIST] = {"-d", "dist"},
    [F_ROW] = {NULL, "row-bytes"},  [F_SEED] = {NULL, "seed"},
    [F_MODE] = {NULL, "mode"},      [F_EXPERTS] = {NULL, "experts"},
    [F_TOPK] = {NULL, "top-k"},     [F_DFF] = {NULL, "d-ff"},
    [F_OVERLAP] = {NULL, "overlap"}, [F_RANK_LIMIT] = {NULL, "rank-limit"},
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
    case F_EXPERTS: return bench_parse_i64(&o->experts, CMD, name, value, 1, MOE_EXPERTS_MAX);
    case F_TOPK: return bench_parse_i64(&o->top_k, CMD, name, value, 1, MOE_EXPERTS_MAX);
    case F_DFF: return bench_parse_i64(&o->d_ff, CMD, name, value, 1, 1 << 20);
    case F_OVERLAP: return bench_parse_i64(&o->overlap, CMD, name, value, 0, 1);
    case F_RANK_LIMIT: return bench_parse_i64(&o->rank_limit, CMD, name, value, 0, MOE_GROUPS_MAX);
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
                       .top_k = DEFAULT_TOP_K,
                       .d_ff = DEFAULT_D_FF,
                       .seed = DEFAULT_SEED,
                       .mode = MODE_RAW};
    parse_dist(o, "uniform");
    bool given[N_FLAGS] = {false};
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
            found = bench_option_or_short(argc, argv, &i, CMD, flags[f].short_name, flags[f].long_name, &value);
            if (found < 0 || (found && !apply_flag(o, f, value))) return bench_usage_error(CMD);
            given[f] = given[f] || found;
        }
        if (!found) return bench_unknown_argument(CMD, arg);
    }
    /* The layer's shape means nothing to a raw exchange: say so rather
     * than run without it. */
    static const int dispatch_only[] = {F_EXPERTS, F_TOPK, F_DFF, F_OVERLAP, F_RANK_LIMIT};
    for (size_t j = 0; o->mode == MODE_RAW && j < sizeof dispatch_only / sizeof dispatch_only[0]; j++)
        if (given[dispatch_only[j]]) {
            fprintf(stderr, "moe-bench %s: --%s applies to --mode dispatch only\n", CMD,
                    flags[dispatch_only[j]].long_name);
            return bench_usage_error(CMD);
        }
    if (o->min_bytes > o->max_bytes) {
        fprintf(stderr, "moe-bench %s: --minbytes=%lld exceeds --maxbytes=%lld\n", CMD,
                (long long)o->min_bytes, (long long)o->max_bytes);
        return bench_usage_error(CMD);
    }
    return -1;
}

#ifdef MOE_HAVE_MPI

/* ------------------------------------------------------------------ shared */

/* The element a rank sends: exact in fp32 (24 bits) and never POISON. */
static float sent_value(uint64_t seed, int src, int dst, int64_t index) {
    uint64_t stream = ((uint64_t)src << 32) | (uint64_t)dst;
    return (float)(moe_rng_bits(seed, stream, (uint64_t)index) >> 40);
}

/* The routing distribution's unnormalised weight of destination rank j. */
static double rank_weight(const a2a_options *o, int j, int P) {
    if (o->dist == DIST_ZIPF) return pow(j + 1.0, -o->dist_param);
    if (o->dist == DIST_HOT) return (1.0 - o->dist_param) / P + (j == 0 ? o->dist_param : 0.0);
    return 1.0 / P;
}

/* units[]: each size from --minbytes to --maxbytes by --stepfactor in whole
 * units of row-bytes * per_row, at least one, skipping a size that gives the
 * units of the one before (both modes step through the sizes alike); at most
 * MAX_SIZES. Returns how many. */
static int size_units(int64_t *units, const a2a_options *o, int64_t per_row) {
    int n = 0;
    for (int64_t size = o->min_bytes; size <= o->max_bytes && n < MAX_SIZES; size *= o->factor) {
        const int64_t u = size / o->row_bytes / per_row > 0 ? size / o->row_bytes / per_row : 1;
        if (n == 0 || units[n - 1] != u) units[n++] = u;
    }
    return n;
}

/* Aborts the job: the other ranks are inside a collective this rank left. */
static _Noreturn void fail_job(moe_comm *comm, const char *what, moe_status st) {
    bench_failed(CMD, what, st);
    moe_comm_abort(comm, BENCH_EXIT_FAILURE);
}

static _Noreturn void fail_memory(moe_comm *comm, const char *what) {
    fprintf(stderr, "moe-bench %s: rank %d: out of memory for %s\n", CMD, moe_comm_rank(comm),
            what);
    moe_comm_abort(comm, BENCH_EXIT_FAILURE);
}

/* One exchange's element counts and displacements [P] each, from the rows
 * sent to and received from each rank, in moe_comm's int64 and MPI's int
 * (the caller has checked that the totals fit int). */
typedef struct a2a_counts {
    int64_t *sc, *sd, *rc, *rd;
    int *isc, *isd, *irc, *ird;
} a2a_counts;

static void set_counts(a2a_counts *c, const int64_t *send_rows, const int64_t *recv_rows, int P,
                       int64_t row_floats) {
    int64_t soff = 0, roff = 0;
    for (int j = 0; j < P; j++) {
        c->sc[j] = send_rows[j] * row_floats;
        c->sd[j] = soff;
        c->rc[j] = recv_rows[j] * row_floats;
        c->rd[j] = roff;
        soff += c->sc[j];
        roff += c->rc[j];
        c->isc[j] = (int)c->sc[j], c->isd[j] = (int)c->sd[j];
        c->irc[j] = (int)c->rc[j], c->ird[j] = (int)c->rd[j];
    }
}

/* Fills send with what this rank sends each rank under counts c. */
static void fill_sent(float *send, const a2a_counts *c, uint64_t seed, int rank, int P) {
    for (int j = 0; j < P; j++)
        for (int64_t i = 0; i < c->sc[j]; i++) send[c->sd[j] + i] = sent_value(seed, rank, j, i);
}

/* want [rows, row_floats]: what a receive of recv_rows[P] rows from each
 * source (source-major) must hold, as fill_sent makes it on the sources.
 * Computed once per size, so checking an exchange costs one pass. */
static void fill_expected(float *want, const int64_t *recv_rows, uint64_t seed, int rank, int P,
                          int64_t row_floats) {
    for (int s = 0; s < P; s++)
        for (int64_t i = 0; i < recv_rows[s] * row_floats; i++)
            *want++ = sent_value(seed, s, rank, i);
}

static void poison(float *buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = POISON;
}

/* Elements of got [n] that differ from want [n]. */
static int64_t count_wrong(const float *got, const float *want, int64_t n) {
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) wrong += got[i] != want[i];
    return wrong;
}

/* One raw MPI_Alltoallv over MPI_COMM_WORLD, started after a barrier, into
 * recv [n_recv] poisoned before and checked against want [n_recv] after,
 * outside the timed region; adds the wrong elements to *wrong. Returns this
 * rank's seconds. */
static double time_mpi(moe_comm *comm, float *recv, const float *want, int64_t n_recv,
                       const int *rc, const int *rd, const float *send, const int *sc,
                       const int *sd, int64_t *wrong) {
    poison(recv, n_recv);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = bench_now_seconds();
    int code = MPI_Alltoallv(send, sc, sd, MPI_FLOAT, recv, rc, rd, MPI_FLOAT, MPI_COMM_WORLD);
    double t1 = bench_now_seconds();
    if (code != MPI_SUCCESS) {
        fprintf(stderr, "moe-bench %s: rank %d: MPI_Alltoallv failed with code %d\n", CMD,
                moe_comm_rank(comm), code);
        moe_comm_abort(comm, BENCH_EXIT_FAILURE);
    }
    *wrong += count_wrong(recv, want, n_recv);
    return t1 - t0;
}

/* Whether every rank's largest exchange fits MPI's int element counts;
 * rank 0 says why not. Collective. */
static bool fits_mpi_int(moe_comm *comm, int64_t max_send_floats, int64_t max_recv_floats) {
    int64_t need[2] = {max_send_floats, max_recv_floats}, worst[2];
    MPI_Allreduce(need, worst, 2, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    if (worst[0] <= INT32_MAX && worst[1] <= INT32_MAX) return true;
    if (moe_comm_rank(comm) == 0)
        fprintf(stderr,
                "moe-bench %s: a rank would move %lld fp32 elements, past MPI's int counts; "
                "lower --maxbytes, or --row-bytes (sizes are whole rows)\n",
                CMD, (long long)(worst[0] > worst[1] ? worst[0] : worst[1]));
    return false;
}

/* Ends a run: frees the communicator and finalises MPI, then reports the
 * wrong elements found over all ranks. */
static int finish(moe_comm *comm, int64_t wrong, int status) {
    int rank = moe_comm_rank(comm);
    moe_comm_free(comm);
    if (bench_failed(CMD, "moe_comm_mpi_finalize", moe_comm_mpi_finalize()))
        return BENCH_EXIT_FAILURE;
    if (status != 0) return status;
    if (wrong > 0) {
        if (rank == 0)
            fprintf(stderr, "moe-bench %s: %lld wrong elements\n", CMD, (long long)wrong);
        return BENCH_EXIT_FAILURE;
    }
    return 0;
}

/* --------------------------------------------------------------- raw mode */

static const bench_column raw_columns[] = {
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
#define N_RAW_COLUMNS ((int)(sizeof raw_columns / sizeof raw_columns[0]))

/* rows[P]: how many of this rank's R rows go to each rank, each row's
 * destination drawn from the distribution. cdf [P] is scratch. */
static void route_rows(int64_t *rows, double *cdf, int64_t R, int P, int rank,
                       const a2a_options *o) {
    double total = 0.0;
    for (int j = 0; j < P; j++) {
        total += rank_weight(o, j, P);
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

/* One size's exchange, in rows. */
typedef struct a2a_plan {
    int64_t R;          /* rows this rank sends */
    int64_t *send_rows; /* [P] */
    int64_t *recv_rows; /* [P] */
    int64_t recv_total; /* rows this rank receives */
} a2a_plan;

typedef struct a2a_run {
    const a2a_options *o;
    moe_comm *comm;
    int rank, P;
    int64_t row_floats;
    float *send, *recv_moe, *recv_mpi; /* [max send rows, rf], [max recv rows, rf] x 2 */
    float *want;                       /* [max recv rows, rf]: what a receive must hold */
    a2a_counts c;
    double *times; /* [2, iters] */
} a2a_run;

/* Times one exchange, started after a barrier, into recv_moe [n_recv]
 * poisoned before and checked after, outside the timed region; adds the
 * wrong elements to *wrong. Returns this rank's seconds. */
static double time_moe(a2a_run *r, int64_t n_recv, int64_t *wrong) {
    poison(r->recv_moe, n_recv);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = bench_now_seconds();
    moe_status st = moe_comm_alltoallv(r->comm, r->recv_moe, r->c.rc, r->c.rd, r->send, r->c.sc,
                                       r->c.sd, MOE_COMM_F32);
    double t1 = bench_now_seconds();
    if (st != MOE_OK) fail_job(r->comm, "moe_comm_alltoallv", st);
    *wrong += count_wrong(r->recv_moe, r->want, n_recv);
    return t1 - t0;
}

static double time_raw(a2a_run *r, int64_t n_recv, int64_t *wrong) {
    return time_mpi(r->comm, r->recv_mpi, r->want, n_recv, r->c.irc, r->c.ird, r->send, r->c.isc,
                    r->c.isd, wrong);
}

/* Runs one size; returns the wrong elements over all ranks (both paths). */
static int64_t run_size(a2a_run *r, const a2a_plan *plan, const bench_table *table) {
    const a2a_options *o = r->o;
    const int P = r->P, iters = (int)o->iters;
    const int64_t rf = r->row_floats;
    set_counts(&r->c, plan->send_rows, plan->recv_rows, P, rf);
    fill_sent(r->send, &r->c, o->seed, r->rank, P);
    fill_expected(r->want, plan->recv_rows, o->seed, r->rank, P, rf);
    const int64_t n_recv = plan->recv_total * rf;

    int64_t local[2] = {0, 0}; /* wrong elements of every exchange: moe, mpi */
    for (int it = 0; it < (int)o->warmup; it++) {
        time_moe(r, n_recv, &local[0]);
        time_raw(r, n_recv, &local[1]);
    }
    /* Alternating which goes first cancels any advantage of the order. */
    for (int it = 0; it < iters; it++) {
        if (it % 2 == 0) {
            r->times[it] = time_moe(r, n_recv, &local[0]);
            r->times[iters + it] = time_raw(r, n_recv, &local[1]);
        } else {
            r->times[iters + it] = time_raw(r, n_recv, &local[1]);
            r->times[it] = time_moe(r, n_recv, &local[0]);
        }
    }

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
        bench_value v[N_RAW_COLUMNS] = {
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

/* Room for counts and displacements of one exchange: [4P] int64 and int. */
static void alloc_counts(a2a_counts *c, moe_comm *comm, int P) {
    int64_t *counts = malloc((size_t)P * 4 * sizeof *counts);
    int *icounts = malloc((size_t)P * 4 * sizeof *icounts);
    if (!counts || !icounts) fail_memory(comm, "the exchange counts");
    *c = (a2a_counts){.sc = counts, .sd = counts + P, .rc = counts + 2 * P, .rd = counts + 3 * P,
                      .isc = icounts, .isd = icounts + P, .irc = icounts + 2 * P,
                      .ird = icounts + 3 * P};
}

static void free_counts(a2a_counts *c) {
    free(c->sc);
    free(c->isc);
}

static int run_raw(const a2a_options *o, moe_comm *comm) {
    a2a_run r = {.o = o, .comm = comm, .row_floats = o->row_bytes / 4};
    r.rank = moe_comm_rank(comm);
    r.P = moe_comm_size(comm);
    const int P = r.P;

    /* Every size's routing first, so the buffers are sized once. */
    a2a_plan plans[MAX_SIZES];
    int64_t Rs[MAX_SIZES];
    const int n_sizes = size_units(Rs, o, 1);
    int64_t max_send = 0, max_recv = 0;
    int64_t *rows = calloc((size_t)MAX_SIZES * 2 * (size_t)P, sizeof *rows);
    double *cdf = malloc((size_t)P * sizeof *cdf);
    if (!rows || !cdf) fail_memory(comm, "the routing tables");
    for (int s = 0; s < n_sizes; s++) {
        const int64_t R = Rs[s];
        a2a_plan *p = &plans[s];
        *p = (a2a_plan){.R = R, .send_rows = rows + (size_t)s * 2 * P};
        p->recv_rows = p->send_rows + P;
        route_rows(p->send_rows, cdf, R, P, r.rank, o);
        moe_status st = moe_comm_alltoall(comm, p->recv_rows, p->send_rows, 1, MOE_COMM_I64);
        if (st != MOE_OK) fail_job(comm, "exchanging row counts", st);
        for (int j = 0; j < P; j++) p->recv_total += p->recv_rows[j];
        max_send = R > max_send ? R : max_send;
        max_recv = p->recv_total > max_recv ? p->recv_total : max_recv;
    }
    free(cdf);
    if (!fits_mpi_int(comm, max_send * r.row_floats, max_recv * r.row_floats)) {
        free(rows);
        return finish(comm, 0, BENCH_EXIT_USAGE);
    }

    bench_buffer bufs[] = {
        {&r.send, (size_t)(max_send * r.row_floats)},
        {&r.recv_moe, (size_t)(max_recv * r.row_floats)},
        {&r.recv_mpi, (size_t)(max_recv * r.row_floats)},
        {&r.want, (size_t)(max_recv * r.row_floats)},
    };
    void *arena = bench_alloc_buffers(bufs, (int)(sizeof bufs / sizeof bufs[0]));
    r.times = malloc((size_t)o->iters * 2 * sizeof *r.times);
    if (!arena || !r.times) fail_memory(comm, "the send and receive buffers");
    alloc_counts(&r.c, comm, P);

    const bench_table table = {
        .bench = CMD, .cols = raw_columns, .n_cols = N_RAW_COLUMNS, .json = o->json};
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

    free_counts(&r.c);
    free(r.times);
    bench_free(arena);
    free(rows);
    return finish(comm, wrong, 0);
}

/* ---------------------------------------------------------- dispatch mode */

/* A forward + backward moves rows four times: rows out, outputs back,
 * output gradients out, input gradients back. */
#define EXCHANGES_PER_STEP 4
/* Hugging Face Mixtral's initializer_range. */
#define INIT_STD 0.02f
/* Stands in for log 0 (log 1e-30): a rank of weight 0 is never chosen while
 * any other expert is left, and the inputs stay finite. */
#define LOG_WEIGHT_FLOOR (-69.0)
/* Output check: |got - want| <= CHECK_REL * (max|want| + |want|), room for
 * the summation order of GEMMs over different row counts. */
#define CHECK_REL 1e-5
/* Sets of tokens the steps alternate between: they route alike and carry
 * different values, so a step whose exchange left the rows of the step
 * before in place gives the other set's outputs. */
#define VARIANTS 2

/* Per-step series: those before S_FAST are the slowest rank's (MAX over
 * ranks), S_FAST the exchange time of the rank that waited least (MIN). */
enum { S_EXCHANGE, S_EXPERTS, S_STEP, S_MPI, S_COPY, S_FAST, N_SERIES };

static const bench_column dispatch_columns[] = {
    {"size_bytes", "size(B)", BENCH_INT, 11, 0},
    {"tokens", "tokens", BENCH_INT, 7, 0},
    {"rows", NULL, BENCH_INT, 0, 0},
    {"time_us", "time(us)", BENCH_F64, 10, 1},
    {"algbw_gbps", "algbw", BENCH_F64, 7, 2},
    {"busbw_gbps", "busbw", BENCH_F64, 7, 2},
    {"xbw_gbps", "xbw", BENCH_F64, 7, 2},
    {"wrong", "#wrong", BENCH_INT, 6, 0},
    {"mpi_time_us", "mpi(us)", BENCH_F64, 10, 1},
    {"mpi_algbw_gbps", "algbw", BENCH_F64, 7, 2},
    {"mpi_busbw_gbps", "busbw", BENCH_F64, 7, 2},
    {"mpi_wrong", "#wrong", BENCH_INT, 6, 0},
    {"ratio", "ratio", BENCH_F64, 6, 3},
    {"recv_imbalance", "recv_imb", BENCH_F64, 8, 2},
    {"fast_time_us", "fast(us)", BENCH_F64, 10, 1},
    {"copy_us", "copy(us)", BENCH_F64, 10, 1},
    {"exchange_pct", "exch%", BENCH_F64, 6, 1},
    {"experts_us", "experts(us)", BENCH_F64, 11, 1},
    {"step_us", NULL, BENCH_F64, 0, 0},
    {"exchange_bytes", NULL, BENCH_INT, 0, 0},
    {"ranks", NULL, BENCH_INT, 0, 0},
    {"dist", NULL, BENCH_STR, 0, 0},
    {"row_bytes", NULL, BENCH_INT, 0, 0},
    {"experts", NULL, BENCH_INT, 0, 0},
    {"top_k", NULL, BENCH_INT, 0, 0},
    {"d_ff", NULL, BENCH_INT, 0, 0},
    {"overlap", NULL, BENCH_INT, 0, 0},
    {"rank_limit", NULL, BENCH_INT, 0, 0},
    {"iters", NULL, BENCH_INT, 0, 0},
    {"mode", NULL, BENCH_STR, 0, 0},
};
#define N_DISPATCH_COLUMNS ((int)(sizeof dispatch_columns / sizeof dispatch_columns[0]))

typedef struct dispatch_run {
    const a2a_options *o;
    moe_comm *comm;
    int rank, P;
    int64_t d, E, k, n_local;       /* d = d_model; n_local = E / P */
    moe_layer *layer;               /* expert-parallel over all ranks */
    moe_layer *ref;                 /* one rank, all E experts, the same parameters */
    float *x[VARIANTS], *dy[VARIANTS];         /* [max_T, d] this rank's tokens, output gradient */
    float *y, *dx;                             /* [max_T, d] the layer's */
    float *y_ref[VARIANTS], *dx_ref[VARIANTS]; /* [max_T, d] the one-rank layer's */
    float *send, *recv, *back;      /* baseline: [max_T k, d], [P max_T k, d], [max_T k, d] */
    float *want;                    /* [P max_T k, d] what recv must hold */
    float *copy;                    /* [max_T k, d] where the memcpy baseline writes */
    int64_t *send_rows, *recv_rows; /* [P] a dispatch's rows to and from each rank */
    a2a_counts c;                   /* a dispatch's; a return swaps send and receive */
    double *times;                  /* [N_SERIES, iters] */
} dispatch_run;

/* gate.weight [E, d] = [I_E | 0]: the router's logits are the first E input
 * columns. */
static void steer_router(moe_layer *layer, moe_comm *comm) {
    moe_tensor_view gate;
    moe_status st = moe_layer_tensor_by_name(layer, "gate.weight", &gate);
    if (st != MOE_OK) fail_job(comm, "gate.weight", st);
    memset(gate.param, 0, (size_t)(gate.rows * gate.cols) * sizeof(float));
    for (int64_t e = 0; e < gate.rows; e++) gate.param[e * gate.cols + e] = 1.0f;
}

/* x[v] [max_T, d]: columns 0 .. E-1 hold log p_e + Gumbel noise, so the k
 * largest logits are a draw of k experts without replacement with
 * probabilities p (the Gumbel top-k trick); p_e is the distribution's
 * weight of the expert's rank spread evenly over its experts. These are
 * the same in every variant v, so every variant routes alike. The other
 * columns, and dy[v], are uniform in [-1, 1], drawn anew for each variant.
 * Every size uses the first T tokens. */
static void fill_tokens(dispatch_run *r, int64_t max_T) {
    const int64_t d = r->d, E = r->E;
    double log_p[MOE_EXPERTS_MAX];
    for (int64_t e = 0; e < E; e++) {
        double p = rank_weight(r->o, (int)(e / r->n_local), r->P) / (double)r->n_local;
        log_p[e] = p > 0.0 ? fmax(log(p), LOG_WEIGHT_FLOOR) : LOG_WEIGHT_FLOOR;
    }
    for (int v = 0; v < VARIANTS; v++) {
        bench_rng route = {.state = r->o->seed ^ (0x726f757465ull * (uint64_t)(r->rank + 1))};
        bench_rng values = {.state = r->o->seed ^
                                     (0x76616c756573ull * (uint64_t)(VARIANTS * r->rank + v + 1))};
        for (int64_t t = 0; t < max_T; t++)
            for (int64_t i = 0; i < d; i++)
                r->x[v][t * d + i] =
                    (float)(i < E ? log_p[i] - log(-log(bench_rng_uniform(&route)))
                                  : 2.0 * bench_rng_uniform(&values) - 1.0);
        bench_fill_uniform(r->dy[v], (size_t)(max_T * d), 1.0f, &values);
    }
}

/* Elements of got [T, d] outside the tolerance around want [T, d]; with
 * report, prints the worst one when there are any. */
static int64_t check_tensor(const dispatch_run *r, const char *name, const float *got,
                            const float *want, int64_t T, bool report) {
    const int64_t n = T * r->d;
    double scale = 0.0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    int64_t wrong = 0, worst = 0;
    double worst_excess = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]), tol = CHECK_REL * (scale + fabs(want[i]));
        if (err <= tol) continue;
        double excess = isnan(err) ? INFINITY : err - tol;
        if (wrong++ == 0 || excess > worst_excess) worst = i, worst_excess = excess;
    }
    if (wrong > 0 && report)
        fprintf(stderr,
                "moe-bench %s: rank %d, T=%lld: %lld of %lld elements of %s differ from the "
                "one-rank layer; worst %s[%lld, %lld] = %.9g, want %.9g (tolerance %.3g)\n",
                CMD, r->rank, (long long)T, (long long)wrong, (long long)n, name, name,
                (long long)(worst / r->d), (long long)(worst % r->d), got[worst], want[worst],
                CHECK_REL * (scale + fabs(want[worst])));
    return wrong;
}

/* One forward + backward of the expert-parallel layer on T tokens of
 * variant v, started after a barrier: the layer's phase timers and this
 * rank's seconds. y and dx are poisoned before and checked against the
 * one-rank layer after, outside the timed region; the wrong elements add
 * to *wrong, and the first step of a size that has any prints the worst. */
static void layer_step(dispatch_run *r, int64_t T, int v, moe_layer_timing *timing,
                       double *seconds, int64_t *wrong) {
    poison(r->y, T * r->d);
    poison(r->dx, T * r->d);
    MPI_Barrier(MPI_COMM_WORLD);
    moe_layer_reset_timing(r->layer);
    double t0 = bench_now_seconds();
    moe_status st = moe_layer_forward(r->layer, r->y, r->x[v], T, NULL);
    if (st != MOE_OK) fail_job(r->comm, "moe_layer_forward", st);
    st = moe_layer_backward(r->layer, r->dx, r->dy[v], r->x[v]);
    if (st != MOE_OK) fail_job(r->comm, "moe_layer_backward", st);
    *seconds = bench_now_seconds() - t0;
    moe_layer_get_timing(r->layer, timing);
    const bool report = *wrong == 0;
    *wrong += check_tensor(r, "y", r->y, r->y_ref[v], T, report) +
              check_tensor(r, "dx", r->dx, r->dx_ref[v], T, report);
}

/* The baseline of one step: its four exchanges as raw MPI_Alltoallv's of
 * the same per-peer counts, each after a barrier, the returns sending back
 * what arrived; recv [n_recv] and back [n_back] are checked after each
 * (time_mpi), the wrong elements adding to *wrong. */
static double raw_step(dispatch_run *r, int64_t n_recv, int64_t n_back, int64_t *wrong) {
    const a2a_counts *c = &r->c;
    double seconds = 0.0;
    for (int pass = 0; pass < EXCHANGES_PER_STEP / 2; pass++) {
        seconds += time_mpi(r->comm, r->recv, r->want, n_recv, c->irc, c->ird, r->send, c->isc,
                            c->isd, wrong);
        seconds += time_mpi(r->comm, r->back, r->send, n_back, c->isc, c->isd, r->recv, c->irc,
                            c->ird, wrong);
    }
    return seconds;
}

/* The unit of the memory-bound passes the layer makes and the raw exchange
 * does not (permute, combine): one memcpy of the rows a dispatch
 * sends, on every rank at once after a barrier. Returns this rank's
 * seconds. */
static double time_copy(dispatch_run *r, int64_t R) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = bench_now_seconds();
    memcpy(r->copy, r->send, (size_t)(R * r->d) * sizeof(float));
    return bench_now_seconds() - t0;
}

/* The rows the last forward sent each rank, from the router's choices
 * (dropless: every token travels; rank r holds experts r E/P .. (r+1) E/P
 * - 1): a token once per rank holding any of its experts; and the rows
 * every rank sent here. */
static void learn_routing(dispatch_run *r, int64_t T) {
    const int32_t *topk; /* [T, k] */
    moe_status st = moe_layer_last_topk(r->layer, &topk);
    if (st != MOE_OK) fail_job(r->comm, "reading the router choices", st);
    for (int j = 0; j < r->P; j++) r->send_rows[j] = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < r->k; i++) {
            const int j = topk[t * r->k + i] / (int)r->n_local;
            bool again = false; /* the token's row already goes to rank j */
            for (int64_t i2 = 0; i2 < i; i2++) again |= topk[t * r->k + i2] / r->n_local == j;
            if (!again) r->send_rows[j]++;
        }
    st = moe_comm_alltoall(r->comm, r->recv_rows, r->send_rows, 1, MOE_COMM_I64);
    if (st != MOE_OK) fail_job(r->comm, "exchanging row counts", st);
}

/* Runs one size of T tokens per rank; returns the failures over all ranks:
 * wrong elements, and steps whose exchange_bytes disagree with the routing. */
static int64_t dispatch_size(dispatch_run *r, int64_t T, const bench_table *table) {
    const a2a_options *o = r->o;
    const int P = r->P, iters = (int)o->iters;
    const int64_t d = r->d, R = T * r->k;
    moe_layer_timing tm;
    double step;

    /* The one-rank layer's y and dx on each variant's tokens: dropless
     * routing without balancing losses makes each token's y and dx depend
     * on that token alone. */
    for (int v = 0; v < VARIANTS; v++) {
        moe_status st = moe_layer_forward(r->ref, r->y_ref[v], r->x[v], T, NULL);
        if (st != MOE_OK) fail_job(r->comm, "moe_layer_forward (one-rank reference)", st);
        st = moe_layer_backward(r->ref, r->dx_ref[v], r->dy[v], r->x[v]);
        if (st != MOE_OK) fail_job(r->comm, "moe_layer_backward (one-rank reference)", st);
    }
    int64_t wrong = 0, mpi_wrong = 0; /* this rank's, over every step */
    int steps = 0;                    /* the layer's, choosing the variant */

    /* An untimed step sizes the layer's buffers and shows the routing. */
    layer_step(r, T, steps++ % VARIANTS, &tm, &step, &wrong);
    learn_routing(r, T);
    set_counts(&r->c, r->send_rows, r->recv_rows, P, d);
    fill_sent(r->send, &r->c, o->seed, r->rank, P);
    fill_expected(r->want, r->recv_rows, o->seed, r->rank, P, d);
    int64_t recv_total = 0, off_rank_rows = 0;
    for (int j = 0; j < P; j++) {
        recv_total += r->recv_rows[j];
        if (j != r->rank) off_rank_rows += r->send_rows[j] + r->recv_rows[j];
    }
    int64_t sent_total = 0;
    for (int j = 0; j < P; j++) sent_total += r->send_rows[j];
    const int64_t n_recv = recv_total * d, n_back = sent_total * d;
    /* A step sends every row twice in each direction it travels; a token
     * also takes its k gate weights and k slot codes out, and brings its k
     * weight gradients back. */
    int64_t step_bytes = 2 * off_rank_rows * d * (int64_t)sizeof(float);
    for (int j = 0; j < P; j++)
        if (j != r->rank) step_bytes += (2 * r->send_rows[j] + r->recv_rows[j]) * r->k * (int64_t)sizeof(float);

    int64_t bad_steps = 0;
    for (int it = 0; it < (int)o->warmup; it++) {
        layer_step(r, T, steps++ % VARIANTS, &tm, &step, &wrong);
        raw_step(r, n_recv, n_back, &mpi_wrong);
        time_copy(r, R);
    }
    for (int it = 0; it < iters; it++) {
        double raw, copy;
        /* Alternating which goes first cancels any advantage of the order. */
        if (it % 2 == 0) {
            layer_step(r, T, steps++ % VARIANTS, &tm, &step, &wrong);
            raw = raw_step(r, n_recv, n_back, &mpi_wrong);
            copy = time_copy(r, R);
        } else {
            copy = time_copy(r, R);
            raw = raw_step(r, n_recv, n_back, &mpi_wrong);
            layer_step(r, T, steps++ % VARIANTS, &tm, &step, &wrong);
        }
        r->times[S_EXCHANGE * iters + it] = tm.exchange_seconds;
        r->times[S_EXPERTS * iters + it] = tm.experts_seconds;
        r->times[S_STEP * iters + it] = step;
        r->times[S_MPI * iters + it] = raw;
        r->times[S_COPY * iters + it] = copy;
        r->times[S_FAST * iters + it] = tm.exchange_seconds;
        if (tm.exchange_bytes != step_bytes || tm.calls != 2) {
            if (bad_steps++ == 0)
                fprintf(stderr,
                        "moe-bench %s: rank %d, T=%lld: the layer counted %lld exchange bytes "
                        "in %lld calls of a step; the routing gives %lld in 2\n",
                        CMD, r->rank, (long long)T, (long long)tm.exchange_bytes,
                        (long long)tm.calls, (long long)step_bytes);
        }
    }

    int64_t local[4] = {wrong, mpi_wrong, bad_steps, step_bytes};
    int64_t sums[4], max_recv = 0;
    MPI_Allreduce(local, sums, 4, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&recv_total, &max_recv, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    /* A step ends when its slowest rank does. */
    MPI_Allreduce(MPI_IN_PLACE, r->times, S_FAST * iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, r->times + S_FAST * iters, (N_SERIES - S_FAST) * iters, MPI_DOUBLE,
                  MPI_MIN, MPI_COMM_WORLD);

    if (r->rank == 0) {
        double med[N_SERIES];
        for (int s = 0; s < N_SERIES; s++) med[s] = bench_median(r->times + s * iters, iters);
        const double bytes = (double)(R * o->row_bytes);
        const double t = med[S_EXCHANGE] / EXCHANGES_PER_STEP;
        const double t_mpi = med[S_MPI] / EXCHANGES_PER_STEP;
        const double bus = P > 1 ? (double)(P - 1) / P : 0.0;
        const double algbw = bytes / t * 1e-9, mpi_algbw = bytes / t_mpi * 1e-9;
        const int64_t mean_step_bytes = sums[3] / P;
        bench_value v[N_DISPATCH_COLUMNS] = {
            {.i = R * o->row_bytes},
            {.i = T},
            {.i = R},
            {.f = t * 1e6},
            {.f = algbw},
            {.f = algbw * bus},
            {.f = (double)mean_step_bytes / med[S_EXCHANGE] * 1e-9},
            {.i = sums[0]},
            {.f = t_mpi * 1e6},
            {.f = mpi_algbw},
            {.f = mpi_algbw * bus},
            {.i = sums[1]},
            {.f = algbw / mpi_algbw},
            {.f = (double)max_recv / (double)R},
            {.f = med[S_FAST] / EXCHANGES_PER_STEP * 1e6},
            {.f = med[S_COPY] * 1e6},
            {.f = 100.0 * med[S_EXCHANGE] / med[S_STEP]},
            {.f = med[S_EXPERTS] * 1e6},
            {.f = med[S_STEP] * 1e6},
            {.i = mean_step_bytes},
            {.i = P},
            {.s = o->dist_label},
            {.i = o->row_bytes},
            {.i = r->E},
            {.i = r->k},
            {.i = o->d_ff},
            {.i = o->overlap},
            {.i = o->rank_limit},
            {.i = o->iters},
            {.s = "dispatch"},
        };
        bench_table_row(table, v);
    }
    return sums[0] + sums[1] + sums[2];
}

/* Rank 0 says what is wrong with the layer's shape for P ranks; false then. */
static bool check_shape(const a2a_options *o, int rank, int P, int64_t d, int64_t E) {
    char why[128] = "";
    if (E % P != 0)
        snprintf(why, sizeof why, "is not a multiple of the %d ranks", P);
    else if (E > d)
        snprintf(why, sizeof why,
                 "exceeds d_model=%lld (row-bytes / 4): the router is steered through E input "
                 "columns",
                 (long long)d);
    else if (o->top_k > E)
        snprintf(why, sizeof why, "is fewer than --top-k=%lld", (long long)o->top_k);
    else if (o->rank_limit > P)
        snprintf(why, sizeof why, "on %d ranks: --rank-limit=%lld exceeds them", P, (long long)o->rank_limit);
    else if (o->rank_limit > 0 && P > MOE_GROUPS_MAX)
        snprintf(why, sizeof why, "on %d ranks: --rank-limit takes at most %d (a routing group per rank)", P,
                 MOE_GROUPS_MAX);
    else if (o->rank_limit > 0 && o->top_k > o->rank_limit * (E / P))
        snprintf(why, sizeof why, "on --rank-limit=%lld ranks of %lld experts cannot hold --top-k=%lld",
                 (long long)o->rank_limit, (long long)(E / P), (long long)o->top_k);
    if (why[0] && rank == 0)
        fprintf(stderr, "moe-bench %s: --mode dispatch: E=%lld experts %s\n", CMD, (long long)E,
                why);
    return why[0] == '\0';
}

static int run_dispatch(const a2a_options *o, moe_comm *comm) {
    dispatch_run r = {.o = o, .comm = comm, .d = o->row_bytes / 4, .k = o->top_k};
    r.rank = moe_comm_rank(comm);
    r.P = moe_comm_size(comm);
    const int P = r.P;
    r.E = o->experts > 0 ? o->experts : DEFAULT_EXPERTS_PER_RANK * (int64_t)P;
    if (!check_shape(o, r.rank, P, r.d, r.E)) return finish(comm, 0, BENCH_EXIT_USAGE);
    r.n_local = r.E / P;

    /* T per size: one dispatch sends T*k rows of row-bytes. */
    int64_t Ts[MAX_SIZES];
    const int n_sizes = size_units(Ts, o, r.k);
    const int64_t max_T = Ts[n_sizes - 1], max_R = max_T * r.k;
    /* A rank may receive every rank's rows. */
    if (!fits_mpi_int(comm, max_R * r.d, P * max_R * r.d)) return finish(comm, 0, BENCH_EXIT_USAGE);

    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = r.d;
    cfg.d_ff = o->d_ff;
    cfg.n_experts = r.E;
    cfg.top_k = r.k;
    if (o->rank_limit > 0) cfg.n_groups = P, cfg.top_groups = o->rank_limit;
    cfg.seed = o->seed;
    const int64_t n_params = moe_layer_config_param_count(&cfg, P);
    float *params = calloc((size_t)n_params, sizeof(float));
    float *grads = calloc((size_t)n_params, sizeof(float));
    if (!params || !grads) fail_memory(comm, "the layer's parameters");
    /* Router first, then this rank's experts; no shared experts. */
    const moe_layer_memory mem = {.router = params, .router_grad = grads,
                                  .experts = params + r.E * r.d, .experts_grad = grads + r.E * r.d};
    moe_status st = moe_layer_create_in(&r.layer, &cfg, &mem, comm, NULL);
    if (st != MOE_OK) fail_job(comm, "moe_layer_create_in", st);
    moe_layer_set_overlap(r.layer, o->overlap != 0);
    st = moe_layer_create(&r.ref, &cfg);
    if (st != MOE_OK) fail_job(comm, "moe_layer_create (one-rank reference)", st);
    /* Both draw every parameter by its index in the whole layer: the same
     * experts on either side. */
    st = moe_layer_init_params(r.layer, INIT_STD, o->seed, 0);
    if (st != MOE_OK) fail_job(comm, "moe_layer_init_params", st);
    st = moe_layer_init_params(r.ref, INIT_STD, o->seed, 0);
    if (st != MOE_OK) fail_job(comm, "moe_layer_init_params (one-rank reference)", st);
    steer_router(r.layer, comm);
    steer_router(r.ref, comm);

    bench_buffer bufs[] = {
        {&r.x[0], (size_t)(max_T * r.d)},     {&r.dy[0], (size_t)(max_T * r.d)},
        {&r.x[1], (size_t)(max_T * r.d)},     {&r.dy[1], (size_t)(max_T * r.d)},
        {&r.y_ref[0], (size_t)(max_T * r.d)}, {&r.dx_ref[0], (size_t)(max_T * r.d)},
        {&r.y_ref[1], (size_t)(max_T * r.d)}, {&r.dx_ref[1], (size_t)(max_T * r.d)},
        {&r.y, (size_t)(max_T * r.d)},        {&r.dx, (size_t)(max_T * r.d)},
        {&r.send, (size_t)(max_R * r.d)},     {&r.recv, (size_t)(P * max_R * r.d)},
        {&r.want, (size_t)(P * max_R * r.d)}, {&r.back, (size_t)(max_R * r.d)},
        {&r.copy, (size_t)(max_R * r.d)},
    };
    _Static_assert(VARIANTS == 2, "bufs holds two variants of the tokens");
    void *arena = bench_alloc_buffers(bufs, (int)(sizeof bufs / sizeof bufs[0]));
    r.send_rows = calloc(2 * (size_t)P, sizeof *r.send_rows);
    r.times = malloc((size_t)o->iters * N_SERIES * sizeof *r.times);
    if (!arena || !r.send_rows || !r.times) fail_memory(comm, "the tokens and exchange buffers");
    r.recv_rows = r.send_rows + P;
    alloc_counts(&r.c, comm, P);
    fill_tokens(&r, max_T);

    const bench_table table = {.bench = CMD, .cols = dispatch_columns,
                               .n_cols = N_DISPATCH_COLUMNS, .json = o->json};
    if (r.rank == 0) {
        char limit[48] = "";
        if (o->rank_limit > 0) snprintf(limit, sizeof limit, " on at most %lld ranks", (long long)o->rank_limit);
        bench_table_note(&table,
                         "moe-bench a2a --mode dispatch, libmoe %s: %d ranks, dist %s, d_model "
                         "%lld (rows of %lld B), %lld experts (%lld per rank), top-%lld%s, d_ff "
                         "%lld, dropless, seed %llu, %lld warmup + %lld timed steps",
                         moe_version_string(), P, o->dist_label, (long long)r.d,
                         (long long)o->row_bytes, (long long)r.E, (long long)r.n_local,
                         (long long)r.k, limit, (long long)o->d_ff, (unsigned long long)o->seed,
                         (long long)o->warmup, (long long)o->iters);
        bench_table_note(&table,
                         "left: the layer's dispatch + combine path (permute, a message per rank with "
                         "each token once, and back), a forward + backward's exchange time / %d; right: "
                         "the same %d exchanges as raw MPI_Alltoallv, / %d",
                         EXCHANGES_PER_STEP, EXCHANGES_PER_STEP, EXCHANGES_PER_STEP);
        bench_table_note(&table,
                         "median of the slowest rank; GB/s; xbw: bytes sent to other ranks / "
                         "exchange time; exch%%, experts(us), step(us): of a forward + backward");
        bench_table_header(&table);
    }
    int64_t wrong = 0;
    for (int s = 0; s < n_sizes; s++) wrong += dispatch_size(&r, Ts[s], &table);

    free_counts(&r.c);
    free(r.times);
    free(r.send_rows);
    bench_free(arena);
    moe_layer_destroy(r.ref);
    moe_layer_destroy(r.layer);
    free(params);
    free(grads);
    return finish(comm, wrong, 0);
}

#endif /* MOE_HAVE_MPI */

#ifdef MOE_HAVE_MPI
static const char *dist_name(int d) { return d == DIST_UNIFORM ? "uniform" : d == DIST_ZIPF ? "zipf" : "hot"; }
static const char *mode_name(int m) { return m == MODE_RAW ? "raw" : "dispatch"; }

/* Ranks given other flags would wait in different collectives (a hang, or
 * MPI's truncation abort): every rank compares them first. */
static moe_status agree_options(moe_comm *comm, const a2a_options *o) {
    const moe_agree_field fields[] = {
        {"--minbytes", (double)o->min_bytes, NULL},  {"--maxbytes", (double)o->max_bytes, NULL},
        {"--stepfactor", (double)o->factor, NULL},   {"--warmup_iters", (double)o->warmup, NULL},
        {"--iters", (double)o->iters, NULL},         {"--row-bytes", (double)o->row_bytes, NULL},
        {"--experts", (double)o->experts, NULL},     {"--top-k", (double)o->top_k, NULL},
        {"--d-ff", (double)o->d_ff, NULL},           {"--overlap", (double)o->overlap, NULL},
        {"--rank-limit", (double)o->rank_limit, NULL},
        {"--seed (high 32 bits)", (double)(o->seed >> 32), NULL},
        {"--seed (low 32 bits)", (double)(o->seed & 0xFFFFFFFFu), NULL},
        {"--dist", (double)o->dist, dist_name},      {"--dist (parameter)", o->dist_param, NULL},
        {"--mode", (double)o->mode, mode_name},
    };
    return moe_grid_agree(comm, fields, (int)(sizeof fields / sizeof *fields));
}
#endif

int bench_a2a_run(int argc, char **argv) {
    a2a_options o;
    int rc = parse_options(&o, argc, argv);
    if (rc >= 0) return rc;
#ifdef MOE_HAVE_MPI
    moe_comm *comm = NULL;
    if (bench_failed(CMD, "moe_comm_mpi_create", moe_comm_mpi_create(&comm)))
        return BENCH_EXIT_FAILURE;
    if (bench_failed(CMD, "the ranks' flags", agree_options(comm, &o))) return BENCH_EXIT_FAILURE;
    return o.mode == MODE_DISPATCH ? run_dispatch(&o, comm) : run_raw(&o, comm);
#else
    fprintf(stderr, "moe-bench %s: %s\n", CMD, BENCH_NO_MPI);
    return BENCH_EXIT_FAILURE;
#endif
}
