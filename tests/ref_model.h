/* ref_model.h: a naive double-precision reference of the whole Mixtral model
 * of engine/model.h (Hugging Face MixtralForCausalLM), written from that
 * specification and sharing no code with the library. It reads the model's
 * fp32 parameters by tensor name into one double array laid out like the
 * model's (same offsets), so a test can perturb any parameter in double and
 * evaluate the loss again. The MoE block is ref_moe.h's layer reference.
 * Test-only: everything is static inline. */
#ifndef MOE_TESTS_REF_MODEL_H
#define MOE_TESTS_REF_MODEL_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine/model.h"
#include "ref_moe.h"

/* ------------------------------------------------------------------ ops */

/* out [N, C] = weight * x * rsqrt(mean(x^2) + eps), per row of x [N, C]. */
static inline void ref_rmsnorm(double *out, const double *x, const double *weight, double eps, int64_t N,
                               int64_t C) {
    for (int64_t n = 0; n < N; n++) {
        double ss = 0.0;
        for (int64_t c = 0; c < C; c++) ss += x[n * C + c] * x[n * C + c];
        const double r = 1.0 / sqrt(ss / (double)C + eps);
        for (int64_t c = 0; c < C; c++) out[n * C + c] = weight[c] * (x[n * C + c] * r);
    }
}

/* out [N, OC] = x [N, C] w^T, w [OC, C] (a bias-free nn.Linear). */
static inline void ref_linear(double *out, const double *x, const double *w, int64_t N, int64_t C, int64_t OC) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < OC; o++) {
            double s = 0.0;
            for (int64_t c = 0; c < C; c++) s += x[n * C + c] * w[o * C + c];
            out[n * OC + o] = s;
        }
}

/* Hugging Face's rotary angle, with its fp32 roundings of the unscaled
 * inverse frequency (1 / theta^(float(2i) / hd) rounded to fp32) and of the
 * angle (float(pos) * inv_freq in fp32) when RoPE is not scaled. They are
 * part of what a Mixtral checkpoint computes, so the reference keeps them.
 * A scaling applies transformers' formulas in double to that frequency
 * (modeling_rope_utils: linear, llama3, yarn). */
static inline double ref_rope_inv_freq(int64_t i, int64_t hd, double theta, const moe_rope_scaling *s) {
    const float expo = (float)(2 * i) / (float)hd;
    const double inv = (double)(1.0f / (float)pow(theta, (double)expo)), two_pi = 6.283185307179586;
    const double context = (double)s->original_max_position_embeddings;
    if (s->type == MOE_ROPE_LINEAR) return inv / s->factor;
    if (s->type == MOE_ROPE_LLAMA3) {
        const double wavelen = two_pi / inv;
        if (wavelen < context / s->high_freq_factor) return inv;
        if (wavelen > context / s->low_freq_factor) return inv / s->factor;
        const double smooth = (context / wavelen - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
        return (1.0 - smooth) * inv / s->factor + smooth * inv;
    }
    if (s->type == MOE_ROPE_YARN) {
        /* The pair dimension at which a frequency turns r times within the context. */
        double low = (double)hd * log(context / (s->beta_fast * two_pi)) / (2.0 * log(theta));
        double high = (double)hd * log(context / (s->beta_slow * two_pi)) / (2.0 * log(theta));
        if (s->truncate) low = floor(low), high = ceil(high);
        low = fmax(low, 0.0), high = fmin(high, (double)(hd - 1));
        if (high == low) high += 0.001;
        const double ramp = fmin(fmax(((double)i - low) / (high - low), 0.0), 1.0);
        return inv / s->factor * ramp + inv * (1.0 - ramp);
    }
    return inv;
}

/* yarn's factor on cos and sin (transformers' get_mscale); 1 otherwise. */
static inline double ref_rope_attention(const moe_rope_scaling *s) {
    if (s->type != MOE_ROPE_YARN) return 1.0;
    if (s->attention_factor != 0.0) return s->attention_factor;
    const double l = s->factor > 1.0 ? log(s->factor) : 0.0;
    if (s->mscale != 0.0 && s->mscale_all_dim != 0.0) return (0.1 * s->mscale * l + 1.0) / (0.1 * s->mscale_all_dim * l + 1.0);
    return 0.1 * l + 1.0;
}

static inline double ref_rope_angle(int64_t pos, int64_t i, int64_t hd, double theta, const moe_rope_scaling *s) {
    if (s->type == MOE_ROPE_DEFAULT) return (double)((float)pos * (float)ref_rope_inv_freq(i, hd, theta, s));
    return (double)pos * ref_rope_inv_freq(i, hd, theta, s);
}

/* "rotate_half" RoPE in place on x [B, T, H, hd]: element i < hd/2 pairs
 * with i + hd/2, x1' = (x1 cos - x2 sin) a, x2' = (x2 cos + x1 sin) a,
 * position t, a the scaling's attention factor. */
static inline void ref_rope(double *x, int64_t B, int64_t T, int64_t H, int64_t hd, double theta,
                            const moe_rope_scaling *scaling) {
    const int64_t half = hd / 2;
    const double a = ref_rope_attention(scaling);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                double *v = x + ((b * T + t) * H + h) * hd;
                for (int64_t i = 0; i < half; i++) {
                    const double angle = ref_rope_angle(t, i, hd, theta, scaling);
                    const double c = a * cos(angle), s = a * sin(angle);
                    const double x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * c - x2 * s;
                    v[i + half] = x2 * c + x1 * s;
                }
            }
}

