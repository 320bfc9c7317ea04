/* experts.cu: grouped GEMMs over an expert-major batch, and the SwiGLU
 * experts built from them (kernels/cpu/experts.c is the reference).
 *
 * Every GEMM of the experts is one "grouped spec": for each expert e with
 * rows [o_e, o_e + n_e), one GEMM whose row-dependent size (M for the
 * activations, K for the weight gradients) is n_e and whose operands start
 * at base + o_e * row_stride + e * expert_stride. Three ways to run it:
 * a loop of cached cuBLASLt GEMMs, one cublasGemmGroupedBatchedEx, or our
 * tensor-core kernel (grouped_mma.cu), which alone reads n_e on the
 * device.
 *
 * ops.h's expert groups (the op table's experts) come with host row counts
 * and may differ in d_ff: each group runs as its own GEMMs, with no offsets
 * to read and so no host wait (but for the growth of the scratch that holds,
 * under bf16 math, the bf16 copies of their operands). */
#include <limits.h>

#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/grouped_mma.cuh"
#include "kernels/moe_math.h"

typedef struct grouped_operand {
    const void *p;
    int64_t ld;     /* row stride of the stored matrix */
    int64_t row;    /* elements from one expert row to the next */
    int64_t expert; /* elements from one expert to the next */
} grouped_operand;

typedef struct grouped_spec {
    bool trans_a, trans_b;
    bool rows_in_k;  /* the expert's rows are K (weight gradients), else M */
    int64_t m, n, k; /* the fixed sizes; the one the rows give is ignored */
    grouped_operand a, b, c;
    moe_cuda_dtype ab_type, c_type;
    float alpha, beta;
} grouped_spec;

/* A GEMM over the expert's rows (M = n_e): c [rows, n] = a [rows, k] op(b_e),
 * b_e at b + e * b_expert; a and c advance by a row per expert row. */
static grouped_spec rows_gemm(void *c, int64_t ldc, const void *a, int64_t lda, const void *b,
                              int64_t ldb, int64_t b_expert, bool trans_b, int64_t n, int64_t k,
                              moe_cuda_dtype t) {
    grouped_spec s;
    s.trans_a = false, s.trans_b = trans_b, s.rows_in_k = false;
    s.m = 0, s.n = n, s.k = k;
    s.a = (grouped_operand){a, lda, lda, 0};
    s.b = (grouped_operand){b, ldb, 0, b_expert};
    s.c = (grouped_operand){c, ldc, ldc, 0};
    s.ab_type = t, s.c_type = t, s.alpha = 1.0f, s.beta = 0.0f;
    return s;
}

/* A weight gradient summed over the expert's rows (K = n_e):
 * c_e [m, n] += a [rows, m]^T b [rows, n], c_e at c + e * m * n, fp32. */
static grouped_spec weight_grad_gemm(float *c, const void *a, int64_t lda, const void *b,
                                     int64_t ldb, int64_t m, int64_t n, moe_cuda_dtype t) {
    grouped_spec s;
    s.trans_a = true, s.trans_b = false, s.rows_in_k = true;
    s.m = m, s.n = n, s.k = 0;
    s.a = (grouped_operand){a, lda, lda, 0};
    s.b = (grouped_operand){b, ldb, ldb, 0};
    s.c = (grouped_operand){c, n, 0, m * n};
    s.ab_type = t, s.c_type = MOE_CUDA_F32, s.alpha = 1.0f, s.beta = 1.0f;
    return s;
}

extern "C" const char *moe_cuda_grouped_algo_name(moe_cuda_grouped_algo algo) {
    switch (algo) {
    case MOE_CUDA_GROUPED_LT_LOOP: return "cublaslt-loop";
    case MOE_CUDA_GROUPED_BATCHED: return "cublas-grouped";
    case MOE_CUDA_GROUPED_MMA: return "mma";
    case MOE_CUDA_GROUPED_WGMMA: return "wgmma";
    case MOE_CUDA_GROUPED_WGMMA_TMA: return "wgmma-tma";
    }
    return "unknown";
}

/* Our kernels, which read the offsets on the device. */
static bool ours(moe_cuda_grouped_algo algo) {
    return algo == MOE_CUDA_GROUPED_MMA || algo == MOE_CUDA_GROUPED_WGMMA ||
           algo == MOE_CUDA_GROUPED_WGMMA_TMA;
}

