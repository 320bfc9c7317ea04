/* comm_mpi.c: the MPI communicator, host memory. Every op is an MPI
 * non-blocking call followed, when blocking, by a polled wait with a
 * deadline, so a dead or stuck peer gives MOE_ERR_COMM with its name instead
 * of a hang. MPI_ERRORS_RETURN is set on every communicator made here, and
 * every MPI failure is reported with MPI_Error_string's text. */
#ifdef MOE_HAVE_MPI

#define _POSIX_C_SOURCE 200809L /* nanosleep */

#include <mpi.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "common/clock.h"
#include "common/status.h"

/* ialltoallv calls in flight at once per communicator; MPI reads their int
 * count arrays until completion, so each holds a slot of them. */
#define MPI_VECTOR_SLOTS 8
/* A wait first tests back to back, as MPI_Wait does: MPI progresses a
 * transfer only inside its calls, so a rank asleep stalls its peers too.
 * Yielding the core is left to MPI, which yields when idle once ranks
 * outnumber cores; a sched_yield() of our own between tests made 4-8 MiB
 * exchanges several times slower on a loaded 2-core machine. A step's
 * exchanges end within this; the CPU it burns is MPI_Wait's. */
#define POLL_SPIN_SECONDS 0.1
/* Past it, a wait is long (a pipeline bubble, a dead peer) and sleeps
 * between tests for 1/POLL_SLEEP_DIVISOR of the time waited so far, within
 * [POLL_SLEEP_MIN_NS, POLL_SLEEP_MAX_NS]: little CPU burnt, and at most ~1%
 * added to the wait. */
#define POLL_SLEEP_DIVISOR 100
#define POLL_SLEEP_MIN_NS 10000L
#define POLL_SLEEP_MAX_NS 1000000L
#define FAILURE_BYTES 768

/* After a collective times out, the ranks waiting in it hold a roll call, so
 * that the message can name the ranks that are not there: each sends every
 * other rank one "here" and listens for theirs. Only a rank whose own wait
 * on a collective of this communicator timed out answers, so silence means
 * dead, stuck, elsewhere, or late to join.
 *
 * Its messages travel on the communicator itself under tags above every tag
 * a caller may use (comm.c keeps those within MOE_COMM_TAG_MAX), so they
 * never match a caller's receive, and MPI keeps collectives' traffic apart
 * from point-to-point traffic. A private duplicate would do the same at the
 * price of a collective MPI_Comm_dup at every creation and a second context
 * id per communicator; the tags cost nothing until a timeout. The tag is
 * ROLL_CALL_TAG plus the collective's number among those started on the
 * communicator (modulo the tags MPI_TAG_UB leaves): ranks of one program
 * call collectives in the same order, so ranks waiting in the same one
 * match, whatever else they have started since, and a "here" left
 * unreceived from an earlier roll call is never taken for an answer to a
 * later one. MPI promises tags only up to
 * 32767: where MPI_TAG_UB is that low, no roll call. */
#define ROLL_CALL_TAG (MOE_COMM_TAG_MAX + 1)
/* The ranks' timeouts expire as far apart as they entered the collective, so
 * the roll call lasts long enough for a rank that entered a little later
 * than this one to time out and answer: a tenth of the timeout, which a user
 * sets far above any legitimate wait, hence above the usual skew between
 * ranks. At least ROLL_CALL_MIN_SECONDS, to absorb scheduling noise on
 * loaded or oversubscribed nodes; at most ROLL_CALL_MAX_SECONDS, so that the
 * error still comes promptly after a long timeout (300 s by default). A rank
 * later than that is named as not answering, with "late" among the reasons;
 * when every rank answers, the roll call ends at once. */
#define ROLL_CALL_TIMEOUT_FRACTION 0.1
#define ROLL_CALL_MIN_SECONDS 0.5
#define ROLL_CALL_MAX_SECONDS 10.0
/* Silent ranks named in a message; more are counted ("and 40 more"), so that
 * the message fits FAILURE_BYTES on any communicator. */
#define ROLL_CALL_NAMED 8

