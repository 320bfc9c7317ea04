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

STRICT(copy, (void *dst, const void *src, size_t bytes), (dst, src, bytes))
STRICT(zero, (void *dst, size_t bytes), (dst, bytes))
STRICT(gemm,
       (float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
        int64_t ldc, bool trans_a, bool trans_b, float alpha, float beta),
       (c, a, b, m, n, k, lda, ldb, ldc, trans_a, trans_b, alpha, beta))
STRICT(gate_forward,
       (int32_t *topk_idx, float *topk_w, float *prob, float *lse, moe_gate_totals *totals, const float *logits,
        const float *bias, const moe_gate_params *p, int64_t T),
       (topk_idx, topk_w, prob, lse, totals, logits, bias, p, T))
STRICT(gate_backward,
       (float *dlogits, const float *dweights, const int32_t *topk_idx, const float *topk_w, const float *prob,
        const float *lse, const float *logits, const float *aux_grad, float z_coef_over_T,
        const moe_gate_params *p, int64_t T),
       (dlogits, dweights, topk_idx, topk_w, prob, lse, logits, aux_grad, z_coef_over_T, p, T))
STRICT(plan_build,
       (int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets, const int32_t *topk_idx,
        const int64_t *keep, void *scratch, int64_t T, int64_t k, int64_t E),
       (pair_row, row_token, expert_offsets, topk_idx, keep, scratch, T, k, E))
STRICT(permute, (float *xp, const float *x, const int64_t *row_token, int64_t n_rows, int64_t d),
       (xp, x, row_token, n_rows, d))
STRICT(combine,
       (float *y, const float *yp, const float *topk_w, const int64_t *pair_row, const float *shared, int64_t T,
        int64_t k, int64_t d),
       (y, yp, topk_w, pair_row, shared, T, k, d))
STRICT(combine_backward,
       (float *dyp, float *dweights, const float *dy, const float *yp, const float *topk_w,
        const int64_t *pair_row, int64_t T, int64_t k, int64_t d),
       (dyp, dweights, dy, yp, topk_w, pair_row, T, k, d))
STRICT(unpermute_add, (float *dx, const float *dxp, const int64_t *pair_row, int64_t T, int64_t k, int64_t d),
       (dx, dxp, pair_row, T, k, d))
STRICT(experts_forward, (moe_expert_group *groups, int64_t n_groups, int64_t d), (groups, n_groups, d))
STRICT(experts_backward, (moe_expert_group *groups, int64_t n_groups, int64_t d), (groups, n_groups, d))
STRICT(embedding_forward, (float *out, const int32_t *tokens, const float *wte, int64_t N, int64_t C),
       (out, tokens, wte, N, C))
STRICT(embedding_backward, (float *dwte, const float *dout, const int32_t *tokens, int64_t N, int64_t C),
       (dwte, dout, tokens, N, C))
STRICT(rmsnorm_forward,
       (float *out, float *rstd, const float *inp, const float *weight, float eps, int64_t N, int64_t C),
       (out, rstd, inp, weight, eps, N, C))
STRICT(rmsnorm_backward,
       (float *dinp, float *dweight, const float *dout, const float *inp, const float *weight, const float *rstd,
        void *scratch, int64_t N, int64_t C),
       (dinp, dweight, dout, inp, weight, rstd, scratch, N, C))
STRICT(matmul_forward, (float *out, const float *inp, const float *weight, int64_t N, int64_t C, int64_t OC),
       (out, inp, weight, N, C, OC))
STRICT(matmul_backward,
       (float *dinp, float *dweight, const float *dout, const float *inp, const float *weight, int64_t N,
        int64_t C, int64_t OC),
       (dinp, dweight, dout, inp, weight, N, C, OC))
STRICT(rope_tables, (float *cos_t, float *sin_t, int64_t T, int64_t hd, float theta), (cos_t, sin_t, T, hd, theta))
STRICT(rope_forward,
       (float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t hd),
       (x, cos_t, sin_t, B, T, H, hd))
STRICT(rope_backward,
       (float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t hd),
       (dx, cos_t, sin_t, B, T, H, hd))
STRICT(attention_forward,
       (float *out, float *att, const float *q, const float *k, const float *v, int64_t B, int64_t T, int64_t Hq,
        int64_t Hkv, int64_t hd),
       (out, att, q, k, v, B, T, Hq, Hkv, hd))
STRICT(attention_backward,
       (float *dq, float *dk, float *dv, float *datt, const float *dout, const float *q, const float *k,
        const float *v, const float *att, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd),
       (dq, dk, dv, datt, dout, q, k, v, att, B, T, Hq, Hkv, hd))
STRICT(crossentropy_forward,
       (float *losses, double *lse, const float *logits, const int32_t *targets, int64_t N, int64_t V),
       (losses, lse, logits, targets, N, V))
STRICT(crossentropy_backward,
       (float *dlogits, const float *logits, const double *lse, const int32_t *targets, const float *dloss,
        int64_t N, int64_t V),
       (dlogits, logits, lse, targets, dloss, N, V))
STRICT(residual_forward, (float *out, const float *a, const float *b, int64_t n), (out, a, b, n))
STRICT(residual_backward, (float *da, float *db, const float *dout, int64_t n), (da, db, dout, n))
STRICT(scale, (float *x, float alpha, int64_t n), (x, alpha, n))
STRICT(multiply, (float *out, const float *a, const float *b, int64_t n), (out, a, b, n))
STRICT(uniform, (float *out, uint64_t seed, uint64_t stream, float lo, float span, int64_t n),
       (out, seed, stream, lo, span, n))
STRICT(adamw,
       (float *params, float *m, float *v, const float *grads, int64_t n, const moe_adamw_span *spans,
        int64_t n_spans, float lr, float beta1, float beta2, float eps, float weight_decay, int64_t t),
       (params, m, v, grads, n, spans, n_spans, lr, beta1, beta2, eps, weight_decay, t))
STRICT(sumsq, (double *out, const float *x, int64_t n), (out, x, n))

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
            .copy = strict_copy,
            .zero = strict_zero,
            .sync = strict_sync,
            .gemm = strict_gemm,
            .gate_forward = strict_gate_forward,
            .gate_backward = strict_gate_backward,
            .plan_scratch_bytes = cpu->plan_scratch_bytes,
            .plan_build = strict_plan_build,
            .permute = strict_permute,
            .combine = strict_combine,
            .combine_backward = strict_combine_backward,
            .unpermute_add = strict_unpermute_add,
            .experts_forward = strict_experts_forward,
            .experts_backward = strict_experts_backward,
            .embedding_forward = strict_embedding_forward,
            .embedding_backward = strict_embedding_backward,
            .rmsnorm_forward = strict_rmsnorm_forward,
            .rmsnorm_scratch_bytes = cpu->rmsnorm_scratch_bytes,
            .rmsnorm_backward = strict_rmsnorm_backward,
            .matmul_forward = strict_matmul_forward,
            .matmul_backward = strict_matmul_backward,
            .rope_tables = strict_rope_tables,
            .rope_forward = strict_rope_forward,
            .rope_backward = strict_rope_backward,
            .attention_forward = strict_attention_forward,
            .attention_backward = strict_attention_backward,
            .crossentropy_forward = strict_crossentropy_forward,
            .crossentropy_backward = strict_crossentropy_backward,
            .residual_forward = strict_residual_forward,
            .residual_backward = strict_residual_backward,
            .scale = strict_scale,
            .multiply = strict_multiply,
            .uniform = strict_uniform,
            .adamw = strict_adamw,
            .sumsq = strict_sumsq,
        };
    }
    return &strict_ops;
}