/* Expert e's operand: base + (o_e * row + e * expert) elements. */
static const void *operand_at(const grouped_operand *op, moe_cuda_dtype t, int64_t e, int64_t o) {
    return (const char *)op->p + (size_t)(o * op->row + e * op->expert) * moe_cuda_dtype_bytes(t);
}

/* THE HOST WAIT: cuBLAS takes every shape from host memory, so the loop
 * and the grouped-batched baselines copy the E+1 offsets to the host and
 * wait for the stream here, once per call. The MMA path never comes here. */
static moe_status read_offsets(const int64_t **out, const int64_t *offsets, int64_t E,
                               int64_t max_rows, moe_cuda_ctx *ctx) {
    int64_t *h = ctx->host_counts;
    MOE_CUDA_CHECK(cudaMemcpyAsync(h, offsets, (size_t)(E + 1) * sizeof *h, cudaMemcpyDeviceToHost,
                                   ctx->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
    for (int64_t e = 0; e < E; e++)
        if (h[e] < 0 || h[e + 1] < h[e] || h[e + 1] > max_rows)
            return moe_error(
                MOE_ERR_INVALID_ARG,
                "expert offsets: offsets[%lld]=%lld, offsets[%lld]=%lld with %lld rows "
                "of buffer",
                (long long)e, (long long)h[e], (long long)(e + 1), (long long)h[e + 1],
                (long long)max_rows);
    *out = h;
    return MOE_OK;
}

static moe_status run_loop(const grouped_spec *s, const int64_t *off, int64_t E,
                           moe_cuda_ctx *ctx) {
    for (int64_t e = 0; e < E; e++) {
        const int64_t o = off[e], rows = off[e + 1] - off[e];
        if (rows == 0) continue; /* as on the CPU: an idle expert adds nothing */
        MOE_TRY(moe_cuda_lt_gemm(
            ctx, (void *)operand_at(&s->c, s->c_type, e, o), s->c_type,
            operand_at(&s->a, s->ab_type, e, o), operand_at(&s->b, s->ab_type, e, o), s->ab_type,
            s->rows_in_k ? s->m : rows, s->n, s->rows_in_k ? rows : s->k, s->a.ld, s->b.ld, s->c.ld,
            s->trans_a, s->trans_b, s->alpha, s->beta,
            s->rows_in_k ? MOE_CUDA_LT_RAGGED_K : MOE_CUDA_LT_RAGGED_M));
    }
    return MOE_OK;
}

/* Pointer slots per grouped-batched GEMM: the up-to-five GEMMs of one
 * experts call stage their pointers in separate slots, because the host
 * fills slot j while the copy of slot j - 1 may still be in flight. */
#define BATCHED_SLOT (3 * MOE_EXPERTS_MAX)

static moe_status run_batched(const grouped_spec *s, const int64_t *off, int64_t E, int slot,
                              moe_cuda_ctx *ctx) {
    if (s->ab_type != s->c_type)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "cublasGemmGroupedBatchedEx takes one storage type for a, b and c; the "
                         "bf16 weight gradients (fp32 output) need the cublaslt-loop algorithm");
    cublasOperation_t ta[MOE_EXPERTS_MAX], tb[MOE_EXPERTS_MAX];
    int m[MOE_EXPERTS_MAX], n[MOE_EXPERTS_MAX], k[MOE_EXPERTS_MAX], size[MOE_EXPERTS_MAX];
    int lda[MOE_EXPERTS_MAX], ldb[MOE_EXPERTS_MAX], ldc[MOE_EXPERTS_MAX];
    float alpha[MOE_EXPERTS_MAX], beta[MOE_EXPERTS_MAX];
    const int64_t lim[] = {s->m, s->n, s->k, s->a.ld, s->b.ld, s->c.ld, off[E]};
    for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
        if (lim[i] > INT_MAX)
            return moe_error(MOE_ERR_UNSUPPORTED,
                             "cublasGemmGroupedBatchedEx takes 32-bit sizes: %lld is too large",
                             (long long)lim[i]);

    void **host = ctx->host_ptrs + (size_t)slot * BATCHED_SLOT;
    void **dev = ctx->ptrs + (size_t)slot * BATCHED_SLOT;
    /* Column-major, swapped as in gemm.cu: cuBLAS's A is our b. */
    int groups = 0, problems = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = off[e + 1] - off[e];
        if (rows == 0) continue;
        const int gm = (int)(s->rows_in_k ? s->m : rows), gk = (int)(s->rows_in_k ? rows : s->k);
        /* Consecutive experts of one shape share a group. */
        if (groups == 0 || m[groups - 1] != (int)s->n || n[groups - 1] != gm ||
            k[groups - 1] != gk) {
            ta[groups] = s->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
            tb[groups] = s->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
            m[groups] = (int)s->n, n[groups] = gm, k[groups] = gk;
            lda[groups] = (int)s->b.ld, ldb[groups] = (int)s->a.ld, ldc[groups] = (int)s->c.ld;
            alpha[groups] = s->alpha, beta[groups] = s->beta;
            size[groups] = 0;
            groups++;
        }
        size[groups - 1]++;
        host[problems] = (void *)operand_at(&s->b, s->ab_type, e, off[e]);
        host[MOE_EXPERTS_MAX + problems] = (void *)operand_at(&s->a, s->ab_type, e, off[e]);
        host[2 * MOE_EXPERTS_MAX + problems] = (void *)operand_at(&s->c, s->c_type, e, off[e]);
        problems++;
    }
    if (problems == 0) return MOE_OK;
    MOE_CUDA_CHECK(cudaMemcpyAsync(dev, host, BATCHED_SLOT * sizeof(void *), cudaMemcpyHostToDevice,
                                   ctx->stream));
    const cudaDataType_t ab = moe_cuda_data_type(s->ab_type), cd = moe_cuda_data_type(s->c_type);
    MOE_CUDA_CHECK(cublasGemmGroupedBatchedEx(
        ctx->blas, ta, tb, m, n, k, alpha, (const void *const *)dev, ab, lda,
        (const void *const *)(dev + MOE_EXPERTS_MAX), ab, ldb, beta, dev + 2 * MOE_EXPERTS_MAX, cd,
        ldc, groups, size, CUBLAS_COMPUTE_32F));
    return MOE_OK;
}

