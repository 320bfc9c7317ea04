/* test_comm_mpi.c: the mpi communicator on several ranks (run under mpirun
 * -np 2 and -np 4). A plain program, not Criterion: Criterion forks, which
 * MPI does not survive. Every value sent is computed from (seed, source
 * rank, destination rank, index), as nccl-tests does, so each receiver
 * knows what it must get without asking anyone. Each check prints one
 * PASS/FAIL line on rank 0 (after agreeing over MPI_COMM_WORLD, outside the
 * code under test), failing ranks print what they saw, and the program ends
 * with "N passed, M failed" and a non-zero exit on any failure. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */

#include <limits.h>
#include <string.h>
#include <time.h>

#include "mpi_check.h"

#define SEED 0x636f6d6dull
/* Counts large enough that MPI switches from eager to rendezvous messages. */
#define LARGE_COUNT 70000
#define SENTINEL (-7)
#define MAX_REPORTS 4 /* detail lines per rank per check */
#define TIMEOUT_SECONDS 1.0
#define RECV_TIMEOUT_SECONDS 1.0
/* The roll call after a collective timeout of TIMEOUT_SECONDS: the
 * library's floor, 0.5 s, above a tenth of the timeout. */
#define ROLL_CALL_SECONDS 0.5
/* How much later than the others a slow rank joins: within the roll call. */
#define LATE_SECONDS 0.2
#define ABSENT_COUNT 8 /* elements of the all-reduce the absent ranks skip */

static int check_failures; /* on this rank, in the running check */

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        if (check_failures++ < MAX_REPORTS) {                                                      \
            printf("  rank %d: ", rank);                                                           \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
            fflush(stdout);                                                                        \
        }                                                                                          \
    } while (0)

#define EXPECT(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) FAIL(__VA_ARGS__);                                                            \
    } while (0)

