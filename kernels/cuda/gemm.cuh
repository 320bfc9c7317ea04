/* gemm.cuh: the GEMM entry points the other .cu files build on: one
 * cuBLASLt GEMM through the context's plan cache, and batched GEMMs over
 * device pointer arrays. Row-major, as ops.h. Internal to kernels/cuda. */
#ifndef MOE_KERNELS_CUDA_GEMM_CUH
#define MOE_KERNELS_CUDA_GEMM_CUH

#include "kernels/cuda/common.cuh"

/* c [m, n] = alpha op(a) op(b) + beta c; a, b in ab_type, c in c_type, fp32
 * arithmetic. The plan (descriptors and heuristic algorithm) is made once
 * per shape, type and operand alignment, then reused. */
moe_status moe_cuda_lt_gemm(moe_cuda_ctx *ctx, void *c, moe_cuda_dtype c_type, const void *a,
                            const void *b, moe_cuda_dtype ab_type, int64_t m, int64_t n, int64_t k,
                            int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b,
                            float alpha, float beta);

void moe_cuda_lt_plans_destroy(moe_cuda_ctx *ctx);

/* Pointer i of a batch: base + (i / inner) * outer_stride +
 * ((i % inner) / div) * inner_stride, in floats. It walks (batch, head)
 * pairs, and div maps query heads onto their shared kv head. */
typedef struct moe_cuda_ptr_walk {
    const float *base;
    int64_t inner, div, outer_stride, inner_stride;
} moe_cuda_ptr_walk;

/* For each i < count: c_i = alpha op(a_i) op(b_i) + beta c_i, fp32 storage
 * in the context's math, the pointers laid out by the three walks into the
 * context's pointer slots. */
moe_status moe_cuda_gemm_batched(moe_cuda_ctx *ctx, moe_cuda_ptr_walk c, moe_cuda_ptr_walk a,
                                 moe_cuda_ptr_walk b, int64_t count, int64_t m, int64_t n,
                                 int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool trans_a,
                                 bool trans_b, float alpha, float beta);

#endif /* MOE_KERNELS_CUDA_GEMM_CUH */