typedef struct mpi_comm {
    moe_comm base;
    MPI_Comm comm;
    int *vectors;          /* [MPI_VECTOR_SLOTS][4][size]: counts and displs */
    unsigned vectors_busy; /* bit s set: slot s belongs to an ialltoallv */
    int64_t collectives;   /* started on this communicator: the roll call's tag */
    /* Non-empty once a wait on this communicator timed out: matching of later
     * ops is no longer trustworthy, so every op refuses with this text. */
    char failure[FAILURE_BYTES];
} mpi_comm;

/* Whether moe_comm_mpi_create() called MPI_Init_thread, so that
 * moe_comm_mpi_finalize() finalises only what libmoe started. */
static bool mpi_started_here;

_Static_assert(sizeof(MPI_Request) <= sizeof(((moe_comm_request *)0)->handle),
               "moe_comm_request.handle must hold an MPI_Request");

static mpi_comm *as_mpi(moe_comm *comm) { return (mpi_comm *)comm; }

static const moe_comm_backend mpi_backend;

/* ----------------------------------------------------------------- messages */

static void mpi_error_text(int code, char *text, size_t size) {
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, buf, &len) == MPI_SUCCESS)
        snprintf(text, size, "%.*s", len, buf);
    else
        snprintf(text, size, "MPI error code %d", code);
}

/* world [n] = the ranks in MPI_COMM_WORLD of ranks [n] of c; -1 where MPI
 * cannot say. */
static void world_ranks_of(int *world, const mpi_comm *c, const int *ranks, int n) {
    MPI_Group group, world_group;
    bool ok = false;
    if (MPI_Comm_group(c->comm, &group) == MPI_SUCCESS) {
        if (MPI_Comm_group(MPI_COMM_WORLD, &world_group) == MPI_SUCCESS) {
            ok = MPI_Group_translate_ranks(group, n, ranks, world_group, world) == MPI_SUCCESS;
            MPI_Group_free(&world_group);
        }
        MPI_Group_free(&group);
    }
    for (int i = 0; i < n; i++)
        if (!ok || world[i] == MPI_UNDEFINED) world[i] = -1;
}

/* peer's rank in MPI_COMM_WORLD, or -1 when MPI cannot say. */
static int world_rank_of(const mpi_comm *c, int peer) {
    int out = -1;
    world_ranks_of(&out, c, &peer, 1);
    return out;
}

/* "mpi alltoallv, rank 1 of 4 (world 1)" and ", peer 3 (world 3)". */
static void describe(const mpi_comm *c, const char *op, int peer, char *text, size_t size) {
    int n = snprintf(text, size, "mpi %s, rank %d of %d (world %d)", op, c->base.rank,
                     c->base.size, c->base.world_rank);
    if (peer >= 0 && n >= 0 && (size_t)n < size)
        snprintf(text + n, size - (size_t)n, ", peer %d (world %d)", peer,
                 world_rank_of(c, peer));
}

/* The failure of MPI function `call` with error code `code`. */
static moe_status mpi_fail(const mpi_comm *c, const char *op, int peer, const char *call,
                           int code) {
    char where[256], text[MPI_MAX_ERROR_STRING + 32];
    describe(c, op, peer, where, sizeof where);
    mpi_error_text(code, text, sizeof text);
    return moe_error(MOE_ERR_COMM, "%s: %s: %s", where, call, text);
}

static moe_status check_usable(const mpi_comm *c, const char *op, int peer) {
    if (!c->failure[0]) return MOE_OK;
    char where[256];
    describe(c, op, peer, where, sizeof where);
    return moe_error(MOE_ERR_COMM, "%s: refused: this communicator failed earlier: %s", where,
                     c->failure);
}

/* ------------------------------------------------------------------ values */

static MPI_Datatype mpi_type(moe_comm_dtype dtype) {
    switch (dtype) {
    case MOE_COMM_F32: return MPI_FLOAT;
    case MOE_COMM_F64: return MPI_DOUBLE;
    case MOE_COMM_I32: return MPI_INT32_T;
    case MOE_COMM_I64: return MPI_INT64_T;
    case MOE_COMM_BYTES:
    case MOE_COMM_DTYPE_COUNT: break;
    }
    return MPI_BYTE;
}

