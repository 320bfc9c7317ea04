/* comm.c: the communicator calls: argument checks made once for every
 * backend, then the backend's table; blocking ops as start + wait. */
#include "comm/comm.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "common/clock.h"
#include "common/status.h"

static const struct {
    const char *name;
    int64_t bytes;
} dtypes[MOE_COMM_DTYPE_COUNT] = {
    [MOE_COMM_F32] = {"f32", 4}, [MOE_COMM_F64] = {"f64", 8},     [MOE_COMM_I32] = {"i32", 4},
    [MOE_COMM_I64] = {"i64", 8}, [MOE_COMM_BYTES] = {"bytes", 1},
};

static bool dtype_valid(moe_comm_dtype dtype) {
    return (int)dtype >= 0 && dtype < MOE_COMM_DTYPE_COUNT;
}

int64_t moe_comm_dtype_size(moe_comm_dtype dtype) {
    return dtype_valid(dtype) ? dtypes[dtype].bytes : 0;
}

const char *moe_comm_dtype_name(moe_comm_dtype dtype) {
    return dtype_valid(dtype) ? dtypes[dtype].name : "unknown dtype";
}

/* ------------------------------------------------------------------ checks */

static moe_status check_comm(const moe_comm *comm, const char *op) {
    if (!comm) return moe_error(MOE_ERR_INVALID_ARG, "%s: comm is NULL", op);
    return MOE_OK;
}

static moe_status check_dtype(moe_comm_dtype dtype, bool reduction, const char *op) {
    if (!dtype_valid(dtype))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: dtype=%d is not a moe_comm_dtype", op,
                         (int)dtype);
    if (reduction && dtype == MOE_COMM_BYTES)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: cannot sum dtype bytes; use f32, f64, i32 or i64",
                         op);
    return MOE_OK;
}

/* A buffer of count elements: count >= 0, and an address when count > 0. */
static moe_status check_buffer(const void *buf, int64_t count, const char *what, const char *op) {
    if (count < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %s count=%lld is negative", op, what,
                         (long long)count);
    if (count > 0 && !buf)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %s is NULL with count=%lld", op, what,
                         (long long)count);
    return MOE_OK;
}

static moe_status check_rank(int rank, const moe_comm *comm, const char *what, const char *op) {
    if (rank < 0 || rank >= comm->size)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %s=%d is outside this %d-rank communicator",
                         op, what, rank, comm->size);
    return MOE_OK;
}

/* counts [size] and displs [size] of one side of an all-to-all-v. */
static moe_status check_vector(const moe_comm *comm, const void *buf, const int64_t *counts,
                               const int64_t *displs, const char *side, const char *op) {
    if (!counts || !displs)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %s_counts or %s_displs is NULL", op, side,
                         side);
    int64_t total = 0;
    for (int j = 0; j < comm->size; j++) {
        if (counts[j] < 0 || displs[j] < 0)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: %s_counts[%d]=%lld, %s_displs[%d]=%lld: "
                             "counts and displacements must be >= 0",
                             op, side, j, (long long)counts[j], side, j, (long long)displs[j]);
        total |= counts[j];
    }
    if (total > 0 && !buf)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %s buffer is NULL with non-zero counts", op,
                         side);
    return MOE_OK;
}

/* Names the op in the backend's messages; refuses a request still in use. */
static moe_status start_request(moe_comm_request *req, moe_comm *comm, const char *op, int peer) {
    MOE_TRY(check_comm(comm, op));
    if (!req) return moe_error(MOE_ERR_INVALID_ARG, "%s: req is NULL", op);
    if (req->comm)
        return moe_error(MOE_ERR_STATE, "%s: the request is still in flight (%s); wait for it "
                         "before reusing it", op, req->op ? req->op : "unnamed");
    *req = (moe_comm_request){.comm = NULL, .op = op, .peer = peer, .slot = -1};
    return MOE_OK;
}

/* The blocking form of an op whose start returned st. */
static moe_status finish(moe_status st, moe_comm_request *req) {
    return st == MOE_OK ? moe_comm_wait(req) : st;
}

