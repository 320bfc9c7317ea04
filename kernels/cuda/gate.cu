/* gate.cu: the fused gating pass and its backward, and the deterministic
 * totals.
 *
 * The forward runs a group of lanes per token (8 up to 256 experts, so 4
 * tokens a warp, else 32), the backward a warp per token. A group keeps its
 * token's logits in shared memory, so the row is read from device memory
 * once; its lanes stride over the experts (g, g + G, ...). Its top-k is k
 * rounds of an argmax over the group on (score, -index), which picks what
 * moe_topk_insert picks, in moe_score_outranks's order.
 * The per-element formulas are the CPU's (kernels/cpu/gate.c), with the
 * exponential and the sigmoid from moe_math.h: moe_expf's clamp below -87
 * makes far-behind experts tie exactly, as on the CPU, where libm's expf
 * would rank them by their denormals. */
#include <limits.h>

#include "kernels/cuda/common.cuh"
#include "kernels/moe_math.h"

/* Warps per block: the shared rows of 2E floats per token stay within the
 * default 48 KB (32 KB at 4 tokens a warp and E = 256, or a token a warp
 * and E = MOE_EXPERTS_MAX). */
#define GATE_WARPS 4

static moe_status check_params(const moe_gate_params *p, int64_t T, const char *op) {
    if (p->n_experts < 1 || p->n_experts > MOE_EXPERTS_MAX || p->top_k < 1 ||
        p->top_k > p->n_experts || T < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: E=%lld k=%lld T=%lld (need 1 <= k <= E <= %d)",
                         op, (long long)p->n_experts, (long long)p->top_k, (long long)T,
                         MOE_EXPERTS_MAX);
    return MOE_OK;
}

/* ---------------------------------------------------------------- forward */

/* Whether candidate (s, e) beats (best, best_e): moe_score_outranks, with
 * e == INT_MAX as no candidate. */
static __device__ __forceinline__ bool outranks(float s, int e, float best, int best_e) {
    if (e == INT_MAX) return false;
    return best_e == INT_MAX || moe_score_outranks(s, e, best, best_e);
}

/* G lanes per token, 32 / G tokens per warp: lane g of a group strides over
 * the experts (g, g + G, ...), and the group's lane 0 (its leader) keeps
 * the slot-order sums. A warp's groups past the last token compute on the
 * last token and write nothing, so that every lane takes part in every
 * shuffle. E <= 32 G: a lane's chosen experts fit one 32-bit mask. */
template <int G>
static __global__ void gate_forward_kernel(int32_t *topk_idx, float *topk_w, float *prob,
                                           float *lse, const float *logits, const float *bias,
                                           int64_t T, int E, int k, moe_gate_kind kind,
                                           bool renormalize) {
    constexpr int TPW = 32 / G; /* tokens per warp */
    extern __shared__ float gate_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane % G, group = lane / G, leader = group * G;
    float *l = gate_shared + (warp * TPW + group) * 2 * E; /* [E] this token's logits */
    float *score = l + E;                                  /* [E] selection scores */
    const bool sig = kind == MOE_GATE_SIGMOID;

    for (int64_t first = ((int64_t)blockIdx.x * GATE_WARPS + warp) * TPW; first < T;
         first += (int64_t)gridDim.x * GATE_WARPS * TPW) {
        const bool own = first + group < T;
        const int64_t t = own ? first + group : T - 1;
        const float *lt = logits + t * E; /* [E] */
        float lmax = -INFINITY;
        for (int e = g; e < E; e += G) {
            l[e] = lt[e];
            lmax = fmaxf(lmax, l[e]);
        }
        lmax = moe_warp_max<G>(lmax);
        double esum = 0.0, ssum = 0.0;
        for (int e = g; e < E; e += G) {
            esum += (double)moe_expf(l[e] - lmax);
            if (sig) ssum += (double)moe_sigmoidf(l[e]);
        }
        esum = moe_warp_sum<double, G>(esum);
        ssum = moe_warp_sum<double, G>(ssum);
        const float log_z = lmax + (float)log(esum);
        const float norm = (float)(1.0 / (sig ? ssum : esum));
        for (int e = g; e < E; e += G) {
            const float r = sig ? moe_sigmoidf(l[e]) : moe_expf(l[e] - lmax);
            const float base = sig ? r : kind == MOE_GATE_TOPK_SOFTMAX ? l[e] : r * norm;
            score[e] = bias ? base + bias[e] : base;
            if (own) prob[t * E + e] = r * norm;
        }
        if (own && g == 0) lse[t] = log_z;
        __syncwarp();

        double wsum = 0.0;   /* the leader's, in slot order */
        uint32_t taken = 0u; /* bit i: expert g + G i is chosen */
        float chosen_max = -INFINITY; /* the leader's: the largest chosen logit */
        for (int j = 0; j < k; j++) {
            float best = -INFINITY;
            int best_e = INT_MAX;
            for (int e = g, i = 0; e < E; e += G, i++)
                if (!(taken >> i & 1u) && outranks(score[e], e, best, best_e))
                    best = score[e], best_e = e;
            for (int o = G / 2; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(MOE_FULL_MASK, best, o);
                const int oe = __shfl_xor_sync(MOE_FULL_MASK, best_e, o);
                if (outranks(ob, oe, best, best_e)) best = ob, best_e = oe;
            }
            if (g == best_e % G) taken |= 1u << (best_e / G);
            if (g == 0) {
                const float le = l[best_e];
                if (own) topk_idx[t * k + j] = best_e;
                if (kind == MOE_GATE_TOPK_SOFTMAX) {
                    chosen_max = fmaxf(chosen_max, le); /* weights after the loop */
                } else {
                    const float w = sig ? moe_sigmoidf(le) : moe_expf(le - lmax) * norm;
                    if (own) topk_w[t * k + j] = w;
                    wsum += w;
                }
            }
        }
        /* topk_softmax: a softmax over the chosen logits from their own
         * largest, as on the CPU. */
        if (kind == MOE_GATE_TOPK_SOFTMAX && g == 0 && own)
            for (int j = 0; j < k; j++) {
                const float w = moe_expf(l[topk_idx[t * k + j]] - chosen_max);
                topk_w[t * k + j] = w;
                wsum += w;
            }
        __syncwarp(); /* the leaders' weights are visible to the lanes that scale them */
        if (kind != MOE_GATE_SOFTMAX_TOPK || renormalize) {
            const float inv = __shfl_sync(MOE_FULL_MASK, (float)(1.0 / wsum), leader);
            for (int j = g; own && j < k; j += G) topk_w[t * k + j] *= inv;
        }
        __syncwarp(); /* l and score are rewritten by the next token */
    }
}