/* MPI counts and displacements are int. */
static moe_status fit_int(const mpi_comm *c, const char *op, const char *what, int index,
                          int64_t v, int *out) {
    if (v > INT_MAX) {
        char where[256];
        describe(c, op, -1, where, sizeof where);
        if (index >= 0)
            return moe_error(MOE_ERR_INVALID_ARG,
                             "%s: %s[%d]=%lld exceeds MPI's int limit INT_MAX=%d", where, what,
                             index, (long long)v, INT_MAX);
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %s=%lld exceeds MPI's int limit INT_MAX=%d",
                         where, what, (long long)v, INT_MAX);
    }
    *out = (int)v;
    return MOE_OK;
}

static MPI_Request get_request(const moe_comm_request *req) {
    MPI_Request r;
    memcpy(&r, &req->handle, sizeof r);
    return r;
}

static void set_request(moe_comm_request *req, MPI_Request r) {
    memcpy(&req->handle, &r, sizeof r);
}

/* Marks req in flight after MPI call `call` returned code with request r. */
static moe_status started(mpi_comm *c, moe_comm_request *req, const char *call, int code,
                          MPI_Request r) {
    if (code != MPI_SUCCESS) return mpi_fail(c, req->op, req->peer, call, code);
    set_request(req, r);
    req->comm = &c->base;
    if (req->peer < 0) req->seq = c->collectives++;
    return MOE_OK;
}

/* ------------------------------------------------------------------ waiting */

/* Tests r until it completes or timeout_seconds pass. Returns the MPI code of
 * the last test; *done says whether r completed. */
static int poll_request(MPI_Request *r, double timeout_seconds, bool *done) {
    const double start = moe_monotonic_seconds();
    for (;;) {
        int flag = 0;
        int code = MPI_Test(r, &flag, MPI_STATUS_IGNORE);
        if (code != MPI_SUCCESS || flag) {
            *done = flag != 0;
            return code;
        }
        double elapsed = moe_monotonic_seconds() - start;
        if (elapsed >= timeout_seconds) {
            *done = false;
            return MPI_SUCCESS;
        }
        if (elapsed >= POLL_SPIN_SECONDS) {
            long ns = (long)(elapsed * 1e9 / POLL_SLEEP_DIVISOR);
            ns = ns < POLL_SLEEP_MIN_NS ? POLL_SLEEP_MIN_NS : ns;
            struct timespec ts = {0, ns < POLL_SLEEP_MAX_NS ? ns : POLL_SLEEP_MAX_NS};
            nanosleep(&ts, NULL);
        }
    }
}

static void release(mpi_comm *c, moe_comm_request *req) {
    if (req->slot >= 0) c->vectors_busy &= ~(1u << req->slot);
    req->slot = -1;
    req->comm = NULL;
}

/* The roll call after a collective timed out (see ROLL_CALL_TAG): sends
 * "here" to every other rank and listens for theirs for window_seconds, or
 * until all have answered. silent [size]: its first entries receive the
 * ranks not heard from, in increasing order. Returns how many, or -1 when
 * the roll call could not be held. */
