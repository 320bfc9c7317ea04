/* comm_nccl.c: the NCCL communicator, device memory. Every op is enqueued on
 * the communicator's stream and followed by a CUDA event from a pool made at
 * creation; a wait polls that event and NCCL's asynchronous error with a
 * deadline. The NCCL communicator is non-blocking (ncclConfig_t.blocking =
 * 0), so that ncclCommAbort can end work in flight: after a timeout or an
 * error the communicator is aborted and refuses every later op, and a dead
 * peer ends the job with an error naming it instead of a hang.
 *
 * All-to-all(-v) and point to point are ncclSend/ncclRecv pairs inside one
 * NCCL group. NCCL has no tags and matches a pair's sends and receives in
 * issue order; isend/irecv open a group lazily and the next other call of
 * this backend on the thread launches it (see moe_comm_nccl_create in
 * comm.h), so the requests of one group share its event. */
#ifdef MOE_HAVE_NCCL

#define _POSIX_C_SOURCE 200809L /* nanosleep */

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "common/clock.h"
#include "common/status.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "comm_nccl.c needs NCCL 2.18 or newer (ncclCommSplit, non-blocking communicators)"
#endif

/* ncclCommRevoke came with NCCL 2.28. Referenced weakly, so that a build
 * against 2.28 headers still loads with an older libnccl (the GPU machine's
 * own), which then goes without it. */
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#pragma weak ncclCommRevoke
static void revoke(ncclComm_t comm) {
    if (ncclCommRevoke) (void)ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
}
#else
static void revoke(ncclComm_t comm) { (void)comm; }
#endif

/* Ops in flight at once per communicator; each holds one event until its
 * wait (the requests of one send/recv group share theirs). */
#define NCCL_EVENT_SLOTS 256 /* a 64-layer model's gradient all-reduces in flight at once, and more */
/* A wait spins on the event for this long (a step's exchanges end within
 * it), then sleeps between looks for 1/POLL_SLEEP_DIVISOR of the time waited
 * so far, within [POLL_SLEEP_MIN_NS, POLL_SLEEP_MAX_NS], as comm_mpi.c does. */
#define POLL_SPIN_SECONDS 0.1
#define POLL_SLEEP_DIVISOR 100
#define POLL_SLEEP_MIN_NS 10000L
#define POLL_SLEEP_MAX_NS 1000000L
#define WHERE_BYTES 256
#define DETAIL_BYTES 768
#define FAILURE_BYTES (WHERE_BYTES + DETAIL_BYTES + 2) /* "<where>: <detail>" */

typedef struct nccl_comm {
    moe_comm base;
    ncclComm_t nccl;     /* NULL before init and once aborted */
    int device;
    cudaStream_t stream; /* every op's; the caller's unless owns_stream */
    bool owns_stream;
    cudaEvent_t events[NCCL_EVENT_SLOTS];
    int event_users[NCCL_EVENT_SLOTS]; /* requests holding each event */
    int open_slot;                     /* event of the group open on this thread, or -1 */
    int32_t *scratch;                  /* [1] on the device: what a barrier sums */
    /* Non-empty once an op failed or timed out: the communicator is aborted,
     * and every op refuses with this text. */
    char failure[FAILURE_BYTES];
    struct nccl_comm *next_live; /* the process's communicators, newest first */
    bool queued;                 /* an op has been put on the stream */
} nccl_comm;

/* The communicator whose NCCL group is open on this thread, or NULL. NCCL's
 * group state is per thread, not per communicator, so any op of this backend
 * launches the open group first: an op of another communicator would
 * otherwise join it. */
static _Thread_local nccl_comm *group_owner;

_Static_assert(sizeof(size_t) >= sizeof(int64_t),
               "counts are non-negative int64_t elements, passed to NCCL as size_t");
_Static_assert(sizeof(cudaEvent_t) <= sizeof(((moe_comm_request *)0)->handle),
               "moe_comm_request.handle must hold a cudaEvent_t");

static nccl_comm *as_nccl(moe_comm *comm) { return (nccl_comm *)comm; }

static const moe_comm_backend nccl_backend;

/* ----------------------------------------------------------------- messages */

/* __FILE__ is the full path; from comm/ on is what a reader needs. */
static const char *short_path(const char *file) {
    const char *s = strstr(file, "comm/");
    return s ? s : file;
}

