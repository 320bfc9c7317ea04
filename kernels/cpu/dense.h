/* dense.h: the dense (non-MoE) ops of a Mixtral-style transformer on the CPU,
 * fp32, computing what Hugging Face MixtralForCausalLM computes.
 *
 * Conventions (llm.c): X_forward(out, ..., inp, ..., sizes) and
 * X_backward(dinp, dweight, ..., dout, inp, ..., sizes). Every backward
 * ACCUMULATES (+=) into its dinp and dweight, so the two branches of a
 * residual sum without a copy; the caller zeroes gradients once per step.
 * Three exceptions, each said again below: cross-entropy writes dlogits,
 * RoPE's backward rotates its gradient in place, and the shared expert's
 * sigmoid gate writes its two gradients.
 * Activations are row-major; N = B * T rows. The reductions written here
 * (embedding, RMSNorm, attention, the sigmoid gate's dot, sum of squares)
 * give the same bits for any OpenMP thread count; the matmuls are
 * OpenBLAS's. OpenBLAS takes 32-bit ints: each single dimension (not a
 * product) must fit in an int. */
#ifndef MOE_KERNELS_CPU_DENSE_H
#define MOE_KERNELS_CPU_DENSE_H

#include <stdint.h>

#include "kernels/ops.h"

/* out[n] = wte[tokens[n]]. 0 <= tokens[n] < V is the caller's invariant:
 * tokens are checked against vocab_size where they are read, not here. */
void moe_cpu_embedding_forward(float *out,            /* [N, C] */
                               const int32_t *tokens, /* [N] */
                               const float *wte,      /* [V, C] */
                               int64_t N, int64_t C);
/* dwte[tokens[n]] += dout[n], summed in increasing n for every element. */
void moe_cpu_embedding_backward(float *dwte,           /* [V, C] */
                                const float *dout,     /* [N, C] */
                                const int32_t *tokens, /* [N] */
                                int64_t N, int64_t C);

/* y = weight * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps) per row. */
void moe_cpu_rmsnorm_forward(float *out,          /* [N, C] */
                             float *rstd,         /* [N], saved for backward */
                             const float *inp,    /* [N, C] */
                             const float *weight, /* [C] */
                             float eps, int64_t N, int64_t C);
void moe_cpu_rmsnorm_backward(float *dinp,         /* [N, C] */
                              float *dweight,      /* [C] */
                              const float *dout,   /* [N, C] */
                              const float *inp,    /* [N, C] */
                              const float *weight, /* [C] */
                              const float *rstd,   /* [N] */
                              int64_t N, int64_t C);

/* out = inp weight^T, no bias (Mixtral has none). */
void moe_cpu_matmul_forward(float *out,          /* [N, OC] */
                            const float *inp,    /* [N, C] */
                            const float *weight, /* [OC, C] */
                            int64_t N, int64_t C, int64_t OC);
/* dinp += dout weight; dweight += dout^T inp. */
void moe_cpu_matmul_backward(float *dinp,         /* [N, C] */
                             float *dweight,      /* [OC, C] */
                             const float *dout,   /* [N, OC] */
                             const float *inp,    /* [N, C] */
                             const float *weight, /* [OC, C] */
                             int64_t N, int64_t C, int64_t OC);

/* In place, HF rotate_half: element i pairs with i + hd/2 (i < hd/2),
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, position t of each sequence. */
void moe_cpu_rope_forward(float *x,           /* [B, T, H, hd], in place */
                          const float *cos_t, /* [T, hd/2] */
                          const float *sin_t, /* [T, hd/2] */
                          int64_t B, int64_t T, int64_t H, int64_t hd);
/* The rotation is orthogonal, so its backward is the inverse rotation of
 * the gradient, in place (this one rewrites dx rather than accumulating). */
void moe_cpu_rope_backward(float *dx,          /* [B, T, H, hd], in place */
                           const float *cos_t, /* [T, hd/2] */
                           const float *sin_t, /* [T, hd/2] */
                           int64_t B, int64_t T, int64_t H, int64_t hd);

/* Causal grouped-query attention, softmax(q k^T / sqrt(hd)) v per head:
 * query head h reads kv head h / (Hq / Hkv); Hq % Hkv == 0. Query t sees
 * the keys t - window + 1 .. t (Mistral's sliding window; window 0: all of
 * 0 .. t). att keeps the probabilities (zero outside each row's keys) for
 * backward. */
void moe_cpu_attention_forward(float *out,     /* [B, T, Hq, hd] */
                               float *att,     /* [B, Hq, T, T] */
                               const float *q, /* [B, T, Hq, hd] */
                               const float *k, /* [B, T, Hkv, hd] */
                               const float *v, /* [B, T, Hkv, hd] */
                               int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window);
/* ops.h attention_decode: one query at position T - 1 against keys and
 * values at positions 0 .. T - 1. */
void moe_cpu_attention_decode(float *out,     /* [Hq, hd] */
                              float *att,     /* [Hq, T] scratch */
                              const float *q, /* [Hq, hd] */
                              const float *k, /* [T, Hkv, hd] */
                              const float *v, /* [T, Hkv, hd] */
                              int64_t T, int64_t Hq, int64_t Hkv, int64_t hd);