/* Causal grouped-query attention: out [B, T, Hq, hd] from q [B, T, Hq, hd]
 * and k, v [B, T, Hkv, hd]; query head h reads kv head h / (Hq / Hkv);
 * scores scaled by 1/sqrt(hd), softmax over positions s <= t, and s > t -
 * window when window > 0 (a sliding window). probs [B, Hq, T, T], unless
 * NULL, gets the probabilities, zeros outside each row's keys. */
static inline void ref_attention(double *out, double *probs, const double *q, const double *k, const double *v,
                                 int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window) {
    const int64_t group = Hq / Hkv;
    const double scale = 1.0 / sqrt((double)hd);
    double *p = ref_alloc((size_t)T * sizeof *p);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            const int64_t g = h / group;
            for (int64_t t = 0; t < T; t++) {
                const double *qt = q + ((b * T + t) * Hq + h) * hd;
                const int64_t lo = window > 0 && t >= window ? t - window + 1 : 0;
                double mx = -INFINITY, sum = 0.0;
                for (int64_t s = lo; s <= t; s++) {
                    const double *ks = k + ((b * T + s) * Hkv + g) * hd;
                    double dot = 0.0;
                    for (int64_t i = 0; i < hd; i++) dot += qt[i] * ks[i];
                    p[s] = dot * scale;
                    mx = fmax(mx, p[s]);
                }
                for (int64_t s = lo; s <= t; s++) sum += (p[s] = exp(p[s] - mx));
                double *o = out + ((b * T + t) * Hq + h) * hd;
                for (int64_t s = 0; probs && s < T; s++)
                    probs[((b * Hq + h) * T + t) * T + s] = s >= lo && s <= t ? p[s] / sum : 0.0;
                for (int64_t i = 0; i < hd; i++) o[i] = 0.0;
                for (int64_t s = lo; s <= t; s++) {
                    const double *vs = v + ((b * T + s) * Hkv + g) * hd;
                    for (int64_t i = 0; i < hd; i++) o[i] += p[s] / sum * vs[i];
                }
            }
        }
    free(p);
}

/* ---------------------------------------------------------------- model */

/* Offsets (into ref_model.p) of one decoder layer's tensors. */
/* The tests' tiny model: hidden 8, ff 6, 4 query heads over 2 kv heads of
 * 4, 4 experts top-2, aux and z losses on; layers and shared experts as
 * given. */
