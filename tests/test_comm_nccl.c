/* test_comm_nccl.c: the nccl communicator (comm/comm_nccl.c) on one rank,
 * bootstrapped by the local communicator, on device 0. Every output buffer
 * is poisoned (0xFF bytes: NaN floats, -1 integers) before the op and has
 * guard elements past its end, so an element NCCL never wrote, or one
 * written out of place, fails the comparison. Communication moves values
 * unchanged and a sum over one rank is the identity, so every comparison is
 * exact (tolerance 0, bytewise) against a host image of what must arrive.
 *
 * Without a device every test skips and says why; built without NCCL, the
 * same tests skip with "built without NCCL". Several ranks are not covered
 * here: this needs one GPU per rank and MPI, which Criterion's forked tests
 * do not survive. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"

#define NCCL_TEST_NAMES(X)                                                                         \
    X(create_rejects_bad_arguments)                                                                \
    X(alltoallv_to_self_uneven_counts)                                                             \
    X(alltoall_polled_with_test)                                                                   \
    X(allreduce_sum_every_dtype)                                                                   \
    X(reduce_scatter_allgather_broadcast_barrier)                                                  \
    X(caller_stream_orders_ops)                                                                    \
    X(send_recv_to_self_in_post_order)                                                             \
    X(split_into_one_rank)                                                                         \
    X(unmatched_receive_fails_and_refuses_later_ops)                                               \
    X(stuck_stream_times_out_and_aborts)

#if !defined(MOE_HAVE_NCCL)

#define SKIP_TEST(name)                                                                            \
    Test(comm_nccl, name) { cr_skip_test("built without NCCL (configure with -DMOE_NCCL=ON)"); }
NCCL_TEST_NAMES(SKIP_TEST)

#else

#include <cuda_runtime_api.h>
#include <stdatomic.h>
#include <time.h>

#define POISON 0xFF
#define GUARD 3                   /* poisoned elements after every output */
#define SHORT_TIMEOUT_SECONDS 0.5 /* for the tests that must fail */
#define FAIL_BOUND_SECONDS 5.0    /* a failing wait must return within this */
#define HOLD_MAX_SECONDS 3.0      /* the stuck stream frees itself after this */
#define MANY_OPS 300
#define ARENA_BYTES ((size_t)4 << 20)
#define ALIGN_BYTES 256

#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status st_ = (call);                                                                   \
        cr_assert(st_ == MOE_OK, "%s: %s: %s", #call, moe_status_string(st_), moe_last_error());   \
    } while (0)

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        cr_assert(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                     \
    } while (0)

/* ------------------------------------------------------------ device state */

static moe_comm *boot, *comm;
static char *arena; /* [ARENA_BYTES] on the device, handed out from arena_used on */
static size_t arena_used;

static bool device_answers(char *why, size_t size) {
    int driver = 0, n = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
        snprintf(why, size, "no NVIDIA driver (libcuda.so.1 not found)");
        return false;
    }
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        snprintf(why, size, "no CUDA device (%s)",
                 err != cudaSuccess ? cudaGetErrorString(err) : "the driver reports none");
        return false;
    }
    return true;
}

/* Each test runs in its own process: the device state is made there.
 * stream: the caller's cudaStream_t, or NULL for the communicator's own. */
static void gpu_begin(void *stream) {
    char why[256];
    if (!device_answers(why, sizeof why)) cr_skip_test("no GPU: %s", why);
    CHECK(moe_comm_local_create(&boot));
    CHECK(moe_comm_nccl_create(&comm, boot, 0, stream));
    CUDA_OK(cudaMalloc((void **)&arena, ARENA_BYTES));
    arena_used = 0;
}

static void gpu_end(void) {
    moe_comm_free(comm);
    moe_comm_free(boot);
    CUDA_OK(cudaFree(arena));
}

