/* ops.h: the table of compute ops that every backend fills (DESIGN.md 2).
 * The engine calls through the table and never asks which backend it has.
 * Argument order: outputs, inputs, sizes. Array pointers are the backend's
 * memory (host for the CPU, device for CUDA), from its alloc; structs and
 * sizes are host values. Ops that accumulate say so.
 *
 * Ops run in call order but may still be running when they return (a
 * device stream): the host reads results only through download, which
 * waits. An op cannot fail on good arguments; a failing one is kept, and
 * the next sync, upload or download reports the first. A device fault
 * shows at the next wait: a sync, a download or a large upload. */
#ifndef MOE_KERNELS_OPS_H
#define MOE_KERNELS_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

/* What the gating pass needs to know about the router. */
typedef struct moe_gate_params {
    int64_t n_experts; /* E */
    int64_t top_k;     /* k */
    moe_gate_kind kind;
    bool renormalize;
    int64_t n_groups;   /* > 1: group-limited routing (moe_layer_config in moe.h) */
    int64_t top_groups; /* groups a token's experts come from, with n_groups > 1 */
    float routed_scale; /* multiplies the weights after their normalisation; 1: none */
    /* Tokens per sequence of the sequence-wise balancing loss: gate_backward's
     * aux_grad holds a row per sequence, token t reading row t / aux_seq_len,
     * and gate_seq_stats sums per sequence. 0: aux_grad is one row for every
     * token. */
    int64_t aux_seq_len;
} moe_gate_params;

/* Per-token work arrays live on the stack, so the router has bounds. */
#define MOE_EXPERTS_MAX 1024
#define MOE_TOPK_MAX MOE_EXPERTS_MAX
#define MOE_GROUPS_MAX 64 /* expert groups of group-limited routing: bits of a mask */

/* Tokens per chunk of the gating pass: statistics are summed per chunk, then
 * the chunks in order, so they are the same for any thread count. */
#define MOE_GATE_CHUNK_TOKENS 64

/* Per-expert statistics of one gating pass, reduced over tokens. */
typedef struct moe_gate_totals {
    int64_t *assigned;     /* [E] (token, slot) pairs the router chose, pre-capacity */
    double *prob_sum;      /* [E] sum over tokens of the router probability */
    double *z_sum;         /* [1] sum over tokens of logsumexp(logits)^2 */
    double *chunk_scratch; /* [ceil(T / MOE_GATE_CHUNK_TOKENS), 2E + 1] */
} moe_gate_totals;

/* One SwiGLU expert applied to a contiguous range of rows:
 *   h = x w13^T, g = silu(h[:, :f]) * h[:, f:], y = g w2^T.
 * h, g and dh are the backend's own between its forward and backward: the
 * CPU's hold these fp32 values, a backend may keep them in a narrower
 * type (CUDA under bf16 math) in the same bytes.
 * w13 holds w1's f rows then w3's f rows, so one GEMM computes both. */
typedef struct moe_expert_group {
    int64_t rows;      /* n, may be 0 */
    int64_t d_ff;      /* f */
    const float *x;    /* [n, d] */
    const float *w13;  /* [2f, d] */
    const float *w2;   /* [d, f] */
    float *h;          /* [n, 2f] saved for backward, in the backend's format */
    float *g;          /* [n, f] saved for backward, in the backend's format */
    float *y;          /* [n, d] */
    /* backward only */
    const float *dy;   /* [n, d] */
    float *dh;         /* [n, 2f] scratch */
    float *dx;         /* [n, d], written */
    float *dw13;       /* [2f, d], accumulated */
    float *dw2;        /* [d, f], accumulated */
} moe_expert_group;

/* Parameters that AdamW's weight decay applies to or not, as consecutive
 * spans: span i covers [the end of span i - 1 (0 for the first), end). */
typedef struct moe_adamw_span {
    int64_t end;
    bool decays; /* false: norms' weights, which weight decay leaves alone */
} moe_adamw_span;