static inline moe_model_config ref_tiny_config(int64_t vocab, int64_t layers, int64_t shared_experts) {
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, vocab);
    cfg.hidden_size = 8;
    cfg.intermediate_size = 6;
    cfg.num_hidden_layers = layers;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 4;
    cfg.num_local_experts = 4;
    cfg.num_experts_per_tok = 2;
    cfg.router_aux_loss_coef = 0.1;
    cfg.moe_z_loss_coef = 0.01;
    cfg.moe_n_shared_experts = shared_experts;
    return cfg;
}

typedef struct ref_model_layer {
    int64_t ln1, wq, wk, wv, wo, ln2; /* attention half */
    int64_t q_norm, k_norm;           /* -1 without moe_qk_norm */
    int64_t bq, bk, bv;               /* -1 without moe_qkv_bias */
    int64_t gate;                     /* [E, C] */
    int64_t *w1, *w3, *w2;            /* [E] offsets of [ff, C], [ff, C], [C, ff] */
    int64_t sg, su, sd;               /* shared experts, -1 when none */
    int64_t sgate;                    /* their gate, -1 when none */
    /* A dense layer (moe_model_config_layer_is_dense): its MLP's gate, up
     * and down projections in place of everything from gate on. */
    bool dense;
    int64_t mg, mu, md;
    /* The MoE block as ref_moe.h sees it: its weight arrays are copies
     * gathered from p before every forward. */
    ref_layer moe;
    ref_out route;       /* routing of the latest forward */
    ref_out saved_route; /* routing kept by ref_model_save_routing */
} ref_model_layer;

typedef struct ref_model {
    moe_model_config cfg;
    int64_t B, T, N;
    int64_t n_params;
    double *p;           /* [n_params], the model's parameter layout */
    int64_t embed;       /* [V, C] */
    int64_t final_norm;  /* [C] */
    int64_t lm_head;     /* [V, C] */
    ref_model_layer *layers; /* [L] */
    double logit_z_coef;     /* the logits' z-loss (moe_model_set_logit_z_loss) */
} ref_model;

typedef struct ref_model_loss {
    double loss;    /* ce + the coefficients times logit_z, aux, seq_aux and z */
    double ce;      /* mean over positions whose target is >= 0 */
    double logit_z; /* mean over them of logsumexp(logits)^2 */
    double aux;     /* mean over the MoE layers of E * sum_e f_e P_e */
    double seq_aux; /* the same of the per-sequence sums' mean */
    double z;       /* mean over the MoE layers of mean_t lse_t^2 */
} ref_model_loss;

/* The offset of the tensor named by fmt, asserting it exists with the
 * expected shape (rows, cols; cols = 1 for a vector). */
static inline int64_t ref_model_offset(const moe_model *m, int64_t rows, int64_t cols, const char *fmt, ...)
    MOE_PRINTF(4, 5);