static void *dalloc(size_t bytes) {
    cr_assert(bytes <= ARENA_BYTES - arena_used, "%zu bytes: raise ARENA_BYTES", bytes);
    void *p = arena + arena_used;
    arena_used += (bytes + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
    return p;
}

/* The legacy default stream that cudaMemset and cudaMemcpy use does not
 * order with the communicator's non-blocking stream: synchronise. */
static void *dpoison(size_t bytes) {
    void *p = dalloc(bytes);
    CUDA_OK(cudaMemset(p, POISON, bytes));
    CUDA_OK(cudaDeviceSynchronize());
    return p;
}

static void *dput(const void *host, size_t bytes) {
    void *p = dalloc(bytes);
    CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
    return p;
}

static void *dget(const void *dev, size_t bytes) {
    void *host = malloc(bytes > 0 ? bytes : 1);
    cr_assert(host);
    CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
    return host;
}

/* ------------------------------------------------------------------ values */

static size_t esize(moe_comm_dtype t) { return (size_t)moe_comm_dtype_size(t); }

/* A value in [0, 2^20): exact in f32, f64, i32 and i64. */
static int64_t value(int64_t i, uint32_t salt) {
    return (int64_t)(((uint64_t)i * 2654435761u + salt * 40503u) % 1048573u);
}

static void *host_poisoned(int64_t n, moe_comm_dtype t) {
    void *a = malloc((size_t)(n > 0 ? n : 1) * esize(t));
    cr_assert(a);
    memset(a, POISON, (size_t)n * esize(t));
    return a;
}

/* buf[first + i] = value(i, salt) for i < n. */
static void fill(void *buf, moe_comm_dtype t, int64_t first, int64_t n, uint32_t salt) {
    for (int64_t i = 0; i < n; i++) {
        int64_t v = value(i, salt), k = first + i;
        switch (t) {
        case MOE_COMM_F32: ((float *)buf)[k] = (float)v; break;
        case MOE_COMM_F64: ((double *)buf)[k] = (double)v; break;
        case MOE_COMM_I32: ((int32_t *)buf)[k] = (int32_t)v; break;
        case MOE_COMM_I64: ((int64_t *)buf)[k] = v; break;
        default: ((uint8_t *)buf)[k] = (uint8_t)v; break;
        }
    }
}

static double as_double(const void *buf, moe_comm_dtype t, int64_t k) {
    switch (t) {
    case MOE_COMM_F32: return ((const float *)buf)[k];
    case MOE_COMM_F64: return ((const double *)buf)[k];
    case MOE_COMM_I32: return ((const int32_t *)buf)[k];
    case MOE_COMM_I64: return (double)((const int64_t *)buf)[k];
    default: return ((const uint8_t *)buf)[k];
    }
}

/* Downloads dev [n] and compares it bytewise with want [n]. */
static void expect_dev(const char *what, const void *dev, const void *want, int64_t n,
                       moe_comm_dtype t) {
    const size_t es = esize(t);
    unsigned char *got = dget(dev, (size_t)n * es);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(got + i * es, (const unsigned char *)want + i * es, es) != 0 && bad++ == 0)
            first = i;
    cr_expect(bad == 0, "%s (%s): %lld of %lld elements differ; first [%lld] got %g want %g",
              what, moe_comm_dtype_name(t), (long long)bad, (long long)n, (long long)first,
              bad ? as_double(got, t, first) : 0.0, bad ? as_double(want, t, first) : 0.0);
    free(got);
}

