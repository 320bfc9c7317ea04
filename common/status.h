/* status.h: setting the thread-local error detail and carrying failures up.
 * Internal to libmoe; the public side is moe_status and moe_last_error(). */
#ifndef MOE_COMMON_STATUS_H
#define MOE_COMMON_STATUS_H

#include "moe.h"

#if defined(__GNUC__)
#define MOE_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define MOE_PRINTF(fmt, args)
#endif

/* Records the detail of a failure for moe_last_error() and returns status, so
 * a caller writes: return moe_error(MOE_ERR_CONFIG, "top_k=%lld ...", k).
 * A detail longer than moe_last_error() holds keeps its head and its tail
 * (where the reason goes) around "...", cut between UTF-8 characters. */
moe_status moe_error(moe_status status, const char *fmt, ...) MOE_PRINTF(2, 3);

/* Prefixes the current detail with context ("model.safetensors: " + detail),
 * as a failure travels up through a caller that knows more. */
moe_status moe_error_prefix(moe_status status, const char *fmt, ...) MOE_PRINTF(2, 3);

void moe_error_clear(void);

/* moe_last_error()'s capacity: a copy of it needs no more. */
#define MOE_ERROR_BYTES 1024

/* A failure kept aside while later calls overwrite moe_last_error(), to be
 * reported once they are done: the first one kept is the cause. */
typedef struct moe_kept_error {
    moe_status status; /* MOE_OK: none kept */
    char detail[MOE_ERROR_BYTES];
} moe_kept_error;

/* Keeps status, with moe_last_error() as its detail, when it is a failure
 * and kept holds none yet. */
void moe_error_keep(moe_kept_error *kept, moe_status status);

/* The kept failure, cleared from kept, with its detail back as
 * moe_last_error(); status when none is kept. */
moe_status moe_error_take(moe_kept_error *kept, moe_status status);

/* Propagates a failing status from a call that has already set the detail. */
/* Returns MOE_ERR_INVALID_ARG naming the argument when ptr is NULL, in
 * moe.h's words: "moe_layer_forward: y is NULL". */
#define MOE_NOT_NULL(op, name, ptr)                                                                \
    do {                                                                                           \
        if (!(ptr)) return moe_error(MOE_ERR_INVALID_ARG, "%s: %s is NULL", (op), (name));         \
    } while (0)

#define MOE_TRY(call)                                                                              \
    do {                                                                                           \
        moe_status moe_try_status_ = (call);                                                       \
        if (moe_try_status_ != MOE_OK) return moe_try_status_;                                     \
    } while (0)

#endif /* MOE_COMMON_STATUS_H */
