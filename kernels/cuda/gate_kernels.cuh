/* gate_kernels.cuh: the device code of the gating pass, forward and
 * backward, which gate.cu launches and describes. It includes nothing: the file that
 * includes it provides the device environment (kernels/cuda/common.cuh and
 * kernels/moe_math.h on a GPU build; tests/simt_emu.h, which runs it on the
 * CPU, in tests/test_gate_emulated.cpp). */
#ifndef MOE_KERNELS_CUDA_GATE_KERNELS_CUH
#define MOE_KERNELS_CUDA_GATE_KERNELS_CUH

/* A block is one chunk of MOE_GATE_CHUNK_TOKENS tokens, the CPU's chunk:
 * its statistics come out of the same kernel, summed in token order as the
 * CPU's. */
#define GATE_THREADS 256

/* Whether candidate (s, e) beats (best, best_e): moe_score_outranks, with
 * e == INT_MAX as no candidate. */
static __device__ __forceinline__ bool gate_outranks(float s, int e, float best, int best_e) {
    if (e == INT_MAX) return false;
    return best_e == INT_MAX || moe_score_outranks(s, e, best, best_e);
}

/* G lanes per token (256 / G tokens a pass over the chunk), lane g holding
 * experts g + G i for i < NPL in registers (E <= G NPL <= 32 G, so a
 * lane's chosen experts fit one 32-bit mask). Each (token, expert) costs
 * one exponential (the sigmoid also a log-sigmoid and its exponential:
 * its probabilities come relative to the row's largest, as on the CPU).
 * The top-k is k rounds of an argmax over the group on (score, -index),
 * which picks what moe_topk_insert picks, in moe_score_outranks's order;
 * every lane learns each round's winner, so every lane sums the weights
 * in slot order, and lane j % G writes slot j. A group past the chunk's
 * last token computes on the last one and writes nothing, so that every
 * lane takes part in every shuffle.
 *
 * chunk_scratch row [2E + 1] of the block: (probability sums [E], chosen
 * counts [E], sum of lse^2), over the chunk's tokens in token order. */
