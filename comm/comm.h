/* comm.h: communicators behind one table of functions. The engine and the
 * router call these, never MPI itself, so one code path runs on one rank
 * (local backend: plain copies) and on many (mpi backend: host memory).
 *
 * Conventions
 *  - Every op returns moe_status; a failure's moe_last_error() names the
 *    operation, this rank, the peer rank when there is one, and the MPI error
 *    string when MPI gave one.
 *  - Counts and displacements are in ELEMENTS of the op's datatype.
 *  - Every collective must be called by every rank of the communicator, in
 *    the same order (blocking and non-blocking ones alike), as in MPI.
 *  - Blocking ops are their non-blocking form plus moe_comm_wait(), so the
 *    communicator's timeout bounds every one of them: a peer that never shows
 *    up gives MOE_ERR_COMM, not a hang. After such a failure the
 *    communicator refuses further ops with MOE_ERR_COMM; the caller ends the
 *    job with moe_comm_abort(), or, once its communicators are freed,
 *    moe_comm_mpi_abort_job() (as moe-train does after any failure on more
 *    than one rank).
 *
 * mpi.h stays out of this header, so code built without MPI includes it too.
 */
#ifndef MOE_COMM_COMM_H
#define MOE_COMM_COMM_H

#include <stdbool.h>
#include <stdint.h>

#include "moe.h"

typedef struct moe_comm moe_comm;

typedef enum moe_comm_dtype {
    MOE_COMM_F32 = 0,
    MOE_COMM_F64,
    MOE_COMM_I32,
    MOE_COMM_I64,
    MOE_COMM_BYTES, /* raw bytes; not for reductions */
    MOE_COMM_DTYPE_COUNT
} moe_comm_dtype;

/* Bytes per element; 0 for a value outside the enum. */
int64_t moe_comm_dtype_size(moe_comm_dtype dtype);
const char *moe_comm_dtype_name(moe_comm_dtype dtype);

/* Seconds a wait may last before it gives up with MOE_ERR_COMM. */
#define MOE_COMM_DEFAULT_TIMEOUT_SECONDS 300.0
/* Tags of send/recv lie in [0, MOE_COMM_TAG_MAX], the range MPI guarantees. */
#define MOE_COMM_TAG_MAX 32767

/* A non-blocking operation in flight. The caller owns the storage, so
 * starting an op allocates nothing; zero it (MOE_COMM_REQUEST_INIT) before
 * first use. The fields belong to the backend. A request is complete, and
 * may be reused, once moe_comm_wait() returns or moe_comm_test() says done;
 * the buffers of the op must stay untouched until then. */
typedef struct moe_comm_request {
    moe_comm *comm; /* NULL: nothing in flight */
    const char *op; /* the operation's name, for messages */
    int peer;       /* the other rank, or -1 for a collective */
    int slot;       /* backend scratch held until completion, or -1 */
    int64_t seq;    /* a collective's number among those started on its communicator */
    union {
        void *ptr;
        int64_t i64;
    } handle; /* the backend's handle (an MPI_Request, a queue slot) */
} moe_comm_request;

#define MOE_COMM_REQUEST_INIT {.comm = NULL, .op = NULL, .peer = -1, .slot = -1, .seq = 0, .handle = {0}}

/* ---------------------------------------------------------------- creation */

/* One rank: every collective is a copy or nothing. */
moe_status moe_comm_local_create(moe_comm **comm);

/* All ranks of MPI_COMM_WORLD, through a duplicate of it (so our traffic never
 * matches the application's), with MPI_ERRORS_RETURN. Initialises MPI
 * (MPI_THREAD_FUNNELED) when nobody has. MOE_ERR_UNSUPPORTED when libmoe was
 * built without MPI. Collective over MPI_COMM_WORLD.
 * When a wait on a collective times out, the ranks waiting in it hold a roll
 * call before the wait returns (a tenth of the timeout, within 0.5 to 10 s;
 * less when every rank answers), so that the error names the ranks that did
 * not answer, by their rank in the communicator and in MPI_COMM_WORLD:
 * ranks missing from it, or (a broadcast, an all-to-all-v with nothing to
 * exchange with the missing) done with their part of it. */
moe_status moe_comm_mpi_create(moe_comm **comm);