static void expect_error(moe_status st, moe_status want, const char *what, const char *needle) {
    cr_expect(st == want, "%s: got %s, want %s (%s)", what, moe_status_string(st),
              moe_status_string(want), moe_last_error());
    cr_expect(strstr(moe_last_error(), needle), "%s: the message should contain \"%s\": %s",
              what, needle, moe_last_error());
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ tests */

Test(comm_nccl, create_rejects_bad_arguments) {
    gpu_begin(NULL);
    moe_comm *c = NULL;
    int n = 0;
    CUDA_OK(cudaGetDeviceCount(&n));
    expect_error(moe_comm_nccl_create(NULL, boot, 0, NULL), MOE_ERR_INVALID_ARG, "NULL out",
                 "comm is NULL");
    expect_error(moe_comm_nccl_create(&c, NULL, 0, NULL), MOE_ERR_INVALID_ARG, "NULL bootstrap",
                 "bootstrap is NULL");
    expect_error(moe_comm_nccl_create(&c, boot, n, NULL), MOE_ERR_INVALID_ARG, "device = count",
                 "device=");
    expect_error(moe_comm_nccl_create(&c, comm, 0, NULL), MOE_ERR_INVALID_ARG,
                 "nccl bootstrap", "bootstrap is an nccl communicator");
    cr_expect(c == NULL);
    cr_expect_str_eq(moe_comm_backend_name(comm), "nccl");
    cr_expect(moe_comm_rank(comm) == 0 && moe_comm_size(comm) == 1);
    cr_expect(moe_comm_timeout(comm) == moe_comm_timeout(boot), "the timeout is bootstrap's");
    gpu_end();
}

/* One rank: the single block goes to self, from send_displs[0] to
 * recv_displs[0]; the elements around it stay poisoned. */
Test(comm_nccl, alltoallv_to_self_uneven_counts) {
    gpu_begin(NULL);
    static const struct {
        int64_t count, send_displ, recv_displ;
        moe_comm_dtype t;
    } cases[] = {{0, 0, 2, MOE_COMM_F32},     {1, 3, 0, MOE_COMM_I32},
                 {7, 1, 5, MOE_COMM_BYTES},   {1000, 0, 17, MOE_COMM_F64},
                 {4099, 11, 1, MOE_COMM_I64}, {70001, 2, 3, MOE_COMM_F32}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const moe_comm_dtype t = cases[k].t;
        const int64_t count = cases[k].count, sd = cases[k].send_displ, rd = cases[k].recv_displ;
        const int64_t send_n = sd + count, recv_n = rd + count + GUARD;
        void *send = host_poisoned(send_n, t), *want = host_poisoned(recv_n, t);
        fill(send, t, sd, count, (uint32_t)k);
        fill(want, t, rd, count, (uint32_t)k);
        void *d_send = dput(send, (size_t)send_n * esize(t));
        void *d_recv = dpoison((size_t)recv_n * esize(t));
        CHECK(moe_comm_alltoallv(comm, d_recv, &count, &rd, d_send, &count, &sd, t));
        char what[64];
        snprintf(what, sizeof what, "alltoallv count %lld", (long long)count);
        expect_dev(what, d_recv, want, recv_n, t);
        free(send);
        free(want);
        arena_used = 0;
    }
    /* Refused before anything reaches NCCL, so the communicator stays usable. */
    const int64_t one = 1, two = 2, zero = 0;
    void *d = dpoison(16);
    expect_error(moe_comm_alltoallv(comm, d, &one, &zero, d, &two, &zero, MOE_COMM_F32),
                 MOE_ERR_INVALID_ARG, "unequal self counts", "send_counts[0]=2");
    CHECK(moe_comm_barrier(comm));
    gpu_end();
}

/* One rank: block 0 of send lands in block 0 of recv. Polled with test(). */
Test(comm_nccl, alltoall_polled_with_test) {
    gpu_begin(NULL);
    const moe_comm_dtype t = MOE_COMM_F32;
    const int64_t count = 513;
    void *send = host_poisoned(count, t), *want = host_poisoned(count + GUARD, t);
    fill(send, t, 0, count, 7);
    fill(want, t, 0, count, 7);
    void *d_send = dput(send, (size_t)count * esize(t));
    void *d_recv = dpoison((size_t)(count + GUARD) * esize(t));
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    CHECK(moe_comm_ialltoall(comm, &req, d_recv, d_send, count, t));
    bool done = false;
    const double start = now_seconds();
    while (!done && now_seconds() - start < FAIL_BOUND_SECONDS) CHECK(moe_comm_test(&req, &done));
    cr_assert(done, "ialltoall not done after %.1f s of moe_comm_test", FAIL_BOUND_SECONDS);
    cr_expect(req.comm == NULL, "a completed request is inactive");
    expect_dev("ialltoall", d_recv, want, count + GUARD, t);
    free(send);
    free(want);
    gpu_end();
}

/* In place; the sum over one rank is the buffer itself. */
Test(comm_nccl, allreduce_sum_every_dtype) {
    gpu_begin(NULL);
    static const moe_comm_dtype types[] = {MOE_COMM_F32, MOE_COMM_F64, MOE_COMM_I32,
                                           MOE_COMM_I64};
    const int64_t n = 3001;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const moe_comm_dtype t = types[k];
        void *want = host_poisoned(n, t);
        fill(want, t, 0, n, 100 + (uint32_t)k);
        void *d_buf = dput(want, (size_t)n * esize(t));
        moe_comm_request req = MOE_COMM_REQUEST_INIT;
        CHECK(moe_comm_iallreduce_sum(comm, &req, d_buf, n, t));
        CHECK(moe_comm_wait(&req));
        expect_dev("iallreduce_sum", d_buf, want, n, t);
        CHECK(moe_comm_allreduce_sum(comm, d_buf, n, t));
        expect_dev("allreduce_sum", d_buf, want, n, t);
        free(want);
    }
    expect_error(moe_comm_allreduce_sum(comm, arena, 4, MOE_COMM_BYTES), MOE_ERR_INVALID_ARG,
                 "bytes", "cannot sum");
    gpu_end();
}

/* One rank: reduce-scatter and all-gather copy send to recv, broadcast from
 * rank 0 leaves the buffer as it is. */