template <int G, int NPL>
static __global__ void __launch_bounds__(GATE_THREADS)
    gate_forward_kernel(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                        double *chunk_scratch, const float *logits, const float *bias, int64_t T,
                        int E, int k, moe_gate_kind kind, bool renormalize, int n_groups, int top_groups,
                        float routed_scale) {
    constexpr int PASS = GATE_THREADS / G; /* tokens a pass */
    __shared__ int counts[MOE_EXPERTS_MAX];
    const int lane = threadIdx.x & 31, g = lane % G, group = threadIdx.x / G;
    const int leader = lane - g; /* the group's lane 0, in the warp */
    const int64_t t0 = (int64_t)blockIdx.x * MOE_GATE_CHUNK_TOKENS;
    const int64_t t1 = min(t0 + (int64_t)MOE_GATE_CHUNK_TOKENS, T);
    const bool sig = kind == MOE_GATE_SIGMOID, tsm = kind == MOE_GATE_TOPK_SOFTMAX;
    for (int e = threadIdx.x; e < E; e += GATE_THREADS) counts[e] = 0;
    __syncthreads();

    for (int64_t first = t0; first < t1; first += PASS) {
        const bool own = first + group < t1;
        const int64_t t = own ? first + group : t1 - 1;
        const float *lt = logits + t * E; /* [E] */
        float lv[NPL], val[NPL], score[NPL];
        /* The largest number, passing over NaN as the CPU does. */
        float lmax = -INFINITY;
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const int e = g + G * i;
            lv[i] = e < E ? lt[e] : -INFINITY;
            lmax = fmaxf(lmax, lv[i]);
        }
        lmax = moe_warp_max<G>(lmax);
        /* The exponentials give the logsumexp for every kind, and the
         * values unless the gate is a sigmoid. */
        double esum = 0.0, ssum = 0.0;
        const float ls_max = sig ? moe_log_sigmoidf(lmax) : 0.0f; /* as on the CPU */
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const bool in = g + G * i < E;
            const float r = in ? moe_expf(lv[i] - lmax) : 0.0f;
            esum += (double)r;
            val[i] = sig ? (in ? moe_expf(moe_log_sigmoidf(lv[i]) - ls_max) : 0.0f) : r;
            if (sig) ssum += (double)val[i];
        }
        esum = moe_warp_sum<double, G>(esum);
        ssum = moe_warp_sum<double, G>(ssum);
        const float log_z = lmax + (float)log(esum);
        const float norm = (float)(1.0 / (sig ? ssum : esum));
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const int e = g + G * i;
            const float p = val[i] * norm;
            if (own && e < E) prob[t * E + e] = p;
            const float base = sig ? (bias ? moe_sigmoidf(lv[i]) : moe_log_sigmoidf(lv[i]))
                               : tsm ? lv[i]
                                     : p;
            score[i] = bias && e < E ? base + bias[e] : base;
        }

        uint32_t taken = 0u; /* bit i: expert g + G i is chosen, or outside the kept groups */
        if (n_groups > 1) {
            /* Group-limited routing: each group's two best values (the
             * sigmoid's sigmoids, else the scores) over the group's lanes,
             * then the kept groups, as on the CPU. */
            const int per = E / n_groups;
            float gs[MOE_GROUPS_MAX];
            for (int gr = 0; gr < n_groups; gr++) {
                float a1 = -INFINITY, a2 = -INFINITY;
#pragma unroll
                for (int i = 0; i < NPL; i++) {
                    const int e = g + G * i;
                    if (e < E && e / per == gr)
                        moe_top2_add(&a1, &a2, sig && !bias ? moe_sigmoidf(lv[i]) : score[i]);
                }
                for (int o = G / 2; o > 0; o >>= 1) {
                    const float b1 = __shfl_xor_sync(MOE_FULL_MASK, a1, o);
                    const float b2 = __shfl_xor_sync(MOE_FULL_MASK, a2, o);
                    moe_top2_add(&a1, &a2, b1);
                    moe_top2_add(&a1, &a2, b2);
                }
                gs[gr] = per > 1 ? a1 + a2 : a1;
            }
            const uint64_t kept = moe_top_groups(gs, n_groups, top_groups);
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                const int e = g + G * i;
                if (e < E && !(kept >> (e / per) & 1u)) taken |= 1u << i;
            }
        }
        /* Weights normalised over the chosen k come from the chosen logits
         * (log-sigmoids), relative to their own largest, as on the CPU. */
        const bool normalised = kind != MOE_GATE_SOFTMAX_TOPK || renormalize;
        float chosen_max = -INFINITY;
        for (int j = 0; j < k; j++) {
            float best = -INFINITY;
            int best_e = INT_MAX;
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                const int e = g + G * i;
                if (e < E && !(taken >> i & 1u) && gate_outranks(score[i], e, best, best_e))
                    best = score[i], best_e = e;
            }
            for (int o = G / 2; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(MOE_FULL_MASK, best, o);
                const int oe = __shfl_xor_sync(MOE_FULL_MASK, best_e, o);
                if (gate_outranks(ob, oe, best, best_e)) best = ob, best_e = oe;
            }
            /* The winner's lane marks it taken and hands its value and
             * logit to the group. */
            float mine_v = 0.0f, mine_l = 0.0f;
            if (g == best_e % G) {
                const int slot = best_e / G;
                taken |= 1u << slot;
#pragma unroll
                for (int i = 0; i < NPL; i++)
                    if (i == slot) mine_v = val[i], mine_l = lv[i];
            }
            const float v = __shfl_sync(MOE_FULL_MASK, mine_v, leader + best_e % G);
            const float le = __shfl_sync(MOE_FULL_MASK, mine_l, leader + best_e % G);
            /* Weights from the unbiased values; normalised ones wait for the
             * largest chosen logit, so their slots hold the logits for now. */
            const float w = !normalised ? v * norm : sig ? moe_log_sigmoidf(le) : le;
            chosen_max = w > chosen_max ? w : chosen_max;
            if (own && g == j % G) {
                topk_idx[t * k + j] = best_e;
                topk_w[t * k + j] = w;
                atomicAdd(&counts[best_e], 1);
            }
        }
        if (normalised) {
            /* A softmax over the chosen logits from their own largest, as
             * on the CPU: every lane sums the slots in order, then each
             * owner turns its logits into weights. */
            double wsum = 0.0;
            __syncwarp();
            for (int j = 0; j < k; j++) wsum += (double)moe_expf(topk_w[t * k + j] - chosen_max);
            __syncwarp();
            const float inv = (float)(1.0 / wsum);
            for (int j = g; own && j < k; j += G)
                topk_w[t * k + j] = moe_expf(topk_w[t * k + j] - chosen_max) * inv;
        }
        for (int j = g; own && j < k; j += G) topk_w[t * k + j] *= routed_scale;
        if (own && g == 0) lse[t] = log_z;
    }

    __syncthreads(); /* the chunk's probabilities, lse and counts are in */
    double *row = chunk_scratch + (int64_t)blockIdx.x * (2 * E + 1);
    for (int e = threadIdx.x; e < E; e += GATE_THREADS) {
        double s = 0.0;
        for (int64_t t = t0; t < t1; t++) s += (double)prob[t * E + e];
        row[e] = s;
        row[E + e] = (double)counts[e];
    }
    if (threadIdx.x == 0) {
        double z = 0.0;
        for (int64_t t = t0; t < t1; t++) z += (double)lse[t] * lse[t];
        row[2 * E] = z;
    }
}