/* Runs s with offsets already on the host (LT_LOOP, BATCHED). */
static moe_status run_host(const grouped_spec *s, const int64_t *off, int64_t E,
                           moe_cuda_grouped_algo algo, int slot, moe_cuda_ctx *ctx) {
    if (algo == MOE_CUDA_GROUPED_LT_LOOP) return run_loop(s, off, E, ctx);
    if (algo == MOE_CUDA_GROUPED_BATCHED) return run_batched(s, off, E, slot, ctx);
    return moe_error(MOE_ERR_UNSUPPORTED, "grouped GEMM algorithm %s does not serve this GEMM",
                     moe_cuda_grouped_algo_name(algo));
}

static moe_status check_experts(int64_t E, const char *op) {
    if (E < 1 || E > MOE_EXPERTS_MAX)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: E=%lld outside [1, %d]", op, (long long)E,
                         MOE_EXPERTS_MAX);
    return MOE_OK;
}

extern "C" moe_status moe_cuda_grouped_gemm(void *c, moe_cuda_dtype c_type, const void *a,
                                            const void *b, moe_cuda_dtype ab_type,
                                            const int64_t *offsets, int64_t E, int64_t max_rows,
                                            int64_t n, int64_t k, moe_cuda_grouped_algo algo,
                                            moe_cuda_ctx *ctx) {
    MOE_TRY(check_experts(E, "moe_cuda_grouped_gemm"));
    if (ours(algo))
        return moe_cuda_grouped_mma(c, c_type, a, b, ab_type, offsets, E, max_rows, n, k, algo,
                                    ctx);
    const int64_t *off = NULL;
    MOE_TRY(read_offsets(&off, offsets, E, max_rows, ctx));
    grouped_spec s = rows_gemm(c, n, a, k, b, k, n * k, true, n, k, ab_type);
    s.c_type = c_type;
    return run_host(&s, off, E, algo, 0, ctx);
}

/* ---------------------------------------------------------------- SwiGLU */

/* The rows r < *n_rows (device), or all max_rows rows when n_rows is NULL
 * (a row count the host knows). */
static __device__ __forceinline__ int64_t swiglu_rows(const int64_t *n_rows, int64_t max_rows) {
    return n_rows ? min(*n_rows, max_rows) : max_rows;
}