static int roll_call(int *silent, mpi_comm *c, int64_t seq, double window_seconds) {
    /* Static: a send to a dead rank may never complete, so it is never
     * waited for, and its buffer must outlive this call. */
    static const int here = 1;
    const int n = c->base.size, me = c->base.rank;
    /* An attribute of MPI_COMM_WORLD only (a duplicate does not copy it),
     * valid on every communicator. */
    int *tag_ub = NULL, has_tag_ub = 0;
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub) != MPI_SUCCESS ||
        !has_tag_ub || *tag_ub < ROLL_CALL_TAG)
        return -1;
    const int tag = ROLL_CALL_TAG + (int)(seq % (*tag_ub - MOE_COMM_TAG_MAX));
    MPI_Request *recvs = malloc((size_t)n * sizeof *recvs);
    int *answers = calloc((size_t)n, sizeof *answers); /* [n]: `here` once heard from */
    if (!recvs || !answers) {
        free(recvs);
        free(answers);
        return -1;
    }
    int code = MPI_SUCCESS, pending = 0;
    for (int j = 0; j < n; j++) recvs[j] = MPI_REQUEST_NULL;
    for (int j = 0; j < n && code == MPI_SUCCESS; j++)
        if (j != me) {
            code = MPI_Irecv(&answers[j], 1, MPI_INT, j, tag, c->comm, &recvs[j]);
            pending += code == MPI_SUCCESS;
        }
    /* One int goes eagerly: the send completes on its own, or never for a
     * dead peer, so the request is let go at once. A failed send (a peer
     * whose connection broke) only means that peer will not hear from us. */
    for (int j = 0; j < n && code == MPI_SUCCESS; j++) {
        MPI_Request s = MPI_REQUEST_NULL;
        if (j != me && MPI_Isend(&here, 1, MPI_INT, j, tag, c->comm, &s) == MPI_SUCCESS)
            MPI_Request_free(&s);
    }
    const double start = moe_monotonic_seconds();
    while (code == MPI_SUCCESS && pending > 0) {
        for (int j = 0; j < n; j++) {
            if (recvs[j] == MPI_REQUEST_NULL) continue;
            int done = 0;
            /* A receive that fails (a peer whose connection broke) ends
             * with that peer silent, not with the roll call; MPI may keep a
             * failed request, so it is let go (see the cancel below). */
            if (MPI_Test(&recvs[j], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
                MPI_Cancel(&recvs[j]);
                MPI_Wait(&recvs[j], MPI_STATUS_IGNORE);
                recvs[j] = MPI_REQUEST_NULL;
                done = 1;
            }
            pending -= done != 0;
        }
        if (pending == 0 || moe_monotonic_seconds() - start >= window_seconds) break;
        struct timespec ts = {0, POLL_SLEEP_MAX_NS};
        nanosleep(&ts, NULL);
    }
    for (int j = 0; j < n; j++)
        if (recvs[j] != MPI_REQUEST_NULL) MPI_Cancel(&recvs[j]);
    /* MPI makes the wait for a cancelled receive local: it returns whatever
     * the other ranks do. A receive matched before the cancel completes
     * instead, and its rank counts as heard. */
    MPI_Waitall(n, recvs, MPI_STATUSES_IGNORE);
    int count = 0;
    for (int j = 0; j < n; j++)
        if (j != me && answers[j] != here) silent[count++] = j;
    free(recvs);
    free(answers);
    return code == MPI_SUCCESS ? count : -1;
}

/* "ranks 1 (world 2), 3 (world 5) and 4 (world 7)" into text [size], for the
 * ranks [count] of c. */
static void name_ranks(char *text, size_t size, const mpi_comm *c, const int *ranks, int count) {
    const int named = count < ROLL_CALL_NAMED ? count : ROLL_CALL_NAMED;
    int world[ROLL_CALL_NAMED];
    world_ranks_of(world, c, ranks, named);
    size_t at = 0;
    for (int i = 0; i < named && at < size; i++) {
        const char *sep = i == 0 ? (count == 1 ? "rank " : "ranks ")
                          : i == count - 1 ? " and "
                                           : ", ";
        int len = snprintf(text + at, size - at, "%s%d (world %d)", sep, ranks[i], world[i]);
        if (len < 0) return;
        at += (size_t)len;
    }
    if (count > named && at < size) snprintf(text + at, size - at, " and %d more", count - named);
}

/* The failure text of a collective that timed out: the roll call's
 * outcome, or, when it could not be held, only what one rank knows. */
static void collective_timed_out(mpi_comm *c, int64_t seq, const char *where) {
    const int n = c->base.size;
    const double timeout = c->base.timeout_seconds;
    double window = timeout * ROLL_CALL_TIMEOUT_FRACTION;
    window = window < ROLL_CALL_MIN_SECONDS   ? ROLL_CALL_MIN_SECONDS
             : window > ROLL_CALL_MAX_SECONDS ? ROLL_CALL_MAX_SECONDS
                                              : window;
    int *silent = malloc((size_t)n * sizeof *silent);
    const int count = silent ? roll_call(silent, c, seq, window) : -1;
    if (count < 0) {
        snprintf(c->failure, sizeof c->failure,
                 "%s: not complete after %g s: %s has not joined it (dead, stuck, or in "
                 "another operation)",
                 where, timeout, n == 2 ? "the other rank" : "at least one of the other ranks");
    } else if (count == 0) {
        /* Every rank answered: they are waiting in it now, or (this rank
         * joining after they gave up) their answers from their own roll
         * call were waiting here. */
        snprintf(c->failure, sizeof c->failure,
                 "%s: not complete after %g s, though every rank answered a roll call: the "
                 "ranks called it with mismatched arguments, it needs longer than the timeout, "
                 "or this rank joined it after the others had timed out in it",
                 where, timeout);
    } else {
        char names[256], answered[64];
        name_ranks(names, sizeof names, c, silent, count);
        const int others = n - 1 - count;
        if (others == 0)
            snprintf(answered, sizeof answered, "no answer to");
        else if (others == 1)
            snprintf(answered, sizeof answered, "the other rank, waiting in it too, answered");
        else
            snprintf(answered, sizeof answered, "the other %d ranks, waiting in it too, answered",
                     others);
        /* "not answering", not "never joined": a rank that entered later
         * than the roll call, or finished its part and moved on (a
         * broadcast, an all-to-all-v with nothing to exchange with the
         * missing), is silent too. */
        snprintf(c->failure, sizeof c->failure,
                 "%s: not complete after %g s: %s %s not answering (dead, stuck, in another "
                 "operation, late to join it, or done with their part of it): %s a %g s roll "
                 "call",
                 where, timeout, names, count == 1 ? "is" : "are", answered, window);
    }
    free(silent);
}