/* ---------------------------------------------------------------- creation */

moe_status moe_comm_split(moe_comm **out, moe_comm *comm, int color, int key) {
    MOE_TRY(check_comm(comm, "split"));
    if (!out) return moe_error(MOE_ERR_INVALID_ARG, "split: out is NULL");
    *out = NULL;
    if (color < 0) return moe_error(MOE_ERR_INVALID_ARG, "split: color=%d is negative", color);
    return comm->backend->split(out, comm, color, key);
}

void moe_comm_free(moe_comm *comm) {
    if (comm) comm->backend->free(comm);
}

_Noreturn void moe_comm_abort(moe_comm *comm, int code) {
    if (comm) comm->backend->abort(comm, code);
    exit(code);
}

/* ---------------------------------------------------------------- queries */

int moe_comm_rank(const moe_comm *comm) { return comm->rank; }
int moe_comm_size(const moe_comm *comm) { return comm->size; }
int moe_comm_world_rank(const moe_comm *comm) { return comm->world_rank; }
const char *moe_comm_backend_name(const moe_comm *comm) { return comm->backend->name; }
bool moe_comm_matches_by_tag(const moe_comm *comm) { return comm->backend->matches_by_tag; }

moe_status moe_comm_set_timeout(moe_comm *comm, double seconds) {
    MOE_TRY(check_comm(comm, "set_timeout"));
    if (!(seconds > 0.0) || !isfinite(seconds))
        return moe_error(MOE_ERR_INVALID_ARG, "comm timeout=%g s: expected a finite number > 0",
                         seconds);
    comm->timeout_seconds = seconds;
    return MOE_OK;
}

double moe_comm_timeout(const moe_comm *comm) { return comm->timeout_seconds; }

/* ------------------------------------------------------------- collectives */

static moe_status ialltoall(moe_comm *comm, moe_comm_request *req, void *recv, const void *send,
                            int64_t count, moe_comm_dtype dtype, const char *op) {
    MOE_TRY(start_request(req, comm, op, -1));
    MOE_TRY(check_dtype(dtype, false, op));
    MOE_TRY(check_buffer(recv, count, "recv", op));
    MOE_TRY(check_buffer(send, count, "send", op));
    return comm->backend->ialltoall(comm, req, recv, send, count, dtype);
}

moe_status moe_comm_ialltoall(moe_comm *comm, moe_comm_request *req, void *recv,
                              const void *send, int64_t count, moe_comm_dtype dtype) {
    return ialltoall(comm, req, recv, send, count, dtype, "ialltoall");
}

moe_status moe_comm_alltoall(moe_comm *comm, void *recv, const void *send, int64_t count,
                             moe_comm_dtype dtype) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(ialltoall(comm, &req, recv, send, count, dtype, "alltoall"), &req);
}

static moe_status ialltoallv(moe_comm *comm, moe_comm_request *req, void *recv,
                             const int64_t *recv_counts, const int64_t *recv_displs,
                             const void *send, const int64_t *send_counts,
                             const int64_t *send_displs, moe_comm_dtype dtype, const char *op) {
    MOE_TRY(start_request(req, comm, op, -1));
    MOE_TRY(check_dtype(dtype, false, op));
    MOE_TRY(check_vector(comm, recv, recv_counts, recv_displs, "recv", op));
    MOE_TRY(check_vector(comm, send, send_counts, send_displs, "send", op));
    return comm->backend->ialltoallv(comm, req, recv, recv_counts, recv_displs, send, send_counts,
                                     send_displs, dtype);
}

moe_status moe_comm_ialltoallv(moe_comm *comm, moe_comm_request *req, void *recv,
                               const int64_t *recv_counts, const int64_t *recv_displs,
                               const void *send, const int64_t *send_counts,
                               const int64_t *send_displs, moe_comm_dtype dtype) {
    return ialltoallv(comm, req, recv, recv_counts, recv_displs, send, send_counts, send_displs,
                      dtype, "ialltoallv");
}

