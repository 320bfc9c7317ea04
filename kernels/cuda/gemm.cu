/* gemm.cu: row-major GEMMs on cuBLASLt with cached plans, and batched
 * GEMMs over pointer arrays built on the device.
 *
 * cuBLAS is column-major. A row-major c [m, n] read column-major is c^T
 * [n, m], and c^T = op(b)^T op(a)^T, so every call swaps the operands and
 * the m/n sizes and keeps the transpose flags with their operands. */
#include <limits.h>
#include <string.h>

#include "kernels/cuda/gemm.cuh"

/* ---------------------------------------------------------------- k == 0 */

/* op(a) op(b) is empty: c = beta c, and BLAS libraries may skip even that. */
static __global__ void scale_kernel(float *c, int64_t m, int64_t n, int64_t ldc, float beta) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m * n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float *p = c + (i / n) * ldc + i % n;
        *p = beta == 0.0f ? 0.0f : beta * *p;
    }
}

/* How fp32 operands are multiplied: on the tensor cores when the context's
 * math says so (moe_cuda_set_math), rounding the inputs, summing in fp32. */
static cublasComputeType_t fp32_compute(const moe_cuda_ctx *ctx) {
    return ctx->math == MOE_CUDA_MATH_TF32   ? CUBLAS_COMPUTE_32F_FAST_TF32
           : ctx->math == MOE_CUDA_MATH_BF16 ? CUBLAS_COMPUTE_32F_FAST_16BF
                                             : CUBLAS_COMPUTE_32F;
}

/* ----------------------------------------------------------- plan cache */

/* The largest power of two (at most 256) that divides the address. */
static int32_t alignment(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int32_t align = 1;
    while (align < 256 && a % (uintptr_t)(2 * align) == 0) align *= 2;
    return align;
}

/* cuBLAS's A (our b: [n, k] column-major, stored [k, n] when op is T), B
 * (our a: [k, m], stored [m, k] when op is T), and C = D ([n, m]), for the
 * key's sizes. */
static moe_status init_layouts(cublasLtMatrixLayoutOpaque_t *l, const moe_cuda_lt_key *key) {
    const cudaDataType_t ab = moe_cuda_data_type((moe_cuda_dtype)key->ab_type);
    const cudaDataType_t cd = moe_cuda_data_type((moe_cuda_dtype)key->c_type);
    const int64_t m = key->m, n = key->n, k = key->k;
    MOE_CUDA_CHECK(cublasLtMatrixLayoutInit(&l[0], ab, (uint64_t)(key->trans_b ? k : n),
                                            (uint64_t)(key->trans_b ? n : k), key->ldb));
    MOE_CUDA_CHECK(cublasLtMatrixLayoutInit(&l[1], ab, (uint64_t)(key->trans_a ? m : k),
                                            (uint64_t)(key->trans_a ? k : m), key->lda));
    MOE_CUDA_CHECK(cublasLtMatrixLayoutInit(&l[2], cd, (uint64_t)n, (uint64_t)m, key->ldc));
    return MOE_OK;
}

/* Fills p for key in the swapped, column-major form described above. */
static moe_status plan_make(moe_cuda_ctx *ctx, moe_cuda_lt_plan *p, const moe_cuda_lt_key *key) {
    const cublasOperation_t op_b = key->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = key->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    memset(p, 0, sizeof *p); /* an evicted plan's slot: nothing of it stays */
    p->key = *key;
    p->used = true;
    MOE_CUDA_CHECK(
        cublasLtMatmulDescInit(&p->desc, (cublasComputeType_t)key->compute, CUDA_R_32F));
    MOE_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(&p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof op_b));
    MOE_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(&p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof op_a));
    MOE_TRY(init_layouts(p->layouts, key));

    /* The preference in place too: nothing to destroy, so each setting is
     * checked as it is made. */
    cublasLtMatmulPreferenceOpaque_t pref;
    MOE_CUDA_CHECK(cublasLtMatmulPreferenceInit(&pref));
    const uint64_t ws = MOE_CUDA_WORKSPACE_BYTES;
    MOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    /* cuBLAS's A is our b and its B our a; C and D are c. */
    const struct {
        cublasLtMatmulPreferenceAttributes_t attr;
        uint32_t bytes;
    } aligns[] = {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, (uint32_t)key->align_b},
                  {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, (uint32_t)key->align_a},
                  {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, (uint32_t)key->align_c},
                  {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, (uint32_t)key->align_c}};
    for (size_t i = 0; i < sizeof aligns / sizeof aligns[0]; i++)
        MOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, aligns[i].attr, &aligns[i].bytes,
                                                            sizeof aligns[i].bytes));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    MOE_CUDA_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx->lt, &p->desc, &p->layouts[0],
                                                  &p->layouts[1], &p->layouts[2], &p->layouts[2],
                                                  &pref, 1, &result, &found));
    if (found == 0)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "cuBLASLt has no algorithm for m=%lld n=%lld k=%lld lda=%lld ldb=%lld "
                         "ldc=%lld trans_a=%d trans_b=%d (%s inputs, %s output) on %s",
                         (long long)key->m, (long long)key->n, (long long)key->k,
                         (long long)key->lda, (long long)key->ldb, (long long)key->ldc,
                         key->trans_a, key->trans_b,
                         key->ab_type == MOE_CUDA_BF16 ? "bf16" : "fp32",
                         key->c_type == MOE_CUDA_BF16 ? "bf16" : "fp32", ctx->name);
    p->algo = result.algo;
    return MOE_OK;
}

