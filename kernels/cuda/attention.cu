/* attention.cu: causal grouped-query attention, the eager path of HF
 * Mixtral (kernels/cpu/attention.c is the reference): batched cuBLAS GEMMs
 * over (batch, head) pointer arrays, so a query head finds its shared kv
 * head without copies, and one warp per row for the causal softmax and its
 * backward. The GEMMs compute the masked upper triangle (and the keys
 * before a sliding window) too and the softmax writes zeros there. Under bf16 math the fused kernels of
 * flash_attention.cu take the sizes they serve instead, and att holds what
 * they save (ops.h: the backend's format).
 *
 * The backward adds into dk and dv once per query head of a group, one
 * batched call per head in order, so the sums have a fixed order. */
#include "kernels/cuda/flash_attention.cuh"
#include "kernels/cuda/gemm.cuh"
#include "kernels/moe_math.h"

#define SOFTMAX_WARPS 8

/* The first key query t sees (ops.h: window keys end at t; 0: every key). */
static __device__ __forceinline__ int64_t window_start(int64_t t, int64_t window) {
    return window > 0 && t >= window ? t - window + 1 : 0;
}

/* Row t of each [T, T] score matrix: p = softmax over lo <= j <= t, zeros
 * elsewhere; with last, every row is a query at position T - 1 (decoding). */
static __global__ void causal_softmax_kernel(float *att, int64_t rows, int64_t T, int64_t window,
                                             bool last) {
    const int lane = threadIdx.x & 31;
    for (int64_t row = blockIdx.x * (int64_t)SOFTMAX_WARPS + (threadIdx.x >> 5); row < rows;
         row += (int64_t)gridDim.x * SOFTMAX_WARPS) {
        const int64_t t = last ? T - 1 : row % T, lo = window_start(t, window);
        float *p = att + row * T;
        float mx = -INFINITY;
        for (int64_t j = lo + lane; j <= t; j += 32) mx = fmaxf(mx, p[j]);
        mx = moe_warp_max(mx);
        double sum = 0.0;
        for (int64_t j = lo + lane; j <= t; j += 32) {
            const float e = moe_expf(p[j] - mx);
            p[j] = e;
            sum += e;
        }
        sum = moe_warp_sum(sum);
        const float inv = (float)(1.0 / sum);
        for (int64_t j = lane; j < T; j += 32) p[j] = j >= lo && j <= t ? p[j] * inv : 0.0f;
    }
}

/* datt = scale * P * (dP - rowsum(P * dP)) over each row's keys, zeros
 * elsewhere; datt holds dP on entry. */
static __global__ void causal_softmax_backward_kernel(float *datt, const float *att, int64_t rows,
                                                      int64_t T, int64_t window, float scale) {
    const int lane = threadIdx.x & 31;
    for (int64_t row = blockIdx.x * (int64_t)SOFTMAX_WARPS + (threadIdx.x >> 5); row < rows;
         row += (int64_t)gridDim.x * SOFTMAX_WARPS) {
        const int64_t t = row % T, lo = window_start(t, window);
        const float *p = att + row * T;
        float *ds = datt + row * T;
        double pd = 0.0;
        for (int64_t j = lo + lane; j <= t; j += 32) pd += (double)(p[j] * ds[j]);
        pd = moe_warp_sum(pd);
        for (int64_t j = lane; j < T; j += 32)
            ds[j] = j >= lo && j <= t ? scale * (p[j] * (ds[j] - (float)pd)) : 0.0f;
    }
}

static unsigned softmax_grid(int64_t rows, const moe_cuda_ctx *ctx) {
    return moe_cuda_grid(rows, SOFTMAX_WARPS, ctx);
}

static moe_status check_sizes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd,
                              int64_t window, const char *op) {
    if (B < 0 || T < 0 || Hq < 1 || Hkv < 1 || hd < 1 || Hq % Hkv != 0 || window < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: B=%lld T=%lld Hq=%lld Hkv=%lld hd=%lld window=%lld",
                         op, (long long)B, (long long)T, (long long)Hq, (long long)Hkv, (long long)hd,
                         (long long)window);
    return MOE_OK;
}

extern "C" moe_status moe_cuda_attention_forward(float *out, float *att, const float *q,
                                                 const float *k, const float *v, int64_t B,
                                                 int64_t T, int64_t Hq, int64_t Hkv, int64_t hd,
                                                 int64_t window, moe_cuda_ctx *ctx) {
    MOE_TRY(check_sizes(B, T, Hq, Hkv, hd, window, "moe_cuda_attention_forward"));
    if (B == 0 || T == 0) return MOE_OK;
    if (moe_cuda_attention_fused(T, Hq, hd, ctx))
        return moe_cuda_flash_forward(out, att, q, k, v, B, T, Hq, Hkv, hd, window, ctx);
    const int64_t group = Hq / Hkv, qs = Hq * hd, ks = Hkv * hd, tt = T * T;
    const float scale = 1.0f / sqrtf((float)hd);
    /* Problem i = b * Hq + h. */
    const moe_cuda_ptr_walk att_w = {att, Hq, 1, Hq * tt, tt};
    const moe_cuda_ptr_walk q_w = {q, Hq, 1, T * qs, hd};
    const moe_cuda_ptr_walk k_w = {k, Hq, group, T * ks, hd};
    const moe_cuda_ptr_walk v_w = {v, Hq, group, T * ks, hd};
    const moe_cuda_ptr_walk out_w = {out, Hq, 1, T * qs, hd};
    /* S = scale q k^T */
    MOE_TRY(moe_cuda_gemm_batched(ctx, att_w, q_w, k_w, B * Hq, T, T, hd, qs, ks, T, false, true,
                                  scale, 0.0f));
    causal_softmax_kernel<<<softmax_grid(B * Hq * T, ctx), SOFTMAX_WARPS * 32, 0, ctx->stream>>>(
        att, B * Hq * T, T, window, false);
    MOE_CUDA_CHECK(cudaGetLastError());
    /* out = P v */
    return moe_cuda_gemm_batched(ctx, out_w, att_w, v_w, B * Hq, T, hd, T, T, ks, qs, false, false,
                                 1.0f, 0.0f);
}