Test(comm_nccl, reduce_scatter_allgather_broadcast_barrier) {
    gpu_begin(NULL);
    const moe_comm_dtype t = MOE_COMM_I64;
    const int64_t n = 2049;
    void *send = host_poisoned(n, t), *want = host_poisoned(n + GUARD, t);
    fill(send, t, 0, n, 21);
    fill(want, t, 0, n, 21);
    void *d_send = dput(send, (size_t)n * esize(t));

    void *d_recv = dpoison((size_t)(n + GUARD) * esize(t));
    CHECK(moe_comm_reduce_scatter_sum(comm, d_recv, d_send, n, t));
    expect_dev("reduce_scatter_sum", d_recv, want, n + GUARD, t);

    d_recv = dpoison((size_t)(n + GUARD) * esize(t));
    CHECK(moe_comm_allgather(comm, d_recv, d_send, n, t));
    expect_dev("allgather", d_recv, want, n + GUARD, t);

    CHECK(moe_comm_broadcast(comm, d_send, n, t, 0));
    expect_dev("broadcast", d_send, want, n, t);
    expect_error(moe_comm_broadcast(comm, d_send, n, t, 1), MOE_ERR_INVALID_ARG, "root 1",
                 "root=1");

    /* More than the communicator's pool of events: each completed request
     * must give its event back. */
    for (int i = 0; i < MANY_OPS; i++) CHECK(moe_comm_barrier(comm));
    free(send);
    free(want);
    gpu_end();
}

/* With the caller's stream, work the caller enqueued before an op is seen by
 * it without any synchronisation in between. */
Test(comm_nccl, caller_stream_orders_ops) {
    char why[256];
    if (!device_answers(why, sizeof why)) cr_skip_test("no GPU: %s", why);
    cudaStream_t stream = NULL;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    gpu_begin(stream);
    const int64_t n = 1 << 16;
    void *d_send = dpoison((size_t)n);
    void *d_recv = dpoison((size_t)(n + GUARD));
    CUDA_OK(cudaMemsetAsync(d_send, 0x5A, (size_t)n, stream));
    CHECK(moe_comm_alltoall(comm, d_recv, d_send, n, MOE_COMM_BYTES));
    unsigned char *want = host_poisoned(n + GUARD, MOE_COMM_BYTES);
    memset(want, 0x5A, (size_t)n);
    expect_dev("alltoall after cudaMemsetAsync", d_recv, want, n + GUARD, MOE_COMM_BYTES);
    free(want);
    gpu_end();
    CUDA_OK(cudaStreamDestroy(stream));
}

/* Tags are ignored and NCCL matches in post order: the first receive gets
 * the first send. Both rounds are one group each, launched by the first
 * wait. */
Test(comm_nccl, send_recv_to_self_in_post_order) {
    gpu_begin(NULL);
    const moe_comm_dtype t = MOE_COMM_F32;
    const int64_t na = 1000, nb = 37;
    for (int round = 0; round < 2; round++) {
        void *a = host_poisoned(na + GUARD, t), *b = host_poisoned(nb + GUARD, t);
        fill(a, t, 0, na, 31 + (uint32_t)round);
        fill(b, t, 0, nb, 41 + (uint32_t)round);
        void *d_a = dput(a, (size_t)na * esize(t)), *d_b = dput(b, (size_t)nb * esize(t));
        void *r_a = dpoison((size_t)(na + GUARD) * esize(t));
        void *r_b = dpoison((size_t)(nb + GUARD) * esize(t));
        moe_comm_request req[4] = {MOE_COMM_REQUEST_INIT, MOE_COMM_REQUEST_INIT,
                                   MOE_COMM_REQUEST_INIT, MOE_COMM_REQUEST_INIT};
        CHECK(moe_comm_irecv(comm, &req[0], r_a, na, t, 0, 5));
        CHECK(moe_comm_irecv(comm, &req[1], r_b, nb, t, 0, 5));
        CHECK(moe_comm_isend(comm, &req[2], d_a, na, t, 0, 9));
        CHECK(moe_comm_isend(comm, &req[3], d_b, nb, t, 0, 9));
        for (int i = 0; i < 4; i++) CHECK(moe_comm_wait(&req[i]));
        expect_dev("first receive", r_a, a, na + GUARD, t);
        expect_dev("second receive", r_b, b, nb + GUARD, t);
        free(a);
        free(b);
    }
    gpu_end();
}

