/* test_comm.c: the communicator calls on the one-rank local backend: every
 * op's result, the checks comm.c makes for every backend, and point-to-point
 * matching to self. Multi-rank behaviour is tests/mpi/test_comm_mpi.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "comm/comm.h"
#include "test_expect.h"

static moe_comm *comm;

static void setup(void) { cr_assert_eq(moe_comm_local_create(&comm), MOE_OK, "%s", moe_last_error()); }
static void teardown(void) { moe_comm_free(comm); }



/* Element-wise equality of float arrays, naming the first difference. */
static void expect_equal_f32(const float *got, const float *want, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i]) {
            cr_expect_fail("%s[%lld] = %g, expected %g", what, (long long)i, got[i], want[i]);
            return;
        }
}

TestSuite(comm_local, .init = setup, .fini = teardown);

Test(comm_local, queries) {
    cr_expect_eq(moe_comm_rank(comm), 0);
    cr_expect_eq(moe_comm_size(comm), 1);
    cr_expect_eq(moe_comm_world_rank(comm), 0);
    cr_expect_str_eq(moe_comm_backend_name(comm), "local");
    cr_expect_eq(moe_comm_timeout(comm), MOE_COMM_DEFAULT_TIMEOUT_SECONDS);
    EXPECT_OK(moe_comm_set_timeout(comm, 2.5));
    cr_expect_eq(moe_comm_timeout(comm), 2.5);
    EXPECT_FAIL(moe_comm_set_timeout(comm, 0.0), MOE_ERR_INVALID_ARG, "timeout=0");
    EXPECT_FAIL(moe_comm_set_timeout(comm, INFINITY), MOE_ERR_INVALID_ARG, "timeout=inf");
    EXPECT_FAIL(moe_comm_set_timeout(comm, NAN), MOE_ERR_INVALID_ARG, "timeout=nan");
    cr_expect_eq(moe_comm_timeout(comm), 2.5, "a rejected timeout must leave the old one");
}

Test(comm_local, dtypes) {
    cr_expect_eq(moe_comm_dtype_size(MOE_COMM_F32), 4);
    cr_expect_eq(moe_comm_dtype_size(MOE_COMM_F64), 8);
    cr_expect_eq(moe_comm_dtype_size(MOE_COMM_I32), 4);
    cr_expect_eq(moe_comm_dtype_size(MOE_COMM_I64), 8);
    cr_expect_eq(moe_comm_dtype_size(MOE_COMM_BYTES), 1);
    cr_expect_eq(moe_comm_dtype_size(MOE_COMM_DTYPE_COUNT), 0);
    cr_expect_str_eq(moe_comm_dtype_name(MOE_COMM_I64), "i64");
}

Test(comm_local, alltoall_copies) {
    float send[5] = {1, 2, 3, 4, 5}, recv[5] = {0};
    EXPECT_OK(moe_comm_alltoall(comm, recv, send, 5, MOE_COMM_F32));
    expect_equal_f32(recv, send, 5, "recv");
    /* One rank may exchange in place. */
    EXPECT_OK(moe_comm_alltoall(comm, send, send, 5, MOE_COMM_F32));
    expect_equal_f32(send, recv, 5, "in place");
    EXPECT_OK(moe_comm_alltoall(comm, NULL, NULL, 0, MOE_COMM_F32));
}

Test(comm_local, alltoallv_honours_displacements) {
    const int64_t send[6] = {10, 11, 12, 13, 14, 15};
    int64_t recv[6] = {-1, -1, -1, -1, -1, -1};
    const int64_t count[1] = {3}, sdispl[1] = {2}, rdispl[1] = {1};
    EXPECT_OK(moe_comm_alltoallv(comm, recv, count, rdispl, send, count, sdispl, MOE_COMM_I64));
    const int64_t want[6] = {-1, 12, 13, 14, -1, -1};
    for (int i = 0; i < 6; i++) cr_expect_eq(recv[i], want[i], "recv[%d] = %lld, expected %lld", i,
                                             (long long)recv[i], (long long)want[i]);

    /* A rank that sends nothing needs no buffers. */
    const int64_t zero[1] = {0};
    EXPECT_OK(moe_comm_alltoallv(comm, NULL, zero, zero, NULL, zero, zero, MOE_COMM_BYTES));

    const int64_t four[1] = {4};
    EXPECT_FAIL(moe_comm_alltoallv(comm, recv, four, rdispl, send, count, sdispl, MOE_COMM_I64),
                MOE_ERR_INVALID_ARG, "recv_counts[0]=4");
}

