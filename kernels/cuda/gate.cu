/* gate.cu: the fused gating pass and its backward, and the deterministic
 * totals.
 *
 * The forward (gate_kernels.cuh) runs a block per chunk of tokens and a
 * group of lanes per token (8 up to 256 experts, 32 beyond), each lane
 * keeping its experts' logits, values and scores in registers; the same
 * kernel sums the chunk's statistics, and a second one the chunks in a
 * fixed tree order. The backward runs a warp per token, its rows in
 * shared memory. The per-element formulas are the CPU's
 * (kernels/cpu/gate.c), with the exponential and the sigmoid from
 * moe_math.h: moe_expf's clamp below -87 makes far-behind experts tie
 * exactly, as on the CPU, where libm's expf would rank them by their
 * denormals. */
#include <limits.h>

#include "kernels/cuda/common.cuh"
#include "kernels/moe_math.h"

#include "kernels/cuda/gate_kernels.cuh"

static moe_status check_params(const moe_gate_params *p, int64_t T, const char *op) {
    if (p->n_experts < 1 || p->n_experts > MOE_EXPERTS_MAX || p->top_k < 1 ||
        p->top_k > p->n_experts || T < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: E=%lld k=%lld T=%lld (need 1 <= k <= E <= %d)",
                         op, (long long)p->n_experts, (long long)p->top_k, (long long)T,
                         MOE_EXPERTS_MAX);
    if (p->n_groups > 1 &&
        (p->n_groups > MOE_GROUPS_MAX || p->n_experts % p->n_groups || p->top_groups < 1 ||
         p->top_groups > p->n_groups || p->top_k > p->top_groups * (p->n_experts / p->n_groups)))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %lld of %lld expert groups cannot hold k=%lld of E=%lld",
                         op, (long long)p->top_groups, (long long)p->n_groups, (long long)p->top_k,
                         (long long)p->n_experts);
    if (!(p->routed_scale > 0.0f && p->routed_scale < INFINITY))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: routed_scale=%g must be positive and finite", op,
                         (double)p->routed_scale);
    return MOE_OK;
}

/* ---------------------------------------------------------------- forward */

