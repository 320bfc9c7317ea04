/* strict.c: the CPU ops on memory the host may touch only inside an op
 * (ops.h, moe_strict_ops). Each piece is its own mapping, kept with no
 * access; a table call opens every piece, runs the CPU op and closes them
 * again, so any other host access to backend memory faults where it
 * happens, as it would be wrong on a device backend. */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/status.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_list.h"

typedef struct piece {
    void *base;
    size_t bytes; /* whole pages */
} piece;

static piece *pieces;
static int64_t n_pieces, cap_pieces;

/* Ops called since the last wait, and the waits that found some: on a
 * device each of those drains the stream, which idles while the host
 * decides and queues what comes next. */
static bool ops_queued;
static int64_t drains;

static void wait_point(void) {
    drains += ops_queued;
    ops_queued = false;
}

int64_t moe_strict_drains(void) { return drains; }

static void protect_all(int prot) {
    for (int64_t i = 0; i < n_pieces; i++)
        if (mprotect(pieces[i].base, pieces[i].bytes, prot) != 0) abort(); /* our own mapping: cannot fail */
}

static void open_all(void) { protect_all(PROT_READ | PROT_WRITE); }
static void close_all(void) { protect_all(PROT_NONE); }

static moe_status strict_alloc(void **out, size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    *out = NULL;
    if (bytes > SIZE_MAX - page) return moe_error(MOE_ERR_OUT_OF_MEMORY, "strict backend: %zu bytes", bytes);
    const size_t rounded = (bytes + page - 1) / page * page;
    if (n_pieces == cap_pieces) {
        int64_t cap = cap_pieces ? 2 * cap_pieces : 64;
        piece *grown = realloc(pieces, (size_t)cap * sizeof *grown);
        if (!grown) return moe_error(MOE_ERR_OUT_OF_MEMORY, "strict backend: piece table");
        pieces = grown, cap_pieces = cap;
    }
    /* Anonymous mappings come zero-filled, as alloc promises. */
    void *p = mmap(NULL, rounded ? rounded : page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return moe_error(MOE_ERR_OUT_OF_MEMORY, "strict backend: %zu bytes", bytes);
    pieces[n_pieces++] = (piece){p, rounded ? rounded : page};
    *out = p;
    return MOE_OK;
}

static void strict_release(void *p) {
    for (int64_t i = 0; p && i < n_pieces; i++)
        if (pieces[i].base == p) {
            munmap(p, pieces[i].bytes);
            pieces[i] = pieces[--n_pieces];
            return;
        }
}

/* Uploads count as waits, as a device's large ones are (its small ones go
 * through staging and do not wait): the count is an upper bound. */
static moe_status strict_upload(void *dst, const void *src, size_t bytes) {
    wait_point();
    open_all();
    if (bytes) memcpy(dst, src, bytes);
    close_all();
    return MOE_OK;
}

static moe_status strict_sync(void) {
    wait_point();
    return MOE_OK;
}

/* Each op of the CPU table, called with every piece open. */
#define STRICT(name, params, args)     \
    static void strict_##name params { \
        ops_queued = true;             \
        open_all();                    \
        moe_cpu_ops()->name args;      \
        close_all();                   \
    }
MOE_QUEUED_OPS(STRICT)

static moe_ops strict_ops;

const moe_ops *moe_strict_ops(void) {
    if (!strict_ops.name) {
        const moe_ops *cpu = moe_cpu_ops();
        strict_ops = (moe_ops){
            .name = "cpu-strict",
            .alloc = strict_alloc,
            .release = strict_release,
            .upload = strict_upload,
            .download = strict_upload,
            .sync = strict_sync,
            /* Host memory: marks are not backend memory. */
            .marks_create = cpu->marks_create,
            .marks_destroy = cpu->marks_destroy,
            .mark = cpu->mark,
            .mark_seconds = cpu->mark_seconds,
            .plan_scratch_bytes = cpu->plan_scratch_bytes,
            .rmsnorm_scratch_bytes = cpu->rmsnorm_scratch_bytes,
        };
#define FILL(name, params, args) strict_ops.name = strict_##name;
        MOE_QUEUED_OPS(FILL)
#undef FILL
    }
    return &strict_ops;
}