/* The forward's batched path for one query row a head: problem h. */
extern "C" moe_status moe_cuda_attention_decode(float *out, float *att, const float *q,
                                                const float *k, const float *v, int64_t T,
                                                int64_t Hq, int64_t Hkv, int64_t hd,
                                                moe_cuda_ctx *ctx) {
    MOE_TRY(check_sizes(1, T, Hq, Hkv, hd, 0, "moe_cuda_attention_decode"));
    if (T == 0) return MOE_OK;
    const int64_t group = Hq / Hkv, qs = Hq * hd, ks = Hkv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    const moe_cuda_ptr_walk att_w = {att, Hq, 1, Hq * T, T};
    const moe_cuda_ptr_walk q_w = {q, Hq, 1, qs, hd};
    const moe_cuda_ptr_walk k_w = {k, Hq, group, T * ks, hd};
    const moe_cuda_ptr_walk v_w = {v, Hq, group, T * ks, hd};
    const moe_cuda_ptr_walk out_w = {out, Hq, 1, qs, hd};
    MOE_TRY(moe_cuda_gemm_batched(ctx, att_w, q_w, k_w, Hq, 1, T, hd, qs, ks, T, false, true, scale,
                                  0.0f));
    causal_softmax_kernel<<<softmax_grid(Hq, ctx), SOFTMAX_WARPS * 32, 0, ctx->stream>>>(att, Hq, T,
                                                                                         0, true);
    MOE_CUDA_CHECK(cudaGetLastError());
    return moe_cuda_gemm_batched(ctx, out_w, att_w, v_w, Hq, 1, hd, T, T, ks, qs, false, false,
                                 1.0f, 0.0f);
}

extern "C" moe_status moe_cuda_attention_backward(float *dq, float *dk, float *dv, float *datt,
                                                  const float *dout, const float *q, const float *k,
                                                  const float *v, const float *att, int64_t B,
                                                  int64_t T, int64_t Hq, int64_t Hkv, int64_t hd,
                                                  int64_t window, moe_cuda_ctx *ctx) {
    MOE_TRY(check_sizes(B, T, Hq, Hkv, hd, window, "moe_cuda_attention_backward"));
    if (B == 0 || T == 0) return MOE_OK;
    if (moe_cuda_attention_fused(T, Hq, hd, ctx))
        return moe_cuda_flash_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, Hq, Hkv, hd,
                                       window, ctx);
    const int64_t group = Hq / Hkv, qs = Hq * hd, ks = Hkv * hd, tt = T * T;
    const float scale = 1.0f / sqrtf((float)hd);
    {
        /* Per query head, problem i = b * Hq + h. */
        const moe_cuda_ptr_walk datt_w = {datt, Hq, 1, Hq * tt, tt};
        const moe_cuda_ptr_walk dout_w = {dout, Hq, 1, T * qs, hd};
        const moe_cuda_ptr_walk dq_w = {dq, Hq, 1, T * qs, hd};
        const moe_cuda_ptr_walk k_w = {k, Hq, group, T * ks, hd};
        const moe_cuda_ptr_walk v_w = {v, Hq, group, T * ks, hd};
        /* dP = dout v^T */
        MOE_TRY(moe_cuda_gemm_batched(ctx, datt_w, dout_w, v_w, B * Hq, T, T, hd, qs, ks, T, false,
                                      true, 1.0f, 0.0f));
        causal_softmax_backward_kernel<<<softmax_grid(B * Hq * T, ctx), SOFTMAX_WARPS * 32, 0,
                                         ctx->stream>>>(datt, att, B * Hq * T, T, window, scale);
        MOE_CUDA_CHECK(cudaGetLastError());
        /* dq += dS k (datt holds scale * dS) */
        MOE_TRY(moe_cuda_gemm_batched(ctx, dq_w, datt_w, k_w, B * Hq, T, hd, T, T, ks, qs, false,
                                      false, 1.0f, 1.0f));
    }
    /* dk += dS^T q and dv += P^T dout, query head g of each group in turn:
     * problem i = b * Hkv + kv head, query head kv * group + g. */
    for (int64_t g = 0; g < group; g++) {
        const moe_cuda_ptr_walk dk_w = {dk, Hkv, 1, T * ks, hd};
        const moe_cuda_ptr_walk dv_w = {dv, Hkv, 1, T * ks, hd};
        const moe_cuda_ptr_walk datt_w = {datt + g * tt, Hkv, 1, Hq * tt, group * tt};
        const moe_cuda_ptr_walk att_w = {att + g * tt, Hkv, 1, Hq * tt, group * tt};
        const moe_cuda_ptr_walk q_w = {q + g * hd, Hkv, 1, T * qs, group * hd};
        const moe_cuda_ptr_walk dout_w = {dout + g * hd, Hkv, 1, T * qs, group * hd};
        MOE_TRY(moe_cuda_gemm_batched(ctx, dk_w, datt_w, q_w, B * Hkv, T, hd, T, T, qs, ks, true,
                                      false, 1.0f, 1.0f));
        MOE_TRY(moe_cuda_gemm_batched(ctx, dv_w, att_w, dout_w, B * Hkv, T, hd, T, T, qs, ks, true,
                                      false, 1.0f, 1.0f));
    }
    return MOE_OK;
}