moe_status moe_comm_alltoallv(moe_comm *comm, void *recv, const int64_t *recv_counts,
                              const int64_t *recv_displs, const void *send,
                              const int64_t *send_counts, const int64_t *send_displs,
                              moe_comm_dtype dtype) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(ialltoallv(comm, &req, recv, recv_counts, recv_displs, send, send_counts,
                             send_displs, dtype, "alltoallv"),
                  &req);
}

static moe_status iallreduce(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                             moe_comm_dtype dtype, const char *op) {
    MOE_TRY(start_request(req, comm, op, -1));
    MOE_TRY(check_dtype(dtype, true, op));
    MOE_TRY(check_buffer(buf, count, "buf", op));
    return comm->backend->iallreduce_sum(comm, req, buf, count, dtype);
}

moe_status moe_comm_iallreduce_sum(moe_comm *comm, moe_comm_request *req, void *buf,
                                   int64_t count, moe_comm_dtype dtype) {
    return iallreduce(comm, req, buf, count, dtype, "iallreduce_sum");
}

moe_status moe_comm_allreduce_sum(moe_comm *comm, void *buf, int64_t count, moe_comm_dtype dtype) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(iallreduce(comm, &req, buf, count, dtype, "allreduce_sum"), &req);
}

static moe_status ireduce_scatter(moe_comm *comm, moe_comm_request *req, void *recv,
                                  const void *send, int64_t recv_count, moe_comm_dtype dtype,
                                  const char *op) {
    MOE_TRY(start_request(req, comm, op, -1));
    MOE_TRY(check_dtype(dtype, true, op));
    MOE_TRY(check_buffer(recv, recv_count, "recv", op));
    MOE_TRY(check_buffer(send, recv_count, "send", op));
    return comm->backend->ireduce_scatter_sum(comm, req, recv, send, recv_count, dtype);
}

moe_status moe_comm_ireduce_scatter_sum(moe_comm *comm, moe_comm_request *req, void *recv,
                                        const void *send, int64_t recv_count,
                                        moe_comm_dtype dtype) {
    return ireduce_scatter(comm, req, recv, send, recv_count, dtype, "ireduce_scatter_sum");
}

moe_status moe_comm_reduce_scatter_sum(moe_comm *comm, void *recv, const void *send,
                                       int64_t recv_count, moe_comm_dtype dtype) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(ireduce_scatter(comm, &req, recv, send, recv_count, dtype, "reduce_scatter_sum"),
                  &req);
}

static moe_status iallgather(moe_comm *comm, moe_comm_request *req, void *recv, const void *send,
                             int64_t count, moe_comm_dtype dtype, const char *op) {
    MOE_TRY(start_request(req, comm, op, -1));
    MOE_TRY(check_dtype(dtype, false, op));
    MOE_TRY(check_buffer(recv, count, "recv", op));
    MOE_TRY(check_buffer(send, count, "send", op));
    return comm->backend->iallgather(comm, req, recv, send, count, dtype);
}

moe_status moe_comm_iallgather(moe_comm *comm, moe_comm_request *req, void *recv,
                               const void *send, int64_t count, moe_comm_dtype dtype) {
    return iallgather(comm, req, recv, send, count, dtype, "iallgather");
}

moe_status moe_comm_allgather(moe_comm *comm, void *recv, const void *send, int64_t count,
                              moe_comm_dtype dtype) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(iallgather(comm, &req, recv, send, count, dtype, "allgather"), &req);
}

static moe_status ibroadcast(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                             moe_comm_dtype dtype, int root, const char *op) {
    MOE_TRY(start_request(req, comm, op, -1));
    MOE_TRY(check_dtype(dtype, false, op));
    MOE_TRY(check_buffer(buf, count, "buf", op));
    MOE_TRY(check_rank(root, comm, "root", op));
    return comm->backend->ibroadcast(comm, req, buf, count, dtype, root);
}

moe_status moe_comm_ibroadcast(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                               moe_comm_dtype dtype, int root) {
    return ibroadcast(comm, req, buf, count, dtype, root, "ibroadcast");
}

