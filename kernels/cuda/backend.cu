/* backend.cu: the CUDA op table of kernels/ops.h over the launchers of
 * cuda_ops.h.
 *
 * The table's entries take no context and most return nothing, so the
 * bound context (moe_cuda_ops) is per-thread state, and the first failure
 * of an entry is kept with its detail, in the context it ran on, until the
 * next sync, upload or download on that context reports it (one of a
 * thread without a context is kept by the thread). While a failure is kept
 * the context's op entries do nothing: their inputs may be the failed op's
 * unwritten outputs, and an index read from those could fault the device,
 * which would turn one reported failure into a lost context. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/common.cuh"

typedef struct bound_state {
    moe_cuda_ctx *ctx;
    moe_kept_error unbound; /* the first failure for want of a context, not yet reported */
} bound_state;

static thread_local bound_state bound;

static moe_kept_error *kept(void) { return bound.ctx ? &bound.ctx->kept : &bound.unbound; }

/* Keeps st, naming the entry, if it is the first failure. */
static void keep(moe_status st, const char *entry) {
    if (st == MOE_OK || kept()->status != MOE_OK) return;
    moe_error_keep(kept(), moe_error_prefix(st, "cuda op %s: ", entry));
}

/* The kept failure, which is cleared, or else st. */
static moe_status report(moe_status st) { return moe_error_take(kept(), st); }

static moe_status no_context(void) {
    return moe_error(MOE_ERR_STATE,
                     "no CUDA context is bound to this thread: call moe_cuda_ops(ctx) on it first");
}

/* Whether an op entry may run: a context is bound and no failure is kept. */
static bool ready(const char *entry) {
    if (bound.ctx) return bound.ctx->kept.status == MOE_OK;
    keep(no_context(), entry);
    return false;
}

#define RUN(entry, call)                                                                           \
    do {                                                                                           \
        if (ready(entry)) keep((call), entry);                                                     \
    } while (0)

/* ------------------------------------------------------------------ memory */

static moe_status fill_zero_and_wait(void *p, size_t bytes, moe_cuda_ctx *ctx) {
    MOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ctx->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
    return MOE_OK;
}

static moe_status table_alloc(void **out, size_t bytes) {
    *out = NULL;
    moe_cuda_ctx *ctx = bound.ctx;
    if (!ctx) return no_context();
    void *p = NULL;
    /* cudaMalloc's pointers are 256-byte aligned, as ops.h promises. */
    MOE_TRY(moe_cuda_malloc(&p, bytes, "cuda op alloc", ctx));
    const moe_status st = fill_zero_and_wait(p, bytes, ctx);
    if (st != MOE_OK) {
        cudaFree(p);
        return st;
    }
    *out = p;
    return MOE_OK;
}

static moe_status free_checked(void *p) {
    MOE_CUDA_CHECK(cudaFree(p));
    return MOE_OK;
}

/* Runs even with a failure kept, so that teardown frees everything. */
static void table_release(void *p) {
    if (!p) return;
    /* Ops queued earlier may still read or write p. */
    if (bound.ctx) keep(moe_cuda_sync(bound.ctx), "release");
    keep(free_checked(p), "release");
}

static moe_status table_upload(void *dst, const void *src_host, size_t bytes) {
    if (!bound.ctx) return report(no_context());
    return report(moe_cuda_upload(dst, src_host, bytes, bound.ctx));
}

static moe_status table_download(void *dst_host, const void *src, size_t bytes) {
    if (!bound.ctx) return report(no_context());
    return report(moe_cuda_download(dst_host, src, bytes, bound.ctx));
}

static moe_status copy_async(void *dst, const void *src, size_t bytes, moe_cuda_ctx *ctx) {
    if (bytes == 0 || dst == src) return MOE_OK;
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx->stream));
    return MOE_OK;
}

static void table_copy(void *dst, const void *src, size_t bytes) {
    RUN("copy", copy_async(dst, src, bytes, bound.ctx));
}

static void table_zero(void *dst, size_t bytes) {
    RUN("zero", moe_cuda_memset(dst, 0, bytes, bound.ctx));
}

static moe_status table_sync(void) {
    if (!bound.ctx) return report(no_context());
    return report(moe_cuda_sync(bound.ctx));
}

/* ------------------------------------------------------------------- marks */

/* Timing events, one per slot; a slot may be stamped again once read. */
typedef struct event_marks {
    int64_t n;
    cudaEvent_t *events; /* [n], NULL until created */
} event_marks;

static void table_marks_destroy(void *marks) {
    event_marks *m = (event_marks *)marks;
    if (!m) return;
    for (int64_t i = 0; i < m->n && m->events; i++)
        if (m->events[i]) cudaEventDestroy(m->events[i]);
    free(m->events);
    free(m);
}