Test(comm_local, ialltoallv_completes_at_start) {
    const float send[2] = {1.5f, 2.5f};
    float recv[2] = {0};
    const int64_t count[1] = {2}, displ[1] = {0};
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_ialltoallv(comm, &req, recv, count, displ, send, count, displ,
                                  MOE_COMM_F32));
    bool done = false;
    EXPECT_OK(moe_comm_test(&req, &done));
    cr_expect(done);
    EXPECT_OK(moe_comm_wait(&req));
    expect_equal_f32(recv, send, 2, "recv");
}

Test(comm_local, reductions_and_gathers) {
    double d[3] = {1.0, -2.0, 3.5};
    EXPECT_OK(moe_comm_allreduce_sum(comm, d, 3, MOE_COMM_F64));
    cr_expect(d[0] == 1.0 && d[1] == -2.0 && d[2] == 3.5, "one rank's sum is its own values");
    int64_t big[1] = {INT64_C(1) << 40};
    EXPECT_OK(moe_comm_allreduce_sum(comm, big, 1, MOE_COMM_I64));
    cr_expect_eq(big[0], INT64_C(1) << 40);

    const float send[4] = {1, 2, 3, 4};
    float recv[4] = {0};
    EXPECT_OK(moe_comm_reduce_scatter_sum(comm, recv, send, 4, MOE_COMM_F32));
    expect_equal_f32(recv, send, 4, "reduce_scatter");
    memset(recv, 0, sizeof recv);
    EXPECT_OK(moe_comm_allgather(comm, recv, send, 4, MOE_COMM_F32));
    expect_equal_f32(recv, send, 4, "allgather");

    int32_t b[2] = {7, 8};
    EXPECT_OK(moe_comm_broadcast(comm, b, 2, MOE_COMM_I32, 0));
    cr_expect(b[0] == 7 && b[1] == 8);
    EXPECT_OK(moe_comm_barrier(comm));

    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_iallreduce_sum(comm, &req, d, 3, MOE_COMM_F64));
    EXPECT_OK(moe_comm_wait(&req));
    EXPECT_OK(moe_comm_ireduce_scatter_sum(comm, &req, recv, send, 4, MOE_COMM_F32));
    EXPECT_OK(moe_comm_wait(&req));
    EXPECT_OK(moe_comm_iallgather(comm, &req, recv, send, 4, MOE_COMM_F32));
    EXPECT_OK(moe_comm_wait(&req));
    EXPECT_OK(moe_comm_ibroadcast(comm, &req, b, 2, MOE_COMM_I32, 0));
    EXPECT_OK(moe_comm_wait(&req));
    EXPECT_OK(moe_comm_ialltoall(comm, &req, recv, send, 4, MOE_COMM_F32));
    EXPECT_OK(moe_comm_wait(&req));
    expect_equal_f32(recv, send, 4, "ialltoall");
}

Test(comm_local, split_inherits_timeout) {
    EXPECT_OK(moe_comm_set_timeout(comm, 7.0));
    moe_comm *sub = NULL;
    EXPECT_OK(moe_comm_split(&sub, comm, 3, -5));
    cr_assert_not_null(sub);
    cr_expect_eq(moe_comm_size(sub), 1);
    cr_expect_eq(moe_comm_rank(sub), 0);
    cr_expect_eq(moe_comm_timeout(sub), 7.0);
    float x[1] = {2.0f};
    EXPECT_OK(moe_comm_allreduce_sum(sub, x, 1, MOE_COMM_F32));
    cr_expect_eq(x[0], 2.0f);
    moe_comm_free(sub);
    EXPECT_FAIL(moe_comm_split(&sub, comm, -1, 0), MOE_ERR_INVALID_ARG, "color=-1");
    cr_expect_null(sub);
}