/* dq, dk, dv accumulate. datt is scratch (its input contents are ignored;
 * one buffer can serve every layer). */
void moe_cpu_attention_backward(float *dq,         /* [B, T, Hq, hd] */
                                float *dk,         /* [B, T, Hkv, hd] */
                                float *dv,         /* [B, T, Hkv, hd] */
                                float *datt,       /* [B, Hq, T, T] scratch */
                                const float *dout, /* [B, T, Hq, hd] */
                                const float *q,    /* [B, T, Hq, hd] */
                                const float *k,    /* [B, T, Hkv, hd] */
                                const float *v,    /* [B, T, Hkv, hd] */
                                const float *att,  /* [B, Hq, T, T] */
                                int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window);

/* losses[n] = lse[n] - logits[n, targets[n]], lse = logsumexp of the row
 * (max-subtracted, the sum in double). lse is kept in double because a
 * float would carry an absolute error of |lse| * 6e-8 into every
 * probability of the backward (5e-4 at logits of 1e4). A negative target
 * marks a row to ignore (HF ignore_index = -100): its loss and gradient
 * are 0. */
void moe_cpu_crossentropy_forward(float *losses,          /* [N] */
                                  double *lse,            /* [N], saved for backward */
                                  const float *logits,    /* [N, V] */
                                  const int32_t *targets, /* [N] */
                                  int64_t N, int64_t V);
/* dlogits = (softmax(logits) (1 + 2 z_coef lse[n]) - onehot(target)) *
 * dloss[n], the gradient of dloss[n] (CE_n + z_coef lse_n^2); dloss[n] is
 * the weight of row n in the total loss (1/N for a mean), rows with a
 * negative target none. WRITES dlogits, and dlogits may be logits itself:
 * the logits' only consumer is this loss, so the gradient can take their
 * memory. */
void moe_cpu_crossentropy_backward(float *dlogits,         /* [N, V], may alias logits */
                                   const float *logits,    /* [N, V] */
                                   const double *lse,      /* [N] */
                                   const int32_t *targets, /* [N] */
                                   const float *dloss,     /* [N] */
                                   float z_coef, int64_t N, int64_t V);

/* out = a + b elementwise; out may be a or b. */
void moe_cpu_residual_forward(float *out, const float *a, const float *b, int64_t n);
/* da += dout; db += dout. */
void moe_cpu_residual_backward(float *da, float *db, const float *dout, int64_t n);

/* out [n] = a * b elementwise (the router's jitter); out may alias a or b. */
void moe_cpu_multiply(float *out, const float *a, const float *b, int64_t n);

/* out [n] = lo + span * U[0, 1) from (seed, stream, first + i) (the router's
 * jitter factors), common/rng.h's moe_rng_uniform_in. */
void moe_cpu_uniform(float *out, uint64_t seed, uint64_t stream, uint64_t first, float lo, float span, int64_t n);

/* Qwen2-MoE's gated shared expert: gate[t] = sigmoid(logits[t]) and
 * out[t] = gate[t] * in[t]; out may alias in. The sigmoid is moe_math.h's
 * moe_sigmoidf, a few ulp from torch's fp32 one, both backends alike; its
 * exponential clamps at 88, so a logit below -88 gives a gate of 6e-39
 * where the exact one is smaller still. */
void moe_cpu_sigmoid_gate_forward(float *out,          /* [T, d] */
                                  float *gate,         /* [T], saved for backward */
                                  const float *in,     /* [T, d], the shared expert's output */
                                  const float *logits, /* [T] */
                                  int64_t T, int64_t d);
/* din = gate * dout and dlogits = (1 - gate) <dout[t], out[t]>, which is
 * gate (1 - gate) <dout[t], in[t]> without the input (the forward may have
 * written over it), the dot in double in column order. WRITES both, not
 * accumulating: the shared expert's output and the gate's logits have no
 * other consumer. din may alias dout. */
void moe_cpu_sigmoid_gate_backward(float *din,         /* [T, d] */
                                   float *dlogits,     /* [T] */
                                   const float *dout,  /* [T, d] */
                                   const float *out,   /* [T, d], the forward's output */
                                   const float *gate,  /* [T] */
                                   int64_t T, int64_t d);

/* One AdamW step t >= 1 over n parameters, PyTorch's torch.optim.AdamW,
 * with g = grads * grad_scale (fl(g * s), as scaling the gradients in
 * place would round it; s = 1 leaves them as they are):
 * p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
 * p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), with wd 0
 * in the spans that do not decay (spans cover [0, n), ops.h). */
void moe_cpu_adamw(float *params,                 /* [n] */
                   float *m,                      /* [n] first moment */
                   float *v,                      /* [n] second moment */
                   const float *grads,            /* [n] */
                   float grad_scale, int64_t n,
                   const moe_adamw_span *spans,   /* [n_spans] */
                   int64_t n_spans, float lr, float beta1, float beta2, float eps, float weight_decay,
                   int64_t t);

/* *out = sum of x[i]^2 in double, in fixed-size parts summed in order: the
 * same bits for any thread count (the global gradient norm is its root). */
void moe_cpu_sumsq(double *out, const float *x /* [n] */, int64_t n);

#endif /* MOE_KERNELS_CPU_DENSE_H */