static moe_status create_events(event_marks *m) {
    for (int64_t i = 0; i < m->n; i++) MOE_CUDA_CHECK(cudaEventCreate(&m->events[i]));
    return MOE_OK;
}

static moe_status table_marks_create(void **out, int64_t n) {
    *out = NULL;
    if (!bound.ctx) return no_context();
    event_marks *m = (event_marks *)calloc(1, sizeof *m);
    if (m) m->events = (cudaEvent_t *)calloc((size_t)(n > 0 ? n : 1), sizeof *m->events);
    if (!m || !m->events) {
        table_marks_destroy(m);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "cuda marks: %lld events", (long long)n);
    }
    m->n = n;
    const moe_status st = create_events(m);
    if (st != MOE_OK) {
        table_marks_destroy(m);
        return st;
    }
    *out = m;
    return MOE_OK;
}

static moe_status record(cudaEvent_t event, moe_cuda_ctx *ctx) {
    MOE_CUDA_CHECK(cudaEventRecord(event, ctx->stream));
    return MOE_OK;
}

/* Stamped even while a failure is kept (a mark reads no op's output), so
 * that no slot keeps an earlier cycle's time. */
static void table_mark(void *marks, int64_t i) {
    if (bound.ctx) keep(record(((event_marks *)marks)->events[i], bound.ctx), "mark");
}

static moe_status table_mark_seconds(double *seconds, const void *marks, int64_t from, int64_t to) {
    const event_marks *m = (const event_marks *)marks;
    float ms = 0.0f;
    const cudaError_t err = cudaEventElapsedTime(&ms, m->events[from], m->events[to]);
    if (err != cudaSuccess) return moe_cuda_report(err, "cudaEventElapsedTime", __FILE__, __LINE__);
    *seconds = 1e-3 * (double)ms;
    return MOE_OK;
}

/* --------------------------------------------------------------------- MoE */

static void table_gemm(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k,
                       int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b,
                       float alpha, float beta) {
    RUN("gemm", moe_cuda_gemm(c, a, b, m, n, k, lda, ldb, ldc, trans_a, trans_b, alpha, beta,
                              bound.ctx));
}

static void table_gate_forward(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                               moe_gate_totals *totals, const float *logits, const float *bias,
                               const moe_gate_params *p, int64_t T) {
    const moe_cuda_gate_totals t = {totals->assigned, totals->prob_sum, totals->z_sum,
                                    totals->chunk_scratch};
    RUN("gate_forward",
        moe_cuda_gate_forward(topk_idx, topk_w, prob, lse, &t, logits, bias, p, T, bound.ctx));
}

static void table_gate_backward(float *dlogits, const float *dweights, const int32_t *topk_idx,
                                const float *topk_w, const float *prob, const float *lse,
                                const float *logits, const float *aux_grad, float z_coef_over_T,
                                const moe_gate_params *p, int64_t T) {
    RUN("gate_backward", moe_cuda_gate_backward(dlogits, dweights, topk_idx, topk_w, prob, lse,
                                                logits, aux_grad, z_coef_over_T, p, T, bound.ctx));
}

static void table_gate_seq_stats(float *stats, const int32_t *topk_idx, const float *prob,
                                 const moe_gate_params *p, int64_t T) {
    RUN("gate_seq_stats", moe_cuda_gate_seq_stats(stats, topk_idx, prob, p, T, bound.ctx));
}

static void table_plan_build(int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets,
                             const int32_t *topk_idx, const int64_t *keep_counts, void *scratch,
                             int64_t T, int64_t k, int64_t E) {
    RUN("plan_build", moe_cuda_plan_build(pair_row, row_token, expert_offsets, topk_idx,
                                          keep_counts, scratch, T, k, E, bound.ctx));
}

/* The host's row count bounds the grid; no count is read on the device. */
static void table_permute(float *xp, const float *x, const int64_t *row_token, int64_t n_rows,
                          int64_t d) {
    RUN("permute", moe_cuda_permute(xp, x, row_token, NULL, n_rows, d, bound.ctx));
}

static void table_combine(float *y, const float *yp, const float *topk_w, const int64_t *pair_row,
                          const float *shared, int64_t T, int64_t k, int64_t d) {
    RUN("combine", moe_cuda_combine(y, yp, topk_w, pair_row, shared, T, k, d, bound.ctx));
}

static void table_combine_backward(float *dyp, float *dweights, const float *dy, const float *yp,
                                   const float *topk_w, const int64_t *pair_row, int64_t T,
                                   int64_t k, int64_t d) {
    RUN("combine_backward", moe_cuda_combine_backward(dyp, dweights, dy, yp, topk_w, pair_row, T,
                                                      k, d, bound.ctx));
}

