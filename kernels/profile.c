/* profile.c: the profiled op table (profile.h). */
#include "kernels/profile.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/op_list.h"

/* Op ids: each queued op, then upload. */
#define OP_ID(name, params, args) OP_##name,
enum { MOE_QUEUED_OPS(OP_ID) OP_upload, N_OPS };
#undef OP_ID

#define OP_NAME(name, params, args) #name,
static const char *const op_names[N_OPS] = {MOE_QUEUED_OPS(OP_NAME) "upload"};
#undef OP_NAME

/* A mark that begins no op's time: the end of the last op before a wait or
 * a pause. */
#define NO_OP (-1)

static struct profile {
    const moe_ops *inner;
    moe_ops table;
    void *marks;                  /* [MOE_PROFILE_MARKS] inner's */
    int op_of[MOE_PROFILE_MARKS]; /* the op that began at each stamped mark, or NO_OP */
    int64_t n_marks;              /* stamped since the last read */
    bool paused;
    int64_t calls[N_OPS];
    double seconds[N_OPS];
    moe_kept_error read_failure; /* the first failure to read the marks */
    moe_kept_error wait_failure; /* of the profile's own sync, for the caller's next wait */
} prof;

int64_t moe_profile_op_count(void) { return N_OPS; }

/* Gives each stamped interval to its op, once a wait has passed them. */
static void read_marks(void) {
    for (int64_t i = 0; i + 1 < prof.n_marks; i++) {
        if (prof.op_of[i] == NO_OP) continue;
        double s = 0.0;
        moe_error_keep(&prof.read_failure, prof.inner->mark_seconds(&s, prof.marks, i, i + 1));
        prof.calls[prof.op_of[i]]++;
        prof.seconds[prof.op_of[i]] += s;
    }
    prof.n_marks = 0;
}

static void stamp(int op) {
    prof.inner->mark(prof.marks, prof.n_marks);
    prof.op_of[prof.n_marks++] = op;
}

/* Ends the time of the last stamped op, if it is still running. */
static void close_last(void) {
    if (prof.n_marks > 0 && prof.op_of[prof.n_marks - 1] != NO_OP) stamp(NO_OP);
}

/* After a wait: its marks are read when it succeeded; after a failed one
 * some may never have been stamped, and they are dropped. */
static moe_status after_wait(moe_status st) {
    if (st == MOE_OK)
        read_marks();
    else
        prof.n_marks = 0;
    return st;
}

static void begin_op(int op) {
    if (prof.paused) return;
    /* Room for this op's mark and the one that ends it. */
    if (prof.n_marks + 2 > MOE_PROFILE_MARKS) {
        close_last();
        /* A failure this sync reports is the caller's: kept for its next wait. */
        moe_error_keep(&prof.wait_failure, after_wait(prof.inner->sync()));
    }
    stamp(op);
}

/* A wait's status, or the failure the profile's own sync kept for it. */
static moe_status report(moe_status st) { return moe_error_take(&prof.wait_failure, st); }

#define PROFILED(name, params, args)     \
    static void profiled_##name params { \
        begin_op(OP_##name);             \
        prof.inner->name args;           \
    }
MOE_QUEUED_OPS(PROFILED)
#undef PROFILED

static moe_status profiled_upload(void *dst, const void *src, size_t bytes) {
    begin_op(OP_upload);
    return report(prof.inner->upload(dst, src, bytes));
}

static moe_status profiled_sync(void) {
    close_last();
    return report(after_wait(prof.inner->sync()));
}

/* A download of nothing need not wait (ops.h): its marks stay for the next. */
static moe_status profiled_download(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return report(prof.inner->download(dst, src, bytes));
    close_last();
    return report(after_wait(prof.inner->download(dst, src, bytes)));
}

void moe_profile_close(void) {
    if (prof.inner && prof.marks) prof.inner->marks_destroy(prof.marks);
    memset(&prof, 0, sizeof prof);
}

moe_status moe_profile_open(const moe_ops **profiled, const moe_ops *inner) {
    moe_profile_close();
    void *marks = NULL;
    MOE_TRY(inner->marks_create(&marks, MOE_PROFILE_MARKS));
    prof.inner = inner;
    prof.marks = marks;
    prof.table = *inner;
    prof.table.upload = profiled_upload;
    prof.table.download = profiled_download;
    prof.table.sync = profiled_sync;
#define FILL(name, params, args) prof.table.name = profiled_##name;
    MOE_QUEUED_OPS(FILL)
#undef FILL
    *profiled = &prof.table;
    return MOE_OK;
}

void moe_profile_pause(bool paused) {
    if (paused) close_last();
    prof.paused = paused;
}

void moe_profile_reset(void) {
    memset(prof.calls, 0, sizeof prof.calls);
    memset(prof.seconds, 0, sizeof prof.seconds);
    prof.n_marks = 0;
    prof.read_failure.status = MOE_OK;
}

static int by_time(const void *a, const void *b) {
    const moe_op_time *x = a, *y = b;
    return (x->seconds < y->seconds) - (x->seconds > y->seconds);
}

moe_status moe_profile_read(moe_op_time *rows, int64_t capacity, int64_t *n_rows) {
    *n_rows = 0;
    if (prof.read_failure.status != MOE_OK)
        return moe_error(prof.read_failure.status, "profile: reading the marks: %s", prof.read_failure.detail);
    moe_op_time all[N_OPS];
    int64_t n = 0;
    for (int op = 0; op < N_OPS; op++)
        if (prof.calls[op] > 0) all[n++] = (moe_op_time){op_names[op], prof.calls[op], prof.seconds[op]};
    qsort(all, (size_t)n, sizeof *all, by_time);
    *n_rows = n < capacity ? n : capacity;
    memcpy(rows, all, (size_t)*n_rows * sizeof *rows);
    return MOE_OK;
}