/* Writes the timeout message, which also becomes the communicator's failure. */
static moe_status timed_out(mpi_comm *c, const moe_comm_request *req) {
    char where[256];
    describe(c, req->op, req->peer, where, sizeof where);
    /* The peer by both ranks: on a split communicator its rank there is not
     * the job rank a user looks for in the launcher's output. */
    if (req->peer >= 0)
        snprintf(c->failure, sizeof c->failure,
                 "%s: nothing heard from peer %d (world %d) after %g s (dead, stuck, or in "
                 "another operation)",
                 where, req->peer, world_rank_of(c, req->peer), c->base.timeout_seconds);
    else
        collective_timed_out(c, req->seq, where);
    return moe_error(MOE_ERR_COMM, "%s", c->failure);
}

static moe_status mpi_wait(moe_comm_request *req) {
    mpi_comm *c = as_mpi(req->comm);
    moe_status st = check_usable(c, req->op, req->peer);
    if (st != MOE_OK) {
        release(c, req);
        return st;
    }
    MPI_Request r = get_request(req);
    bool done = false;
    int code = poll_request(&r, c->base.timeout_seconds, &done);
    set_request(req, r);
    if (code != MPI_SUCCESS) {
        st = mpi_fail(c, req->op, req->peer, "MPI_Test", code);
        release(c, req);
        return st;
    }
    if (done) {
        release(c, req);
        return MOE_OK;
    }
    /* MPI cannot cancel a collective, so the request stays with MPI and the
     * slot stays busy; the communicator refuses every later op. */
    st = timed_out(c, req);
    req->comm = NULL;
    return st;
}

static moe_status mpi_test(moe_comm_request *req, bool *done) {
    mpi_comm *c = as_mpi(req->comm);
    *done = false;
    moe_status st = check_usable(c, req->op, req->peer);
    if (st != MOE_OK) {
        release(c, req);
        return st;
    }
    MPI_Request r = get_request(req);
    int flag = 0;
    int code = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    set_request(req, r);
    if (code != MPI_SUCCESS) {
        st = mpi_fail(c, req->op, req->peer, "MPI_Test", code);
        release(c, req);
        return st;
    }
    *done = flag != 0;
    if (flag) release(c, req);
    return MOE_OK;
}

/* ---------------------------------------------------------------- creation */

/* Takes ownership of handle (MPI_COMM_NULL is not one). */
static moe_status wrap(moe_comm **out, MPI_Comm handle, double timeout_seconds, const char *op) {
    int code = MPI_Comm_set_errhandler(handle, MPI_ERRORS_RETURN);
    int rank = 0, size = 0, world_rank = 0;
    if (code == MPI_SUCCESS) code = MPI_Comm_rank(handle, &rank);
    if (code == MPI_SUCCESS) code = MPI_Comm_size(handle, &size);
    if (code == MPI_SUCCESS) code = MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    if (code != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING + 32];
        mpi_error_text(code, text, sizeof text);
        MPI_Comm_free(&handle);
        return moe_error(MOE_ERR_COMM, "mpi %s: setting up the new communicator: %s", op, text);
    }
    mpi_comm *c = calloc(1, sizeof *c);
    int *vectors = calloc((size_t)MPI_VECTOR_SLOTS * 4 * (size_t)size, sizeof *vectors);
    if (!c || !vectors) {
        free(c);
        free(vectors);
        MPI_Comm_free(&handle);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "mpi %s: communicator of %d ranks", op, size);
    }
    c->base = (moe_comm){.backend = &mpi_backend,
                         .rank = rank,
                         .size = size,
                         .world_rank = world_rank,
                         .timeout_seconds = timeout_seconds};
    c->comm = handle;
    c->vectors = vectors;
    *out = &c->base;
    return MOE_OK;
}

