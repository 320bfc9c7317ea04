/* ref_moe.h: a naive double-precision reference of the MoE layer and its
 * ops, written from the specification in include/moe.h and kernels/ops.h and
 * sharing no code with the library, plus the random inputs and the
 * comparison helpers the tests use. Test-only: everything is static inline. */
#ifndef MOE_TESTS_REF_MOE_H
#define MOE_TESTS_REF_MOE_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

/* ------------------------------------------------------------ randomness */

typedef struct ref_rng {
    uint64_t s;
} ref_rng;

/* splitmix64: a fixed, platform-independent stream per seed. */
static inline uint64_t ref_next(ref_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double ref_uniform(ref_rng *r, double lo, double hi) {
    return lo + (hi - lo) * (double)(ref_next(r) >> 11) * 0x1.0p-53;
}

static inline void ref_fill(float *a, int64_t n, ref_rng *r, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) a[i] = (float)ref_uniform(r, lo, hi);
}

static inline void *ref_alloc(size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    cr_assert(p != NULL, "test allocation of %zu bytes failed", bytes);
    return p;
}

static inline double *ref_to_double(const float *a, int64_t n) {
    double *out = ref_alloc((size_t)n * sizeof *out);
    for (int64_t i = 0; i < n; i++) out[i] = a[i];
    return out;
}

/* ------------------------------------------------------------ comparison */

typedef struct ref_cmp {
    int64_t n_bad;   /* elements over tolerance */
    int64_t worst;   /* index of the largest err / tol */
    double got, ref; /* at worst */
    double err, tol; /* at worst */
} ref_cmp;

/* Element i passes when |got - ref| <= atol + rtol * |ref|. NaN fails. */
static inline ref_cmp ref_compare(const float *got, const double *ref, int64_t n, double atol,
                                  double rtol) {
    ref_cmp c = {0, -1, 0, 0, 0, 0};
    double worst_ratio = -1.0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - ref[i]);
        double tol = atol + rtol * fabs(ref[i]);
        double ratio = isnan(err) ? INFINITY : err / tol;
        if (!(err <= tol)) c.n_bad++;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            c = (ref_cmp){c.n_bad, i, got[i], ref[i], err, tol};
        }
    }
    return c;
}

static inline double ref_max_abs(const double *a, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(a[i]));
    return m;
}

#define REF_EXPECT_CLOSE(what_, got_, ref_, n_, atol_, rtol_)                                      \
    do {                                                                                           \
        ref_cmp c_ = ref_compare((got_), (ref_), (n_), (atol_), (rtol_));                          \
        cr_expect(c_.n_bad == 0,                                                                   \
                  "%s: %lld of %lld elements off; worst [%lld] got %.9g ref %.9g, |err| %.3g > "   \
                  "tol %.3g",                                                                      \
                  (what_), (long long)c_.n_bad, (long long)(n_), (long long)c_.worst, c_.got,      \
                  c_.ref, c_.err, c_.tol);                                                         \
    } while (0)

/* ------------------------------------------------------------------ gate */

static inline double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static inline double ref_silu(double x) { return x * ref_sigmoid(x); }

/* Router probability r [E] and logsumexp of one token's logits [E]. */
static inline void ref_router_prob(double *r, double *lse, const double *logits, int64_t E,
                                   moe_gate_kind kind) {
    double m = -INFINITY;
    for (int64_t e = 0; e < E; e++) m = fmax(m, logits[e]);
    double sum = 0.0;
    for (int64_t e = 0; e < E; e++) sum += exp(logits[e] - m);
    *lse = m + log(sum);
    if (kind == MOE_GATE_SIGMOID) {
        double ssum = 0.0;
        for (int64_t e = 0; e < E; e++) ssum += ref_sigmoid(logits[e]);
        for (int64_t e = 0; e < E; e++) r[e] = ref_sigmoid(logits[e]) / ssum;
    } else {
        for (int64_t e = 0; e < E; e++) r[e] = exp(logits[e] - *lse);
    }
}