/* Records a failed call and evaluates to whether it succeeded. */
#define OK(call) ok_((call), #call)
static int ok_(moe_status st, const char *what) {
    if (st == MOE_OK) return 1;
    FAIL("%s: %s: %s", what, moe_status_string(st), moe_last_error());
    return 0;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A value in [0, 2^21): exact in every dtype but bytes, and sums over up to
 * eight ranks stay below 2^24, exact in f32. */
static int64_t value(int src, int dst, int64_t i) {
    return (int64_t)(moe_rng_bits(SEED, (uint64_t)src * 4096u + (uint64_t)dst, (uint64_t)i) >> 43);
}

static void store(void *buf, moe_comm_dtype t, int64_t i, int64_t v) {
    switch (t) {
    case MOE_COMM_F32: ((float *)buf)[i] = (float)v; break;
    case MOE_COMM_F64: ((double *)buf)[i] = (double)v; break;
    case MOE_COMM_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case MOE_COMM_I64: ((int64_t *)buf)[i] = v; break;
    default: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    }
}

static int64_t load(const void *buf, moe_comm_dtype t, int64_t i) {
    switch (t) {
    case MOE_COMM_F32: return (int64_t)((const float *)buf)[i];
    case MOE_COMM_F64: return (int64_t)((const double *)buf)[i];
    case MOE_COMM_I32: return ((const int32_t *)buf)[i];
    case MOE_COMM_I64: return ((const int64_t *)buf)[i];
    default: return ((const uint8_t *)buf)[i];
    }
}

/* What a value becomes after a round trip through dtype t. */
static int64_t as_dtype(moe_comm_dtype t, int64_t v) { return t == MOE_COMM_BYTES ? (uint8_t)v : v; }

static void *alloc(int64_t count, moe_comm_dtype t) {
    void *p = malloc((size_t)(count > 0 ? count : 1) * (size_t)moe_comm_dtype_size(t));
    if (!p) {
        fprintf(stderr, "rank %d: out of memory for %lld elements\n", rank, (long long)count);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return p;
}

static void fill(void *buf, moe_comm_dtype t, int64_t n, int64_t v) {
    for (int64_t i = 0; i < n; i++) store(buf, t, i, v);
}

/* ------------------------------------------------------------------ checks */

static void check_world(void) {
    int r = -1, n = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    EXPECT(moe_comm_rank(world) == r && moe_comm_size(world) == n,
           "rank/size %d/%d, MPI_COMM_WORLD says %d/%d", moe_comm_rank(world),
           moe_comm_size(world), r, n);
    EXPECT(moe_comm_world_rank(world) == r, "world rank %d, expected %d",
           moe_comm_world_rank(world), r);
    EXPECT(strcmp(moe_comm_backend_name(world), "mpi") == 0, "backend %s",
           moe_comm_backend_name(world));
    EXPECT(moe_comm_timeout(world) == MOE_COMM_DEFAULT_TIMEOUT_SECONDS, "timeout %g",
           moe_comm_timeout(world));
    /* A second communicator over an initialised MPI. */
    moe_comm *again = NULL;
    if (OK(moe_comm_mpi_create(&again))) {
        EXPECT(moe_comm_size(again) == n, "second communicator has %d ranks",
               moe_comm_size(again));
        OK(moe_comm_barrier(again));
        moe_comm_free(again);
    }
}

static void check_alltoall_dtype(moe_comm *c, moe_comm_dtype t, int64_t count) {
    const int me = moe_comm_rank(c), n = moe_comm_size(c);
    void *send = alloc(n * count, t), *recv = alloc(n * count, t);
    for (int j = 0; j < n; j++)
        for (int64_t i = 0; i < count; i++) store(send, t, j * count + i, value(me, j, i));
    fill(recv, t, n * count, SENTINEL);
    if (OK(moe_comm_alltoall(c, recv, send, count, t)))
        for (int j = 0; j < n; j++)
            for (int64_t i = 0; i < count; i++) {
                int64_t got = load(recv, t, j * count + i), want = as_dtype(t, value(j, me, i));
                EXPECT(got == want, "alltoall %s count %lld: from rank %d [%lld] = %lld, want %lld",
                       moe_comm_dtype_name(t), (long long)count, j, (long long)i,
                       (long long)got, (long long)want);
            }
    free(send);
    free(recv);
}

static void check_alltoall(void) {
    check_alltoall_dtype(world, MOE_COMM_F32, 3);
    check_alltoall_dtype(world, MOE_COMM_I64, 1);
    check_alltoall_dtype(world, MOE_COMM_BYTES, LARGE_COUNT);
    check_alltoall_dtype(world, MOE_COMM_F64, 0);
}

/* Uneven counts with zeros: rank 1 sends nothing at all, the last rank (of
 * more than two) receives nothing, and some pairs move enough to go by
 * rendezvous. */
static int64_t a2av_count(int src, int dst, int n) {
    if (src == 1) return 0;
    if (n > 2 && dst == n - 1) return 0;
    int64_t c = (src * 7 + dst * 3 + 1) % 5;
    if ((src + dst) % 3 == 0) c += LARGE_COUNT / 4;
    return c;
}

/* One all-to-all-v with gaps between the segments (one element on the send
 * side, two on the receive side), which must stay untouched. When req is
 * non-NULL the exchange is started on it and *state receives what
 * finish_alltoallv needs. */
typedef struct a2av {
    moe_comm *comm;
    moe_comm_dtype t;
    int64_t *sc, *sd, *rc, *rd; /* [n] each */
    void *send, *recv;
    int64_t recv_len;
} a2av;

static void start_alltoallv(a2av *a, moe_comm *c, moe_comm_dtype t, moe_comm_request *req) {
    const int me = moe_comm_rank(c), n = moe_comm_size(c);
    const int wme = moe_comm_world_rank(c);
    *a = (a2av){.comm = c, .t = t};
    a->sc = calloc((size_t)n * 4, sizeof(int64_t));
    if (!a->sc) MPI_Abort(MPI_COMM_WORLD, 2);
    a->sd = a->sc + n, a->rc = a->sd + n, a->rd = a->rc + n;
    int64_t soff = 0, roff = 0;
    for (int j = 0; j < n; j++) {
        a->sc[j] = a2av_count(me, j, n);
        a->sd[j] = soff;
        soff += a->sc[j] + 1;
        a->rc[j] = a2av_count(j, me, n);
        a->rd[j] = roff;
        roff += a->rc[j] + 2;
    }
    a->recv_len = roff;
    a->send = alloc(soff, t);
    a->recv = alloc(roff, t);
    fill(a->send, t, soff, SENTINEL);
    fill(a->recv, t, roff, SENTINEL);
    /* Values name world ranks, so a group's exchange is checked the same way. */
    for (int j = 0; j < n; j++)
        for (int64_t i = 0; i < a->sc[j]; i++) store(a->send, t, a->sd[j] + i, value(wme, j, i));
    if (req)
        OK(moe_comm_ialltoallv(c, req, a->recv, a->rc, a->rd, a->send, a->sc, a->sd, t));
    else
        OK(moe_comm_alltoallv(c, a->recv, a->rc, a->rd, a->send, a->sc, a->sd, t));
}

/* world_of[j]: the world rank of rank j of a->comm. */
static void finish_alltoallv(a2av *a, const int *world_of, const char *what) {
    const int me = moe_comm_rank(a->comm), n = moe_comm_size(a->comm);
    int64_t pos = 0;
    for (int j = 0; j < n; j++) {
        for (; pos < a->rd[j]; pos++)
            EXPECT(load(a->recv, a->t, pos) == as_dtype(a->t, SENTINEL),
                   "%s %s: gap element %lld was written", what, moe_comm_dtype_name(a->t),
                   (long long)pos);
        for (int64_t i = 0; i < a->rc[j]; i++, pos++) {
            int64_t got = load(a->recv, a->t, pos);
            int64_t want = as_dtype(a->t, value(world_of[j], me, i));
            EXPECT(got == want, "%s %s: from rank %d [%lld] = %lld, want %lld", what,
                   moe_comm_dtype_name(a->t), j, (long long)i, (long long)got, (long long)want);
        }
    }
    for (; pos < a->recv_len; pos++)
        EXPECT(load(a->recv, a->t, pos) == as_dtype(a->t, SENTINEL),
               "%s %s: gap element %lld was written", what, moe_comm_dtype_name(a->t),
               (long long)pos);
    free(a->sc);
    free(a->send);
    free(a->recv);
}

static int *identity_ranks(int n) {
    int *w = malloc((size_t)n * sizeof *w);
    if (!w) MPI_Abort(MPI_COMM_WORLD, 2);
    for (int j = 0; j < n; j++) w[j] = j;
    return w;
}

static void check_alltoallv(void) {
    int *w = identity_ranks(size);
    const moe_comm_dtype types[] = {MOE_COMM_F32, MOE_COMM_I32, MOE_COMM_I64, MOE_COMM_BYTES};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        a2av a;
        start_alltoallv(&a, world, types[k], NULL);
        finish_alltoallv(&a, w, "alltoallv");
    }
    free(w);
}

/* Two all-to-all-v in flight, with an all-reduce and a ring of messages
 * started and finished in between, then waited for in reverse order. */
static void check_overlap(void) {
    int *w = identity_ranks(size);
    moe_comm_request r1 = MOE_COMM_REQUEST_INIT, r2 = MOE_COMM_REQUEST_INIT;
    a2av a1, a2;
    start_alltoallv(&a1, world, MOE_COMM_F32, &r1);
    start_alltoallv(&a2, world, MOE_COMM_I64, &r2);

    int64_t sum[4];
    for (int i = 0; i < 4; i++) sum[i] = value(rank, 0, i);
    OK(moe_comm_allreduce_sum(world, sum, 4, MOE_COMM_I64));
    for (int i = 0; i < 4; i++) {
        int64_t want = 0;
        for (int r = 0; r < size; r++) want += value(r, 0, i);
        EXPECT(sum[i] == want, "allreduce during all-to-all-v: [%d] = %lld, want %lld", i,
               (long long)sum[i], (long long)want);
    }

    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    float out = (float)value(rank, next, 0), in = -1.0f;
    moe_comm_request rs = MOE_COMM_REQUEST_INIT, rr = MOE_COMM_REQUEST_INIT;
    OK(moe_comm_irecv(world, &rr, &in, 1, MOE_COMM_F32, prev, 11));
    OK(moe_comm_isend(world, &rs, &out, 1, MOE_COMM_F32, next, 11));
    OK(moe_comm_wait(&rr));
    OK(moe_comm_wait(&rs));
    EXPECT(in == (float)value(prev, rank, 0), "ring during all-to-all-v: got %g, want %g",
           (double)in, (double)value(prev, rank, 0));

    /* moe_comm_test until done; the bound only keeps a bug from hanging. */
    bool done = false;
    const double give_up = now_seconds() + 30.0;
    while (!done && now_seconds() < give_up)
        if (!OK(moe_comm_test(&r2, &done))) break;
    EXPECT(done, "moe_comm_test never reported the second all-to-all-v done");
    OK(moe_comm_wait(&r1));
    EXPECT(r1.comm == NULL && r2.comm == NULL, "completed requests must be inactive");
    finish_alltoallv(&a1, w, "ialltoallv 1");
    finish_alltoallv(&a2, w, "ialltoallv 2");
    free(w);
}

static void check_allreduce(void) {
    const moe_comm_dtype types[] = {MOE_COMM_F32, MOE_COMM_F64, MOE_COMM_I32, MOE_COMM_I64};
    const int64_t n = 1000;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const moe_comm_dtype t = types[k];
        /* i64 values past 2^32 show that all 64 bits are summed. */
        const int64_t scale = t == MOE_COMM_I64 ? INT64_C(1) << 20 : 1;
        void *buf = alloc(n, t);
        for (int64_t i = 0; i < n; i++) store(buf, t, i, value(rank, 0, i) * scale);
        moe_comm_request req = MOE_COMM_REQUEST_INIT;
        bool ok = k % 2 ? OK(moe_comm_allreduce_sum(world, buf, n, t))
                        : OK(moe_comm_iallreduce_sum(world, &req, buf, n, t)) &&
                              OK(moe_comm_wait(&req));
        for (int64_t i = 0; ok && i < n; i++) {
            int64_t want = 0;
            for (int r = 0; r < size; r++) want += value(r, 0, i) * scale;
            EXPECT(load(buf, t, i) == want, "allreduce %s [%lld] = %lld, want %lld",
                   moe_comm_dtype_name(t), (long long)i, (long long)load(buf, t, i),
                   (long long)want);
        }
        free(buf);
    }
}