moe_status moe_comm_broadcast(moe_comm *comm, void *buf, int64_t count, moe_comm_dtype dtype,
                              int root) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(ibroadcast(comm, &req, buf, count, dtype, root, "broadcast"), &req);
}

moe_status moe_comm_barrier(moe_comm *comm) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    MOE_TRY(start_request(&req, comm, "barrier", -1));
    return finish(comm->backend->ibarrier(comm, &req), &req);
}

/* ---------------------------------------------------------- point to point */

static moe_status check_p2p(const moe_comm *comm, const void *buf, int64_t count,
                            moe_comm_dtype dtype, int peer, int tag, const char *op) {
    MOE_TRY(check_dtype(dtype, false, op));
    MOE_TRY(check_buffer(buf, count, "buf", op));
    MOE_TRY(check_rank(peer, comm, "peer", op));
    if (tag < 0 || tag > MOE_COMM_TAG_MAX)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: tag=%d is outside [0, %d]", op, tag,
                         MOE_COMM_TAG_MAX);
    return MOE_OK;
}

static moe_status isend(moe_comm *comm, moe_comm_request *req, const void *buf, int64_t count,
                        moe_comm_dtype dtype, int peer, int tag, const char *op) {
    MOE_TRY(start_request(req, comm, op, peer));
    MOE_TRY(check_p2p(comm, buf, count, dtype, peer, tag, op));
    return comm->backend->isend(comm, req, buf, count, dtype, peer, tag);
}

moe_status moe_comm_isend(moe_comm *comm, moe_comm_request *req, const void *buf, int64_t count,
                          moe_comm_dtype dtype, int peer, int tag) {
    return isend(comm, req, buf, count, dtype, peer, tag, "isend");
}

moe_status moe_comm_send(moe_comm *comm, const void *buf, int64_t count, moe_comm_dtype dtype,
                         int peer, int tag) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(isend(comm, &req, buf, count, dtype, peer, tag, "send"), &req);
}

static moe_status irecv(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                        moe_comm_dtype dtype, int peer, int tag, const char *op) {
    MOE_TRY(start_request(req, comm, op, peer));
    MOE_TRY(check_p2p(comm, buf, count, dtype, peer, tag, op));
    return comm->backend->irecv(comm, req, buf, count, dtype, peer, tag);
}

moe_status moe_comm_irecv(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                          moe_comm_dtype dtype, int peer, int tag) {
    return irecv(comm, req, buf, count, dtype, peer, tag, "irecv");
}

moe_status moe_comm_recv(moe_comm *comm, void *buf, int64_t count, moe_comm_dtype dtype, int peer,
                         int tag) {
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    return finish(irecv(comm, &req, buf, count, dtype, peer, tag, "recv"), &req);
}

/* ---------------------------------------------------------------- requests */

static _Thread_local double waited_seconds;

double moe_comm_wait_seconds(void) { return waited_seconds; }

moe_status moe_comm_wait(moe_comm_request *req) {
    if (!req) return moe_error(MOE_ERR_INVALID_ARG, "wait: req is NULL");
    if (!req->comm) return MOE_OK;
    const double start = moe_monotonic_seconds();
    const moe_status st = req->comm->backend->wait(req);
    waited_seconds += moe_monotonic_seconds() - start;
    return st;
}

moe_status moe_comm_wait_all(moe_comm_request *reqs, int n, moe_status st) {
    if (n > 0 && !reqs) return moe_error(MOE_ERR_INVALID_ARG, "wait_all: reqs is NULL with n=%d", n);
    /* The first failure, reported once the other waits are done. */
    moe_kept_error first = {MOE_OK, ""};
    moe_error_keep(&first, st);
    for (int i = 0; i < n; i++) moe_error_keep(&first, moe_comm_wait(&reqs[i]));
    return moe_error_take(&first, MOE_OK);
}

moe_status moe_comm_test(moe_comm_request *req, bool *done) {
    if (!req || !done) return moe_error(MOE_ERR_INVALID_ARG, "test: req or done is NULL");
    *done = true;
    if (!req->comm) return MOE_OK;
    return req->comm->backend->test(req, done);
}
