#include "status.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
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

/* Of an elided message, the bytes kept before the "...": what failed comes
 * first, and why last, so the tail keeps the rest. */
#define ERROR_HEAD_BYTES 384

static bool utf8_continuation(char c) { return ((unsigned char)c & 0xC0) == 0x80; }

/* last_error = text [len]: whole when it fits, else its head and its tail
 * around "...", each cut at a UTF-8 character boundary, so that a long path
 * in the middle leaves both ends readable. */
static void set_last_error(const char *text, size_t len) {
    const size_t room = sizeof last_error - 1;
    if (len <= room) {
        memcpy(last_error, text, len);
        last_error[len] = '\0';
        return;
    }
    size_t head = ERROR_HEAD_BYTES, tail = len - (room - ERROR_HEAD_BYTES - 3);
    while (head > 0 && utf8_continuation(text[head])) head--;
    while (tail < len && utf8_continuation(text[tail])) tail++;
    memcpy(last_error, text, head);
    memcpy(last_error + head, "...", 3);
    memcpy(last_error + head + 3, text + tail, len - tail);
    last_error[head + 3 + len - tail] = '\0';
}

/* A message up to this long is assembled on the stack; a longer one on the
 * heap, and when that fails, its prefix is cut (at a character) to leave
 * room for the detail. */
#define ERROR_STACK_BYTES (4 * MOE_ERROR_BYTES)

/* prefix (formatted) + detail, whole, then fitted to last_error. */
static void set_error_v(const char *detail, const char *fmt, va_list ap) {
    char stack[ERROR_STACK_BYTES];
    va_list again;
    va_copy(again, ap);
    const int n = vsnprintf(stack, sizeof stack, fmt, again);
    va_end(again);
    const size_t prefix = n > 0 ? (size_t)n : 0, tail = detail ? strlen(detail) : 0;
    char *text = stack;
    size_t len = prefix;
    if (prefix + tail >= sizeof stack) {
        char *heap = malloc(prefix + tail + 1);
        if (heap) {
            vsnprintf(heap, prefix + 1, fmt, ap);
            text = heap;
        } else {
            /* tail < MOE_ERROR_BYTES: the detail keeps its place at the end. */
            len = sizeof stack - 1 - tail < prefix ? sizeof stack - 1 - tail : prefix;
            while (len > 0 && utf8_continuation(stack[len])) len--;
        }
    }
    if (tail) memcpy(text + len, detail, tail);
    text[len + tail] = '\0';
    set_last_error(text, len + tail);
    if (text != stack) free(text);
}

moe_status moe_error(moe_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error_v(NULL, fmt, ap);
    va_end(ap);
    return status;
}

moe_status moe_error_prefix(moe_status status, const char *fmt, ...) {
    char detail[MOE_ERROR_BYTES];
    memcpy(detail, last_error, sizeof detail);
    va_list ap;
    va_start(ap, fmt);
    set_error_v(detail, fmt, ap);
    va_end(ap);
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