static void check_reduce_scatter(void) {
    const int64_t count = 257;
    float *send = alloc(size * count, MOE_COMM_F32), *recv = alloc(count, MOE_COMM_F32);
    for (int b = 0; b < size; b++)
        for (int64_t i = 0; i < count; i++) send[b * count + i] = (float)value(rank, b, i);
    fill(recv, MOE_COMM_F32, count, SENTINEL);
    if (OK(moe_comm_reduce_scatter_sum(world, recv, send, count, MOE_COMM_F32)))
        for (int64_t i = 0; i < count; i++) {
            int64_t want = 0;
            for (int r = 0; r < size; r++) want += value(r, rank, i);
            EXPECT(recv[i] == (float)want, "reduce_scatter [%lld] = %g, want %lld", (long long)i,
                   (double)recv[i], (long long)want);
        }
    free(send);
    free(recv);
}

static void check_allgather(void) {
    const int64_t count = LARGE_COUNT / 8;
    int32_t *send = alloc(count, MOE_COMM_I32), *recv = alloc(size * count, MOE_COMM_I32);
    for (int64_t i = 0; i < count; i++) send[i] = (int32_t)value(rank, 0, i);
    fill(recv, MOE_COMM_I32, size * count, SENTINEL);
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    if (OK(moe_comm_iallgather(world, &req, recv, send, count, MOE_COMM_I32)) &&
        OK(moe_comm_wait(&req)))
        for (int j = 0; j < size; j++)
            for (int64_t i = 0; i < count; i++)
                EXPECT(recv[j * count + i] == (int32_t)value(j, 0, i),
                       "allgather block %d [%lld] = %d, want %lld", j, (long long)i,
                       recv[j * count + i], (long long)value(j, 0, i));
    free(send);
    free(recv);
}