/* A duplicate of handle, wrapped: idup rather than dup, so that a rank
 * that never arrives times out here too. */
static moe_status duplicate(moe_comm **comm, MPI_Comm handle, const char *what, const char *op) {
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Request r = MPI_REQUEST_NULL;
    int code = MPI_Comm_idup(handle, &dup, &r);
    bool done = false;
    if (code == MPI_SUCCESS) code = poll_request(&r, MOE_COMM_DEFAULT_TIMEOUT_SECONDS, &done);
    if (code != MPI_SUCCESS || !done) {
        char text[MPI_MAX_ERROR_STRING + 32];
        if (code != MPI_SUCCESS)
            mpi_error_text(code, text, sizeof text);
        else
            snprintf(text, sizeof text, "not every rank joined within %.0f s",
                     MOE_COMM_DEFAULT_TIMEOUT_SECONDS);
        return moe_error(MOE_ERR_COMM, "%s: MPI_Comm_idup(%s): %s", op, what, text);
    }
    return wrap(comm, dup, MOE_COMM_DEFAULT_TIMEOUT_SECONDS, op);
}

moe_status moe_comm_mpi_create(moe_comm **comm) {
    if (!comm) return moe_error(MOE_ERR_INVALID_ARG, "mpi_create: comm is NULL");
    *comm = NULL;
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (finalised)
        return moe_error(MOE_ERR_STATE, "mpi_create: MPI has been finalised in this process");
    if (!initialised) {
        int provided = 0;
        int code = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (code != MPI_SUCCESS) {
            char text[MPI_MAX_ERROR_STRING + 32];
            mpi_error_text(code, text, sizeof text);
            return moe_error(MOE_ERR_COMM, "mpi_create: MPI_Init_thread: %s", text);
        }
        mpi_started_here = true;
    }
    /* Open MPI reports some failures of non-blocking collectives on our
     * duplicate (a truncated message, say) through MPI_COMM_WORLD's handler,
     * which aborts the job by default: in a process whose MPI we started,
     * errors are returned there too, so they reach the caller as text. */
    if (mpi_started_here) MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    return duplicate(comm, MPI_COMM_WORLD, "MPI_COMM_WORLD", "mpi_create");
}

moe_status moe_comm_mpi_create_from(moe_comm **comm, const void *mpi_comm) {
    if (!comm) return moe_error(MOE_ERR_INVALID_ARG, "mpi_create_from: comm is NULL");
    *comm = NULL;
    if (!mpi_comm) return moe_error(MOE_ERR_INVALID_ARG, "mpi_create_from: mpi_comm is NULL");
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (!initialised || finalised)
        return moe_error(MOE_ERR_STATE, "mpi_create_from: MPI is %s in this process",
                         finalised ? "finalised" : "not initialised");
    const MPI_Comm handle = *(const MPI_Comm *)mpi_comm;
    if (handle == MPI_COMM_NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "mpi_create_from: the communicator is MPI_COMM_NULL (a rank "
                                              "left out of a split?)");
    int inter = 0;
    int code = MPI_Comm_test_inter(handle, &inter);
    if (code != MPI_SUCCESS || inter)
        return moe_error(MOE_ERR_INVALID_ARG, "mpi_create_from: %s",
                         inter ? "an intercommunicator; pass an intracommunicator" : "not a valid communicator");
    return duplicate(comm, handle, "the caller's communicator", "mpi_create_from");
}

void moe_comm_mpi_abort_job(int code) {
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (initialised && !finalised) MPI_Abort(MPI_COMM_WORLD, code);
}