Test(comm_local, send_recv_to_self) {
    const float a[3] = {1, 2, 3};
    float got[4] = {0};

    /* A posted receive lets a blocking send complete. */
    moe_comm_request rreq = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_irecv(comm, &rreq, got, 4, MOE_COMM_F32, 0, 9));
    bool done = true;
    EXPECT_OK(moe_comm_test(&rreq, &done));
    cr_expect(!done, "a receive with no send yet must not be complete");
    EXPECT_OK(moe_comm_send(comm, a, 3, MOE_COMM_F32, 0, 9));
    EXPECT_OK(moe_comm_wait(&rreq));
    expect_equal_f32(got, a, 3, "irecv + send");
    cr_expect_eq(got[3], 0.0f, "a shorter message must leave the rest of the receive");

    /* Same tag: in post order. Other tag: not matched by this one. */
    const float b[3] = {4, 5, 6}, c[3] = {7, 8, 9};
    moe_comm_request s1 = MOE_COMM_REQUEST_INIT, s2 = MOE_COMM_REQUEST_INIT,
                     s3 = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_isend(comm, &s1, a, 3, MOE_COMM_F32, 0, 1));
    EXPECT_OK(moe_comm_isend(comm, &s2, b, 3, MOE_COMM_F32, 0, 2));
    EXPECT_OK(moe_comm_isend(comm, &s3, c, 3, MOE_COMM_F32, 0, 1));
    EXPECT_OK(moe_comm_recv(comm, got, 3, MOE_COMM_F32, 0, 1));
    expect_equal_f32(got, a, 3, "first tag-1 message");
    EXPECT_OK(moe_comm_recv(comm, got, 3, MOE_COMM_F32, 0, 1));
    expect_equal_f32(got, c, 3, "second tag-1 message");
    EXPECT_OK(moe_comm_recv(comm, got, 3, MOE_COMM_F32, 0, 2));
    expect_equal_f32(got, b, 3, "tag-2 message");
    EXPECT_OK(moe_comm_wait(&s1));
    EXPECT_OK(moe_comm_wait(&s2));
    EXPECT_OK(moe_comm_wait(&s3));
    EXPECT_OK(moe_comm_wait(&s3)); /* a completed request waits no more */
}

Test(comm_local, unmatched_blocking_p2p_fails_instead_of_hanging) {
    float x[2] = {1, 2};
    EXPECT_FAIL(moe_comm_send(comm, x, 2, MOE_COMM_F32, 0, 4), MOE_ERR_STATE,
                "no matching receive");
    EXPECT_FAIL(moe_comm_recv(comm, x, 2, MOE_COMM_F32, 0, 4), MOE_ERR_STATE,
                "no matching send");
    /* The failed ops left nothing queued: a fresh pair still matches. */
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_isend(comm, &req, x, 2, MOE_COMM_F32, 0, 4));
    float y[2] = {0};
    EXPECT_OK(moe_comm_recv(comm, y, 2, MOE_COMM_F32, 0, 4));
    EXPECT_OK(moe_comm_wait(&req));
    expect_equal_f32(y, x, 2, "recv");
}

Test(comm_local, message_larger_than_receive) {
    float x[4] = {1, 2, 3, 4}, y[2] = {0};
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_isend(comm, &req, x, 4, MOE_COMM_F32, 0, 0));
    EXPECT_FAIL(moe_comm_recv(comm, y, 2, MOE_COMM_F32, 0, 0), MOE_ERR_INVALID_ARG,
                "does not fit");
}

/* Every request is waited for, the first failure is returned with its own
 * message, and a failure the caller brings is kept with its message. */