static void check_broadcast(void) {
    const int64_t count = 1000;
    double *buf = alloc(count, MOE_COMM_F64);
    for (int root = 0; root < size; root++) {
        for (int64_t i = 0; i < count; i++)
            buf[i] = rank == root ? (double)value(root, 99, i) : SENTINEL;
        if (!OK(moe_comm_broadcast(world, buf, count, MOE_COMM_F64, root))) continue;
        for (int64_t i = 0; i < count; i++)
            EXPECT(buf[i] == (double)value(root, 99, i), "broadcast from %d [%lld] = %g", root,
                   (long long)i, buf[i]);
    }
    free(buf);
}

/* Blocking send/recv around a ring (even ranks send first, so no cycle of
 * blocked senders), small and large; then two tags received out of order. */
static void check_send_recv(void) {
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    const int64_t counts[] = {1, LARGE_COUNT};
    for (size_t k = 0; k < 2; k++) {
        const int64_t n = counts[k];
        float *out = alloc(n, MOE_COMM_F32), *in = alloc(n, MOE_COMM_F32);
        for (int64_t i = 0; i < n; i++) out[i] = (float)value(rank, next, i);
        fill(in, MOE_COMM_F32, n, SENTINEL);
        bool ok = rank % 2 == 0
                      ? OK(moe_comm_send(world, out, n, MOE_COMM_F32, next, 3)) &&
                            OK(moe_comm_recv(world, in, n, MOE_COMM_F32, prev, 3))
                      : OK(moe_comm_recv(world, in, n, MOE_COMM_F32, prev, 3)) &&
                            OK(moe_comm_send(world, out, n, MOE_COMM_F32, next, 3));
        for (int64_t i = 0; ok && i < n; i++)
            EXPECT(in[i] == (float)value(prev, rank, i), "ring %lld: [%lld] = %g, want %lld",
                   (long long)n, (long long)i, (double)in[i], (long long)value(prev, rank, i));
        free(out);
        free(in);
    }

    int64_t a = value(rank, next, 1), b = value(rank, next, 2), got_a = -1, got_b = -1;
    moe_comm_request sa = MOE_COMM_REQUEST_INIT, sb = MOE_COMM_REQUEST_INIT;
    OK(moe_comm_isend(world, &sa, &a, 1, MOE_COMM_I64, next, 21));
    OK(moe_comm_isend(world, &sb, &b, 1, MOE_COMM_I64, next, 22));
    OK(moe_comm_recv(world, &got_b, 1, MOE_COMM_I64, prev, 22));
    OK(moe_comm_recv(world, &got_a, 1, MOE_COMM_I64, prev, 21));
    OK(moe_comm_wait(&sa));
    OK(moe_comm_wait(&sb));
    EXPECT(got_a == value(prev, rank, 1) && got_b == value(prev, rank, 2),
           "tags: got %lld/%lld, want %lld/%lld", (long long)got_a, (long long)got_b,
           (long long)value(prev, rank, 1), (long long)value(prev, rank, 2));
}