/* g [rows, f] = silu(h[:, :f]) * h[:, f:]. */
template <typename T>
static __global__ void swiglu_forward_kernel(T *g, const T *h, const int64_t *n_rows,
                                             int64_t max_rows, int64_t f) {
    const int64_t n = swiglu_rows(n_rows, max_rows) * f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / f, j = i % f;
        g[i] = moe_from_float<T>(
            moe_swiglu(moe_to_float(h[r * 2 * f + j]), moe_to_float(h[r * 2 * f + f + j])));
    }
}

/* In place on dh [rows, 2f]: [dg | .] becomes [da | db]. */
template <typename T>
static __global__ void swiglu_backward_kernel(T *dh, const T *h, const int64_t *n_rows,
                                              int64_t max_rows, int64_t f) {
    const int64_t n = swiglu_rows(n_rows, max_rows) * f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t a = (i / f) * 2 * f + i % f, b = a + f;
        float da, db;
        moe_swiglu_backward(&da, &db, moe_to_float(dh[a]), moe_to_float(h[a]), moe_to_float(h[b]));
        dh[a] = moe_from_float<T>(da);
        dh[b] = moe_from_float<T>(db);
    }
}

/* Forward: out is g [rows, f]; backward: out is dh [rows, 2f], in place. */
static moe_status swiglu_run(void *out, const void *h, const int64_t *n_rows, int64_t max_rows,
                             int64_t f, moe_cuda_dtype t, bool backward, moe_cuda_ctx *ctx) {
    const unsigned grid = moe_cuda_grid(max_rows * f, MOE_CUDA_THREADS, ctx);
    if (t == MOE_CUDA_BF16) {
        if (backward)
            swiglu_backward_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>(
                (__nv_bfloat16 *)out, (const __nv_bfloat16 *)h, n_rows, max_rows, f);
        else
            swiglu_forward_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>(
                (__nv_bfloat16 *)out, (const __nv_bfloat16 *)h, n_rows, max_rows, f);
    } else {
        if (backward)
            swiglu_backward_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>(
                (float *)out, (const float *)h, n_rows, max_rows, f);
        else
            swiglu_forward_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>(
                (float *)out, (const float *)h, n_rows, max_rows, f);
    }
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* The batch's rows r < offsets[E]. */
static moe_status swiglu(const moe_cuda_experts *x, bool backward, moe_cuda_ctx *ctx) {
    return swiglu_run(backward ? x->dh : x->g, x->h, x->offsets + x->n_experts, x->max_rows,
                      x->d_ff, x->dtype, backward, ctx);
}

/* --------------------------------------------------------------- experts */

extern "C" moe_status moe_cuda_experts_forward(const moe_cuda_experts *x,
                                               moe_cuda_grouped_algo algo, moe_cuda_ctx *ctx) {
    MOE_TRY(check_experts(x->n_experts, "moe_cuda_experts_forward"));
    const int64_t E = x->n_experts, d = x->d_model, f = x->d_ff;
    if (ours(algo)) {
        MOE_TRY(moe_cuda_grouped_mma(x->h, x->dtype, x->x, x->w13, x->dtype, x->offsets, E,
                                     x->max_rows, 2 * f, d, algo, ctx));
        MOE_TRY(swiglu(x, false, ctx));
        return moe_cuda_grouped_mma(x->y, x->dtype, x->g, x->w2, x->dtype, x->offsets, E,
                                    x->max_rows, d, f, algo, ctx);
    }
    const int64_t *off = NULL;
    MOE_TRY(read_offsets(&off, x->offsets, E, x->max_rows, ctx));
    const moe_cuda_dtype t = x->dtype;
    /* h = x w13^T, then y = g w2^T */
    const grouped_spec up =
        rows_gemm(x->h, 2 * f, x->x, d, x->w13, d, 2 * f * d, true, 2 * f, d, t);
    const grouped_spec down = rows_gemm(x->y, d, x->g, f, x->w2, f, d * f, true, d, f, t);
    MOE_TRY(run_host(&up, off, E, algo, 0, ctx));
    MOE_TRY(swiglu(x, false, ctx));
    return run_host(&down, off, E, algo, 1, ctx);
}

/* dg = dy w2 into the first half of each dh row, the SwiGLU backward in
 * place, dx = dh w13, then dw13 += dh^T x and dw2 += dy^T g, each summed
 * over the expert's rows (K = n_e). */
extern "C" moe_status moe_cuda_experts_backward(const moe_cuda_experts *x,
                                                moe_cuda_grouped_algo algo, moe_cuda_ctx *ctx) {
    MOE_TRY(check_experts(x->n_experts, "moe_cuda_experts_backward"));
    if (ours(algo))
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "moe_cuda_experts_backward: the %s kernel serves the forward only",
                         moe_cuda_grouped_algo_name(algo));
    /* Refused before any GEMM runs, so dh and dx are left as they were. */
    if (algo == MOE_CUDA_GROUPED_BATCHED && x->dtype == MOE_CUDA_BF16)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "moe_cuda_experts_backward: bf16 weight gradients (fp32 output) need the "
                         "cublaslt-loop algorithm; cublasGemmGroupedBatchedEx takes one storage "
                         "type");
    const int64_t E = x->n_experts, d = x->d_model, f = x->d_ff;
    const moe_cuda_dtype t = x->dtype;
    const int64_t *off = NULL;
    MOE_TRY(read_offsets(&off, x->offsets, E, x->max_rows, ctx));
    const grouped_spec dg = rows_gemm(x->dh, 2 * f, x->dy, d, x->w2, f, d * f, false, f, d, t);
    const grouped_spec dxs =
        rows_gemm(x->dx, d, x->dh, 2 * f, x->w13, d, 2 * f * d, false, d, 2 * f, t);
    const grouped_spec dw13 = weight_grad_gemm(x->dw13, x->dh, 2 * f, x->x, d, 2 * f, d, t);
    const grouped_spec dw2 = weight_grad_gemm(x->dw2, x->dy, d, x->g, f, d, f, t);
    MOE_TRY(run_host(&dg, off, E, algo, 0, ctx));
    MOE_TRY(swiglu(x, true, ctx));
    MOE_TRY(run_host(&dxs, off, E, algo, 1, ctx));
    MOE_TRY(run_host(&dw13, off, E, algo, 2, ctx));
    return run_host(&dw2, off, E, algo, 3, ctx);
}