/* "nccl alltoallv, rank 1 of 4 (world 1)" and ", peer 3". */
static void describe(const nccl_comm *c, const char *op, int peer, char *text, size_t size) {
    int n = snprintf(text, size, "nccl %s, rank %d of %d (world %d)", op, c->base.rank,
                     c->base.size, c->base.world_rank);
    if (peer >= 0 && n >= 0 && (size_t)n < size)
        snprintf(text + n, size - (size_t)n, ", peer %d", peer);
}

/* Every communicator of the process, so that a failure can stop the ones
 * that share its stream. Created and freed on the thread that drives them,
 * as their ops are. */
static nccl_comm *live_comms;

/* The communicators other than c with work put on c's stream. */
static bool shares_work(const nccl_comm *o, const nccl_comm *c) {
    return o != c && o->nccl && o->queued && o->stream == c->stream;
}

/* Aborts c's NCCL communicator (closing its open group first, so that the
 * thread's next NCCL call is not inside it) and keeps the first failure.
 * ncclCommAbort waits for the work queued on c's stream ahead of c's own,
 * which may be another communicator's stuck on the same dead peer: so once
 * c has put work there, c and every communicator with work on its stream
 * are revoked first (which stops their work without waiting; NCCL 2.28
 * and later), then aborted, and those fail with c's text. A failure while setting up (no
 * work queued) aborts c alone. */
static void mark_failed(nccl_comm *c, const char *text) {
    if (group_owner == c) {
        group_owner = NULL;
        c->open_slot = -1;
        (void)ncclGroupEnd();
    }
    if (c->nccl) {
        if (c->queued) {
            revoke(c->nccl);
            for (nccl_comm *o = live_comms; o; o = o->next_live)
                if (shares_work(o, c)) revoke(o->nccl);
            for (nccl_comm *o = live_comms; o; o = o->next_live)
                if (shares_work(o, c)) {
                    (void)ncclCommAbort(o->nccl);
                    o->nccl = NULL;
                    if (!o->failure[0])
                        snprintf(o->failure, sizeof o->failure,
                                 "stopped with a communicator on its stream: %s", text);
                }
        }
        (void)ncclCommAbort(c->nccl);
        c->nccl = NULL;
    }
    if (!c->failure[0]) snprintf(c->failure, sizeof c->failure, "%s", text);
}

/* "<where>: <detail>" becomes c's failure and the error returned. */
static moe_status fail(nccl_comm *c, moe_status status, const char *op, int peer,
                       const char *fmt, ...) MOE_PRINTF(5, 6);
static moe_status fail(nccl_comm *c, moe_status status, const char *op, int peer,
                       const char *fmt, ...) {
    char where[WHERE_BYTES], detail[DETAIL_BYTES], text[FAILURE_BYTES];
    describe(c, op, peer, where, sizeof where);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    snprintf(text, sizeof text, "%s: %s", where, detail);
    mark_failed(c, text);
    return moe_error(status, "%s", text);
}

static moe_status nccl_failed(nccl_comm *c, const char *op, int peer, const char *call,
                              ncclResult_t r, int line) {
    /* Read before fail() aborts the communicator. */
    const char *last = ncclGetLastError(c->nccl);
    return fail(c, MOE_ERR_COMM, op, peer, "%s failed at %s:%d: %s%s%s", call,
                short_path(__FILE__), line, ncclGetErrorString(r), last && last[0] ? ": " : "",
                last ? last : "");
}

static moe_status cuda_failed(nccl_comm *c, const char *op, int peer, const char *call,
                              cudaError_t err, int line) {
    (void)cudaGetLastError(); /* a non-sticky error: leave none behind */
    moe_status st = MOE_ERR_COMM;
    if (err == cudaErrorMemoryAllocation)
        st = MOE_ERR_OUT_OF_MEMORY;
    else if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
        st = MOE_ERR_UNSUPPORTED;
    return fail(c, st, op, peer, "%s failed at %s:%d: %s: %s", call, short_path(__FILE__), line,
                cudaGetErrorName(err), cudaGetErrorString(err));
}

/* ncclInProgress is no failure on a non-blocking communicator: the call goes
 * on in the background, and settle() waits for it before the next one. */