Test(comm_local, wait_all_keeps_the_first_failure) {
    float x[2] = {1, 2}, y[2] = {0};
    moe_comm_request reqs[4] = {MOE_COMM_REQUEST_INIT, MOE_COMM_REQUEST_INIT, MOE_COMM_REQUEST_INIT,
                                MOE_COMM_REQUEST_INIT};
    EXPECT_OK(moe_comm_irecv(comm, &reqs[0], y, 2, MOE_COMM_F32, 0, 1));
    EXPECT_OK(moe_comm_send(comm, x, 2, MOE_COMM_F32, 0, 1)); /* completes reqs[0] */
    EXPECT_OK(moe_comm_isend(comm, &reqs[1], x, 2, MOE_COMM_F32, 0, 5));
    EXPECT_OK(moe_comm_irecv(comm, &reqs[2], y, 2, MOE_COMM_F32, 0, 6));
    /* reqs[3] was never started. */
    EXPECT_FAIL(moe_comm_wait_all(reqs, 4, MOE_OK), MOE_ERR_STATE, "isend (tag 5)");
    cr_expect(strstr(moe_last_error(), "tag 6") == NULL, "a later failure overwrote the first: %s",
              moe_last_error());
    expect_equal_f32(y, x, 2, "the completed receive");
    for (int i = 0; i < 4; i++) {
        bool done = false;
        EXPECT_OK(moe_comm_test(&reqs[i], &done));
        cr_expect(done, "request %d is still in flight after wait_all", i);
    }
    /* The failed receive is gone: a new pair with its tag matches each other. */
    float z[2] = {0};
    EXPECT_OK(moe_comm_isend(comm, &reqs[0], x, 2, MOE_COMM_F32, 0, 6));
    EXPECT_OK(moe_comm_recv(comm, z, 2, MOE_COMM_F32, 0, 6));
    EXPECT_OK(moe_comm_wait_all(reqs, 1, MOE_OK));
    expect_equal_f32(z, x, 2, "a receive after wait_all");

    /* The caller's own failure (starting an op) comes back with its message,
     * after the requests are waited for. */
    moe_status started = moe_comm_allreduce_sum(comm, x, 1, MOE_COMM_BYTES);
    cr_assert_eq(started, MOE_ERR_INVALID_ARG);
    EXPECT_OK(moe_comm_isend(comm, &reqs[0], x, 2, MOE_COMM_F32, 0, 7));
    EXPECT_FAIL(moe_comm_wait_all(reqs, 1, started), MOE_ERR_INVALID_ARG, "cannot sum dtype bytes");
    bool done = false;
    EXPECT_OK(moe_comm_test(&reqs[0], &done));
    cr_expect(done, "the request is still in flight after wait_all with a failure");
    EXPECT_OK(moe_comm_wait_all(NULL, 0, MOE_OK));
}

Test(comm_local, request_in_flight_cannot_be_reused) {
    float x[1] = {1};
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    EXPECT_OK(moe_comm_irecv(comm, &req, x, 1, MOE_COMM_F32, 0, 3));
    EXPECT_FAIL(moe_comm_isend(comm, &req, x, 1, MOE_COMM_F32, 0, 3), MOE_ERR_STATE,
                "still in flight (irecv)");
    EXPECT_FAIL(moe_comm_wait(&req), MOE_ERR_STATE, "no matching send");
}