/* ---------------------------------------------------------- expert groups */

static moe_status check_groups(const moe_expert_group *groups, int64_t n_groups, int64_t d,
                               const char *op) {
    if (n_groups < 0 || d < 1 || (n_groups > 0 && !groups))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: n_groups=%lld d=%lld groups=%p", op,
                         (long long)n_groups, (long long)d, (const void *)groups);
    for (int64_t i = 0; i < n_groups; i++)
        if (groups[i].rows < 0 || (groups[i].rows > 0 && groups[i].d_ff < 1))
            return moe_error(MOE_ERR_INVALID_ARG, "%s: group %lld has rows=%lld d_ff=%lld", op,
                             (long long)i, (long long)groups[i].rows, (long long)groups[i].d_ff);
    return MOE_OK;
}

/* A group is one expert of the grouped specs, rows [0, n): the loop runs
 * its GEMMs, each planned for its rows' bucket. */
static moe_status run_group(const grouped_spec *s, int64_t n, moe_cuda_ctx *ctx) {
    const int64_t off[2] = {0, n};
    return run_loop(s, off, 1, ctx);
}

/* A group's GEMM operands in the storage type its GEMMs read. Under bf16
 * math that is bf16: cuBLASLt's bf16 kernels run at about twice the rate
 * of its fp32-operand kernels that round inside the GEMM, so x, the
 * weights and dy are converted into the context's scratch, and h, g and dh
 * hold bf16 in the first half of their fp32 buffers (they are this
 * backend's, saved for its own backward). y, dx and the weight gradients
 * stay fp32. Otherwise the group's own fp32 arrays. */
typedef struct group_operands {
    moe_cuda_dtype t;
    const void *x, *w13, *w2, *dy; /* dy: backward only */
} group_operands;

static size_t scratch_piece(int64_t elems) {
    return ((size_t)elems * sizeof(__nv_bfloat16) + 255) / 256 * 256;
}