/* The ranks of the caller's MPI communicator (mpi_comm points to an
 * MPI_Comm), through a duplicate of it, as above; MPI must be initialised.
 * Collective over that communicator. */
moe_status moe_comm_mpi_create_from(moe_comm **comm, const void *mpi_comm);

/* Ends every process of the MPI job (MPI_Abort on MPI_COMM_WORLD) with exit
 * status code, when MPI is initialised and not finalised; otherwise, and
 * without MPI, returns having done nothing, and the caller exits as usual.
 * Needs no communicator, so a program may free them first. Why exiting is
 * not enough: a rank that fails alone leaves the others waiting in a
 * collective until their timeout, and a rank that is stuck never exits; a
 * launcher that does not end the job when one process exits non-zero
 * (Slurm's default, Open MPI's orte_abort_on_non_zero_status 0) then keeps
 * the job alive. */
void moe_comm_mpi_abort_job(int code);

/* Finalises MPI if moe_comm_mpi_create() initialised it; a program that
 * initialised MPI itself finalises it itself. Call after freeing every
 * communicator. MOE_OK and nothing done without MPI. */
moe_status moe_comm_mpi_finalize(void);

/* NCCL over device memory, with the ranks of bootstrap (a host communicator:
 * mpi, or local for one rank), its world ranks and its timeout. Rank 0 makes
 * NCCL's unique id and sends it to the others with moe_comm_broadcast() on
 * bootstrap, which may be freed afterwards. device: this rank's CUDA device,
 * made current on the calling thread. cuda_stream: a cudaStream_t of
 * device that every op is enqueued on, so ops are ordered with the caller's
 * kernels on it; NULL: the communicator makes and owns one, and the caller
 * finishes its writes to a buffer before starting an op on it. Use the
 * communicator from one thread. Collective over bootstrap.
 * MOE_ERR_UNSUPPORTED when libmoe was built without NCCL or no CUDA device
 * answers.
 *
 * On this backend buffers are device memory and count/displacement arrays
 * host memory. A wait polls the op's CUDA event and NCCL's asynchronous
 * error; a timeout or an error aborts the NCCL communicator
 * (ncclCommAbort), so a dead peer gives MOE_ERR_COMM, not a hang.
 * Point to point: tags are ignored. NCCL matches the sends and receives
 * between a pair in the order they were posted, so both sides post them in
 * the same order, and a receive's count equals the send's. The isend/irecv
 * calls between two other calls of this backend on the thread form one NCCL
 * group, started by the first of them and launched by the next wait, test,
 * collective, split or free (of any NCCL communicator), so that two ranks
 * that both send first do not deadlock; make no NCCL calls of your own
 * while such a group is open. NCCL connects two ranks at their first op
 * together, and queueing that op waits for the peer: a test that launches
 * it may wait too, up to the timeout. */
moe_status moe_comm_nccl_create(moe_comm **comm, moe_comm *bootstrap, int device,
                                void *cuda_stream);

/* Splits comm into groups of equal color, ranked by key (ties by rank in
 * comm), like MPI_Comm_split: the expert-, data- and pipeline-parallel
 * groups. color >= 0. The new communicator inherits the timeout. Collective
 * over comm. An nccl split runs on comm's stream: free it before comm when
 * comm made its own stream (a NULL cuda_stream). */
moe_status moe_comm_split(moe_comm **out, moe_comm *comm, int color, int key);

/* Releases comm. Requests still in flight on it must have completed. */
void moe_comm_free(moe_comm *comm);

/* Ends the whole job with exit status code: MPI_Abort for mpi (every rank of
 * the job exits), exit() for local and for a NULL comm. With
 * moe_comm_mpi_abort_job(), the only libmoe calls that end the process; a
 * program makes one after an op returned MOE_ERR_COMM (moe-train, whose
 * communicators are freed by then, the latter). */
_Noreturn void moe_comm_abort(moe_comm *comm, int code);

/* ---------------------------------------------------------------- queries */

int moe_comm_rank(const moe_comm *comm);
int moe_comm_size(const moe_comm *comm);
/* The rank in the job's world, for messages; equals rank for local. */
int moe_comm_world_rank(const moe_comm *comm);
const char *moe_comm_backend_name(const moe_comm *comm);
/* The backend's matches_by_tag: whether a receive may be posted ahead of
 * unrelated messages between the same pair. */