static moe_status plan_get(moe_cuda_ctx *ctx, const moe_cuda_lt_key *key, moe_cuda_lt_plan **out) {
    int free_slot = -1;
    for (int i = 0; i < MOE_CUDA_LT_PLANS; i++) {
        moe_cuda_lt_plan *p = &ctx->plans[i];
        if (p->used && memcmp(&p->key, key, sizeof *key) == 0) {
            *out = p;
            return MOE_OK;
        }
        if (!p->used && free_slot < 0) free_slot = i;
    }
    if (free_slot < 0) {
        free_slot = ctx->next_plan;
        ctx->next_plan = (ctx->next_plan + 1) % MOE_CUDA_LT_PLANS;
    }
    moe_cuda_lt_plan *p = &ctx->plans[free_slot];
    moe_status st = plan_make(ctx, p, key);
    if (st != MOE_OK) {
        memset(p, 0, sizeof *p);
        return st;
    }
    *out = p;
    return MOE_OK;
}

/* The smallest power of two >= rows (at least 16): the size a ragged
 * dimension's plan is made for. */
static int64_t rows_bucket(int64_t rows) {
    int64_t b = 16;
    while (b < rows) b *= 2;
    return b;
}

static cublasStatus_t lt_matmul(moe_cuda_ctx *ctx, moe_cuda_lt_plan *p,
                                cublasLtMatrixLayoutOpaque_t *l, void *c, const void *a,
                                const void *b, float alpha, float beta) {
    return cublasLtMatmul(ctx->lt, &p->desc, &alpha, b, &l[0], a, &l[1], &beta, c, &l[2], c, &l[2],
                          &p->algo, ctx->workspace, MOE_CUDA_WORKSPACE_BYTES, ctx->stream);
}

moe_status moe_cuda_lt_gemm(moe_cuda_ctx *ctx, void *c, moe_cuda_dtype c_type, const void *a,
                            const void *b, moe_cuda_dtype ab_type, int64_t m, int64_t n, int64_t k,
                            int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b,
                            float alpha, float beta, moe_cuda_lt_ragged ragged) {
    if (m == 0 || n == 0) return MOE_OK;
    if (k == 0) {
        if (c_type != MOE_CUDA_F32)
            return moe_error(MOE_ERR_UNSUPPORTED, "GEMM with k=0 on a bf16 output");
        scale_kernel<<<moe_cuda_grid(m * n, MOE_CUDA_THREADS, ctx), MOE_CUDA_THREADS, 0,
                       ctx->stream>>>((float *)c, m, n, ldc, beta);
        MOE_CUDA_CHECK(cudaGetLastError());
        return MOE_OK;
    }
    moe_cuda_lt_key key;
    memset(&key, 0, sizeof key); /* padding too: keys are compared bytewise */
    key.m = m, key.n = n, key.k = k, key.lda = lda, key.ldb = ldb, key.ldc = ldc;
    key.trans_a = trans_a, key.trans_b = trans_b, key.ab_type = ab_type, key.c_type = c_type;
    key.align_a = alignment(a), key.align_b = alignment(b), key.align_c = alignment(c);
    /* bf16 operands always go through the tensor cores, summing in fp32. */
    key.compute = ab_type != MOE_CUDA_F32 ? CUBLAS_COMPUTE_32F : fp32_compute(ctx);
    moe_cuda_lt_plan *p = NULL;
    if (ragged != MOE_CUDA_LT_FIXED) {
        /* The bucket's plan, on layouts of the real sizes. A bucket with no
         * plan (its rows past a leading dimension, say), or whose algorithm
         * cuBLASLt finds does not fit these sizes, leaves the call to a plan
         * of its own below. */
        moe_cuda_lt_key bucket = key;
        if (ragged == MOE_CUDA_LT_RAGGED_M) bucket.m = rows_bucket(m);
        if (ragged == MOE_CUDA_LT_RAGGED_K) bucket.k = rows_bucket(k);
        cublasLtMatrixLayoutOpaque_t layouts[3];
        if (plan_get(ctx, &bucket, &p) == MOE_OK && !p->misfits) {
            MOE_TRY(init_layouts(layouts, &key));
            const cublasStatus_t st = lt_matmul(ctx, p, layouts, c, a, b, alpha, beta);
            if (st == CUBLAS_STATUS_SUCCESS) return MOE_OK;
            if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
                return moe_cuda_report(st, "cublasLtMatmul (the row bucket's plan)", __FILE__,
                                       __LINE__);
            p->misfits = true; /* the bucket's counts take exact plans from now on */
        }
    }
    MOE_TRY(plan_get(ctx, &key, &p));
    MOE_CUDA_CHECK(lt_matmul(ctx, p, p->layouts, c, a, b, alpha, beta));
    return MOE_OK;
}

