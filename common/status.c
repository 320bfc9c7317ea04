#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[MOE_ERROR_BYTES];

static const char *const status_strings[MOE_STATUS_COUNT] = {
    [MOE_OK] = "success",
    [MOE_ERR_INVALID_ARG] = "invalid argument",
    [MOE_ERR_CONFIG] = "invalid configuration",
    [MOE_ERR_OUT_OF_MEMORY] = "out of memory",
    [MOE_ERR_IO] = "input/output error",
    [MOE_ERR_FORMAT] = "malformed file",
    [MOE_ERR_STATE] = "call out of order",
    [MOE_ERR_UNSUPPORTED] = "not supported by this build or machine",
    [MOE_ERR_COMM] = "communication failure",
    [MOE_ERR_INTERNAL] = "internal error",
};

const char *moe_status_string(moe_status status) {
    if ((int)status < 0 || status >= MOE_STATUS_COUNT) return "unknown status";
    return status_strings[status];
}

const char *moe_last_error(void) { return last_error; }

void moe_error_clear(void) { last_error[0] = '\0'; }

moe_status moe_error(moe_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

moe_status moe_error_prefix(moe_status status, const char *fmt, ...) {
    char detail[MOE_ERROR_BYTES];
    memcpy(detail, last_error, sizeof detail);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof last_error)
        snprintf(last_error + n, sizeof last_error - (size_t)n, "%s", detail);
    return status;
}

#define MOE_STR2(x) #x
#define MOE_STR(x) MOE_STR2(x)

const char *moe_version_string(void) {
    return MOE_STR(MOE_VERSION_MAJOR) "." MOE_STR(MOE_VERSION_MINOR) "." MOE_STR(MOE_VERSION_PATCH);
}

void moe_version(int *major, int *minor, int *patch) {
    if (major) *major = MOE_VERSION_MAJOR;
    if (minor) *minor = MOE_VERSION_MINOR;
    if (patch) *patch = MOE_VERSION_PATCH;
}

void moe_error_keep(moe_kept_error *kept, moe_status status) {
    if (status == MOE_OK || kept->status != MOE_OK) return;
    kept->status = status;
    snprintf(kept->detail, sizeof kept->detail, "%s", last_error);
}

moe_status moe_error_take(moe_kept_error *kept, moe_status status) {
    if (kept->status == MOE_OK) return status;
    const moe_status first = kept->status;
    kept->status = MOE_OK;
    return moe_error(first, "%s", kept->detail);
}