bool moe_comm_matches_by_tag(const moe_comm *comm);

/* seconds > 0 and finite. */
moe_status moe_comm_set_timeout(moe_comm *comm, double seconds);
double moe_comm_timeout(const moe_comm *comm);

/* ------------------------------------------------------------- collectives */

/* recv[j*count ..] = what rank j sent to this rank; send[j*count ..] goes to
 * rank j. recv [size*count], send [size*count]. */
moe_status moe_comm_alltoall(moe_comm *comm, void *recv, const void *send, int64_t count,
                             moe_comm_dtype dtype);
moe_status moe_comm_ialltoall(moe_comm *comm, moe_comm_request *req, void *recv,
                              const void *send, int64_t count, moe_comm_dtype dtype);

/* Rank j's send_counts[this] elements from its send_displs[this] land at
 * recv + recv_displs[j]; recv_counts[j] must equal what rank j sends here.
 * Every array is [size]; counts and displacements >= 0. Zero counts, and
 * ranks that send or receive nothing at all, are fine. */
moe_status moe_comm_alltoallv(moe_comm *comm, void *recv, const int64_t *recv_counts,
                              const int64_t *recv_displs, const void *send,
                              const int64_t *send_counts, const int64_t *send_displs,
                              moe_comm_dtype dtype);
moe_status moe_comm_ialltoallv(moe_comm *comm, moe_comm_request *req, void *recv,
                               const int64_t *recv_counts, const int64_t *recv_displs,
                               const void *send, const int64_t *send_counts,
                               const int64_t *send_displs, moe_comm_dtype dtype);

/* buf [count] = the sum over ranks of buf, in place. Not for MOE_COMM_BYTES.
 * Floating-point sums follow MPI's order, which may differ between rank
 * counts but is the same on every rank of one call. */
moe_status moe_comm_allreduce_sum(moe_comm *comm, void *buf, int64_t count, moe_comm_dtype dtype);
moe_status moe_comm_iallreduce_sum(moe_comm *comm, moe_comm_request *req, void *buf,
                                   int64_t count, moe_comm_dtype dtype);

/* recv [recv_count] = block `rank` of the sum over ranks of send
 * [size*recv_count]. Not for MOE_COMM_BYTES. */
moe_status moe_comm_reduce_scatter_sum(moe_comm *comm, void *recv, const void *send,
                                       int64_t recv_count, moe_comm_dtype dtype);
moe_status moe_comm_ireduce_scatter_sum(moe_comm *comm, moe_comm_request *req, void *recv,
                                        const void *send, int64_t recv_count,
                                        moe_comm_dtype dtype);

/* recv [size*count]: block j is rank j's send [count]. */
moe_status moe_comm_allgather(moe_comm *comm, void *recv, const void *send, int64_t count,
                              moe_comm_dtype dtype);
moe_status moe_comm_iallgather(moe_comm *comm, moe_comm_request *req, void *recv,
                               const void *send, int64_t count, moe_comm_dtype dtype);

/* buf [count] on every rank = buf on rank root. */
moe_status moe_comm_broadcast(moe_comm *comm, void *buf, int64_t count, moe_comm_dtype dtype,
                              int root);
moe_status moe_comm_ibroadcast(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                               moe_comm_dtype dtype, int root);

moe_status moe_comm_barrier(moe_comm *comm);

/* ---------------------------------------------------------- point to point */

/* buf [count] to rank peer with tag; a receive of at least count elements
 * with the same tag must be posted there. Messages between one pair with one
 * tag arrive in order. On the local backend a rank sends only to itself, and
 * a blocking send or receive whose match was not posted before it fails with
 * MOE_ERR_STATE instead of waiting forever. */
moe_status moe_comm_send(moe_comm *comm, const void *buf, int64_t count, moe_comm_dtype dtype,
                         int peer, int tag);
moe_status moe_comm_isend(moe_comm *comm, moe_comm_request *req, const void *buf, int64_t count,
                          moe_comm_dtype dtype, int peer, int tag);
