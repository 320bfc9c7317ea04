/* moe_math.h: per-element math shared by the CPU and CUDA backends.
 * Everything here is static inline and marked MOE_HD, so the CPU tests run
 * the very formulas the GPU kernels compile. No state, no allocation. */
#ifndef MOE_KERNELS_MATH_H
#define MOE_KERNELS_MATH_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/host_device.h"

/* x clamped to [lo, hi] (lo <= hi, neither NaN nor a zero, which the key
 * below orders as -0 < +0), NaN kept: the bits of
 * x < lo ? lo : x > hi ? hi : x, which the GPU computes so. The CPU takes
 * integer minimum and maximum on a key that orders floats as numbers: the
 * float comparisons' branches would give the clamped values their own paths,
 * along which the compiler folds what follows into constants and then
 * computes those products in every vector lane (for x * sigmoid(x), x
 * times sigmoid(-88), a subnormal that costs a microcode assist per vector:
 * SwiGLU ran 12 times slower). */
MOE_HD uint32_t moe_float_order_key(float x) {
    union {
        float f;
        uint32_t u;
    } v = {.f = x};
    return v.u ^ ((0u - (v.u >> 31)) | 0x80000000u); /* negatives reversed below the positives */
}

MOE_HD float moe_clampf(float x, float lo, float hi) {
#ifdef __CUDA_ARCH__
    /* A GPU takes subnormals at full speed, and min and max instructions. */
    return x < lo ? lo : x > hi ? hi : x;
#else
    const uint32_t lo_key = moe_float_order_key(lo), hi_key = moe_float_order_key(hi);
    uint32_t key = moe_float_order_key(x);
    key = key < lo_key ? lo_key : key;
    key = key > hi_key ? hi_key : key;
    union {
        float f;
        uint32_t u;
    } v = {.u = key ^ (((key >> 31) - 1u) | 0x80000000u)};
    return x != x ? x : v.f;
#endif
}

/* exp(x) to within 2 ulp on [-87, 88] (clamped outside, where float's
 * normal range ends; NaN stays NaN), in plain arithmetic so that compilers
 * vectorise the loops that call it: Cody-Waite reduction x = n ln2 + r,
 * |r| <= ln2 / 2, a degree-7 polynomial for exp(r), and 2^n built in the
 * exponent bits. */
MOE_HD float moe_expf(float x) {
    x = moe_clampf(x, -87.0f, 88.0f);
    /* Adding 1.5 * 2^23 rounds to the nearest integer in round-to-nearest,
     * which then sits in the low bits of t: n's int is read from there, by
     * unsigned arithmetic, so a NaN x (which passes the clamp and makes p
     * NaN) is no undefined float-to-int conversion. */
    const float shifter = 12582912.0f;
    union {
        float f;
        uint32_t u;
    } t = {.f = x * 1.44269504088896341f + shifter}, scale;
    const float n = t.f - shifter;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723e-6f;
    float p = 1.9875691500e-4f; /* Cephes' minimax coefficients */
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    scale.u = (t.u - 0x4B400000u + 127u) << 23; /* 0x4B400000: the shifter's bits */
    return p * scale.f;
}

MOE_HD float moe_sigmoidf(float x) { return 1.0f / (1.0f + moe_expf(-x)); }

/* log(1 + u) for u in [0, 1], within 2 ulp, in plain arithmetic so that
 * the loops calling it vectorise (libm's log1pf is a call per element):
 * 2 atanh(y) with y = u / (2 + u) <= 1/3, which keeps a small u's bits, as
 * its odd series through y^15. */
MOE_HD float moe_log1p_unit(float u) {
    const float y = u / (2.0f + u), y2 = y * y;
    float p = 1.0f / 15.0f;
    p = p * y2 + 1.0f / 13.0f;
    p = p * y2 + 1.0f / 11.0f;
    p = p * y2 + 1.0f / 9.0f;
    p = p * y2 + 1.0f / 7.0f;
    p = p * y2 + 1.0f / 5.0f;
    p = p * y2 + 1.0f / 3.0f;
    return 2.0f * (y + y * y2 * p);
}

/* log(sigmoid(x)) = min(x, 0) - log(1 + e^-|x|): exact where sigmoid(x)
 * itself leaves float's range (x far below zero, where it is x). */
MOE_HD float moe_log_sigmoidf(float x) { return (x < 0.0f ? x : 0.0f) - moe_log1p_unit(moe_expf(-fabsf(x))); }

