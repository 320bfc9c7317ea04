/* profile.c: the profiled op table (profile.h). */
#include "kernels/profile.h"

#include <stdio.h>
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
    moe_status failed; /* the first failure to read the marks */
    char failure[256];
} prof;

int64_t moe_profile_op_count(void) { return N_OPS; }

/* Gives each stamped interval to its op, once a wait has passed them. */
static void read_marks(void) {
    for (int64_t i = 0; i + 1 < prof.n_marks; i++) {
        if (prof.op_of[i] == NO_OP) continue;
        double s = 0.0;
        const moe_status st = prof.inner->mark_seconds(&s, prof.marks, i, i + 1);
        if (st != MOE_OK && prof.failed == MOE_OK) {
            prof.failed = st;
            snprintf(prof.failure, sizeof prof.failure, "%s", moe_last_error());
        }
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

static void begin_op(int op) {
    if (prof.paused) return;
    /* Room for this op's mark and the one that ends it. */
    if (prof.n_marks + 2 > MOE_PROFILE_MARKS) {
        close_last();
        (void)prof.inner->sync(); /* a failure shows at the caller's next wait */
        read_marks();
    }
    stamp(op);
}

#define PROFILED(name, params, args)     \
    static void profiled_##name params { \
        begin_op(OP_##name);             \
        prof.inner->name args;           \
    }
MOE_QUEUED_OPS(PROFILED)
#undef PROFILED

static moe_status profiled_upload(void *dst, const void *src, size_t bytes) {
    begin_op(OP_upload);
    return prof.inner->upload(dst, src, bytes);
}

static moe_status profiled_sync(void) {
    close_last();
    const moe_status st = prof.inner->sync();
    read_marks();
    return st;
}

static moe_status profiled_download(void *dst, const void *src, size_t bytes) {
    close_last();
    const moe_status st = prof.inner->download(dst, src, bytes);
    read_marks();
    return st;
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
}

static int by_time(const void *a, const void *b) {
    const moe_op_time *x = a, *y = b;
    return (x->seconds < y->seconds) - (x->seconds > y->seconds);
}

moe_status moe_profile_read(moe_op_time *rows, int64_t capacity, int64_t *n_rows) {
    *n_rows = 0;
    if (prof.failed != MOE_OK) return moe_error(prof.failed, "profile: reading the marks: %s", prof.failure);
    moe_op_time all[N_OPS];
    int64_t n = 0;
    for (int op = 0; op < N_OPS; op++)
        if (prof.calls[op] > 0) all[n++] = (moe_op_time){op_names[op], prof.calls[op], prof.seconds[op]};
    qsort(all, (size_t)n, sizeof *all, by_time);
    *n_rows = n < capacity ? n : capacity;
    memcpy(rows, all, (size_t)*n_rows * sizeof *rows);
    return MOE_OK;
}