static inline int64_t ref_model_offset(const moe_model *m, int64_t rows, int64_t cols, const char *fmt, ...) {
    char name[MOE_TENSOR_NAME_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    const moe_model_tensor *t = moe_model_find_tensor(m, name);
    cr_assert(t != NULL, "the model has no tensor named %s", name);
    cr_assert(t->shape[0] == rows && t->shape[1] == cols && t->numel == rows * cols,
              "%s is [%lld, %lld] (%lld elements), the specification says [%lld, %lld]", name,
              (long long)t->shape[0], (long long)t->shape[1], (long long)t->numel, (long long)rows,
              (long long)cols);
    return t->offset;
}

/* Copies the model's fp32 parameters into r->p. */
static inline void ref_model_sync(ref_model *r, moe_model *m) {
    const float *p = moe_model_params(m);
    for (int64_t i = 0; i < r->n_params; i++) r->p[i] = p[i];
}

/* Builds the reference twin of m (shapes from its config, parameters read
 * by Hugging Face name) for batches of B sequences of T tokens. */
static inline void ref_model_init(ref_model *r, moe_model *m) {
    memset(r, 0, sizeof *r);
    const moe_model_config *c = moe_model_get_config(m);
    r->cfg = *c;
    r->B = moe_model_batch_size(m);
    r->T = moe_model_seq_len(m);
    r->N = r->B * r->T;
    r->n_params = moe_model_param_count(m);
    r->p = ref_alloc((size_t)r->n_params * sizeof *r->p);
    const int64_t C = c->hidden_size, V = c->vocab_size, hd = c->head_dim, ff = c->intermediate_size;
    const int64_t E = c->num_local_experts, k = c->num_experts_per_tok, L = c->num_hidden_layers;
    const int64_t qdim = c->num_attention_heads * hd, kvdim = c->num_key_value_heads * hd;
    const int64_t S =
        c->moe_n_shared_experts * (c->moe_shared_intermediate_size ? c->moe_shared_intermediate_size : ff);
    cr_assert(E <= 64, "ref_moe.h supports E <= 64");
    r->embed = ref_model_offset(m, V, C, "model.embed_tokens.weight");
    r->final_norm = ref_model_offset(m, C, 1, "model.norm.weight");
    /* Tied, the head is the embedding: one tensor, both uses. */
    r->lm_head = r->cfg.tie_word_embeddings ? r->embed : ref_model_offset(m, V, C, "lm_head.weight");
    r->layers = ref_alloc((size_t)L * sizeof *r->layers);
    for (int64_t l = 0; l < L; l++) {
        ref_model_layer *y = &r->layers[l];
        const long long ll = (long long)l;
        y->ln1 = ref_model_offset(m, C, 1, "model.layers.%lld.input_layernorm.weight", ll);
        y->wq = ref_model_offset(m, qdim, C, "model.layers.%lld.self_attn.q_proj.weight", ll);
        y->wk = ref_model_offset(m, kvdim, C, "model.layers.%lld.self_attn.k_proj.weight", ll);
        y->wv = ref_model_offset(m, kvdim, C, "model.layers.%lld.self_attn.v_proj.weight", ll);
        y->wo = ref_model_offset(m, C, qdim, "model.layers.%lld.self_attn.o_proj.weight", ll);
        y->ln2 = ref_model_offset(m, C, 1, "model.layers.%lld.post_attention_layernorm.weight", ll);
        y->q_norm = y->k_norm = -1;
        /* Qwen3's norms are head_dim wide, OLMoE's the projections' width. */
        const bool per_head = c->moe_qk_norm == MOE_QK_NORM_PER_HEAD;
        if (c->moe_qk_norm != MOE_QK_NORM_NONE) {
            y->q_norm = ref_model_offset(m, per_head ? hd : qdim, 1, "model.layers.%lld.self_attn.q_norm.weight", ll);
            y->k_norm = ref_model_offset(m, per_head ? hd : kvdim, 1, "model.layers.%lld.self_attn.k_norm.weight", ll);
        }
        y->bq = y->bk = y->bv = -1;
        if (c->moe_qkv_bias) {
            y->bq = ref_model_offset(m, qdim, 1, "model.layers.%lld.self_attn.q_proj.bias", ll);
            y->bk = ref_model_offset(m, kvdim, 1, "model.layers.%lld.self_attn.k_proj.bias", ll);
            y->bv = ref_model_offset(m, kvdim, 1, "model.layers.%lld.self_attn.v_proj.bias", ll);
        }
        y->dense = moe_model_config_layer_is_dense(c, l);
        if (y->dense) {
            const int64_t F = c->moe_dense_intermediate_size ? c->moe_dense_intermediate_size : ff;
            y->mg = ref_model_offset(m, F, C, "model.layers.%lld.mlp.gate_proj.weight", ll);
            y->mu = ref_model_offset(m, F, C, "model.layers.%lld.mlp.up_proj.weight", ll);
            y->md = ref_model_offset(m, C, F, "model.layers.%lld.mlp.down_proj.weight", ll);
            continue;
        }
        y->gate = ref_model_offset(m, E, C, "model.layers.%lld.block_sparse_moe.gate.weight", ll);
        y->w1 = ref_alloc((size_t)E * sizeof *y->w1);
        y->w3 = ref_alloc((size_t)E * sizeof *y->w3);
        y->w2 = ref_alloc((size_t)E * sizeof *y->w2);
        for (int64_t e = 0; e < E; e++) {
            const long long ee = (long long)e;
            y->w1[e] = ref_model_offset(m, ff, C, "model.layers.%lld.block_sparse_moe.experts.%lld.w1.weight", ll, ee);
            y->w3[e] = ref_model_offset(m, ff, C, "model.layers.%lld.block_sparse_moe.experts.%lld.w3.weight", ll, ee);
            y->w2[e] = ref_model_offset(m, C, ff, "model.layers.%lld.block_sparse_moe.experts.%lld.w2.weight", ll, ee);
        }
        y->sg = y->su = y->sd = y->sgate = -1;
        if (c->moe_shared_expert_gate)
            y->sgate = ref_model_offset(m, 1, C, "model.layers.%lld.block_sparse_moe.shared_expert_gate.weight", ll);
        if (S > 0) {
            y->sg = ref_model_offset(m, S, C, "model.layers.%lld.block_sparse_moe.shared_experts.gate_proj.weight", ll);
            y->su = ref_model_offset(m, S, C, "model.layers.%lld.block_sparse_moe.shared_experts.up_proj.weight", ll);
            y->sd = ref_model_offset(m, C, S, "model.layers.%lld.block_sparse_moe.shared_experts.down_proj.weight", ll);
        }
        y->moe = (ref_layer){.d = C,
                             .ff = ff,
                             .E = E,
                             .k = k,
                             .shared_ff = S,
                             .gate = c->moe_gate,
                             .renormalize = c->moe_renormalize,
                             .routed_scale = c->moe_routed_scaling_factor,
                             .capacity_factor = c->moe_capacity_factor,
                             .aux_loss_coef = c->router_aux_loss_coef,
                             .z_loss_coef = c->moe_z_loss_coef,
                             .seq_aux_loss_coef = c->moe_seq_aux_loss_coef,
                             .seq_len = c->moe_seq_aux_loss_coef > 0.0 ? r->T : 0,
                             .bias = NULL};
        y->moe.wg = ref_alloc((size_t)(E * C) * sizeof(double));
        y->moe.w1 = ref_alloc((size_t)(E * ff * C) * sizeof(double));
        y->moe.w3 = ref_alloc((size_t)(E * ff * C) * sizeof(double));
        y->moe.w2 = ref_alloc((size_t)(E * C * ff) * sizeof(double));
        y->moe.sg = ref_alloc((size_t)(S * C) * sizeof(double));
        y->moe.su = ref_alloc((size_t)(S * C) * sizeof(double));
        y->moe.sd = ref_alloc((size_t)(C * S) * sizeof(double));
        if (y->sgate >= 0) y->moe.sgate = ref_alloc((size_t)C * sizeof(double));
        y->route = ref_out_alloc(r->N, E, k);
        y->saved_route = ref_out_alloc(r->N, E, k);
    }
    ref_model_sync(r, m);
}

static inline void ref_model_free(ref_model *r) {
    for (int64_t l = 0; l < r->cfg.num_hidden_layers; l++) {
        ref_model_layer *y = &r->layers[l];
        free(y->w1);
        free(y->w3);
        free(y->w2);
        free(y->moe.wg);
        free(y->moe.w1);
        free(y->moe.w3);
        free(y->moe.w2);
        free(y->moe.sg);
        free(y->moe.su);
        free(y->moe.sd);
        free(y->moe.sgate);
        ref_out_free(&y->route);
        ref_out_free(&y->saved_route);
    }
    free(r->layers);
    free(r->p);
    memset(r, 0, sizeof *r);
}

/* Copies layer y's MoE weights from p into the contiguous arrays ref_layer
 * expects. */
static inline void ref_model_gather_moe(ref_model_layer *y, const double *p) {
    const ref_layer *M = &y->moe;
    const int64_t C = M->d, ff = M->ff, S = M->shared_ff;
    memcpy(M->wg, p + y->gate, (size_t)(M->E * C) * sizeof(double));
    for (int64_t e = 0; e < M->E; e++) {
        memcpy(M->w1 + e * ff * C, p + y->w1[e], (size_t)(ff * C) * sizeof(double));
        memcpy(M->w3 + e * ff * C, p + y->w3[e], (size_t)(ff * C) * sizeof(double));
        memcpy(M->w2 + e * C * ff, p + y->w2[e], (size_t)(C * ff) * sizeof(double));
    }
    if (S > 0) {
        memcpy(M->sg, p + y->sg, (size_t)(S * C) * sizeof(double));
        memcpy(M->su, p + y->su, (size_t)(S * C) * sizeof(double));
        memcpy(M->sd, p + y->sd, (size_t)(C * S) * sizeof(double));
    }
    if (M->sgate) memcpy(M->sgate, p + y->sgate, (size_t)C * sizeof(double));
}

/* The model's forward at the parameters in r->p, over inputs [B, T] with
 * targets [B, T] (< 0: ignored). Returns the total loss and fills out (may
 * be NULL) and losses [N] (per-position cross-entropy, 0 where ignored; may
 * be NULL). Each layer's routing lands in layers[l].route. */
static inline double ref_model_forward(ref_model *r, ref_model_loss *out, double *losses, const int32_t *inputs,
                                       const int32_t *targets) {
    const moe_model_config *c = &r->cfg;
    const int64_t B = r->B, T = r->T, N = r->N, C = c->hidden_size, V = c->vocab_size, hd = c->head_dim;
    const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads, L = c->num_hidden_layers;
    const int64_t qdim = Hq * hd, kvdim = Hkv * hd;
    const double *p = r->p;
    double *x = ref_alloc((size_t)(N * C) * sizeof *x);     /* residual stream */
    double *h = ref_alloc((size_t)(N * C) * sizeof *h);     /* normed */
    double *y = ref_alloc((size_t)(N * C) * sizeof *y);     /* block output */
    double *q = ref_alloc((size_t)(N * qdim) * sizeof *q);
    double *k = ref_alloc((size_t)(N * kvdim) * sizeof *k);
    double *v = ref_alloc((size_t)(N * kvdim) * sizeof *v);
    double *att = ref_alloc((size_t)(N * qdim) * sizeof *att);
    double *logits = ref_alloc((size_t)V * sizeof *logits);
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < C; i++) x[n * C + i] = p[r->embed + inputs[n] * C + i];
    double aux = 0.0, seq_aux = 0.0, z = 0.0;
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < L; l++) moe_layers += !r->layers[l].dense;
    for (int64_t l = 0; l < L; l++) {
        ref_model_layer *ly = &r->layers[l];
        ref_rmsnorm(h, x, p + ly->ln1, c->rms_norm_eps, N, C);
        ref_linear(q, h, p + ly->wq, N, C, qdim);
        ref_linear(k, h, p + ly->wk, N, C, kvdim);
        ref_linear(v, h, p + ly->wv, N, C, kvdim);
        for (int64_t n = 0; c->moe_qkv_bias && n < N; n++) {
            for (int64_t i = 0; i < qdim; i++) q[n * qdim + i] += p[ly->bq + i];
            for (int64_t i = 0; i < kvdim; i++) k[n * kvdim + i] += p[ly->bk + i], v[n * kvdim + i] += p[ly->bv + i];
        }
        if (c->moe_qk_norm == MOE_QK_NORM_PER_HEAD) { /* Qwen3's: each head on its own */
            ref_rmsnorm(q, q, p + ly->q_norm, c->rms_norm_eps, N * Hq, hd);
            ref_rmsnorm(k, k, p + ly->k_norm, c->rms_norm_eps, N * Hkv, hd);
        } else if (c->moe_qk_norm == MOE_QK_NORM_ACROSS_HEADS) { /* OLMoE's: each token's whole q and k */
            ref_rmsnorm(q, q, p + ly->q_norm, c->rms_norm_eps, N, qdim);
            ref_rmsnorm(k, k, p + ly->k_norm, c->rms_norm_eps, N, kvdim);
        }
        ref_rope(q, B, T, Hq, hd, c->rope_theta, &c->rope_scaling);
        ref_rope(k, B, T, Hkv, hd, c->rope_theta, &c->rope_scaling);
        ref_attention(att, NULL, q, k, v, B, T, Hq, Hkv, hd, c->sliding_window);
        ref_linear(y, att, p + ly->wo, N, qdim, C);
        for (int64_t i = 0; i < N * C; i++) x[i] += y[i];
        ref_rmsnorm(h, x, p + ly->ln2, c->rms_norm_eps, N, C);
        if (ly->dense) { /* down(silu(gate h) * up h), a row at a time */
            const int64_t F = c->moe_dense_intermediate_size ? c->moe_dense_intermediate_size : c->intermediate_size;
            double *a = ref_alloc((size_t)F * sizeof *a), *b = ref_alloc((size_t)F * sizeof *b);
            for (int64_t n = 0; n < N; n++) {
                ref_linear(a, h + n * C, p + ly->mg, 1, C, F);
                ref_linear(b, h + n * C, p + ly->mu, 1, C, F);
                for (int64_t i = 0; i < F; i++) a[i] = a[i] / (1.0 + exp(-a[i])) * b[i];
                ref_linear(y + n * C, a, p + ly->md, 1, F, C);
            }
            free(a);
            free(b);
            for (int64_t i = 0; i < N * C; i++) x[i] += y[i];
            continue;
        }
        ref_model_gather_moe(ly, p);
        /* The MoE block routes all B*T tokens as one batch (capacity too). */
        ref_layer_forward(y, &ly->route, &ly->moe, h, N);
        for (int64_t i = 0; i < N * C; i++) x[i] += y[i];
        aux += ly->route.aux / (double)moe_layers;
        seq_aux += ly->route.seq_aux / (double)moe_layers;
        z += ly->route.z / (double)moe_layers;
    }
    ref_rmsnorm(h, x, p + r->final_norm, c->rms_norm_eps, N, C);
    double ce = 0.0, logit_z = 0.0;
    int64_t counted = 0;
    for (int64_t n = 0; n < N; n++) {
        if (losses) losses[n] = 0.0;
        if (targets[n] < 0) continue;
        ref_linear(logits, h + n * C, p + r->lm_head, 1, C, V);
        double mx = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < V; j++) mx = fmax(mx, logits[j]);
        for (int64_t j = 0; j < V; j++) sum += exp(logits[j] - mx);
        const double lse = mx + log(sum), loss = lse - logits[targets[n]];
        if (losses) losses[n] = loss;
        ce += loss;
        logit_z += lse * lse;
        counted++;
    }
    ce = counted ? ce / (double)counted : 0.0;
    logit_z = counted ? logit_z / (double)counted : 0.0;
    free(x);
    free(h);
    free(y);
    free(q);
    free(k);
    free(v);
    free(att);
    free(logits);
    const double total = ce + r->logit_z_coef * logit_z + c->router_aux_loss_coef * aux +
                         c->moe_seq_aux_loss_coef * seq_aux + c->moe_z_loss_coef * z;
    if (out)
        *out = (ref_model_loss){
            .loss = total, .ce = ce, .logit_z = logit_z, .aux = aux, .seq_aux = seq_aux, .z = z};
    return total;
}

/* Keeps the latest forward's routing (chosen experts and kept pairs). */
static inline void ref_model_save_routing(ref_model *r) {
    const int64_t k = r->cfg.num_experts_per_tok;
    for (int64_t l = 0; l < r->cfg.num_hidden_layers; l++) {
        ref_model_layer *y = &r->layers[l];
        if (y->dense) continue;
        memcpy(y->saved_route.idx, y->route.idx, (size_t)(r->N * k) * sizeof *y->route.idx);
        memcpy(y->saved_route.kept, y->route.kept, (size_t)(r->N * k) * sizeof *y->route.kept);
    }
}

/* Whether the latest forward routed every layer as the saved one did: if
 * not, the loss is not differentiable between the two parameter points. */
static inline int ref_model_same_routing(const ref_model *r) {
    for (int64_t l = 0; l < r->cfg.num_hidden_layers; l++)
        if (!r->layers[l].dense && !ref_same_routing(&r->layers[l].route, &r->layers[l].saved_route, r->N, r->cfg.num_experts_per_tok))
            return 0;
    return 1;
}

#endif /* MOE_TESTS_REF_MODEL_H */