/* silu(a) = a * sigmoid(a); silu'(a) = s * (1 + a * (1 - s)). */
MOE_HD float moe_siluf(float a) { return a * moe_sigmoidf(a); }
MOE_HD float moe_silu_gradf(float a) {
    float s = moe_sigmoidf(a);
    return s * (1.0f + a * (1.0f - s));
}

/* SwiGLU forward on one element pair: g = silu(a) * b. */
MOE_HD float moe_swiglu(float a, float b) { return moe_siluf(a) * b; }

/* SwiGLU backward: from dg, da = dg * b * silu'(a) and db = dg * silu(a). */
MOE_HD void moe_swiglu_backward(float *da, float *db, float dg, float a, float b) {
    float s = moe_sigmoidf(a);
    *da = dg * b * s * (1.0f + a * (1.0f - s));
    *db = dg * a * s;
}

/* The selection order of top-k: whether candidate (s, e) ranks above
 * (best, best_e). Higher score first, ties to the lower index, and a NaN
 * score (from a NaN logit) below every number, so a router that meets one
 * picks the same experts on every backend. */
MOE_HD bool moe_score_outranks(float s, int32_t e, float best, int32_t best_e) {
    if (s != s) return best != best && e < best_e;
    if (best != best) return true;
    return s > best || (s == best && e < best_e);
}

/* Inserts (score, e) into the descending list idx/val of length *n <= k, in
 * moe_score_outranks's order. Candidates arrive in increasing e, so a tie
 * keeps the entry already there first. */
MOE_HD void moe_topk_insert(int32_t *idx, float *val, int *n, int k, int32_t e, float score) {
    int pos = *n < k ? *n : k;
    while (pos > 0 && moe_score_outranks(score, e, val[pos - 1], idx[pos - 1])) pos--;
    if (pos >= k) return;
    int last = *n < k ? *n : k - 1;
    for (int i = last; i > pos; i--) {
        idx[i] = idx[i - 1];
        val[i] = val[i - 1];
    }
    idx[pos] = e;
    val[pos] = score;
    if (*n < k) (*n)++;
}

/* Group-limited routing: a group's score is the sum of its two best
 * values (its one value for groups of one), kept by moe_top2_add as
 * (*a1 >= *a2) from -INFINITY each. */
MOE_HD void moe_top2_add(float *a1, float *a2, float v) {
    if (v > *a1) {
        *a2 = *a1;
        *a1 = v;
    } else if (v > *a2) {
        *a2 = v;
    }
}

/* Of n <= 64 groups scored gs [n], the top that a token keeps, in
 * moe_score_outranks's order (ties to the lower group): bit j set for
 * group j. */
MOE_HD uint64_t moe_top_groups(const float *gs, int n, int top) {
    uint64_t kept = 0;
    for (int r = 0; r < top; r++) {
        int best = -1;
        for (int j = 0; j < n; j++)
            if (!(kept >> j & 1u) && (best < 0 || moe_score_outranks(gs[j], j, gs[best], best))) best = j;
        kept |= (uint64_t)1 << best;
    }
    return kept;
}

/* AdamW's per-step scalars, computed on the host in double as PyTorch does
 * in Python: decay = 1 - lr * wd (for the parameters weight decay applies
 * to; the others use 1), step_size = lr / (1 - beta1^t), bc2_sqrt =
 * sqrt(1 - beta2^t). */
typedef struct moe_adamw_step {
    float decay, step_size, bc2_sqrt;
} moe_adamw_step;

static inline moe_adamw_step moe_adamw_step_at(float lr, float beta1, float beta2, float weight_decay,
                                               int64_t t) {
    const moe_adamw_step s = {(float)(1.0 - (double)lr * (double)weight_decay),
                              (float)((double)lr / (1.0 - pow((double)beta1, (double)t))),
                              (float)sqrt(1.0 - pow((double)beta2, (double)t))};
    return s;
}

/* One AdamW element update in PyTorch's order (torch.optim.AdamW): the
 * decoupled decay first, then the moments, then the step, with the
 * scalars of moe_adamw_step_at. */
MOE_HD void moe_adamw_update(float *p, float *m, float *v, float g, float beta1, float beta2,
                             float eps, float decay, float step_size, float bc2_sqrt) {
    float mi = beta1 * *m + (1.0f - beta1) * g;
    float vi = beta2 * *v + (1.0f - beta2) * g * g;
    *m = mi;
    *v = vi;
    *p = *p * decay - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
}

#endif /* MOE_KERNELS_MATH_H */