#define NCCL_CALL(c, op, peer, call)                                                               \
    do {                                                                                           \
        ncclResult_t nccl_r_ = (call);                                                             \
        if (nccl_r_ != ncclSuccess && nccl_r_ != ncclInProgress)                                   \
            return nccl_failed((c), (op), (peer), #call, nccl_r_, __LINE__);                       \
    } while (0)

#define CUDA_CALL(c, op, peer, call)                                                               \
    do {                                                                                           \
        cudaError_t cuda_e_ = (call);                                                              \
        if (cuda_e_ != cudaSuccess)                                                                \
            return cuda_failed((c), (op), (peer), #call, cuda_e_, __LINE__);                       \
    } while (0)

static moe_status check_usable(const nccl_comm *c, const char *op, int peer) {
    if (!c->failure[0]) return MOE_OK;
    char where[WHERE_BYTES];
    describe(c, op, peer, where, sizeof where);
    return moe_error(MOE_ERR_COMM, "%s: refused: this communicator failed earlier: %s", where,
                     c->failure);
}

/* ------------------------------------------------------------------ values */

static ncclDataType_t nccl_type(moe_comm_dtype dtype) {
    switch (dtype) {
    case MOE_COMM_F32: return ncclFloat32;
    case MOE_COMM_F64: return ncclFloat64;
    case MOE_COMM_I32: return ncclInt32;
    case MOE_COMM_I64: return ncclInt64;
    case MOE_COMM_BYTES:
    case MOE_COMM_DTYPE_COUNT: break;
    }
    return ncclUint8;
}

/* Whether elements [first, first + count) of `bytes` each have byte offsets
 * that fit int64_t; first and count are >= 0 (comm.c checked). */
static bool extent_fits(int64_t first, int64_t count, int64_t bytes) {
    return first <= INT64_MAX / bytes - count;
}

static char *at(void *buf, int64_t index, moe_comm_dtype dtype) {
    return (char *)buf + index * moe_comm_dtype_size(dtype);
}

static const char *at_const(const void *buf, int64_t index, moe_comm_dtype dtype) {
    return (const char *)buf + index * moe_comm_dtype_size(dtype);
}

/* ------------------------------------------------------------------ waiting */

static void nap(double elapsed) {
    long ns = (long)(elapsed * 1e9 / POLL_SLEEP_DIVISOR);
    ns = ns < POLL_SLEEP_MIN_NS ? POLL_SLEEP_MIN_NS : ns;
    struct timespec ts = {0, ns < POLL_SLEEP_MAX_NS ? ns : POLL_SLEEP_MAX_NS};
    nanosleep(&ts, NULL);
}

/* One look: *done once no NCCL call is in progress on c and, given an event,
 * the work enqueued before it has finished. An asynchronous NCCL error (a
 * peer gone, a network failure) fails c. */
static moe_status query(nccl_comm *c, const char *op, int peer, cudaEvent_t event, bool *done) {
    *done = false;
    ncclResult_t state = ncclSuccess;
    NCCL_CALL(c, op, peer, ncclCommGetAsyncError(c->nccl, &state));
    if (state == ncclInProgress) return MOE_OK;
    if (state != ncclSuccess)
        return nccl_failed(c, op, peer, "work in flight (ncclCommGetAsyncError)", state, __LINE__);
    if (event) {
        cudaError_t e = cudaEventQuery(event);
        if (e == cudaErrorNotReady) return MOE_OK;
        if (e != cudaSuccess) return cuda_failed(c, op, peer, "cudaEventQuery(event)", e, __LINE__);
    }
    *done = true;
    return MOE_OK;
}

static moe_status timed_out(nccl_comm *c, const char *op, int peer) {
    const double t = c->base.timeout_seconds;
    if (peer >= 0)
        return fail(c, MOE_ERR_COMM, op, peer,
                    "not complete after %g s: nothing heard from rank %d (dead, stuck, or in "
                    "another operation), or earlier work on the stream is stuck; communicator "
                    "aborted",
                    t, peer);
    if (c->base.size == 1)
        return fail(c, MOE_ERR_COMM, op, peer,
                    "not complete after %g s: earlier work on the stream is stuck; "
                    "communicator aborted",
                    t);
    return fail(c, MOE_ERR_COMM, op, peer,
                "not complete after %g s: %s has not joined it (dead, stuck, or in another "
                "operation), or earlier work on the stream is stuck; communicator aborted",
                t, c->base.size == 2 ? "the other rank" : "at least one of the other ranks");
}

/* Polls until query() says done, at most the communicator's timeout. */
static moe_status settle(nccl_comm *c, const char *op, int peer, cudaEvent_t event) {
    const double start = moe_monotonic_seconds();
    for (;;) {
        bool done = false;
        MOE_TRY(query(c, op, peer, event, &done));
        if (done) return MOE_OK;
        double elapsed = moe_monotonic_seconds() - start;
        if (elapsed >= c->base.timeout_seconds) return timed_out(c, op, peer);
        if (elapsed >= POLL_SPIN_SECONDS) nap(elapsed);
    }
}

/* ------------------------------------------------------------------ events */

static moe_status take_slot(const nccl_comm *c, const char *op, int *slot) {
    for (int s = 0; s < NCCL_EVENT_SLOTS; s++) {
        if (c->event_users[s] == 0 && s != c->open_slot) {
            *slot = s;
            return MOE_OK;
        }
    }
    char where[WHERE_BYTES];
    describe(c, op, -1, where, sizeof where);
    return moe_error(MOE_ERR_STATE,
                     "%s: %d operations already in flight on this communicator; wait for one "
                     "first",
                     where, NCCL_EVENT_SLOTS);
}

static void attach(nccl_comm *c, moe_comm_request *req, int slot) {
    c->event_users[slot]++;
    req->comm = &c->base;
    req->slot = slot;
    req->handle.ptr = c->events[slot];
}

static void release(nccl_comm *c, moe_comm_request *req) {
    if (req->slot >= 0) c->event_users[req->slot]--;
    req->slot = -1;
    req->comm = NULL;
}

/* ------------------------------------------------------------------ groups */

static moe_status open_group(nccl_comm *c, const char *op, int peer) {
    int slot = 0;
    MOE_TRY(take_slot(c, op, &slot));
    NCCL_CALL(c, op, peer, ncclGroupStart());
    group_owner = c;
    c->open_slot = slot;
    return MOE_OK;
}

/* Launches c's open group and records its event after it. */
static moe_status close_group(nccl_comm *c, const char *op, int peer) {
    const int slot = c->open_slot;
    group_owner = NULL;
    c->open_slot = -1;
    c->queued = true;
    NCCL_CALL(c, op, peer, ncclGroupEnd());
    MOE_TRY(settle(c, op, peer, NULL));
    CUDA_CALL(c, op, peer, cudaEventRecord(c->events[slot], c->stream));
    return MOE_OK;
}

/* Launches the group open on this thread, whichever communicator it belongs
 * to. A failure stays with that communicator, whose waits report it. */
static void flush_group(void) {
    if (group_owner) (void)close_group(group_owner, "isend/irecv group", -1);
}

/* Every op but isend/irecv into an open group starts here. */
static moe_status begin_op(nccl_comm *c, const char *op, int peer) {
    flush_group();
    return check_usable(c, op, peer);
}

static moe_status begin_collective(nccl_comm *c, const moe_comm_request *req, int *slot) {
    MOE_TRY(begin_op(c, req->op, -1));
    return take_slot(c, req->op, slot);
}

/* After the NCCL call `call` returned r: waits for its enqueue, records the
 * event of slot after it and puts req in flight on it. */
static moe_status launched(nccl_comm *c, moe_comm_request *req, int slot, ncclResult_t r,
                           const char *call, int line) {
    c->queued = true;
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_failed(c, req->op, req->peer, call, r, line);
    MOE_TRY(settle(c, req->op, req->peer, NULL));
    CUDA_CALL(c, req->op, req->peer, cudaEventRecord(c->events[slot], c->stream));
    attach(c, req, slot);
    return MOE_OK;
}

#define LAUNCH(c, req, slot, call) launched((c), (req), (slot), (call), #call, __LINE__)

/* ---------------------------------------------------------------- requests */

/* Launches the group open on this thread: req's own on its behalf, any
 * other for the communicator it belongs to. */
static moe_status begin_wait(nccl_comm *c, const moe_comm_request *req) {
    if (req->slot == c->open_slot)
        MOE_TRY(close_group(c, req->op, req->peer));
    else
        flush_group();
    return check_usable(c, req->op, req->peer);
}

static moe_status nccl_wait(moe_comm_request *req) {
    nccl_comm *c = as_nccl(req->comm);
    moe_status st = begin_wait(c, req);
    if (st == MOE_OK) st = settle(c, req->op, req->peer, req->handle.ptr);
    release(c, req);
    return st;
}

static moe_status nccl_test(moe_comm_request *req, bool *done) {
    nccl_comm *c = as_nccl(req->comm);
    *done = false;
    moe_status st = begin_wait(c, req);
    if (st == MOE_OK) st = query(c, req->op, req->peer, req->handle.ptr, done);
    if (st != MOE_OK || *done) release(c, req);
    return st;
}

/* ---------------------------------------------------------------- creation */

/* A communicator at like's place (rank, size and timeout, which NCCL
 * confirms once it is initialised), with nothing on the device yet. */
static nccl_comm *comm_new(const moe_comm *like) {
    nccl_comm *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->base = (moe_comm){.backend = &nccl_backend,
                         .rank = like->rank,
                         .size = like->size,
                         .world_rank = like->world_rank,
                         .timeout_seconds = like->timeout_seconds};
    c->open_slot = -1;
    c->next_live = live_comms;
    live_comms = c;
    return c;
}

static moe_status use_device(nccl_comm *c, int device) {
    int n = 0;
    CUDA_CALL(c, "create", -1, cudaGetDeviceCount(&n));
    if (device < 0 || device >= n)
        return fail(c, MOE_ERR_INVALID_ARG, "create", -1,
                    "device=%d, but this process sees %d CUDA device%s", device, n,
                    n == 1 ? "" : "s");
    CUDA_CALL(c, "create", -1, cudaSetDevice(device));
    c->device = device;
    return MOE_OK;
}

/* The stream (stream, or one of c's own when NULL), the event pool and the
 * barrier's scratch, on the current device. */
static moe_status add_resources(nccl_comm *c, cudaStream_t stream, const char *op) {
    if (stream) {
        c->stream = stream;
    } else {
        CUDA_CALL(c, op, -1, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
        c->owns_stream = true;
    }
    for (int s = 0; s < NCCL_EVENT_SLOTS; s++)
        CUDA_CALL(c, op, -1, cudaEventCreateWithFlags(&c->events[s], cudaEventDisableTiming));
    CUDA_CALL(c, op, -1, cudaMalloc((void **)&c->scratch, sizeof *c->scratch));
    CUDA_CALL(c, op, -1, cudaMemsetAsync(c->scratch, 0, sizeof *c->scratch, c->stream));
    return MOE_OK;
}

static moe_status make_id(nccl_comm *c, ncclUniqueId *id) {
    NCCL_CALL(c, "create", -1, ncclGetUniqueId(id));
    return MOE_OK;
}

/* Rank 0's NCCL unique id, broadcast over bootstrap, then a count of the
 * ranks that failed to set up. Every rank joins both even after a failure
 * of its own (st), so that a failure on any rank reaches the others at once
 * rather than after their timeout in ncclCommInitRankConfig. The count is of
 * set-up failures only, and is read first: rank 0 makes no id when its own
 * set-up failed, and the others' message then blames the set-up, not the
 * id. */
static moe_status share_id(nccl_comm *c, moe_comm *bootstrap, moe_status st, ncclUniqueId *id) {
    struct {
        ncclUniqueId id;
        int32_t ok;
    } msg;
    memset(&msg, 0, sizeof msg);
    int32_t failed = st != MOE_OK;
    if (st == MOE_OK && c->base.rank == 0) {
        st = make_id(c, &msg.id);
        msg.ok = st == MOE_OK;
    }
    char mine[FAILURE_BYTES + 64] = "";
    if (st != MOE_OK) snprintf(mine, sizeof mine, "%s", moe_last_error());
    moe_status sent = moe_comm_broadcast(bootstrap, &msg, (int64_t)sizeof msg, MOE_COMM_BYTES, 0);
    if (sent == MOE_OK) sent = moe_comm_allreduce_sum(bootstrap, &failed, 1, MOE_COMM_I32);
    if (st != MOE_OK) return moe_error(st, "%s", mine);
    if (sent != MOE_OK)
        return moe_error_prefix(sent, "nccl create, rank %d of %d (world %d): sending NCCL's "
                                "unique id over the %s communicator: ",
                                c->base.rank, c->base.size, c->base.world_rank,
                                moe_comm_backend_name(bootstrap));
    if (failed > 0)
        return fail(c, MOE_ERR_COMM, "create", -1,
                    "%d other rank%s could not set up their device or stream (their own errors "
                    "say why)",
                    (int)failed, failed == 1 ? "" : "s");
    if (!msg.ok)
        return fail(c, MOE_ERR_COMM, "create", -1,
                    "rank 0 could not make NCCL's unique id (its own error says why)");
    *id = msg.id;
    return MOE_OK;
}

static moe_status join(nccl_comm *c, ncclUniqueId id) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    NCCL_CALL(c, "create", -1,
              ncclCommInitRankConfig(&c->nccl, c->base.size, id, c->base.rank, &config));
    return settle(c, "create", -1, NULL);
}

static void nccl_free(moe_comm *comm);

moe_status moe_comm_nccl_create(moe_comm **comm, moe_comm *bootstrap, int device,
                                void *cuda_stream) {
    if (!comm) return moe_error(MOE_ERR_INVALID_ARG, "nccl_create: comm is NULL");
    *comm = NULL;
    if (!bootstrap) return moe_error(MOE_ERR_INVALID_ARG, "nccl_create: bootstrap is NULL");
    if (bootstrap->backend == &nccl_backend)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "nccl_create: bootstrap is an nccl communicator; the unique id travels "
                         "in host memory, over mpi or local");
    flush_group();
    nccl_comm *c = comm_new(bootstrap);
    if (!c)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "nccl_create: %zu bytes", sizeof(nccl_comm));
    moe_status st = use_device(c, device);
    if (st == MOE_OK) st = add_resources(c, (cudaStream_t)cuda_stream, "create");
    ncclUniqueId id = {{0}};
    st = share_id(c, bootstrap, st, &id);
    if (st == MOE_OK) st = join(c, id);
    if (st != MOE_OK) {
        nccl_free(&c->base);
        return st;
    }
    *comm = &c->base;
    return MOE_OK;
}