Test(comm_local, bad_arguments) {
    float x[4] = {0};
    const int64_t one[1] = {1}, minus[1] = {-1};
    EXPECT_FAIL(moe_comm_allreduce_sum(NULL, x, 1, MOE_COMM_F32), MOE_ERR_INVALID_ARG,
                "allreduce_sum: comm is NULL");
    EXPECT_FAIL(moe_comm_allreduce_sum(comm, x, -1, MOE_COMM_F32), MOE_ERR_INVALID_ARG,
                "count=-1 is negative");
    EXPECT_FAIL(moe_comm_allreduce_sum(comm, NULL, 2, MOE_COMM_F32), MOE_ERR_INVALID_ARG,
                "buf is NULL");
    EXPECT_FAIL(moe_comm_allreduce_sum(comm, x, 1, MOE_COMM_BYTES), MOE_ERR_INVALID_ARG,
                "cannot sum dtype bytes");
    EXPECT_FAIL(moe_comm_reduce_scatter_sum(comm, x, x, 1, MOE_COMM_BYTES), MOE_ERR_INVALID_ARG,
                "reduce_scatter_sum: cannot sum");
    EXPECT_FAIL(moe_comm_alltoall(comm, x, x, 1, (moe_comm_dtype)42), MOE_ERR_INVALID_ARG,
                "dtype=42");
    EXPECT_FAIL(moe_comm_alltoall(comm, x, NULL, 1, MOE_COMM_F32), MOE_ERR_INVALID_ARG,
                "send is NULL");
    EXPECT_FAIL(moe_comm_alltoallv(comm, x, NULL, one, x, one, one, MOE_COMM_F32),
                MOE_ERR_INVALID_ARG, "recv_counts or recv_displs is NULL");
    EXPECT_FAIL(moe_comm_alltoallv(comm, x, one, one, x, minus, one, MOE_COMM_F32),
                MOE_ERR_INVALID_ARG, "send_counts[0]=-1");
    EXPECT_FAIL(moe_comm_alltoallv(comm, x, one, minus, x, one, one, MOE_COMM_F32),
                MOE_ERR_INVALID_ARG, "recv_displs[0]=-1");
    EXPECT_FAIL(moe_comm_alltoallv(comm, NULL, one, one, x, one, one, MOE_COMM_F32),
                MOE_ERR_INVALID_ARG, "recv buffer is NULL");
    EXPECT_FAIL(moe_comm_broadcast(comm, x, 1, MOE_COMM_F32, 1), MOE_ERR_INVALID_ARG,
                "root=1 is outside this 1-rank communicator");
    EXPECT_FAIL(moe_comm_send(comm, x, 1, MOE_COMM_F32, 1, 0), MOE_ERR_INVALID_ARG,
                "send: peer=1");
    EXPECT_FAIL(moe_comm_recv(comm, x, 1, MOE_COMM_F32, -1, 0), MOE_ERR_INVALID_ARG,
                "recv: peer=-1");
    EXPECT_FAIL(moe_comm_send(comm, x, 1, MOE_COMM_F32, 0, MOE_COMM_TAG_MAX + 1),
                MOE_ERR_INVALID_ARG, "tag=32768");
    EXPECT_FAIL(moe_comm_isend(comm, NULL, x, 1, MOE_COMM_F32, 0, 0), MOE_ERR_INVALID_ARG,
                "req is NULL");
    EXPECT_FAIL(moe_comm_wait(NULL), MOE_ERR_INVALID_ARG, "wait: req is NULL");
    moe_comm *out = NULL;
    EXPECT_FAIL(moe_comm_split(&out, NULL, 0, 0), MOE_ERR_INVALID_ARG, "split: comm is NULL");
    EXPECT_FAIL(moe_comm_local_create(NULL), MOE_ERR_INVALID_ARG, "comm is NULL");
}

/* The driver's last call after a failure: this process exits with the code. */
Test(comm_local, abort_exits_with_code, .exit_code = 3) {
    moe_comm_abort(comm, 3);
}

/* Without MPI running, ending the job is the caller's exit, not this call's. */
Test(comm_local, mpi_abort_job_returns_without_mpi) {
    moe_comm_mpi_abort_job(3);
}

#ifndef MOE_HAVE_MPI
Test(comm_local, mpi_create_says_not_built) {
    moe_comm *mpi = (moe_comm *)1;
    EXPECT_FAIL(moe_comm_mpi_create(&mpi), MOE_ERR_UNSUPPORTED, "built without MPI");
    cr_expect_null(mpi);
    EXPECT_OK(moe_comm_mpi_finalize());
}
#endif