/* buf [count]: room for at most count elements. */
moe_status moe_comm_recv(moe_comm *comm, void *buf, int64_t count, moe_comm_dtype dtype, int peer,
                         int tag);
moe_status moe_comm_irecv(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                          moe_comm_dtype dtype, int peer, int tag);

/* ---------------------------------------------------------------- requests */

/* Waits for req to complete, at most the communicator's timeout. An inactive
 * (zeroed or completed) request returns MOE_OK at once. */
moe_status moe_comm_wait(moe_comm_request *req);

/* Seconds this thread has spent inside moe_comm_wait, on any
 * communicator, since it started: every blocking op ends in one, so the
 * time a rank waits for its peers (and for the transfers) shows here, and
 * the rest of its time is its own work. On a device backend a wait can
 * return before the device is done, and the device's share shows where
 * the host next waits for it. */
double moe_comm_wait_seconds(void);

/* Waits for every request of reqs [n], also after one has failed, so that
 * all are complete (their buffers free) on return. st is the caller's status
 * so far (a failure starting one of the ops, or MOE_OK): a failure is
 * returned as is, moe_last_error() untouched; otherwise the first failed
 * wait's status with that wait's own message. The later waits' messages
 * are dropped: on a communicator that has failed they only say "refused",
 * which would hide the cause. */
moe_status moe_comm_wait_all(moe_comm_request *reqs, int n, moe_status st);

/* *done = whether req has completed; never waits. */
moe_status moe_comm_test(moe_comm_request *req, bool *done);

/* --------------------------------------------------------- backend interface */

/* What a backend provides. Arguments arrive checked by comm.c (non-negative
 * counts, ranks in range, a valid dtype, non-NULL buffers where counts are
 * non-zero), so a backend checks only its own limits. Every collective is
 * non-blocking; comm.c builds the blocking forms from start + wait. A start
 * that completes at once leaves req inactive (req->comm == NULL). */
typedef struct moe_comm_backend {
    const char *name;
    /* Receives are matched by tag and complete on their own (MPI, local):
     * a receive may be posted long before its send. False when sends and
     * receives match in post order only (NCCL). */
    bool matches_by_tag;
    moe_status (*split)(moe_comm **out, moe_comm *comm, int color, int key);
    moe_status (*ialltoall)(moe_comm *comm, moe_comm_request *req, void *recv, const void *send,
                            int64_t count, moe_comm_dtype dtype);
    moe_status (*ialltoallv)(moe_comm *comm, moe_comm_request *req, void *recv,
                             const int64_t *recv_counts, const int64_t *recv_displs,
                             const void *send, const int64_t *send_counts,
                             const int64_t *send_displs, moe_comm_dtype dtype);
    moe_status (*iallreduce_sum)(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                                 moe_comm_dtype dtype);
    moe_status (*ireduce_scatter_sum)(moe_comm *comm, moe_comm_request *req, void *recv,
                                      const void *send, int64_t recv_count, moe_comm_dtype dtype);
    moe_status (*iallgather)(moe_comm *comm, moe_comm_request *req, void *recv, const void *send,
                             int64_t count, moe_comm_dtype dtype);
    moe_status (*ibroadcast)(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                             moe_comm_dtype dtype, int root);
    moe_status (*ibarrier)(moe_comm *comm, moe_comm_request *req);
    moe_status (*isend)(moe_comm *comm, moe_comm_request *req, const void *buf, int64_t count,
                        moe_comm_dtype dtype, int peer, int tag);
    moe_status (*irecv)(moe_comm *comm, moe_comm_request *req, void *buf, int64_t count,
                        moe_comm_dtype dtype, int peer, int tag);
    /* Leave req inactive once it has completed or failed. */
    moe_status (*wait)(moe_comm_request *req);
    moe_status (*test)(moe_comm_request *req, bool *done);
    /* Ends the other ranks' processes (nothing for one rank); moe_comm_abort
     * then exits this one. */
    void (*abort)(moe_comm *comm, int code);
    void (*free)(moe_comm *comm);
} moe_comm_backend;

/* The part every backend's communicator starts with. */
struct moe_comm {
    const moe_comm_backend *backend;
    int rank, size;
    int world_rank;
    double timeout_seconds;
};

#endif /* MOE_COMM_COMM_H */