Test(comm_nccl, split_into_one_rank) {
    gpu_begin(NULL);
    CHECK(moe_comm_set_timeout(comm, 7.0));
    moe_comm *sub = NULL;
    CHECK(moe_comm_split(&sub, comm, 3, 0));
    cr_assert(sub);
    cr_expect_str_eq(moe_comm_backend_name(sub), "nccl");
    cr_expect(moe_comm_rank(sub) == 0 && moe_comm_size(sub) == 1, "rank %d of %d",
              moe_comm_rank(sub), moe_comm_size(sub));
    cr_expect(moe_comm_timeout(sub) == 7.0, "the timeout is inherited: %g", moe_comm_timeout(sub));

    const moe_comm_dtype t = MOE_COMM_I32;
    const int64_t n = 777;
    void *want = host_poisoned(n + GUARD, t);
    fill(want, t, 0, n, 55);
    void *d_buf = dput(want, (size_t)n * esize(t));
    void *d_recv = dpoison((size_t)(n + GUARD) * esize(t));
    CHECK(moe_comm_allreduce_sum(sub, d_buf, n, t));
    expect_dev("allreduce_sum on the split", d_buf, want, n, t);
    CHECK(moe_comm_allgather(sub, d_recv, d_buf, n, t));
    expect_dev("allgather on the split", d_recv, want, n + GUARD, t);
    moe_comm_free(sub);
    CHECK(moe_comm_allreduce_sum(comm, d_buf, n, t));
    expect_dev("allreduce_sum on the parent after the split", d_buf, want, n, t);
    free(want);
    gpu_end();
}

/* A receive from self with no send: NCCL refuses the group when it is
 * launched (or, failing that, the wait times out); either way MOE_ERR_COMM
 * naming the op and the peer, and the communicator refuses what follows. */
Test(comm_nccl, unmatched_receive_fails_and_refuses_later_ops) {
    gpu_begin(NULL);
    CHECK(moe_comm_set_timeout(comm, SHORT_TIMEOUT_SECONDS));
    void *d = dpoison(64 * sizeof(float));
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    CHECK(moe_comm_irecv(comm, &req, d, 64, MOE_COMM_F32, 0, 0));
    const double start = now_seconds();
    expect_error(moe_comm_wait(&req), MOE_ERR_COMM, "unmatched irecv",
                 "nccl irecv, rank 0 of 1 (world 0), peer 0: ");
    const double elapsed = now_seconds() - start;
    cr_expect(elapsed < FAIL_BOUND_SECONDS, "the failing wait took %.1f s", elapsed);
    cr_expect(req.comm == NULL, "a failed request is inactive");
    expect_error(moe_comm_barrier(comm), MOE_ERR_COMM, "barrier after the failure",
                 "refused: this communicator failed earlier: nccl irecv");
    gpu_end();
}

/* The caller's stream is held by a host function, so the op's event cannot
 * complete: the wait gives up after the timeout, aborts the communicator
 * and names the op. The host function lets go once the test says so (or
 * after HOLD_MAX_SECONDS, should the abort wait for the stream). */
static atomic_int hold_released;

static void hold_stream(void *arg) {
    (void)arg;
    const double start = now_seconds();
    struct timespec ms = {0, 1000000L};
    while (!atomic_load(&hold_released) && now_seconds() - start < HOLD_MAX_SECONDS)
        nanosleep(&ms, NULL);
}

Test(comm_nccl, stuck_stream_times_out_and_aborts) {
    char why[256];
    if (!device_answers(why, sizeof why)) cr_skip_test("no GPU: %s", why);
    cudaStream_t stream = NULL;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    gpu_begin(stream);
    CHECK(moe_comm_set_timeout(comm, SHORT_TIMEOUT_SECONDS));
    void *d = dpoison(256 * sizeof(float));
    CUDA_OK(cudaLaunchHostFunc(stream, hold_stream, NULL));
    const double start = now_seconds();
    expect_error(moe_comm_allreduce_sum(comm, d, 256, MOE_COMM_F32), MOE_ERR_COMM,
                 "allreduce_sum behind a held stream",
                 "nccl allreduce_sum, rank 0 of 1 (world 0): not complete after 0.5 s");
    const double elapsed = now_seconds() - start;
    cr_expect(elapsed >= SHORT_TIMEOUT_SECONDS && elapsed < FAIL_BOUND_SECONDS,
              "the wait took %.2f s with a %.1f s timeout", elapsed, SHORT_TIMEOUT_SECONDS);
    atomic_store(&hold_released, 1);
    CUDA_OK(cudaStreamSynchronize(stream));
    expect_error(moe_comm_allgather(comm, d, d, 1, MOE_COMM_F32), MOE_ERR_COMM,
                 "allgather after the timeout", "failed earlier: nccl allreduce_sum");
    gpu_end();
    CUDA_OK(cudaStreamDestroy(stream));
}

#endif /* MOE_HAVE_NCCL */
