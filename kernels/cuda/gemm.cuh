/* gemm.cuh: the GEMM entry points the other .cu files build on: one
 * cuBLASLt GEMM through the context's plan cache, and batched GEMMs over
 * device pointer arrays. Row-major, as ops.h. Internal to kernels/cuda. */
#ifndef MOE_KERNELS_CUDA_GEMM_CUH
#define MOE_KERNELS_CUDA_GEMM_CUH

#include "kernels/cuda/common.cuh"

/* Which size of a GEMM follows the routing: an expert's rows are M of its
 * activation GEMMs and K of its weight gradients. */
typedef enum moe_cuda_lt_ragged {
    MOE_CUDA_LT_FIXED,    /* every size is the model's */
    MOE_CUDA_LT_RAGGED_M, /* m changes from call to call */
    MOE_CUDA_LT_RAGGED_K, /* k changes from call to call */
} moe_cuda_lt_ragged;

/* c [m, n] = alpha op(a) op(b) + beta c; a, b in ab_type, c in c_type, fp32
 * arithmetic. The plan (descriptors and heuristic algorithm) is made once
 * per shape, type and operand alignment, then reused; a ragged size is
 * planned for its power-of-two bucket (the heuristic is the costly part of
 * a plan, and routing gives every step new row counts), falling back to a
 * plan of its own where the bucket's algorithm does not fit. */
moe_status moe_cuda_lt_gemm(moe_cuda_ctx *ctx, void *c, moe_cuda_dtype c_type, const void *a,
                            const void *b, moe_cuda_dtype ab_type, int64_t m, int64_t n, int64_t k,
                            int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b,
                            float alpha, float beta, moe_cuda_lt_ragged ragged);

/* Pointer i of a batch: base + (i / inner) * outer_stride +
 * ((i % inner) / div) * inner_stride, in floats. It walks (batch, head)
 * pairs, and div maps query heads onto their shared kv head. */
typedef struct moe_cuda_ptr_walk {
    const float *base;
    int64_t inner, div, outer_stride, inner_stride;
} moe_cuda_ptr_walk;

/* For each i < count: c_i = alpha op(a_i) op(b_i) + beta c_i, fp32 storage
 * in the context's math when every pointer is 16-byte aligned (else plain
 * fp32), the pointers laid out by the three walks into the context's
 * pointer slots. */
moe_status moe_cuda_gemm_batched(moe_cuda_ctx *ctx, moe_cuda_ptr_walk c, moe_cuda_ptr_walk a,
                                 moe_cuda_ptr_walk b, int64_t count, int64_t m, int64_t n,
                                 int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool trans_a,
                                 bool trans_b, float alpha, float beta);

#endif /* MOE_KERNELS_CUDA_GEMM_CUH */
