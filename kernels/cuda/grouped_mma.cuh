/* grouped_mma.cuh: our grouped GEMM on the tensor cores. Internal to
 * kernels/cuda; moe_cuda_grouped_gemm and the experts reach it through
 * MOE_CUDA_GROUPED_MMA, _WGMMA and _WGMMA_TMA. */
#ifndef MOE_KERNELS_CUDA_GROUPED_MMA_CUH
#define MOE_KERNELS_CUDA_GROUPED_MMA_CUH

#include "kernels/cuda/common.cuh"

/* c [rows, n] = a [rows, k] b_e [n, k]^T for the rows [offsets[e],
 * offsets[e+1]) of each expert e, b [E, n, k]; a, b bf16, c bf16 or fp32,
 * fp32 accumulation. Reads the offsets on the device: no host wait.
 * Needs k % 8 == 0, 16-byte aligned a and b, and c aligned to two of its
 * elements (MOE_ERR_UNSUPPORTED otherwise); max_rows >= offsets[E] sizes the grid,
 * and a holds max_rows rows: the TMA kernel's tiles may read past offsets[E]
 * (their products are dropped).
 * algo: MMA (mma.sync, sm_80 and up), WGMMA or WGMMA_TMA (Hopper's
 * warpgroup MMA: compute capability 9.0 and a build for sm_90a;
 * MOE_ERR_UNSUPPORTED elsewhere). */
moe_status moe_cuda_grouped_mma(void *c, moe_cuda_dtype c_type, const void *a, const void *b,
                                moe_cuda_dtype ab_type, const int64_t *offsets, int64_t E,
                                int64_t max_rows, int64_t n, int64_t k, moe_cuda_grouped_algo algo,
                                moe_cuda_ctx *ctx);

#endif /* MOE_KERNELS_CUDA_GROUPED_MMA_CUH */