static void table_unpermute_add(float *dx, const float *dxp, const int64_t *pair_row, int64_t T,
                                int64_t k, int64_t d) {
    RUN("unpermute_add", moe_cuda_unpermute_add(dx, dxp, pair_row, T, k, d, bound.ctx));
}

static void table_experts_forward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    RUN("experts_forward", moe_cuda_expert_groups_forward(groups, n_groups, d, bound.ctx));
}

static void table_experts_backward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    RUN("experts_backward", moe_cuda_expert_groups_backward(groups, n_groups, d, bound.ctx));
}

/* ------------------------------------------------------------------- dense */

static void table_embedding_forward(float *out, const int32_t *tokens, const float *wte, int64_t N,
                                    int64_t C) {
    RUN("embedding_forward", moe_cuda_embedding_forward(out, tokens, wte, N, C, bound.ctx));
}

static void table_embedding_backward(float *dwte, const float *dout, const int32_t *tokens,
                                     int64_t N, int64_t C) {
    RUN("embedding_backward", moe_cuda_embedding_backward(dwte, dout, tokens, N, C, bound.ctx));
}

static void table_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                                  float eps, int64_t N, int64_t C) {
    RUN("rmsnorm_forward",
        moe_cuda_rmsnorm_forward(out, rstd, inp, weight, eps, N, C, bound.ctx));
}

static void table_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                                   const float *inp, const float *weight, const float *rstd,
                                   void *scratch, int64_t N, int64_t C) {
    RUN("rmsnorm_backward", moe_cuda_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd,
                                                      scratch, N, C, bound.ctx));
}

static void table_matmul_forward(float *out, const float *inp, const float *weight, int64_t N,
                                 int64_t C, int64_t OC) {
    RUN("matmul_forward", moe_cuda_matmul_forward(out, inp, weight, N, C, OC, bound.ctx));
}

static void table_matmul_backward(float *dinp, float *dweight, const float *dout,
                                  const float *inp, const float *weight, int64_t N, int64_t C,
                                  int64_t OC) {
    RUN("matmul_backward",
        moe_cuda_matmul_backward(dinp, dweight, dout, inp, weight, N, C, OC, bound.ctx));
}

static void table_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B,
                               int64_t T, int64_t H, int64_t hd) {
    RUN("rope_forward", moe_cuda_rope_forward(x, cos_t, sin_t, B, T, H, hd, bound.ctx));
}

static void table_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B,
                                int64_t T, int64_t H, int64_t hd) {
    RUN("rope_backward", moe_cuda_rope_backward(dx, cos_t, sin_t, B, T, H, hd, bound.ctx));
}

static void table_attention_forward(float *out, float *att, const float *q, const float *k,
                                    const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                    int64_t hd, int64_t window) {
    RUN("attention_forward",
        moe_cuda_attention_forward(out, att, q, k, v, B, T, Hq, Hkv, hd, window, bound.ctx));
}

static void table_attention_decode(float *out, float *att, const float *q, const float *k,
                                   const float *v, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd) {
    RUN("attention_decode", moe_cuda_attention_decode(out, att, q, k, v, T, Hq, Hkv, hd, bound.ctx));
}

static void table_attention_backward(float *dq, float *dk, float *dv, float *datt,
                                     const float *dout, const float *q, const float *k,
                                     const float *v, const float *att, int64_t B, int64_t T,
                                     int64_t Hq, int64_t Hkv, int64_t hd, int64_t window) {
    RUN("attention_backward", moe_cuda_attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B,
                                                          T, Hq, Hkv, hd, window, bound.ctx));
}

static void table_crossentropy_forward(float *losses, double *lse, const float *logits,
                                       const int32_t *targets, int64_t N, int64_t V) {
    RUN("crossentropy_forward",
        moe_cuda_crossentropy_forward(losses, lse, logits, targets, N, V, bound.ctx));
}

static void table_crossentropy_backward(float *dlogits, const float *logits, const double *lse,
                                        const int32_t *targets, const float *dloss, float z_coef,
                                        int64_t N, int64_t V) {
    RUN("crossentropy_backward", moe_cuda_crossentropy_backward(dlogits, logits, lse, targets, dloss,
                                                                z_coef, N, V, bound.ctx));
}

static void table_residual_forward(float *out, const float *a, const float *b, int64_t n) {
    RUN("residual_forward", moe_cuda_residual_forward(out, a, b, n, bound.ctx));
}

static void table_residual_backward(float *da, float *db, const float *dout, int64_t n) {
    RUN("residual_backward", moe_cuda_residual_backward(da, db, dout, n, bound.ctx));
}