/* child: made by comm_new(c), on c's device and stream. */
static moe_status split_into(nccl_comm *child, nccl_comm *c, int color, int key) {
    CUDA_CALL(child, "split", -1, cudaSetDevice(c->device));
    child->device = c->device;
    MOE_TRY(add_resources(child, c->stream, "split"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    NCCL_CALL(c, "split", -1, ncclCommSplit(c->nccl, color, key, &child->nccl, &config));
    /* The parent first: a non-blocking split may hand out the child's
     * handle only once the parent's part is done (NCCL 2.28 does). */
    MOE_TRY(settle(c, "split", -1, NULL));
    if (!child->nccl)
        return fail(c, MOE_ERR_COMM, "split", -1, "ncclCommSplit completed without a communicator");
    MOE_TRY(settle(child, "split", -1, NULL));
    NCCL_CALL(child, "split", -1, ncclCommUserRank(child->nccl, &child->base.rank));
    NCCL_CALL(child, "split", -1, ncclCommCount(child->nccl, &child->base.size));
    return MOE_OK;
}

/* The new communicator shares comm's stream. A split that fails or times out
 * fails comm too: its ranks no longer agree on the order of ops. */
static moe_status nccl_split(moe_comm **out, moe_comm *comm, int color, int key) {
    nccl_comm *c = as_nccl(comm);
    MOE_TRY(begin_op(c, "split", -1));
    nccl_comm *child = comm_new(comm);
    if (!child) return moe_error(MOE_ERR_OUT_OF_MEMORY, "nccl split: %zu bytes", sizeof *child);
    moe_status st = split_into(child, c, color, key);
    if (st != MOE_OK) {
        mark_failed(c, moe_last_error());
        mark_failed(child, c->failure);
        nccl_free(&child->base);
        return st;
    }
    *out = &child->base;
    return MOE_OK;
}

/* Flushes c's work (bounded by its timeout) before ncclCommDestroy. */
static moe_status finalize(nccl_comm *c) {
    NCCL_CALL(c, "free", -1, ncclCommFinalize(c->nccl));
    return settle(c, "free", -1, NULL);
}

/* Statuses are ignored from here on: there is nobody left to tell, and a
 * communicator that fails to finalise is aborted instead. */
static void nccl_free(moe_comm *comm) {
    nccl_comm *c = as_nccl(comm);
    flush_group();
    for (nccl_comm **at = &live_comms; *at; at = &(*at)->next_live)
        if (*at == c) {
            *at = c->next_live;
            break;
        }
    if (c->nccl && finalize(c) == MOE_OK) (void)ncclCommDestroy(c->nccl);
    for (int s = 0; s < NCCL_EVENT_SLOTS; s++)
        if (c->events[s]) (void)cudaEventDestroy(c->events[s]);
    if (c->scratch) (void)cudaFree(c->scratch);
    if (c->owns_stream && c->stream) (void)cudaStreamDestroy(c->stream);
    free(c);
}

/* Ends this rank's NCCL work; the peers see it as a remote error or a
 * timeout. A job under mpirun ends the others through its mpi communicator.
 * The process exits next, so another communicator's open group is aborted
 * with it rather than launched. */
static void nccl_abort(moe_comm *comm, int code) {
    (void)code;
    if (group_owner && group_owner != as_nccl(comm))
        mark_failed(group_owner, "aborted by moe_comm_abort on another communicator");
    mark_failed(as_nccl(comm), "aborted by moe_comm_abort");
}

/* ------------------------------------------------------------- collectives */

/* Posts the receive of recv_count elements from peer j and the send of
 * send_count to it, skipping empty ones, into the open group. */
static moe_status post_pair(nccl_comm *c, const char *op, int j, void *recv, int64_t recv_count,
                            const void *send, int64_t send_count, moe_comm_dtype dtype) {
    if (recv_count > 0)
        NCCL_CALL(c, op, j,
                  ncclRecv(recv, (size_t)recv_count, nccl_type(dtype), j, c->nccl, c->stream));
    if (send_count > 0)
        NCCL_CALL(c, op, j,
                  ncclSend(send, (size_t)send_count, nccl_type(dtype), j, c->nccl, c->stream));
    return MOE_OK;
}

static moe_status nccl_ialltoall(moe_comm *comm, moe_comm_request *req, void *recv,
                                 const void *send, int64_t count, moe_comm_dtype dtype) {
    nccl_comm *c = as_nccl(comm);
    if (!extent_fits(0, count, moe_comm_dtype_size(dtype) * comm->size)) {
        char where[WHERE_BYTES];
        describe(c, req->op, -1, where, sizeof where);
        return moe_error(MOE_ERR_INVALID_ARG, "%s: count=%lld times %d ranks overflows a byte "
                         "offset",
                         where, (long long)count, comm->size);
    }
    MOE_TRY(begin_op(c, req->op, -1));
    MOE_TRY(open_group(c, req->op, -1));
    const int slot = c->open_slot;
    for (int j = 0; j < comm->size; j++)
        MOE_TRY(post_pair(c, req->op, j, at(recv, j * count, dtype), count,
                          at_const(send, j * count, dtype), count, dtype));
    MOE_TRY(close_group(c, req->op, -1));
    attach(c, req, slot);
    return MOE_OK;
}

/* Each count and displacement of one side addresses bytes within int64_t. */
static moe_status check_extents(const nccl_comm *c, const char *op, const int64_t *counts,
                                const int64_t *displs, moe_comm_dtype dtype, const char *side) {
    for (int j = 0; j < c->base.size; j++) {
        if (extent_fits(displs[j], counts[j], moe_comm_dtype_size(dtype))) continue;
        char where[WHERE_BYTES];
        describe(c, op, -1, where, sizeof where);
        return moe_error(MOE_ERR_INVALID_ARG,
                         "%s: %s_displs[%d]=%lld + %s_counts[%d]=%lld overflows a byte offset",
                         where, side, j, (long long)displs[j], side, j, (long long)counts[j]);
    }
    return MOE_OK;
}

static moe_status nccl_ialltoallv(moe_comm *comm, moe_comm_request *req, void *recv,
                                  const int64_t *recv_counts, const int64_t *recv_displs,
                                  const void *send, const int64_t *send_counts,
                                  const int64_t *send_displs, moe_comm_dtype dtype) {
    nccl_comm *c = as_nccl(comm);
    const int me = comm->rank;
    /* NCCL fails a send to self without its receive, or the reverse, only
     * once the group is launched, which aborts the communicator. */
    if (send_counts[me] != recv_counts[me]) {
        char where[WHERE_BYTES];
        describe(c, req->op, -1, where, sizeof where);
        return moe_error(MOE_ERR_INVALID_ARG,
                         "%s: send_counts[%d]=%lld but recv_counts[%d]=%lld: what a rank sends "
                         "itself is what it receives",
                         where, me, (long long)send_counts[me], me, (long long)recv_counts[me]);
    }
    MOE_TRY(check_extents(c, req->op, recv_counts, recv_displs, dtype, "recv"));
    MOE_TRY(check_extents(c, req->op, send_counts, send_displs, dtype, "send"));
    MOE_TRY(begin_op(c, req->op, -1));
    MOE_TRY(open_group(c, req->op, -1));
    const int slot = c->open_slot;
    for (int j = 0; j < comm->size; j++)
        MOE_TRY(post_pair(c, req->op, j, at(recv, recv_displs[j], dtype), recv_counts[j],
                          at_const(send, send_displs[j], dtype), send_counts[j], dtype));
    MOE_TRY(close_group(c, req->op, -1));
    attach(c, req, slot);
    return MOE_OK;
}

static moe_status nccl_iallreduce_sum(moe_comm *comm, moe_comm_request *req, void *buf,
                                      int64_t count, moe_comm_dtype dtype) {
    nccl_comm *c = as_nccl(comm);
    int slot = 0;
    MOE_TRY(begin_collective(c, req, &slot));
    return LAUNCH(c, req, slot,
                  ncclAllReduce(buf, buf, (size_t)count, nccl_type(dtype), ncclSum, c->nccl,
                                c->stream));
}

static moe_status nccl_ireduce_scatter_sum(moe_comm *comm, moe_comm_request *req, void *recv,
                                           const void *send, int64_t recv_count,
                                           moe_comm_dtype dtype) {
    nccl_comm *c = as_nccl(comm);
    int slot = 0;
    MOE_TRY(begin_collective(c, req, &slot));
    return LAUNCH(c, req, slot,
                  ncclReduceScatter(send, recv, (size_t)recv_count, nccl_type(dtype), ncclSum,
                                    c->nccl, c->stream));
}

static moe_status nccl_iallgather(moe_comm *comm, moe_comm_request *req, void *recv,
                                  const void *send, int64_t count, moe_comm_dtype dtype) {
    nccl_comm *c = as_nccl(comm);
    int slot = 0;
    MOE_TRY(begin_collective(c, req, &slot));
    return LAUNCH(c, req, slot,
                  ncclAllGather(send, recv, (size_t)count, nccl_type(dtype), c->nccl, c->stream));
}

static moe_status nccl_ibroadcast(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                                  moe_comm_dtype dtype, int root) {
    nccl_comm *c = as_nccl(comm);
    int slot = 0;
    MOE_TRY(begin_collective(c, req, &slot));
    return LAUNCH(c, req, slot,
                  ncclBroadcast(buf, buf, (size_t)count, nccl_type(dtype), root, c->nccl,
                                c->stream));
}

/* NCCL has no barrier: an all-reduce of one int completes only once every
 * rank has joined it. */
static moe_status nccl_ibarrier(moe_comm *comm, moe_comm_request *req) {
    nccl_comm *c = as_nccl(comm);
    int slot = 0;
    MOE_TRY(begin_collective(c, req, &slot));
    return LAUNCH(c, req, slot,
                  ncclAllReduce(c->scratch, c->scratch, 1, ncclInt32, ncclSum, c->nccl,
                                c->stream));
}

/* ---------------------------------------------------------- point to point */

/* Opens a group on c unless c's is the one open. */
static moe_status join_group(nccl_comm *c, const moe_comm_request *req) {
    if (group_owner == c) return MOE_OK;
    MOE_TRY(begin_op(c, req->op, req->peer));
    return open_group(c, req->op, req->peer);
}

/* The tag is ignored: see moe_comm_nccl_create. */
static moe_status nccl_isend(moe_comm *comm, moe_comm_request *req, const void *buf,
                             int64_t count, moe_comm_dtype dtype, int peer, int tag) {
    (void)tag;
    nccl_comm *c = as_nccl(comm);
    MOE_TRY(join_group(c, req));
    if (count > 0)
        NCCL_CALL(c, req->op, peer,
                  ncclSend(buf, (size_t)count, nccl_type(dtype), peer, c->nccl, c->stream));
    attach(c, req, c->open_slot);
    return MOE_OK;
}

static moe_status nccl_irecv(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                             moe_comm_dtype dtype, int peer, int tag) {
    (void)tag;
    nccl_comm *c = as_nccl(comm);
    MOE_TRY(join_group(c, req));
    if (count > 0)
        NCCL_CALL(c, req->op, peer,
                  ncclRecv(buf, (size_t)count, nccl_type(dtype), peer, c->nccl, c->stream));
    attach(c, req, c->open_slot);
    return MOE_OK;
}

static const moe_comm_backend nccl_backend = {
    .name = "nccl",
    .matches_by_tag = false,
    .split = nccl_split,
    .ialltoall = nccl_ialltoall,
    .ialltoallv = nccl_ialltoallv,
    .iallreduce_sum = nccl_iallreduce_sum,
    .ireduce_scatter_sum = nccl_ireduce_scatter_sum,
    .iallgather = nccl_iallgather,
    .ibroadcast = nccl_ibroadcast,
    .ibarrier = nccl_ibarrier,
    .isend = nccl_isend,
    .irecv = nccl_irecv,
    .wait = nccl_wait,
    .test = nccl_test,
    .abort = nccl_abort,
    .free = nccl_free,
};

#else /* !MOE_HAVE_NCCL */

#include "comm/comm.h"
#include "common/status.h"

moe_status moe_comm_nccl_create(moe_comm **comm, moe_comm *bootstrap, int device,
                                void *cuda_stream) {
    (void)bootstrap;
    (void)device;
    (void)cuda_stream;
    if (comm) *comm = NULL;
    return moe_error(MOE_ERR_UNSUPPORTED,
                     "nccl_create: libmoe was built without NCCL (configure with MOE_CUDA on "
                     "and -DMOE_NCCL=ON after installing NCCL >= 2.28: libnccl-dev, or set "
                     "NCCL_ROOT)");
}

#endif /* MOE_HAVE_NCCL */