/* Lanes per token: 8 (4 tokens a warp) up to 256 experts, where a lane has at
 * most 32 of them; a whole warp beyond. */
#define GATE_GROUP_E_MAX 256

template <int G>
static moe_status launch_gate_forward(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                                      const float *logits, const float *bias,
                                      const moe_gate_params *p, int64_t T, moe_cuda_ctx *ctx) {
    constexpr int TPW = 32 / G;
    const int E = (int)p->n_experts;
    const size_t smem = (size_t)GATE_WARPS * TPW * 2 * E * sizeof(float);
    gate_forward_kernel<G><<<moe_cuda_grid((T + TPW - 1) / TPW, GATE_WARPS, ctx), GATE_WARPS * 32,
                             smem, ctx->stream>>>(topk_idx, topk_w, prob, lse, logits, bias, T, E,
                                                  (int)p->top_k, p->kind, p->renormalize);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* One block per chunk of MOE_CUDA_GATE_CHUNK_TOKENS tokens: its row of
 * chunk_scratch [2E + 1] = (prob sums [E], assigned counts [E], z), each
 * summed over the chunk's tokens in token order, as the CPU does. */
static __global__ void gate_chunk_kernel(double *scratch, const float *prob, const float *lse,
                                         const int32_t *topk_idx, int64_t T, int E, int k) {
    __shared__ int counts[MOE_EXPERTS_MAX];
    const int64_t t0 = blockIdx.x * (int64_t)MOE_CUDA_GATE_CHUNK_TOKENS;
    const int64_t t1 = min(t0 + (int64_t)MOE_CUDA_GATE_CHUNK_TOKENS, T);
    double *row = scratch + blockIdx.x * (int64_t)(2 * E + 1);
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    /* Integer counts: the order in which the atomics land cannot matter. */
    for (int64_t p = t0 * k + threadIdx.x; p < t1 * k; p += blockDim.x)
        atomicAdd(&counts[topk_idx[p]], 1);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double s = 0.0;
        for (int64_t t = t0; t < t1; t++) s += (double)prob[t * E + e];
        row[e] = s;
    }
    if (threadIdx.x == 0) {
        double z = 0.0;
        for (int64_t t = t0; t < t1; t++) z += (double)lse[t] * lse[t];
        row[2 * E] = z;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) row[E + e] = (double)counts[e];
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
    const int E = (int)p->n_experts, k = (int)p->top_k;
    const int64_t n_chunks = (T + MOE_CUDA_GATE_CHUNK_TOKENS - 1) / MOE_CUDA_GATE_CHUNK_TOKENS;
    if (T > 0) {
        MOE_TRY(E <= GATE_GROUP_E_MAX
                    ? launch_gate_forward<8>(topk_idx, topk_w, prob, lse, logits, bias, p, T, ctx)
                    : launch_gate_forward<32>(topk_idx, topk_w, prob, lse, logits, bias, p, T, ctx));
        gate_chunk_kernel<<<(unsigned)n_chunks, MOE_CUDA_THREADS, 0, ctx->stream>>>(
            totals->chunk_scratch, prob, lse, topk_idx, T, E, k);
        MOE_CUDA_CHECK(cudaGetLastError());
    }
    gate_totals_kernel<<<2 * E + 1, MOE_CUDA_THREADS, 0, ctx->stream>>>(
        totals->assigned, totals->prob_sum, totals->z_sum, totals->chunk_scratch, n_chunks, E);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* --------------------------------------------------------------- backward */

static __global__ void gate_backward_kernel(float *dlogits, const float *dweights,
                                            const int32_t *topk_idx, const float *topk_w,
                                            const float *prob, const float *lse,
                                            const float *logits, const float *aux_grad,
                                            float z_coef_over_T, int64_t T, int E, int k,
                                            moe_gate_kind kind, bool renormalize) {
    extern __shared__ float gate_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *dr = gate_shared + warp * 2 * E; /* [E] d(loss)/d(prob), then d/ds for sigmoid */
    float *dl = dr + E;                     /* [E] d(loss)/d(logits) */

    for (int64_t t = blockIdx.x * (int64_t)GATE_WARPS + warp; t < T;
         t += (int64_t)gridDim.x * GATE_WARPS) {
        const float *l = logits + t * E, *r = prob + t * E, *dw = dweights + t * k;
        const float *w = topk_w + t * k;
        const int32_t *idx = topk_idx + t * k;
        for (int e = lane; e < E; e += 32) {
            dr[e] = aux_grad ? aux_grad[e] : 0.0f;
            dl[e] = 0.0f;
        }
        /* Sums over the k slots run in slot order in every lane, as on the
         * CPU; k is small. */
        float dot = 0.0f;
        for (int j = 0; j < k; j++) dot += w[j] * dw[j];
        __syncwarp();

        /* The k chosen experts are distinct, so lanes own distinct slots. */
        if (kind == MOE_GATE_SOFTMAX_TOPK) {
            float chosen = 0.0f;
            for (int j = 0; j < k; j++) chosen += r[idx[j]];
            for (int j = lane; j < k; j += 32)
                dr[idx[j]] += renormalize ? (dw[j] - dot) / chosen : dw[j];
        } else if (kind == MOE_GATE_TOPK_SOFTMAX) {
            for (int j = lane; j < k; j += 32) dl[idx[j]] += w[j] * (dw[j] - dot);
        }
        __syncwarp();

        if (kind == MOE_GATE_SIGMOID) {
            float s_all = 0.0f, dr_r = 0.0f, s_chosen = 0.0f;
            for (int e = lane; e < E; e += 32) {
                s_all += moe_sigmoidf(l[e]);
                dr_r += dr[e] * r[e];
            }
            s_all = moe_warp_sum(s_all);
            dr_r = moe_warp_sum(dr_r);
            for (int j = 0; j < k; j++) s_chosen += moe_sigmoidf(l[idx[j]]);
            for (int e = lane; e < E; e += 32) dr[e] = (dr[e] - dr_r) / s_all; /* now ds */
            __syncwarp();
            for (int j = lane; j < k; j += 32) dr[idx[j]] += (dw[j] - dot) / s_chosen;
            __syncwarp();
            for (int e = lane; e < E; e += 32) {
                const float s = moe_sigmoidf(l[e]);
                dl[e] = dr[e] * s * (1.0f - s);
            }
        } else {
            float dr_r = 0.0f;
            for (int e = lane; e < E; e += 32) dr_r += dr[e] * r[e];
            dr_r = moe_warp_sum(dr_r);
            for (int e = lane; e < E; e += 32) dl[e] += r[e] * (dr[e] - dr_r);
        }
        const float zg = 2.0f * z_coef_over_T * lse[t];
        for (int e = lane; e < E; e += 32) {
            float g = dl[e];
            if (z_coef_over_T != 0.0f) g += zg * moe_expf(l[e] - lse[t]);
            dlogits[t * E + e] = g;
        }
        __syncwarp(); /* dr and dl are rewritten by the next token */
    }
}

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
        (int)p->top_k, p->kind, p->renormalize);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}