/* The selection score of expert e: what top-k ranks. */
static inline double ref_score(const double *logits, const double *bias, int64_t e, double lse,
                               moe_gate_kind kind) {
    double s = kind == MOE_GATE_SOFTMAX_TOPK   ? exp(logits[e] - lse)
               : kind == MOE_GATE_TOPK_SOFTMAX ? logits[e]
                                               : ref_sigmoid(logits[e]);
    return s + (bias ? bias[e] : 0.0);
}

/* Top-k by repeated arg-max with a strict '>' over increasing e, so ties go
 * to the lower index; with n_groups > 1, among the experts of the
 * top_groups groups whose two best scores sum highest (ties to the lower
 * group). *min_gap: the smallest distance between consecutive scores among
 * the first min(k + 1, E) in order, and between the last kept group's
 * score and the next, i.e. how far the selection and its slot order are
 * from changing. */
static inline void ref_topk_grouped(int32_t *idx, double *min_gap, const double *logits, const double *bias,
                                    int64_t E, int64_t k, moe_gate_kind kind, int64_t n_groups, int64_t top_groups) {
    double lse, dummy[64];
    cr_assert(E <= 64, "reference supports E <= 64");
    ref_router_prob(dummy, &lse, logits, E, kind);
    double score[64];
    int taken[64] = {0};
    for (int64_t e = 0; e < E; e++) score[e] = ref_score(logits, bias, e, lse, kind);
    double gap = INFINITY;
    int64_t allowed = E;
    if (n_groups > 1) {
        const int64_t per = E / n_groups;
        double gs[64];
        int kept[64] = {0};
        for (int64_t g = 0; g < n_groups; g++) {
            double a1 = -INFINITY, a2 = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (score[e] > a1) a2 = a1, a1 = score[e];
                else if (score[e] > a2) a2 = score[e];
            }
            gs[g] = per > 1 ? a1 + a2 : a1;
        }
        double last = 0.0;
        for (int64_t r = 0; r <= top_groups && r < n_groups; r++) {
            int64_t best = -1;
            for (int64_t g = 0; g < n_groups; g++)
                if (!kept[g] && (best < 0 || gs[g] > gs[best])) best = g;
            if (r == top_groups) {
                gap = fmin(gap, last - gs[best]);
                break;
            }
            kept[best] = 1;
            last = gs[best];
        }
        for (int64_t e = 0; e < E; e++) taken[e] = !kept[e / per];
        allowed = top_groups * per;
    }
    int64_t depth = k < allowed ? k + 1 : allowed;
    double prev = 0.0;
    for (int64_t j = 0; j < depth; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || score[e] > score[best])) best = e;
        taken[best] = 1;
        if (j < k) idx[j] = (int32_t)best;
        if (j > 0) gap = fmin(gap, prev - score[best]);
        prev = score[best];
    }
    if (min_gap) *min_gap = gap;
}

static inline void ref_topk(int32_t *idx, double *min_gap, const double *logits, const double *bias, int64_t E,
                            int64_t k, moe_gate_kind kind) {
    ref_topk_grouped(idx, min_gap, logits, bias, E, k, kind, 0, 0);
}

/* The k weights of a fixed selection idx [k] for one token. */
static inline void ref_topk_weights(double *w, const double *logits, const int32_t *idx, int64_t E,
                                    int64_t k, moe_gate_kind kind, int renormalize) {
    double r[64], lse;
    ref_router_prob(r, &lse, logits, E, kind);
    double sum = 0.0;
    if (kind == MOE_GATE_SOFTMAX_TOPK) {
        for (int64_t j = 0; j < k; j++) sum += (w[j] = exp(logits[idx[j]] - lse));
        if (!renormalize) sum = 1.0;
    } else if (kind == MOE_GATE_TOPK_SOFTMAX) {
        double m = -INFINITY;
        for (int64_t j = 0; j < k; j++) m = fmax(m, logits[idx[j]]);
        for (int64_t j = 0; j < k; j++) sum += (w[j] = exp(logits[idx[j]] - m));
    } else {
        for (int64_t j = 0; j < k; j++) sum += (w[j] = ref_sigmoid(logits[idx[j]]));
    }
    for (int64_t j = 0; j < k; j++) w[j] /= sum;
}

/* ----------------------------------------------------------------- layer */

/* One SwiGLU MLP on one row: out [d] = down (silu(gate x) * (up x)), with
 * gate, up [f, d] and down [d, f]. */