moe_status moe_comm_mpi_finalize(void) {
    if (!mpi_started_here) return MOE_OK;
    mpi_started_here = false;
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (finalised) return MOE_OK;
    int code = MPI_Finalize();
    if (code != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING + 32];
        mpi_error_text(code, text, sizeof text);
        return moe_error(MOE_ERR_COMM, "mpi_finalize: MPI_Finalize: %s", text);
    }
    return MOE_OK;
}

static moe_status mpi_ibarrier(moe_comm *comm, moe_comm_request *req);

/* MPI_Comm_split has no non-blocking form: a polled barrier first makes a
 * missing rank time out here rather than hang inside the split. */
static moe_status mpi_split(moe_comm **out, moe_comm *comm, int color, int key) {
    mpi_comm *c = as_mpi(comm);
    moe_comm_request req = MOE_COMM_REQUEST_INIT;
    req.op = "split";
    MOE_TRY(mpi_ibarrier(comm, &req));
    MOE_TRY(mpi_wait(&req));
    MPI_Comm handle = MPI_COMM_NULL;
    int code = MPI_Comm_split(c->comm, color, key, &handle);
    if (code != MPI_SUCCESS) return mpi_fail(c, "split", -1, "MPI_Comm_split", code);
    return wrap(out, handle, comm->timeout_seconds, "split");
}

static void mpi_free(moe_comm *comm) {
    mpi_comm *c = as_mpi(comm);
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised) MPI_Comm_free(&c->comm);
    free(c->vectors);
    free(c);
}

static void mpi_abort(moe_comm *comm, int code) { MPI_Abort(as_mpi(comm)->comm, code); }

/* ------------------------------------------------------------- collectives */

static moe_status mpi_ialltoall(moe_comm *comm, moe_comm_request *req, void *recv,
                                const void *send, int64_t count, moe_comm_dtype dtype) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "count", -1, count, &n));
    MPI_Request r;
    int code = MPI_Ialltoall(send, n, mpi_type(dtype), recv, n, mpi_type(dtype), c->comm, &r);
    return started(c, req, "MPI_Ialltoall", code, r);
}

static moe_status mpi_ialltoallv(moe_comm *comm, moe_comm_request *req, void *recv,
                                 const int64_t *recv_counts, const int64_t *recv_displs,
                                 const void *send, const int64_t *send_counts,
                                 const int64_t *send_displs, moe_comm_dtype dtype) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    int slot = 0;
    while (slot < MPI_VECTOR_SLOTS && (c->vectors_busy & (1u << slot))) slot++;
    if (slot == MPI_VECTOR_SLOTS) {
        char where[256];
        describe(c, req->op, -1, where, sizeof where);
        return moe_error(MOE_ERR_STATE,
                         "%s: %d all-to-all-v already in flight on this communicator; wait for "
                         "one first",
                         where, MPI_VECTOR_SLOTS);
    }
    const int n = comm->size;
    int *sc = c->vectors + (size_t)slot * 4 * (size_t)n, *sd = sc + n, *rc = sd + n, *rd = rc + n;
    for (int j = 0; j < n; j++) {
        MOE_TRY(fit_int(c, req->op, "send_counts", j, send_counts[j], &sc[j]));
        MOE_TRY(fit_int(c, req->op, "send_displs", j, send_displs[j], &sd[j]));
        MOE_TRY(fit_int(c, req->op, "recv_counts", j, recv_counts[j], &rc[j]));
        MOE_TRY(fit_int(c, req->op, "recv_displs", j, recv_displs[j], &rd[j]));
    }
    MPI_Request r;
    int code = MPI_Ialltoallv(send, sc, sd, mpi_type(dtype), recv, rc, rd, mpi_type(dtype),
                              c->comm, &r);
    MOE_TRY(started(c, req, "MPI_Ialltoallv", code, r));
    c->vectors_busy |= 1u << slot;
    req->slot = slot;
    return MOE_OK;
}

static moe_status mpi_iallreduce_sum(moe_comm *comm, moe_comm_request *req, void *buf,
                                     int64_t count, moe_comm_dtype dtype) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "count", -1, count, &n));
    MPI_Request r;
    int code = MPI_Iallreduce(MPI_IN_PLACE, buf, n, mpi_type(dtype), MPI_SUM, c->comm, &r);
    return started(c, req, "MPI_Iallreduce", code, r);
}

