/* profile.h: where a backend's time goes, op by op. A profiled table wraps
 * another (ops.h) entry by entry: it stamps a mark (ops.h mark) before each
 * queued op and upload, and at each sync or download, and gives the time
 * between one mark and the next to the op that began there. On a device
 * the marks are events in the stream, so an op's time is the device's,
 * plus any idle gap until the host queued the next op; on the CPU it is
 * the wall clock from the op's call to the next. The marks are read at
 * the waits the caller makes anyway; only a run of more than
 * MOE_PROFILE_MARKS ops without a wait costs a sync of its own.
 *
 * One profile per process, driven by one thread, like moe_strict_ops. */
#ifndef MOE_KERNELS_PROFILE_H
#define MOE_KERNELS_PROFILE_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "moe.h"

#define MOE_PROFILE_MARKS 4096

typedef struct moe_op_time {
    const char *op; /* the ops.h entry: "gemm", "attention_forward", "upload", ... */
    int64_t calls;
    double seconds;
} moe_op_time;

/* How many entries a profile can report: every queued op and upload. */
int64_t moe_profile_op_count(void);

/* The profiled table over inner, summing from now. Replaces a profile
 * opened before, whose table must no longer be used. */
moe_status moe_profile_open(const moe_ops **profiled, const moe_ops *inner);

/* While paused, ops run unstamped and their time is nobody's (an
 * evaluation inside a training run, say). */
void moe_profile_pause(bool paused);

/* Forgets the sums so far, and the ops not yet read (start-up, say). */
void moe_profile_reset(void);

/* The ops called since the last reset, up to the last sync or download,
 * largest time first: rows [capacity] gets the first *n_rows of them. A
 * failure to read the marks is reported here. */
moe_status moe_profile_read(moe_op_time *rows, int64_t capacity, int64_t *n_rows);

/* Frees the marks; the profiled table must no longer be used. */
void moe_profile_close(void);

#endif /* MOE_KERNELS_PROFILE_H */