static moe_status group_operands_get(group_operands *o, const moe_expert_group *g, int64_t d,
                                     bool backward, moe_cuda_ctx *ctx) {
    const int64_t n = g->rows, f = g->d_ff;
    if (ctx->math != MOE_CUDA_MATH_BF16) {
        *o = (group_operands){MOE_CUDA_F32, g->x, g->w13, g->w2, g->dy};
        return MOE_OK;
    }
    const int64_t elems[4] = {n * d, 2 * f * d, d * f, backward ? n * d : 0};
    const float *src[4] = {g->x, g->w13, g->w2, g->dy};
    size_t bytes = 0;
    for (int i = 0; i < 4; i++) bytes += scratch_piece(elems[i]);
    char *p = NULL;
    MOE_TRY(moe_cuda_scratch((void **)&p, bytes, MOE_CUDA_SCRATCH_EXPERTS, ctx));
    void *dst[4];
    for (int i = 0; i < 4; i++) {
        dst[i] = p;
        MOE_TRY(moe_cuda_f32_to_bf16(p, src[i], elems[i], ctx));
        p += scratch_piece(elems[i]);
    }
    *o = (group_operands){MOE_CUDA_BF16, dst[0], dst[1], dst[2], backward ? dst[3] : NULL};
    return MOE_OK;
}

/* As kernels/cpu/experts.c, one group at a time: h = x w13^T, the SwiGLU,
 * y = g w2^T. */
extern "C" moe_status moe_cuda_expert_groups_forward(const moe_expert_group *groups,
                                                     int64_t n_groups, int64_t d,
                                                     moe_cuda_ctx *ctx) {
    MOE_TRY(check_groups(groups, n_groups, d, "moe_cuda_expert_groups_forward"));
    for (int64_t i = 0; i < n_groups; i++) {
        const moe_expert_group *g = &groups[i];
        const int64_t n = g->rows, f = g->d_ff;
        if (n == 0) continue;
        group_operands o;
        MOE_TRY(group_operands_get(&o, g, d, false, ctx));
        const moe_cuda_dtype t = o.t;
        const grouped_spec up = rows_gemm(g->h, 2 * f, o.x, d, o.w13, d, 0, true, 2 * f, d, t);
        grouped_spec down = rows_gemm(g->y, d, g->g, f, o.w2, f, 0, true, d, f, t);
        down.c_type = MOE_CUDA_F32;
        MOE_TRY(run_group(&up, n, ctx));
        MOE_TRY(swiglu_run(g->g, g->h, NULL, n, f, t, false, ctx));
        MOE_TRY(run_group(&down, n, ctx));
    }
    return MOE_OK;
}

/* dg = dy w2 into the first half of each dh row, the SwiGLU backward in
 * place, dx = dh w13, then dw13 += dh^T x and dw2 += dy^T g over the
 * group's rows. An empty group adds nothing to its weight gradients. */
extern "C" moe_status moe_cuda_expert_groups_backward(const moe_expert_group *groups,
                                                      int64_t n_groups, int64_t d,
                                                      moe_cuda_ctx *ctx) {
    MOE_TRY(check_groups(groups, n_groups, d, "moe_cuda_expert_groups_backward"));
    for (int64_t i = 0; i < n_groups; i++) {
        const moe_expert_group *g = &groups[i];
        const int64_t n = g->rows, f = g->d_ff;
        if (n == 0) continue;
        group_operands o;
        MOE_TRY(group_operands_get(&o, g, d, true, ctx));
        const moe_cuda_dtype t = o.t;
        const grouped_spec dg = rows_gemm(g->dh, 2 * f, o.dy, d, o.w2, f, 0, false, f, d, t);
        grouped_spec dxs = rows_gemm(g->dx, d, g->dh, 2 * f, o.w13, d, 0, false, d, 2 * f, t);
        dxs.c_type = MOE_CUDA_F32;
        const grouped_spec dw13 = weight_grad_gemm(g->dw13, g->dh, 2 * f, o.x, d, 2 * f, d, t);
        const grouped_spec dw2 = weight_grad_gemm(g->dw2, o.dy, d, g->g, f, d, f, t);
        MOE_TRY(run_group(&dg, n, ctx));
        MOE_TRY(swiglu_run(g->dh, g->h, NULL, n, f, t, true, ctx));
        MOE_TRY(run_group(&dxs, n, ctx));
        MOE_TRY(run_group(&dw13, n, ctx));
        MOE_TRY(run_group(&dw2, n, ctx));
    }
    return MOE_OK;
}