template <int G, int NPL>
static moe_status launch_forward(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                                 double *chunk_scratch, const float *logits, const float *bias,
                                 const moe_gate_params *p, int64_t T, int64_t n_chunks,
                                 moe_cuda_ctx *ctx) {
    gate_forward_kernel<G, NPL><<<(unsigned)n_chunks, GATE_THREADS, 0, ctx->stream>>>(
        topk_idx, topk_w, prob, lse, chunk_scratch, logits, bias, T, (int)p->n_experts,
        (int)p->top_k, p->kind, p->renormalize, p->n_groups > 1 ? (int)p->n_groups : 1,
        (int)p->top_groups, p->routed_scale);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* One block per column j of chunk_scratch: the chunks summed in a fixed
 * tree order. */
static __global__ void gate_totals_kernel(int64_t *assigned, double *prob_sum, double *z_sum,
                                          const double *scratch, int64_t n_chunks, int E) {
    __shared__ double partial[32];
    const int j = blockIdx.x, width = 2 * E + 1;
    double s = 0.0;
    for (int64_t c = threadIdx.x; c < n_chunks; c += blockDim.x) s += scratch[c * width + j];
    s = moe_block_sum(s, partial);
    if (threadIdx.x != 0) return;
    if (j < E)
        prob_sum[j] = s;
    else if (j < 2 * E)
        assigned[j - E] = (int64_t)s;
    else
        *z_sum = s;
}

extern "C" moe_status moe_cuda_gate_forward(int32_t *topk_idx, float *topk_w, float *prob,
                                            float *lse, const moe_cuda_gate_totals *totals,
                                            const float *logits, const float *bias,
                                            const moe_gate_params *p, int64_t T,
                                            moe_cuda_ctx *ctx) {
    MOE_TRY(check_params(p, T, "moe_cuda_gate_forward"));
    const int64_t E = p->n_experts;
    const int64_t n_chunks = (T + MOE_CUDA_GATE_CHUNK_TOKENS - 1) / MOE_CUDA_GATE_CHUNK_TOKENS;
    if (n_chunks > INT_MAX)
        return moe_error(MOE_ERR_UNSUPPORTED, "moe_cuda_gate_forward: T=%lld is past the grid",
                         (long long)T);
    if (T > 0) {
        /* 8 lanes a token up to 256 experts, each holding the next power
         * of two >= E / 8 of them; a whole warp beyond. */
        double *cs = totals->chunk_scratch;
#define GATE_LAUNCH(G, NPL)                                                                        \
    launch_forward<G, NPL>(topk_idx, topk_w, prob, lse, cs, logits, bias, p, T, n_chunks, ctx)
        MOE_TRY(E <= 8     ? GATE_LAUNCH(8, 1)
                : E <= 16  ? GATE_LAUNCH(8, 2)
                : E <= 32  ? GATE_LAUNCH(8, 4)
                : E <= 64  ? GATE_LAUNCH(8, 8)
                : E <= 128 ? GATE_LAUNCH(8, 16)
                : E <= 256 ? GATE_LAUNCH(8, 32)
                           : GATE_LAUNCH(32, 32));
#undef GATE_LAUNCH
    }
    gate_totals_kernel<<<2 * E + 1, MOE_CUDA_THREADS, 0, ctx->stream>>>(
        totals->assigned, totals->prob_sum, totals->z_sum, totals->chunk_scratch, n_chunks, (int)E);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* --------------------------------------------------------------- backward */

extern "C" moe_status moe_cuda_gate_backward(float *dlogits, const float *dweights,
                                             const int32_t *topk_idx, const float *topk_w,
                                             const float *prob, const float *lse,
                                             const float *logits, const float *aux_grad,
                                             float z_coef_over_T, const moe_gate_params *p,
                                             int64_t T, moe_cuda_ctx *ctx) {
    MOE_TRY(check_params(p, T, "moe_cuda_gate_backward"));
    if (T == 0) return MOE_OK;
    const int E = (int)p->n_experts;
    const size_t smem = (size_t)GATE_WARPS * 2 * E * sizeof(float);
    gate_backward_kernel<<<moe_cuda_grid(T, GATE_WARPS, ctx), GATE_WARPS * 32, smem, ctx->stream>>>(
        dlogits, dweights, topk_idx, topk_w, prob, lse, logits, aux_grad, z_coef_over_T, T, E,
        (int)p->top_k, p->kind, p->renormalize, p->routed_scale, p->aux_seq_len);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ------------------------------------------------------- per-sequence sums */

extern "C" moe_status moe_cuda_gate_seq_stats(float *stats, const int32_t *topk_idx,
                                              const float *prob, const moe_gate_params *p,
                                              int64_t T, moe_cuda_ctx *ctx) {
    MOE_TRY(check_params(p, T, "moe_cuda_gate_seq_stats"));
    if (p->aux_seq_len < 1 || T % p->aux_seq_len)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_cuda_gate_seq_stats: T=%lld is not a multiple of aux_seq_len=%lld",
                         (long long)T, (long long)p->aux_seq_len);
    const int64_t S = T / p->aux_seq_len;
    if (S == 0) return MOE_OK;
    if (S > INT_MAX)
        return moe_error(MOE_ERR_UNSUPPORTED, "moe_cuda_gate_seq_stats: %lld sequences are past the grid",
                         (long long)S);
    const int E = (int)p->n_experts, threads = E < MOE_CUDA_THREADS ? ((E + 31) / 32) * 32 : MOE_CUDA_THREADS;
    gate_seq_stats_kernel<<<(unsigned)S, (unsigned)threads, 0, ctx->stream>>>(stats, topk_idx, prob,
                                                                               p->aux_seq_len, E,
                                                                               (int)p->top_k);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}