static void table_multiply(float *out, const float *a, const float *b, int64_t n) {
    RUN("multiply", moe_cuda_multiply(out, a, b, n, bound.ctx));
}

static void table_sigmoid_gate_forward(float *out, float *gate, const float *in,
                                       const float *logits, int64_t T, int64_t d) {
    RUN("sigmoid_gate_forward", moe_cuda_sigmoid_gate_forward(out, gate, in, logits, T, d, bound.ctx));
}

static void table_sigmoid_gate_backward(float *din, float *dlogits, const float *dout,
                                        const float *out, const float *gate, int64_t T, int64_t d) {
    RUN("sigmoid_gate_backward",
        moe_cuda_sigmoid_gate_backward(din, dlogits, dout, out, gate, T, d, bound.ctx));
}

static void table_uniform(float *out, uint64_t seed, uint64_t stream, uint64_t first, float lo,
                          float span, int64_t n) {
    RUN("uniform", moe_cuda_uniform(out, seed, stream, first, lo, span, n, bound.ctx));
}

static void table_adamw(float *params, float *m, float *v, const float *grads, float grad_scale,
                        int64_t n,
                        const moe_adamw_span *spans, int64_t n_spans, float lr, float beta1,
                        float beta2, float eps, float weight_decay, int64_t t) {
    RUN("adamw", moe_cuda_adamw(params, m, v, grads, grad_scale, n, spans, n_spans, lr, beta1, beta2, eps,
                                weight_decay, t, bound.ctx));
}

/* out is device memory: the host reads it with download. */
static void table_sumsq(double *out, const float *x, int64_t n) {
    RUN("sumsq", moe_cuda_sumsq(out, x, n, bound.ctx));
}

/* ------------------------------------------------------------------- table */

/* Field by field: C++17 has no designated initializers. */
static moe_ops make_table(void) {
    moe_ops t;
    memset(&t, 0, sizeof t);
    t.name = "cuda";
    t.host_visible = false;
    t.alloc = table_alloc;
    t.release = table_release;
    t.upload = table_upload;
    t.download = table_download;
    t.copy = table_copy;
    t.zero = table_zero;
    t.sync = table_sync;
    t.marks_create = table_marks_create;
    t.marks_destroy = table_marks_destroy;
    t.mark = table_mark;
    t.mark_seconds = table_mark_seconds;
    t.gemm = table_gemm;
    t.gate_forward = table_gate_forward;
    t.gate_backward = table_gate_backward;
    t.gate_seq_stats = table_gate_seq_stats;
    t.plan_scratch_bytes = moe_cuda_plan_scratch_bytes;
    t.plan_build = table_plan_build;
    t.permute = table_permute;
    t.combine = table_combine;
    t.combine_backward = table_combine_backward;
    t.unpermute_add = table_unpermute_add;
    t.experts_forward = table_experts_forward;
    t.experts_backward = table_experts_backward;
    t.embedding_forward = table_embedding_forward;
    t.embedding_backward = table_embedding_backward;
    t.rmsnorm_forward = table_rmsnorm_forward;
    t.rmsnorm_scratch_bytes = moe_cuda_rmsnorm_scratch_bytes;
    t.rmsnorm_backward = table_rmsnorm_backward;
    t.matmul_forward = table_matmul_forward;
    t.matmul_backward = table_matmul_backward;
    t.rope_forward = table_rope_forward;
    t.rope_backward = table_rope_backward;
    t.attention_forward = table_attention_forward;
    t.attention_decode = table_attention_decode;
    t.attention_backward = table_attention_backward;
    t.crossentropy_forward = table_crossentropy_forward;
    t.crossentropy_backward = table_crossentropy_backward;
    t.residual_forward = table_residual_forward;
    t.residual_backward = table_residual_backward;
    t.multiply = table_multiply;
    t.sigmoid_gate_forward = table_sigmoid_gate_forward;
    t.sigmoid_gate_backward = table_sigmoid_gate_backward;
    t.uniform = table_uniform;
    t.adamw = table_adamw;
    t.sumsq = table_sumsq;
    return t;
}

static moe_status make_current(const moe_cuda_ctx *ctx) {
    MOE_CUDA_CHECK(cudaSetDevice(ctx->device));
    return MOE_OK;
}

extern "C" void moe_cuda_unbind(moe_cuda_ctx *ctx) {
    if (bound.ctx == ctx) bound.ctx = NULL; /* its failure goes with it */
}

extern "C" const moe_ops *moe_cuda_ops(moe_cuda_ctx *ctx) {
    /* Made on first use, whatever the order of static initialisers. */
    static const moe_ops table = make_table();
    bound.ctx = ctx;
    if (ctx) keep(make_current(ctx), "moe_cuda_ops");
    return &table;
}