/* 2-rank expert-parallel groups (color rank/2) crossed with data-parallel
 * groups (color rank%2, ranked in reverse by key), as an EP x DP grid; then
 * collectives inside each. */
static void check_split(void) {
    moe_comm *ep = NULL, *dp = NULL;
    OK(moe_comm_set_timeout(world, 60.0));
    if (!OK(moe_comm_split(&ep, world, rank / 2, rank)) ||
        !OK(moe_comm_split(&dp, world, rank % 2, -rank)))
        goto done;
    const int ep_size = rank / 2 * 2 + 2 <= size ? 2 : 1;
    const int dp_size = (size - rank % 2 + 1) / 2;
    const int dp_rank = dp_size - 1 - rank / 2;
    EXPECT(moe_comm_size(ep) == ep_size && moe_comm_rank(ep) == rank % 2,
           "ep group: rank %d of %d, want %d of %d", moe_comm_rank(ep), moe_comm_size(ep),
           rank % 2, ep_size);
    EXPECT(moe_comm_size(dp) == dp_size && moe_comm_rank(dp) == dp_rank,
           "dp group: rank %d of %d, want %d of %d", moe_comm_rank(dp), moe_comm_size(dp),
           dp_rank, dp_size);
    EXPECT(moe_comm_world_rank(dp) == rank, "dp group world rank %d", moe_comm_world_rank(dp));
    EXPECT(moe_comm_timeout(ep) == 60.0, "split must inherit the timeout, got %g",
           moe_comm_timeout(ep));

    /* Sum of (world rank + 1) over each group's members. */
    int64_t s[2] = {rank + 1, rank + 1};
    OK(moe_comm_allreduce_sum(ep, &s[0], 1, MOE_COMM_I64));
    OK(moe_comm_allreduce_sum(dp, &s[1], 1, MOE_COMM_I64));
    int64_t want_ep = 0, want_dp = 0;
    for (int r = 0; r < size; r++) {
        if (r / 2 == rank / 2) want_ep += r + 1;
        if (r % 2 == rank % 2) want_dp += r + 1;
    }
    EXPECT(s[0] == want_ep && s[1] == want_dp, "group sums %lld/%lld, want %lld/%lld",
           (long long)s[0], (long long)s[1], (long long)want_ep, (long long)want_dp);

    /* An all-to-all-v inside the dp group, whose ranks run against world order. */
    int *w = malloc((size_t)dp_size * sizeof *w);
    if (!w) MPI_Abort(MPI_COMM_WORLD, 2);
    for (int j = 0; j < dp_size; j++) w[j] = (dp_size - 1 - j) * 2 + rank % 2;
    a2av a;
    start_alltoallv(&a, dp, MOE_COMM_F32, NULL);
    finish_alltoallv(&a, w, "dp alltoallv");
    free(w);

    /* A group of a group. */
    moe_comm *one = NULL;
    if (OK(moe_comm_split(&one, ep, moe_comm_rank(ep), 0))) {
        EXPECT(moe_comm_size(one) == 1, "split into singletons gave %d ranks",
               moe_comm_size(one));
        OK(moe_comm_barrier(one));
        moe_comm_free(one);
    }
done:
    OK(moe_comm_set_timeout(world, MOE_COMM_DEFAULT_TIMEOUT_SECONDS));
    moe_comm_free(ep);
    moe_comm_free(dp);
}

