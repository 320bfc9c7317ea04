/* comm_local.c: the one-rank communicator. Collectives are copies (or
 * nothing); point-to-point messages go to this rank itself, matched in post
 * order per tag, as MPI matches them. Every op completes when started except
 * a send or receive whose match is not posted yet: a small fixed table keeps
 * those until the other side is posted. */
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/status.h"

/* Sends and receives to self that may wait for their match at once; a
 * pipeline with one stage posts none, a test a handful. */
#define LOCAL_PENDING_MAX 64

typedef struct local_p2p {
    bool used, is_send, matched;
    void *buf; /* [bytes]; a send's buffer is only read */
    int64_t bytes;
    int tag;
    uint64_t order; /* post order: the earliest match wins */
} local_p2p;

typedef struct local_comm {
    moe_comm base;
    local_p2p pending[LOCAL_PENDING_MAX];
    uint64_t posted;
} local_comm;

static local_comm *as_local(moe_comm *comm) { return (local_comm *)comm; }

static const moe_comm_backend local_backend;

moe_status moe_comm_local_create(moe_comm **comm) {
    if (!comm) return moe_error(MOE_ERR_INVALID_ARG, "local_create: comm is NULL");
    local_comm *c = calloc(1, sizeof *c);
    *comm = NULL;
    if (!c) return moe_error(MOE_ERR_OUT_OF_MEMORY, "local_create: %zu bytes", sizeof *c);
    c->base = (moe_comm){.backend = &local_backend,
                         .rank = 0,
                         .size = 1,
                         .world_rank = 0,
                         .timeout_seconds = MOE_COMM_DEFAULT_TIMEOUT_SECONDS};
    *comm = &c->base;
    return MOE_OK;
}

static moe_status local_split(moe_comm **out, moe_comm *comm, int color, int key) {
    (void)color;
    (void)key;
    MOE_TRY(moe_comm_local_create(out));
    (*out)->timeout_seconds = comm->timeout_seconds;
    return MOE_OK;
}

static void local_free(moe_comm *comm) { free(comm); }

static void local_abort(moe_comm *comm, int code) {
    (void)comm;
    (void)code;
}

/* ------------------------------------------------------------- collectives */

static size_t nbytes(int64_t count, moe_comm_dtype dtype) {
    return (size_t)(count * moe_comm_dtype_size(dtype));
}

/* memmove: with one rank, send and receive buffers may be the same. */
static void copy(void *dst, const void *src, int64_t count, moe_comm_dtype dtype) {
    if (count > 0) memmove(dst, src, nbytes(count, dtype));
}

static moe_status local_ialltoall(moe_comm *comm, moe_comm_request *req, void *recv,
                                  const void *send, int64_t count, moe_comm_dtype dtype) {
    (void)comm;
    (void)req;
    copy(recv, send, count, dtype);
    return MOE_OK;
}

static moe_status local_ialltoallv(moe_comm *comm, moe_comm_request *req, void *recv,
                                   const int64_t *recv_counts, const int64_t *recv_displs,
                                   const void *send, const int64_t *send_counts,
                                   const int64_t *send_displs, moe_comm_dtype dtype) {
    (void)comm;
    if (recv_counts[0] != send_counts[0])
        return moe_error(MOE_ERR_INVALID_ARG,
                         "local %s: send_counts[0]=%lld but recv_counts[0]=%lld: on one rank "
                         "what is sent is what is received",
                         req->op, (long long)send_counts[0], (long long)recv_counts[0]);
    copy((char *)recv + nbytes(recv_displs[0], dtype),
         (const char *)send + nbytes(send_displs[0], dtype), send_counts[0], dtype);
    return MOE_OK;
}

static moe_status local_iallreduce_sum(moe_comm *comm, moe_comm_request *req, void *buf,
                                       int64_t count, moe_comm_dtype dtype) {
    (void)comm, (void)req, (void)buf, (void)count, (void)dtype;
    return MOE_OK;
}

static moe_status local_ireduce_scatter_sum(moe_comm *comm, moe_comm_request *req, void *recv,
                                            const void *send, int64_t recv_count,
                                            moe_comm_dtype dtype) {
    (void)comm;
    (void)req;
    copy(recv, send, recv_count, dtype);
    return MOE_OK;
}

static moe_status local_iallgather(moe_comm *comm, moe_comm_request *req, void *recv,
                                   const void *send, int64_t count, moe_comm_dtype dtype) {
    (void)comm;
    (void)req;
    copy(recv, send, count, dtype);
    return MOE_OK;
}

