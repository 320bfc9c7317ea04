/* flash_attention.cuh: causal grouped-query attention fused into
 * tensor-core kernels, for the sizes moe_cuda_attention_fused accepts
 * (attention.cu chooses). Internal to kernels/cuda. */
#ifndef MOE_KERNELS_CUDA_FLASH_ATTENTION_CUH
#define MOE_KERNELS_CUDA_FLASH_ATTENTION_CUH

#include "kernels/cuda/common.cuh"

/* out [B, T, Hq, hd] = softmax(q k^T / sqrt(hd), causal) v, as
 * moe_cuda_attention_forward. att [B, Hq, T, T] holds what the backward
 * needs instead of the probabilities: the rows' log-sum-exp [B, Hq, T],
 * then a copy of out. */
moe_status moe_cuda_flash_forward(float *out, float *att, const float *q, const float *k,
                                  const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                  int64_t hd, int64_t window, moe_cuda_ctx *ctx);

/* dq, dk, dv += the gradients, as moe_cuda_attention_backward, from what
 * moe_cuda_flash_forward saved in att; datt's first B * Hq * T floats are
 * scratch. */
moe_status moe_cuda_flash_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                                   const float *q, const float *k, const float *v,
                                   const float *att, int64_t B, int64_t T, int64_t Hq,
                                   int64_t Hkv, int64_t hd, int64_t window, moe_cuda_ctx *ctx);

#endif /* MOE_KERNELS_CUDA_FLASH_ATTENTION_CUH */