/* Counts past MPI's int and out-of-range peers fail on every rank alike,
 * before anything reaches MPI, so the ranks stay in step. */
static void check_errors(void) {
    float x[4] = {0};
    int64_t *sc = calloc((size_t)size * 2, sizeof *sc);
    if (!sc) MPI_Abort(MPI_COMM_WORLD, 2);
    int64_t *sd = sc + size;
    sc[size - 1] = (int64_t)INT_MAX + 1;
    moe_status st = moe_comm_alltoallv(world, x, sd, sd, x, sc, sd, MOE_COMM_F32);
    EXPECT(st == MOE_ERR_INVALID_ARG && strstr(moe_last_error(), "send_counts") &&
               strstr(moe_last_error(), "INT_MAX"),
           "alltoallv with a count past INT_MAX: %s: %s", moe_status_string(st), moe_last_error());
    free(sc);
    st = moe_comm_allreduce_sum(world, x, (int64_t)INT_MAX + 1, MOE_COMM_F32);
    EXPECT(st == MOE_ERR_INVALID_ARG && strstr(moe_last_error(), "INT_MAX"),
           "allreduce with a count past INT_MAX: %s: %s", moe_status_string(st), moe_last_error());
    st = moe_comm_send(world, x, 1, MOE_COMM_F32, size, 0);
    EXPECT(st == MOE_ERR_INVALID_ARG && strstr(moe_last_error(), "peer="),
           "send to rank %d: %s: %s", size, moe_status_string(st), moe_last_error());
    /* The communicator is still usable. */
    OK(moe_comm_barrier(world));
}

/* Whether rank j of c is in absent [n_absent]. */
static bool is_absent(int j, const int *absent, int n_absent) {
    for (int i = 0; i < n_absent; i++)
        if (absent[i] == j) return true;
    return false;
}

/* What a survivor's timeout message must say: the op and the time; the
 * absent ranks [n_absent] of c (rank j of c is world rank size-1-j), by
 * both ranks, and no other rank; how many ranks answered the roll call. */
static void expect_absent_named(const char *msg, int me, const int *absent, int n_absent) {
    char after[48], want[160], answered[80];
    snprintf(after, sizeof after, "not complete after %g s", TIMEOUT_SECONDS);
    if (n_absent == 1)
        snprintf(want, sizeof want, "rank %d (world %d) is not answering", absent[0],
                 size - 1 - absent[0]);
    else
        snprintf(want, sizeof want, "ranks %d (world %d) and %d (world %d) are not answering",
                 absent[0], size - 1 - absent[0], absent[1], size - 1 - absent[1]);
    const int others = size - 1 - n_absent;
    if (others == 0)
        snprintf(answered, sizeof answered, "no answer to a %g s roll call", ROLL_CALL_SECONDS);
    else if (others == 1)
        snprintf(answered, sizeof answered,
                 "the other rank, waiting in it too, answered a %g s roll call",
                 ROLL_CALL_SECONDS);
    else
        snprintf(answered, sizeof answered,
                 "the other %d ranks, waiting in it too, answered a %g s roll call", others,
                 ROLL_CALL_SECONDS);
    EXPECT(strstr(msg, "allreduce_sum") && strstr(msg, after) && strstr(msg, want) &&
               strstr(msg, answered),
           "timeout message: %s (expected '%s', '%s' and '%s')", msg, after, want, answered);
    /* The prefix names this rank; past it only absent ranks may appear. */
    const char *tail = strstr(msg, "not complete after");
    for (int j = 0; tail && j < size; j++) {
        char name[48];
        snprintf(name, sizeof name, "%d (world %d)", j, size - 1 - j);
        EXPECT(j == me || is_absent(j, absent, n_absent) || !strstr(tail, name),
               "rank %d, which joined, is named: %s", j, msg);
    }
}