/* Warps per block of the backward: its shared rows of 2E floats per warp
 * stay within the default 48 KB (32 KB at E = MOE_EXPERTS_MAX). */
#define GATE_WARPS 4

static __global__ void gate_backward_kernel(float *dlogits, const float *dweights,
                                            const int32_t *topk_idx, const float *topk_w,
                                            const float *prob, const float *lse,
                                            const float *logits, const float *aux_grad,
                                            float z_coef_over_T, int64_t T, int E, int k,
                                            moe_gate_kind kind, bool renormalize, float routed_scale,
                                            int64_t aux_seq_len) {
    MOE_DYNAMIC_SHARED(float, gate_shared);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *dr = gate_shared + warp * 2 * E; /* [E] d(loss)/d(prob) */
    float *dl = dr + E;                     /* [E] d(loss)/d(logits) */

    for (int64_t t = blockIdx.x * (int64_t)GATE_WARPS + warp; t < T;
         t += (int64_t)gridDim.x * GATE_WARPS) {
        const float *l = logits + t * E, *r = prob + t * E, *dw = dweights + t * k;
        const float *w = topk_w + t * k;
        const int32_t *idx = topk_idx + t * k;
        const float *ag = aux_grad ? aux_grad + (aux_seq_len ? t / aux_seq_len : 0) * E : NULL;
        for (int e = lane; e < E; e += 32) dr[e] = ag ? ag[e] : 0.0f;
        /* Sums over the k slots run in slot order in every lane, as on the
         * CPU; k is small. */
        float dot = 0.0f;
        for (int j = 0; j < k; j++) dot += w[j] * dw[j];
        dot /= routed_scale; /* the weights are scaled: as on the CPU */
        __syncwarp();

        /* The probabilities' part, then the normalised weights', as on the
         * CPU (kernels/cpu/gate.c). The k chosen experts are distinct, so
         * lanes own distinct slots. */
        if (kind == MOE_GATE_SOFTMAX_TOPK && !renormalize)
            for (int j = lane; j < k; j += 32) dr[idx[j]] += routed_scale * dw[j];
        __syncwarp();
        float dr_r = 0.0f;
        for (int e = lane; e < E; e += 32) dr_r += dr[e] * r[e];
        dr_r = moe_warp_sum(dr_r);
        for (int e = lane; e < E; e += 32) {
            const float sig = kind == MOE_GATE_SIGMOID ? 1.0f - moe_sigmoidf(l[e]) : 1.0f;
            dl[e] = r[e] * (dr[e] - dr_r) * sig;
        }
        __syncwarp();
        if (kind != MOE_GATE_SOFTMAX_TOPK || renormalize)
            for (int j = lane; j < k; j += 32) {
                const float sig =
                    kind == MOE_GATE_SIGMOID ? 1.0f - moe_sigmoidf(l[idx[j]]) : 1.0f;
                dl[idx[j]] += w[j] * (dw[j] - dot) * sig;
            }
        __syncwarp();
        const float zg = 2.0f * z_coef_over_T * lse[t];
        for (int e = lane; e < E; e += 32) {
            float g = dl[e];
            if (z_coef_over_T != 0.0f) g += zg * moe_expf(l[e] - lse[t]);
            dlogits[t * E + e] = g;
        }
        __syncwarp(); /* dr and dl are rewritten by the next token */
    }
}

/* The sequence-wise balancing loss's statistics (ops.h gate_seq_stats):
 * block q sums sequence q, thread e expert e's pairs and probabilities in
 * token order, so the sums are the CPU's. Neighbouring threads read
 * neighbouring probabilities; each reads a token's k choices. */
static __global__ void gate_seq_stats_kernel(float *stats, const int32_t *topk_idx,
                                             const float *prob, int64_t seq_len, int E, int k) {
    const int64_t q = blockIdx.x;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t assigned = 0;
        double prob_sum = 0.0; /* as the CPU's, which long sequences need */
        for (int64_t t = q * seq_len; t < (q + 1) * seq_len; t++) {
            for (int j = 0; j < k; j++) assigned += topk_idx[t * k + j] == e;
            prob_sum += prob[t * E + e];
        }
        stats[q * 2 * E + e] = (float)assigned;
        stats[q * 2 * E + E + e] = (float)prob_sum;
    }
}

#endif /* MOE_KERNELS_CUDA_GATE_KERNELS_CUH */
