/* gate.c: the fused gating pass and its backward, one token at a time.
 * Each token's row of logits is read once into cache and everything the
 * router produces for it (probabilities, top-k, weights, logsumexp and the
 * per-expert statistics) comes out of that one visit. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/moe_math.h"

void moe_cpu_gate_forward(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                          moe_gate_totals *totals, const float *logits, const float *bias,
                          const moe_gate_params *p, int64_t T) {
    const int64_t E = p->n_experts, k = p->top_k;
    const int64_t n_chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;
    double *scratch = totals->chunk_scratch; /* [n_chunks, 2E + 1] */

#pragma omp parallel for schedule(static) if (T * E >= MOE_CPU_PAR_MIN)
    for (int64_t c = 0; c < n_chunks; c++) {
        double *c_prob = scratch + c * (2 * E + 1); /* [E] */
        double *c_assigned = c_prob + E;            /* [E] */
        double *c_z = c_assigned + E;               /* [1] */
        memset(c_prob, 0, (size_t)(2 * E + 1) * sizeof(double));
        int64_t t_end = (c + 1) * MOE_GATE_CHUNK_TOKENS < T ? (c + 1) * MOE_GATE_CHUNK_TOKENS : T;
        for (int64_t t = c * MOE_GATE_CHUNK_TOKENS; t < t_end; t++) {
            const float *l = logits + t * E; /* [E] */
            float *r = prob + t * E;         /* [E] */
            int32_t *idx = topk_idx + t * k; /* [k] */
            float *w = topk_w + t * k;       /* [k] */
            /* The largest number, passing over NaN as the GPU's fmaxf does. */
            float lmax = -INFINITY;
#pragma omp simd reduction(max : lmax)
            for (int64_t e = 0; e < E; e++) lmax = l[e] > lmax ? l[e] : lmax;
            /* Vector loops: lanes of partial sums in a fixed order. The
             * exponentials give the logsumexp for every kind, and the
             * probabilities unless the gate is a sigmoid. */
            double esum = 0.0, ssum = 0.0;
#pragma omp simd reduction(+ : esum)
            for (int64_t e = 0; e < E; e++) {
                r[e] = moe_expf(l[e] - lmax);
                esum += r[e];
            }
            float ls[MOE_EXPERTS_MAX]; /* the sigmoid's log-sigmoids, made once for all their uses */
            if (p->kind == MOE_GATE_SIGMOID) {
                /* s = sigmoid(l) relative to the row's largest, through
                 * log-sigmoids (increasing, so the largest is lmax's): the
                 * probabilities s / sum(s) stay apart where s itself leaves
                 * float's range (logits below -88). */
                const float ls_max = moe_log_sigmoidf(lmax);
                for (int64_t e = 0; e < E; e++) ls[e] = moe_log_sigmoidf(l[e]);
#pragma omp simd reduction(+ : ssum)
                for (int64_t e = 0; e < E; e++) {
                    r[e] = moe_expf(ls[e] - ls_max);
                    ssum += r[e];
                }
            }
            float log_z = lmax + (float)log(esum);
            lse[t] = log_z;
            float norm = (float)(1.0 / (p->kind == MOE_GATE_SIGMOID ? ssum : esum));

            /* The sigmoid's scores: s + bias (DeepSeek-V3's), or without a
             * bias the log-sigmoid, which ranks as s does but keeps apart
             * the logits whose s is out of float's range. */
            float ranked[MOE_EXPERTS_MAX];
            for (int64_t e = 0; e < E; e++) {
                float base = p->kind == MOE_GATE_SIGMOID
                                 ? (bias ? moe_sigmoidf(l[e]) : ls[e])
                             : p->kind == MOE_GATE_TOPK_SOFTMAX ? l[e]
                                                                : r[e] * norm;
                ranked[e] = bias ? base + bias[e] : base;
            }
            /* Group-limited routing: the experts of the kept groups only,
             * the groups scored by sigmoids where the sigmoid's ranks
             * log-sigmoids (DeepSeek-V3 sums the sigmoids). */
            uint64_t kept = 1;
            int64_t per_group = E;
            if (p->n_groups > 1) {
                float gs[MOE_GROUPS_MAX];
                per_group = E / p->n_groups;
                for (int64_t g = 0; g < p->n_groups; g++) {
                    float a1 = -INFINITY, a2 = -INFINITY;
                    for (int64_t e = g * per_group; e < (g + 1) * per_group; e++)
                        moe_top2_add(&a1, &a2, p->kind == MOE_GATE_SIGMOID && !bias ? moe_sigmoidf(l[e]) : ranked[e]);
                    gs[g] = per_group > 1 ? a1 + a2 : a1;
                }
                kept = moe_top_groups(gs, (int)p->n_groups, (int)p->top_groups);
            }
            float score[MOE_TOPK_MAX];
            int n = 0;
            for (int64_t g = 0; g * per_group < E; g++) /* group by group: no division per expert */
                if (kept >> g & 1u)
                    for (int64_t e = g * per_group; e < (g + 1) * per_group; e++)
                        moe_topk_insert(idx, score, &n, (int)k, (int32_t)e, ranked[e]);
            /* Weights from the unbiased values: the bias steers selection
             * only. Weights normalised over the chosen k (every kind but
             * softmax_topk without renormalize) come from the chosen logits,
             * or log-sigmoids, relative to their own largest: a softmax over
             * them, equal to the probabilities' ratios, but not the row's
             * largest, since a bias may choose experts so far below it that
             * their probabilities leave float's range (and would tie). */
            const bool normalised = p->kind != MOE_GATE_SOFTMAX_TOPK || p->renormalize;
            float chosen_max = -INFINITY;
            for (int64_t j = 0; j < k; j++) {
                const float le = l[idx[j]];
                w[j] = !normalised ? r[idx[j]] * norm
                       : p->kind == MOE_GATE_SIGMOID ? ls[idx[j]]
                                                     : le;
                chosen_max = w[j] > chosen_max ? w[j] : chosen_max;
            }
            if (normalised) {
                double wsum = 0.0;
                for (int64_t j = 0; j < k; j++) {
                    w[j] = moe_expf(w[j] - chosen_max);
                    wsum += w[j];
                }
                float inv = (float)(1.0 / wsum);
                for (int64_t j = 0; j < k; j++) w[j] *= inv;
            }
            for (int64_t j = 0; j < k; j++) w[j] *= p->routed_scale;
            for (int64_t e = 0; e < E; e++) {
                r[e] *= norm;
                c_prob[e] += r[e];
            }
            for (int64_t j = 0; j < k; j++) c_assigned[idx[j]] += 1.0;
            *c_z += (double)log_z * log_z;
        }
    }
    /* Chunks are summed in order, so the totals do not depend on threads. */
    for (int64_t e = 0; e < E; e++) {
        totals->prob_sum[e] = 0.0;
        totals->assigned[e] = 0;
    }
    double z_sum = 0.0;
    for (int64_t c = 0; c < n_chunks; c++) {
        const double *row = scratch + c * (2 * E + 1);
        for (int64_t e = 0; e < E; e++) {
            totals->prob_sum[e] += row[e];
            totals->assigned[e] += (int64_t)row[E + e];
        }
        z_sum += row[2 * E];
    }
    *totals->z_sum = z_sum;
}