static moe_status mpi_ireduce_scatter_sum(moe_comm *comm, moe_comm_request *req, void *recv,
                                          const void *send, int64_t recv_count,
                                          moe_comm_dtype dtype) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "recv_count", -1, recv_count, &n));
    MPI_Request r;
    int code =
        MPI_Ireduce_scatter_block(send, recv, n, mpi_type(dtype), MPI_SUM, c->comm, &r);
    return started(c, req, "MPI_Ireduce_scatter_block", code, r);
}

static moe_status mpi_iallgather(moe_comm *comm, moe_comm_request *req, void *recv,
                                 const void *send, int64_t count, moe_comm_dtype dtype) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "count", -1, count, &n));
    MPI_Request r;
    int code = MPI_Iallgather(send, n, mpi_type(dtype), recv, n, mpi_type(dtype), c->comm, &r);
    return started(c, req, "MPI_Iallgather", code, r);
}

static moe_status mpi_ibroadcast(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                                 moe_comm_dtype dtype, int root) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "count", -1, count, &n));
    MPI_Request r;
    int code = MPI_Ibcast(buf, n, mpi_type(dtype), root, c->comm, &r);
    return started(c, req, "MPI_Ibcast", code, r);
}

static moe_status mpi_ibarrier(moe_comm *comm, moe_comm_request *req) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, -1));
    MPI_Request r;
    int code = MPI_Ibarrier(c->comm, &r);
    return started(c, req, "MPI_Ibarrier", code, r);
}

/* ---------------------------------------------------------- point to point */

static moe_status mpi_isend(moe_comm *comm, moe_comm_request *req, const void *buf, int64_t count,
                            moe_comm_dtype dtype, int peer, int tag) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, peer));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "count", -1, count, &n));
    MPI_Request r;
    int code = MPI_Isend(buf, n, mpi_type(dtype), peer, tag, c->comm, &r);
    return started(c, req, "MPI_Isend", code, r);
}

static moe_status mpi_irecv(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                            moe_comm_dtype dtype, int peer, int tag) {
    mpi_comm *c = as_mpi(comm);
    MOE_TRY(check_usable(c, req->op, peer));
    int n = 0;
    MOE_TRY(fit_int(c, req->op, "count", -1, count, &n));
    MPI_Request r;
    int code = MPI_Irecv(buf, n, mpi_type(dtype), peer, tag, c->comm, &r);
    return started(c, req, "MPI_Irecv", code, r);
}

static const moe_comm_backend mpi_backend = {
    .name = "mpi",
    .matches_by_tag = true,
    .split = mpi_split,
    .ialltoall = mpi_ialltoall,
    .ialltoallv = mpi_ialltoallv,
    .iallreduce_sum = mpi_iallreduce_sum,
    .ireduce_scatter_sum = mpi_ireduce_scatter_sum,
    .iallgather = mpi_iallgather,
    .ibroadcast = mpi_ibroadcast,
    .ibarrier = mpi_ibarrier,
    .isend = mpi_isend,
    .irecv = mpi_irecv,
    .wait = mpi_wait,
    .test = mpi_test,
    .abort = mpi_abort,
    .free = mpi_free,
};

#else /* !MOE_HAVE_MPI */

#include "comm/comm.h"
#include "common/status.h"

moe_status moe_comm_mpi_create(moe_comm **comm) {
    if (comm) *comm = NULL;
    return moe_error(MOE_ERR_UNSUPPORTED,
                     "mpi_create: libmoe was built without MPI (configure with -DMOE_MPI=ON "
                     "after apt-get install libopenmpi-dev openmpi-bin)");
}

moe_status moe_comm_mpi_create_from(moe_comm **comm, const void *mpi_comm) {
    (void)mpi_comm;
    if (comm) *comm = NULL;
    return moe_error(MOE_ERR_UNSUPPORTED,
                     "mpi_create_from: libmoe was built without MPI (configure with -DMOE_MPI=ON "
                     "after apt-get install libopenmpi-dev openmpi-bin)");
}

void moe_comm_mpi_abort_job(int code) { (void)code; }

moe_status moe_comm_mpi_finalize(void) { return MOE_OK; }

#endif /* MOE_HAVE_MPI */