static moe_status local_ibroadcast(moe_comm *comm, moe_comm_request *req, void *buf,
                                   int64_t count, moe_comm_dtype dtype, int root) {
    (void)comm, (void)req, (void)buf, (void)count, (void)dtype, (void)root;
    return MOE_OK;
}

static moe_status local_ibarrier(moe_comm *comm, moe_comm_request *req) {
    (void)comm;
    (void)req;
    return MOE_OK;
}

/* ---------------------------------------------------------- point to point */

/* The earliest unmatched entry of the other kind with this tag, or NULL. */
static local_p2p *find_match(local_comm *c, bool want_send, int tag) {
    local_p2p *best = NULL;
    for (int i = 0; i < LOCAL_PENDING_MAX; i++) {
        local_p2p *p = &c->pending[i];
        if (p->used && !p->matched && p->is_send == want_send && p->tag == tag &&
            (!best || p->order < best->order))
            best = p;
    }
    return best;
}

static moe_status deliver(void *recv, int64_t recv_bytes, const void *send, int64_t send_bytes,
                          int tag, const char *op) {
    if (send_bytes > recv_bytes)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "local %s: a %lld-byte message with tag %d does not fit the %lld-byte "
                         "receive",
                         op, (long long)send_bytes, tag, (long long)recv_bytes);
    if (send_bytes > 0) memcpy(recv, send, (size_t)send_bytes);
    return MOE_OK;
}

/* Matches the new op against a posted one, or queues it with req in flight. */
static moe_status post(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                       moe_comm_dtype dtype, int tag, bool is_send) {
    local_comm *c = as_local(comm);
    const int64_t bytes = (int64_t)nbytes(count, dtype);
    local_p2p *match = find_match(c, !is_send, tag);
    if (match) {
        MOE_TRY(is_send ? deliver(match->buf, match->bytes, buf, bytes, tag, req->op)
                        : deliver(buf, bytes, match->buf, match->bytes, tag, req->op));
        match->matched = true;
        return MOE_OK;
    }
    for (int i = 0; i < LOCAL_PENDING_MAX; i++) {
        local_p2p *p = &c->pending[i];
        if (p->used) continue;
        *p = (local_p2p){.used = true, .is_send = is_send, .buf = buf, .bytes = bytes, .tag = tag,
                         .order = c->posted++};
        req->comm = comm;
        req->handle.i64 = i;
        return MOE_OK;
    }
    return moe_error(MOE_ERR_STATE,
                     "local %s: %d sends and receives to self already wait for their match",
                     req->op, LOCAL_PENDING_MAX);
}

static moe_status local_isend(moe_comm *comm, moe_comm_request *req, const void *buf,
                              int64_t count, moe_comm_dtype dtype, int peer, int tag) {
    (void)peer;
    return post(comm, req, (void *)buf, count, dtype, tag, true);
}

static moe_status local_irecv(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                              moe_comm_dtype dtype, int peer, int tag) {
    (void)peer;
    return post(comm, req, buf, count, dtype, tag, false);
}

static moe_status local_test(moe_comm_request *req, bool *done) {
    local_p2p *p = &as_local(req->comm)->pending[req->handle.i64];
    *done = p->matched;
    if (p->matched) {
        p->used = false;
        req->comm = NULL;
    }
    return MOE_OK;
}

/* Nothing else runs on this rank, so an unmatched op would never complete. */
static moe_status local_wait(moe_comm_request *req) {
    local_p2p *p = &as_local(req->comm)->pending[req->handle.i64];
    const bool matched = p->matched;
    const bool is_send = p->is_send;
    const int tag = p->tag;
    p->used = false;
    req->comm = NULL;
    if (matched) return MOE_OK;
    return moe_error(MOE_ERR_STATE,
                     "local %s (tag %d) to self: no matching %s was posted, and on one rank "
                     "waiting would never end",
                     req->op, tag, is_send ? "receive" : "send");
}

static const moe_comm_backend local_backend = {
    .name = "local",
    .matches_by_tag = true,
    .split = local_split,
    .ialltoall = local_ialltoall,
    .ialltoallv = local_ialltoallv,
    .iallreduce_sum = local_iallreduce_sum,
    .ireduce_scatter_sum = local_ireduce_scatter_sum,
    .iallgather = local_iallgather,
    .ibroadcast = local_ibroadcast,
    .ibarrier = local_ibarrier,
    .isend = local_isend,
    .irecv = local_irecv,
    .wait = local_wait,
    .test = local_test,
    .abort = local_abort,
    .free = local_free,
};