static inline void ref_swiglu_mlp(double *out, const double *x, const double *gate,
                                  const double *up, const double *down, int64_t d, int64_t f) {
    double *g = ref_alloc((size_t)f * sizeof *g);
    for (int64_t i = 0; i < f; i++) {
        double a = 0.0, b = 0.0;
        for (int64_t c = 0; c < d; c++) {
            a += gate[i * d + c] * x[c];
            b += up[i * d + c] * x[c];
        }
        g[i] = ref_silu(a) * b;
    }
    for (int64_t r = 0; r < d; r++) {
        double s = 0.0;
        for (int64_t i = 0; i < f; i++) s += down[r * f + i] * g[i];
        out[r] = s;
    }
    free(g);
}

typedef struct ref_layer {
    int64_t d, ff, E, k;
    int64_t shared_ff; /* S, the shared experts' width; 0: none */
    int64_t n_groups, top_groups; /* group-limited routing when n_groups > 1 */
    moe_gate_kind gate;
    int renormalize;
    double routed_scale; /* multiplies the weights; 0 or 1: none */
    double capacity_factor, aux_loss_coef, z_loss_coef;
    double seq_aux_loss_coef; /* the sequence-wise balancing loss, over sequences of seq_len tokens */
    int64_t seq_len;
    double *wg;         /* [E, d] */
    double *w1, *w3;    /* [E, ff, d] */
    double *w2;         /* [E, d, ff] */
    double *sg, *su;    /* [S, d] */
    double *sd;         /* [d, S] */
    double *sgate;      /* [d] the shared experts' sigmoid gate (Qwen2-MoE's); NULL: none */
    const double *bias; /* [E] or NULL */
} ref_layer;

typedef struct ref_out {
    int32_t *idx;        /* [T, k] */
    double *w;           /* [T, k] */
    int *kept;           /* [T, k] */
    double *r;           /* [T, E] router probability */
    double *lse;         /* [T] */
    int64_t *assigned;   /* [E] pre-capacity */
    int64_t *kept_count; /* [E] */
    int64_t dropped;
    double aux, z, imbalance;
    double seq_aux; /* mean over sequences of E sum_e f_e P_e; 0 without seq_len */
    double min_gap; /* over tokens, see ref_topk */
} ref_out;

static inline ref_out ref_out_alloc(int64_t T, int64_t E, int64_t k) {
    ref_out o;
    memset(&o, 0, sizeof o);
    o.idx = ref_alloc((size_t)(T * k) * sizeof *o.idx);
    o.w = ref_alloc((size_t)(T * k) * sizeof *o.w);
    o.kept = ref_alloc((size_t)(T * k) * sizeof *o.kept);
    o.r = ref_alloc((size_t)(T * E) * sizeof *o.r);
    o.lse = ref_alloc((size_t)T * sizeof *o.lse);
    o.assigned = ref_alloc((size_t)E * sizeof *o.assigned);
    o.kept_count = ref_alloc((size_t)E * sizeof *o.kept_count);
    return o;
}

static inline void ref_out_free(ref_out *o) {
    free(o->idx);
    free(o->w);
    free(o->kept);
    free(o->r);
    free(o->lse);
    free(o->assigned);
    free(o->kept_count);
}

static inline int64_t ref_capacity(double cf, int64_t T, int64_t k, int64_t E) {
    return cf > 0.0 ? (int64_t)ceil(cf * (double)T * (double)k / (double)E) : INT64_MAX;
}