extern "C" moe_status moe_cuda_gemm(float *c, const float *a, const float *b, int64_t m, int64_t n,
                                    int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool trans_a,
                                    bool trans_b, float alpha, float beta, moe_cuda_ctx *ctx) {
    return moe_cuda_lt_gemm(ctx, c, MOE_CUDA_F32, a, b, MOE_CUDA_F32, m, n, k, lda, ldb, ldc,
                            trans_a, trans_b, alpha, beta, MOE_CUDA_LT_FIXED);
}

extern "C" moe_status moe_cuda_gemm_ex(void *c, moe_cuda_dtype c_type, const void *a, const void *b,
                                       moe_cuda_dtype ab_type, int64_t m, int64_t n, int64_t k,
                                       int64_t lda, int64_t ldb, int64_t ldc, bool trans_a,
                                       bool trans_b, float alpha, float beta, moe_cuda_ctx *ctx) {
    return moe_cuda_lt_gemm(ctx, c, c_type, a, b, ab_type, m, n, k, lda, ldb, ldc, trans_a, trans_b,
                            alpha, beta, MOE_CUDA_LT_FIXED);
}

/* -------------------------------------------------------------- batched */

typedef struct ptr_walks {
    moe_cuda_ptr_walk w[3];
} ptr_walks;

/* ptrs[j * count + i] = pointer i of walk j. */
static __global__ void fill_ptrs_kernel(void **ptrs, ptr_walks walks, int64_t count) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < 3 * count;
         i += (int64_t)gridDim.x * blockDim.x) {
        const moe_cuda_ptr_walk w = walks.w[i / count];
        const int64_t j = i % count;
        ptrs[i] = (void *)(w.base + (j / w.inner) * w.outer_stride +
                           ((j % w.inner) / w.div) * w.inner_stride);
    }
}

/* Every pointer of the walk is 16-byte aligned. */
static bool walk_aligned16(const moe_cuda_ptr_walk *w) {
    return (uintptr_t)w->base % 16 == 0 && w->outer_stride % 4 == 0 && w->inner_stride % 4 == 0;
}

moe_status moe_cuda_gemm_batched(moe_cuda_ctx *ctx, moe_cuda_ptr_walk c, moe_cuda_ptr_walk a,
                                 moe_cuda_ptr_walk b, int64_t count, int64_t m, int64_t n,
                                 int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool trans_a,
                                 bool trans_b, float alpha, float beta) {
    if (count == 0 || m == 0 || n == 0) return MOE_OK;
    if (3 * count > MOE_CUDA_PTR_SLOTS)
        return moe_error(MOE_ERR_UNSUPPORTED, "batched GEMM of %lld problems: at most %d",
                         (long long)count, MOE_CUDA_PTR_SLOTS / 3);
    const int64_t dims[] = {m, n, k, lda, ldb, ldc, count};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i] > INT_MAX)
            return moe_error(MOE_ERR_UNSUPPORTED,
                             "batched GEMM m=%lld n=%lld k=%lld: cuBLAS takes 32-bit sizes",
                             (long long)m, (long long)n, (long long)k);
    ptr_walks walks = {{c, a, b}};
    fill_ptrs_kernel<<<moe_cuda_grid(3 * count, MOE_CUDA_THREADS, ctx), MOE_CUDA_THREADS, 0,
                       ctx->stream>>>(ctx->ptrs, walks, count);
    MOE_CUDA_CHECK(cudaGetLastError());
    void *const *cp = ctx->ptrs;
    const void *const *ap = (const void *const *)(ctx->ptrs + count);
    const void *const *bp = (const void *const *)(ctx->ptrs + 2 * count);
    /* cuBLAS sees the pointers only on the device, and its tensor-core paths
     * assume every one 16-byte aligned: the context's math where they are
     * (every stride and leading dimension a multiple of 4 floats), plain
     * fp32 where they are not (attention with T not a multiple of 4). */
    const bool aligned = walk_aligned16(&c) && walk_aligned16(&a) && walk_aligned16(&b) &&
                         lda % 4 == 0 && ldb % 4 == 0 && ldc % 4 == 0;
    /* Swapped as in the header comment: cuBLAS's A is our b. */
    MOE_CUDA_CHECK(cublasGemmBatchedEx(
        ctx->blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n,
        (int)m, (int)k, &alpha, bp, CUDA_R_32F, (int)ldb, ap, CUDA_R_32F, (int)lda, &beta, cp,
        CUDA_R_32F, (int)ldc, (int)count, aligned ? fp32_compute(ctx) : CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
    return MOE_OK;
}