typedef struct moe_ops {
    const char *name;
    /* The host may read and write this backend's memory directly (the
     * CPU): a caller that needs values on the host may then use the arrays
     * themselves instead of downloaded copies. */
    bool host_visible;

    /* Memory. alloc gives zero-filled memory aligned to 256 bytes, or
     * MOE_ERR_OUT_OF_MEMORY naming the size; release(NULL) is a no-op.
     * upload returns once src may be reused, download once dst holds the
     * data; copy and zero are queued like ops. sync waits for every op so
     * far and reports the first failure. */
    moe_status (*alloc)(void **out, size_t bytes);
    void (*release)(void *p);
    moe_status (*upload)(void *dst, const void *src_host, size_t bytes);
    moe_status (*download)(void *dst_host, const void *src, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);
    void (*zero)(void *dst, size_t bytes);
    moe_status (*sync)(void);

    /* Timestamps in queue order, for a profile of the ops (kernels/
     * profile.h). marks_create makes n slots; mark(marks, i) stamps slot i
     * when the backend reaches that point of its queue, as an op would;
     * once a sync or download has passed both, mark_seconds gives the
     * seconds from slot from to slot to. */
    moe_status (*marks_create)(void **marks, int64_t n);
    void (*marks_destroy)(void *marks);
    void (*mark)(void *marks, int64_t i);
    moe_status (*mark_seconds)(double *seconds, const void *marks, int64_t from, int64_t to);

    /* c[m, n] = alpha * op(a) op(b) + beta * c, row-major, op(a) [m, k],
     * op(b) [k, n]; lda/ldb/ldc are row strides of the stored matrices. */
    void (*gemm)(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k,
                 int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha,
                 float beta);

    /* One pass per token over logits [T, E]: router probabilities prob
     * [T, E] (softmax, or sigmoid normalised over all experts), the top-k
     * chosen by score + bias (bias [E] or NULL; ties to the lower index),
     * their weights topk_w [T, k], lse [T] (logsumexp of the logits), and
     * the totals. totals are overwritten. */
    void (*gate_forward)(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                         moe_gate_totals *totals, const float *logits, const float *bias,
                         const moe_gate_params *p, int64_t T);

    /* dlogits [T, E] (written) from dweights [T, k], plus the balancing
     * losses: aux_grad = d(aux terms)/d(prob[t, e]), [E] the same for every
     * token, or with p->aux_seq_len [T / aux_seq_len, E] a row per sequence
     * (NULL: none); z_coef_over_T = z_loss_coef / T. */
    void (*gate_backward)(float *dlogits, const float *dweights, const int32_t *topk_idx,
                          const float *topk_w, const float *prob, const float *lse,
                          const float *logits, const float *aux_grad, float z_coef_over_T,
                          const moe_gate_params *p, int64_t T);

    /* The sequence-wise balancing loss's statistics: for each sequence q of
     * p->aux_seq_len tokens (T a multiple of it), stats [T / aux_seq_len,
     * 2E] gets the (token, slot) pairs the router chose per expert, then the
     * sum of its tokens' probabilities per expert (prob from gate_forward). */
    void (*gate_seq_stats)(float *stats, const int32_t *topk_idx, const float *prob,
                           const moe_gate_params *p, int64_t T);

    /* The dispatch plan: where every (token, slot) pair of topk_idx [T, k]
     * goes, a stable counting sort by expert, so each expert's rows are
     * contiguous and in token order. Pairs are taken in token order, then
     * slot order; expert e keeps its first keep[e] pairs (keep [E]) and
     * drops the rest. expert_offsets [E+1]: first row of each expert, [E] =
     * rows kept; pair_row [T*k]: the row of pair t*k+j, -1 if dropped;
     * row_token [T*k]: the token of each row, the first expert_offsets[E]
     * valid. scratch holds plan_scratch_bytes(T, k, E) bytes. */
    size_t (*plan_scratch_bytes)(int64_t T, int64_t k, int64_t E);
    void (*plan_build)(int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets, const int32_t *topk_idx,
                       const int64_t *keep, void *scratch, int64_t T, int64_t k, int64_t E);

    /* xp[r] = x[row_token[r]] for r < n_rows; xp [n_rows, d], x [T, d]. */
    void (*permute)(float *xp, const float *x, const int64_t *row_token, int64_t n_rows,
                    int64_t d);

    /* y[t] = sum_j topk_w[t, j] * yp[pair_row[t*k + j]] (+ shared[t]), in
     * slot order; pair_row -1 marks a dropped pair. shared may be NULL. */
    void (*combine)(float *y, const float *yp, const float *topk_w, const int64_t *pair_row,
                    const float *shared, int64_t T, int64_t k, int64_t d);

    /* Backward of combine: dyp[r] = w * dy[t] for each kept pair and
     * dweights [T, k] = <dy[t], yp[r]> (0 for dropped pairs). */
    void (*combine_backward)(float *dyp, float *dweights, const float *dy, const float *yp,
                             const float *topk_w, const int64_t *pair_row, int64_t T, int64_t k,
                             int64_t d);

    /* dx[t] += sum_j dxp[pair_row[t*k + j]] in slot order (kept pairs). */
    void (*unpermute_add)(float *dx, const float *dxp, const int64_t *pair_row, int64_t T,
                          int64_t k, int64_t d);

    /* The grouped SwiGLU experts, forward and backward, over n_groups. */
    void (*experts_forward)(moe_expert_group *groups, int64_t n_groups, int64_t d);
    void (*experts_backward)(moe_expert_group *groups, int64_t n_groups, int64_t d);

    /* The dense transformer ops; kernels/cpu/dense.h says what each does.
     * Backward ops accumulate into their input gradients. */
    void (*embedding_forward)(float *out, const int32_t *tokens, const float *wte, int64_t N, int64_t C);
    void (*embedding_backward)(float *dwte, const float *dout, const int32_t *tokens, int64_t N, int64_t C);
    void (*rmsnorm_forward)(float *out, float *rstd, const float *inp, const float *weight, float eps, int64_t N,
                            int64_t C);
    /* scratch: rmsnorm_scratch_bytes(N, C) bytes (the dweight reduction's). */
    size_t (*rmsnorm_scratch_bytes)(int64_t N, int64_t C);
    void (*rmsnorm_backward)(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                             const float *rstd, void *scratch, int64_t N, int64_t C);
    void (*matmul_forward)(float *out, const float *inp, const float *weight, int64_t N, int64_t C, int64_t OC);
    void (*matmul_backward)(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                            int64_t N, int64_t C, int64_t OC);
    void (*rope_forward)(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t H,
                         int64_t hd);
    void (*rope_backward)(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t H,
                          int64_t hd);
    /* att [B, Hq, T, T] is the backend's between forward and backward:
     * the CPU's holds the probabilities; a fused kernel may keep its own
     * state there (CUDA under bf16 math). datt is the backward's scratch.
     * Query t sees keys t - window + 1 .. t (a sliding window; 0: 0 .. t);
     * the backward gets the forward's window. */
    void (*attention_forward)(float *out, float *att, const float *q, const float *k, const float *v, int64_t B,
                              int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window);
    void (*attention_backward)(float *dq, float *dk, float *dv, float *datt, const float *dout, const float *q,
                               const float *k, const float *v, const float *att, int64_t B, int64_t T, int64_t Hq,
                               int64_t Hkv, int64_t hd, int64_t window);
    /* One query, at position T - 1 of one sequence, against that
     * sequence's keys and values [T, Hkv*hd] at positions 0 .. T - 1 (a
     * decoding step with a key-value cache): out [Hq*hd] is what
     * attention_forward gives at that position, to rounding. att [Hq, T] is
     * scratch. */
    void (*attention_decode)(float *out, float *att, const float *q, const float *k, const float *v, int64_t T,
                             int64_t Hq, int64_t Hkv, int64_t hd);
    void (*crossentropy_forward)(float *losses, double *lse, const float *logits, const int32_t *targets, int64_t N,
                                 int64_t V);
    /* The gradient of sum_n dloss[n] (CE_n + z_coef lse_n^2) over the rows
     * whose target is not negative: the logits' z-loss (PaLM's) rides on
     * each row's weight. */
    void (*crossentropy_backward)(float *dlogits, const float *logits, const double *lse, const int32_t *targets,
                                  const float *dloss, float z_coef, int64_t N, int64_t V);
    void (*residual_forward)(float *out, const float *a, const float *b, int64_t n);
    void (*residual_backward)(float *da, float *db, const float *dout, int64_t n);
    /* out[i] = a[i] * b[i]; out may be a or b. */
    void (*multiply)(float *out, const float *a, const float *b, int64_t n);
    /* Qwen2-MoE's gated shared expert, sigmoid(x . w) * shared(x) per
     * token: gate [T] = sigmoid(logits [T]) (kernels/moe_math.h's, fp32)
     * and out [T, d] = gate[t] * in[t, :]; out may be in. */
    void (*sigmoid_gate_forward)(float *out, float *gate, const float *in, const float *logits, int64_t T,
                                 int64_t d);
    /* The gradients of sum out * dout, WRITTEN (not accumulated): din [T, d]
     * = gate[t] * dout[t, :] and dlogits [T] = (1 - gate) <dout[t], out[t]>
     * (= gate (1 - gate) <dout[t], in[t]>), out being the forward's output,
     * so that the forward may write it over its input; din may be dout. The
     * dot is summed in a fixed order: the same bits on every run. */
    void (*sigmoid_gate_backward)(float *din, float *dlogits, const float *dout, const float *out,
                                  const float *gate, int64_t T, int64_t d);
    /* out[i] = moe_rng_uniform_in(seed, stream, first + i, lo, span)
     * (common/rng.h): the same bits on every backend, drawn where they are
     * used. */
    void (*uniform)(float *out, uint64_t seed, uint64_t stream, uint64_t first, float lo, float span, int64_t n);
    /* One AdamW step t over params [n] (dense.h says how), as one pass over
     * every tensor, on the gradients times grad_scale (gradient clipping's
     * factor, or 1): spans [n_spans] (backend memory) cover [0, n) and say
     * where weight_decay applies. */
    void (*adamw)(float *params, float *m, float *v, const float *grads, float grad_scale, int64_t n,
                  const moe_adamw_span *spans, int64_t n_spans, float lr, float beta1, float beta2, float eps,
                  float weight_decay, int64_t t);
    /* out [1] = sum of x[i]^2. */
    void (*sumsq)(double *out, const float *x, int64_t n);
} moe_ops;

/* Host memory and the kernels of kernels/cpu. */
const moe_ops *moe_cpu_ops(void);

/* The CPU ops on memory the host cannot touch outside an op: alloc maps it
 * with no access, and each table call opens every piece for the call's
 * length only. A host read or write of backend memory that a device
 * backend would not allow faults at once, so CPU tests check that the
 * engine keeps the device discipline. Slow (two mprotect per piece per
 * call); for tests. Not thread-safe: one thread drives it. */
const moe_ops *moe_strict_ops(void);

/* Waits (sync, upload, download) on moe_strict_ops that found ops called
 * since the previous wait: where a device stream would drain and idle
 * while the host catches up (at most: a device's small uploads need not
 * wait). A count since the process began. */
int64_t moe_strict_drains(void);

#endif /* MOE_KERNELS_OPS_H */