/* y [T, d] = MoE(x [T, d]) and everything about the routing in o. */
static inline void ref_layer_forward(double *y, ref_out *o, const ref_layer *L, const double *x,
                                     int64_t T) {
    const int64_t d = L->d, E = L->E, k = L->k, ff = L->ff, S = L->shared_ff;
    double logits[64], *ye = ref_alloc((size_t)d * sizeof *ye);
    memset(o->assigned, 0, (size_t)E * sizeof *o->assigned);
    memset(o->kept_count, 0, (size_t)E * sizeof *o->kept_count);
    o->min_gap = INFINITY;
    o->dropped = 0;
    o->z = 0.0;
    const int64_t cap = ref_capacity(L->capacity_factor, T, k, E);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t e = 0; e < E; e++) {
            double s = 0.0;
            for (int64_t c = 0; c < d; c++) s += L->wg[e * d + c] * x[t * d + c];
            logits[e] = s;
        }
        double gap;
        ref_router_prob(o->r + t * E, o->lse + t, logits, E, L->gate);
        ref_topk_grouped(o->idx + t * k, &gap, logits, L->bias, E, k, L->gate, L->n_groups, L->top_groups);
        ref_topk_weights(o->w + t * k, logits, o->idx + t * k, E, k, L->gate, L->renormalize);
        for (int64_t j = 0; j < k && L->routed_scale > 0.0; j++) o->w[t * k + j] *= L->routed_scale;
        o->min_gap = fmin(o->min_gap, gap);
        o->z += o->lse[t] * o->lse[t] / (double)T;
        for (int64_t c = 0; c < d; c++) y[t * d + c] = 0.0;
        for (int64_t j = 0; j < k; j++) {
            int32_t e = o->idx[t * k + j];
            o->assigned[e]++;
            o->kept[t * k + j] = o->kept_count[e] < cap;
            if (!o->kept[t * k + j]) {
                o->dropped++;
                continue;
            }
            o->kept_count[e]++;
            ref_swiglu_mlp(ye, x + t * d, L->w1 + e * ff * d, L->w3 + e * ff * d,
                           L->w2 + e * d * ff, d, ff);
            for (int64_t c = 0; c < d; c++) y[t * d + c] += o->w[t * k + j] * ye[c];
        }
        if (S > 0) {
            ref_swiglu_mlp(ye, x + t * d, L->sg, L->su, L->sd, d, S);
            double g = 1.0, s = 0.0;
            for (int64_t c = 0; L->sgate && c < d; c++) s += L->sgate[c] * x[t * d + c];
            if (L->sgate) g = 1.0 / (1.0 + exp(-s));
            for (int64_t c = 0; c < d; c++) y[t * d + c] += g * ye[c];
        }
    }
    o->aux = 0.0;
    o->imbalance = 0.0;
    for (int64_t e = 0; e < E; e++) {
        double P = 0.0;
        for (int64_t t = 0; t < T; t++) P += o->r[t * E + e] / (double)T;
        double f = (double)o->assigned[e] / (double)(T * k);
        o->aux += (double)E * f * P;
        o->imbalance = fmax(o->imbalance, (double)o->assigned[e] / ((double)(T * k) / (double)E));
    }
    /* DeepSeek-V3's sequence-wise loss: the same sum per sequence, its
     * own tokens' shares and probabilities, averaged. */
    o->seq_aux = 0.0;
    const int64_t n = L->seq_len, seqs = n > 0 ? T / n : 0;
    for (int64_t q = 0; q < seqs; q++)
        for (int64_t e = 0; e < E; e++) {
            double P = 0.0, f = 0.0;
            for (int64_t t = q * n; t < (q + 1) * n; t++) {
                P += o->r[t * E + e] / (double)n;
                for (int64_t j = 0; j < k; j++) f += o->idx[t * k + j] == e ? 1.0 / (double)(n * k) : 0.0;
            }
            o->seq_aux += (double)E * f * P / (double)seqs;
        }
    free(ye);
}

/* The scalar whose gradient moe_layer_backward computes. */
static inline double ref_layer_loss(const double *y, const double *dy, const ref_out *o,
                                    const ref_layer *L, int64_t T) {
    double s = 0.0;
    for (int64_t i = 0; i < T * L->d; i++) s += dy[i] * y[i];
    return s + L->aux_loss_coef * o->aux + L->seq_aux_loss_coef * o->seq_aux + L->z_loss_coef * o->z;
}

/* Whether two forwards chose the same experts and kept the same pairs. */
static inline int ref_same_routing(const ref_out *a, const ref_out *b, int64_t T, int64_t k) {
    return memcmp(a->idx, b->idx, (size_t)(T * k) * sizeof *a->idx) == 0 &&
           memcmp(a->kept, b->kept, (size_t)(T * k) * sizeof *a->kept) == 0;
}

#endif /* MOE_TESTS_REF_MOE_H */