/* The ranks absent [n_absent] of a communicator c (the world, ranked in
 * reverse so that its ranks differ from the world ranks) stay out of an
 * all-reduce on it: every other rank must give up after the timeout and
 * the roll call with MOE_ERR_COMM naming exactly the absent ranks. Rank
 * `late` of c (or -1) joins LATE_SECONDS after the others: slow but
 * present, it must not be named. Rank `elsewhere` of c (or -1), one of the
 * absent, meanwhile waits in a receive on another communicator, polling
 * MPI but not in the all-reduce, until rank 0 of c has given up and sends
 * it. The other absent ones wait in MPI_Barrier on MPI_COMM_WORLD. Rank
 * `ahead` of c (or -1) starts the next all-reduce before it waits for this
 * one: the roll call must still match it with the others, who have started
 * one fewer. A fresh communicator keeps the failure away from the world
 * one.
 *
 * The absent ranks never join: the others' all-reduce stays in flight for
 * good, as after any timeout, and MPI_Finalize ends it. Joining late would
 * finish it, but Open MPI's non-blocking collectives keep no reference to
 * their communicator between rounds, so a round that completes after the
 * communicator was freed may touch freed memory. buf [ABSENT_COUNT] is
 * static: it belongs to that all-reduce until the end. */
static void check_absent(float *buf, const int *absent, int n_absent, int late, int elsewhere,
                         int ahead) {
    moe_comm *c = NULL, *side = NULL;
    if (!OK(moe_comm_split(&c, world, 0, size - 1 - rank))) return;
    if (elsewhere >= 0 && !OK(moe_comm_split(&side, world, 0, rank))) {
        moe_comm_free(c);
        return;
    }
    OK(moe_comm_set_timeout(c, TIMEOUT_SECONDS));
    const int me = moe_comm_rank(c);
    if (!is_absent(me, absent, n_absent)) {
        for (int64_t i = 0; i < ABSENT_COUNT; i++) buf[i] = (float)value(rank, 0, i);
        if (me == late) nanosleep(&(struct timespec){0, (long)(LATE_SECONDS * 1e9)}, NULL);
        double t0 = now_seconds();
        moe_status st;
        if (me == ahead) {
            static float next[ABSENT_COUNT]; /* MPI's until the end, as buf */
            moe_comm_request reqs[2] = {MOE_COMM_REQUEST_INIT, MOE_COMM_REQUEST_INIT};
            OK(moe_comm_iallreduce_sum(c, &reqs[0], buf, ABSENT_COUNT, MOE_COMM_F32));
            OK(moe_comm_iallreduce_sum(c, &reqs[1], next, ABSENT_COUNT, MOE_COMM_F32));
            st = moe_comm_wait(&reqs[0]);
        } else {
            st = moe_comm_allreduce_sum(c, buf, ABSENT_COUNT, MOE_COMM_F32);
        }
        double waited = now_seconds() - t0;
        EXPECT(st == MOE_ERR_COMM, "allreduce without %d absent rank(s): %s: %s", n_absent,
               moe_status_string(st), moe_last_error());
        if (st == MOE_ERR_COMM) expect_absent_named(moe_last_error(), me, absent, n_absent);
        EXPECT(waited >= TIMEOUT_SECONDS * 0.9 &&
                   waited < TIMEOUT_SECONDS + ROLL_CALL_SECONDS + 3.0,
               "gave up after %.2f s, timeout %.1f s and a %.1f s roll call", waited,
               TIMEOUT_SECONDS, ROLL_CALL_SECONDS);
        if (me == 0) printf("  rank 0 of the group after %.2f s: %s\n", waited, moe_last_error());
        t0 = now_seconds();
        st = moe_comm_barrier(c);
        EXPECT(st == MOE_ERR_COMM && strstr(moe_last_error(), "failed earlier") &&
                   now_seconds() - t0 < 0.5,
               "an op after the timeout: %s: %s", moe_status_string(st), moe_last_error());
        if (me == 0 && elsewhere >= 0) {
            int64_t x = 1;
            OK(moe_comm_send(side, &x, 1, MOE_COMM_I64, size - 1 - elsewhere, 9));
        }
    } else if (me == elsewhere) {
        int64_t x = 0;
        OK(moe_comm_set_timeout(side, 30.0));
        OK(moe_comm_recv(side, &x, 1, MOE_COMM_I64, size - 1, 9));
    }
    /* Outside the code under test: the absent ranks wait here until the
     * others have given up. */
    MPI_Barrier(MPI_COMM_WORLD);
    moe_comm_free(side);
    moe_comm_free(c);
}

/* One rank of the group skips the all-reduce: rank 2 of 4 (world 1), with
 * rank 3 (world 0) late and rank 0 (world 3) a collective ahead; rank 1 of
 * 2 (world 0). */
static void check_absent_one(void) {
    static float buf[ABSENT_COUNT];
    const int absent = size > 2 ? 2 : 1;
    check_absent(buf, &absent, 1, size > 3 ? 3 : -1, -1, size > 3 ? 0 : -1);
}