void moe_cpu_gate_backward(float *dlogits, const float *dweights, const int32_t *topk_idx,
                           const float *topk_w, const float *prob, const float *lse,
                           const float *logits, const float *aux_grad, float z_coef_over_T,
                           const moe_gate_params *p, int64_t T) {
    const int64_t E = p->n_experts, k = p->top_k;
#pragma omp parallel for schedule(static) if (T * E >= MOE_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E, *r = prob + t * E, *dw = dweights + t * k;
        const float *w = topk_w + t * k; /* the weights times s = routed_scale */
        const int32_t *idx = topk_idx + t * k;
        float *dl = dlogits + t * E;
        const float s = p->routed_scale;
        /* dr: the gradient with respect to the router probabilities r. */
        float dr[MOE_EXPERTS_MAX];
        const float *ag = aux_grad ? aux_grad + (p->aux_seq_len ? t / p->aux_seq_len : 0) * E : NULL;
        for (int64_t e = 0; e < E; e++) dr[e] = ag ? ag[e] : 0.0f;

        /* sum_j w_j dw_j: the normalisation's share. Of the unscaled
         * weights w / s the gradient is s dw, so s cancels but in the dot. */
        float dot = 0.0f;
        for (int64_t j = 0; j < k; j++) dot += w[j] * dw[j];
        dot /= s;

        /* The probabilities' part (the aux loss's, and softmax_topk's
         * weights without renormalize, which are r): softmax backward
         * dl = r (dr - <r, dr>); for the sigmoid, r = s / sum(s) and
         * s' = s (1 - s) give r (dr - <r, dr>) (1 - s). */
        if (p->kind == MOE_GATE_SOFTMAX_TOPK && !p->renormalize)
            for (int64_t j = 0; j < k; j++) dr[idx[j]] += s * dw[j];
        float dr_r = 0.0f;
        for (int64_t e = 0; e < E; e++) dr_r += dr[e] * r[e];
        for (int64_t e = 0; e < E; e++) {
            const float sig = p->kind == MOE_GATE_SIGMOID ? 1.0f - moe_sigmoidf(l[e]) : 1.0f;
            dl[e] = r[e] * (dr[e] - dr_r) * sig;
        }
        /* Normalised weights are a softmax over the chosen logits (or
         * log-sigmoids, whose derivative is 1 - s): w (dw - <w, dw>), with
         * no division by the chosen probabilities, which may underflow. */
        if (p->kind != MOE_GATE_SOFTMAX_TOPK || p->renormalize)
            for (int64_t j = 0; j < k; j++) {
                const float le = l[idx[j]];
                const float sig = p->kind == MOE_GATE_SIGMOID ? 1.0f - moe_sigmoidf(le) : 1.0f;
                dl[idx[j]] += w[j] * (dw[j] - dot) * sig;
            }
        if (z_coef_over_T != 0.0f) {
            float zg = 2.0f * z_coef_over_T * lse[t];
            for (int64_t e = 0; e < E; e++) dl[e] += zg * moe_expf(l[e] - lse[t]);
        }
    }
}

void moe_cpu_gate_seq_stats(float *stats, const int32_t *topk_idx, const float *prob, const moe_gate_params *p,
                            int64_t T) {
    const int64_t E = p->n_experts, k = p->top_k, n = p->aux_seq_len, S = T / n;
#pragma omp parallel for schedule(static) if (T * E >= MOE_CPU_PAR_MIN)
    for (int64_t q = 0; q < S; q++) {
        float *assigned = stats + q * 2 * E, *prob_sum = assigned + E;
        /* Long sequences: float sums would stop short (counts at 2^24). */
        double count[MOE_EXPERTS_MAX], sum[MOE_EXPERTS_MAX];
        for (int64_t e = 0; e < E; e++) count[e] = sum[e] = 0.0;
        for (int64_t t = q * n; t < (q + 1) * n; t++) {
            for (int64_t j = 0; j < k; j++) count[topk_idx[t * k + j]] += 1.0;
            for (int64_t e = 0; e < E; e++) sum[e] += prob[t * E + e];
        }
        for (int64_t e = 0; e < E; e++) assigned[e] = (float)count[e], prob_sum[e] = (float)sum[e];
    }
}