/* Two ranks of 4 skip it: rank 1 (world 2) waits in another operation,
 * rank 2 (world 1) outside the library. */
static void check_absent_two(void) {
    static float buf[ABSENT_COUNT];
    const int absent[2] = {1, 2};
    check_absent(buf, absent, 2, -1, 1, -1);
}

/* Waiting for several requests after a timeout: the first failure's
 * message comes back, not the refusals of the waits after it (which name
 * the cause only at second hand). The last rank joins nothing. */
static void check_timeout_wait_all(void) {
    moe_comm *c = NULL;
    if (!OK(moe_comm_split(&c, world, 0, rank))) return;
    OK(moe_comm_set_timeout(c, TIMEOUT_SECONDS));
    if (rank != size - 1) {
        float x[8] = {0}, y[8] = {0};
        moe_comm_request reqs[2] = {MOE_COMM_REQUEST_INIT, MOE_COMM_REQUEST_INIT};
        OK(moe_comm_iallreduce_sum(c, &reqs[0], x, 8, MOE_COMM_F32));
        OK(moe_comm_iallgather(c, &reqs[1], y, x, 1, MOE_COMM_F32));
        moe_status st = moe_comm_wait_all(reqs, 2, MOE_OK);
        EXPECT(st == MOE_ERR_COMM && strstr(moe_last_error(), "iallreduce_sum") &&
                   strstr(moe_last_error(), "not complete after") &&
                   !strstr(moe_last_error(), "refused") && !strstr(moe_last_error(), "iallgather"),
               "wait_all after a timeout: %s: %s", moe_status_string(st), moe_last_error());
    }
    moe_comm_free(c);
}

/* Sub-communicator rank 0 waits for a message its peer 1 never sends: the
 * error names the peer by both ranks. The split reverses the ranks, so the
 * two differ (peer 1 is world rank size - 2). */
static void check_timeout_recv(void) {
    moe_comm *c = NULL;
    if (!OK(moe_comm_split(&c, world, 0, size - 1 - rank))) return;
    OK(moe_comm_set_timeout(c, RECV_TIMEOUT_SECONDS));
    if (moe_comm_rank(c) == 0) {
        int64_t x = 0;
        char peer[64];
        snprintf(peer, sizeof peer, "nothing heard from peer 1 (world %d)", size - 2);
        moe_status st = moe_comm_recv(c, &x, 1, MOE_COMM_I64, 1, 5);
        EXPECT(st == MOE_ERR_COMM && strstr(moe_last_error(), peer),
               "recv from a silent peer: %s: %s (expected '%s')", moe_status_string(st),
               moe_last_error(), peer);
        printf("  world rank %d: %s\n", rank, moe_last_error());
    }
    moe_comm_free(c);
}

/* ------------------------------------------------------------------ driver */

/* Agrees over MPI_COMM_WORLD whether every rank passed. */
static void run(const char *name, void (*check)(void)) {
    check_failures = 0;
    check();
    const int ranks_bad = mpi_agree(check_failures > 0);
    if (rank == 0) {
        if (ranks_bad)
            printf("FAIL %s (np %d: %d ranks failed)\n", name, size, ranks_bad);
        else
            printf("PASS %s (np %d)\n", name, size);
        fflush(stdout);
    }
}

int main(void) {
    if (!mpi_check_init()) return 1;
    if (size < 2) {
        if (rank == 0) fprintf(stderr, "test_comm_mpi: run under mpirun with -np 2 or more\n");
        moe_comm_free(world);
        moe_comm_mpi_finalize();
        return 1;
    }

    run("world", check_world);
    run("alltoall", check_alltoall);
    run("alltoallv uneven, zero counts, silent rank", check_alltoallv);
    run("ialltoallv overlapped with allreduce and send/recv", check_overlap);
    run("allreduce f32 f64 i32 i64", check_allreduce);
    run("reduce_scatter", check_reduce_scatter);
    run("allgather", check_allgather);
    run("broadcast from every root", check_broadcast);
    run("send/recv ring and tags", check_send_recv);
    run("split EP x DP groups", check_split);
    run("argument errors", check_errors);
    run("timeout: a rank skips an allreduce, the others name it", check_absent_one);
    if (size >= 4)
        run("timeout: two ranks skip an allreduce, the others name both", check_absent_two);
    run("timeout: wait_all reports the first failure", check_timeout_wait_all);
    run("timeout: a recv from a silent rank", check_timeout_recv);

    return mpi_check_finish();
}
