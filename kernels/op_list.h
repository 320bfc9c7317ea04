/* op_list.h: the queued ops of the op table (ops.h) as one list, for the
 * tables that wrap another one entry by entry: X(name, params, args) for
 * each op, with its parameter list and the argument list that passes them
 * on. Memory management, waits and the size queries are not in it: each
 * wrapper says what it does with those. */
#ifndef MOE_KERNELS_OP_LIST_H
#define MOE_KERNELS_OP_LIST_H

#define MOE_QUEUED_OPS(X)                                                                                        \
    X(copy, (void *dst, const void *src, size_t bytes), (dst, src, bytes))                                       \
    X(zero, (void *dst, size_t bytes), (dst, bytes))                                                             \
    X(gemm, (float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k, int64_t lda,             \
        int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha, float beta), (c, a, b, m, n, k, lda,  \
        ldb, ldc, trans_a, trans_b, alpha, beta))                                                                \
    X(gate_forward, (int32_t *topk_idx, float *topk_w, float *prob, float *lse, moe_gate_totals *totals,         \
        const float *logits, const float *bias, const moe_gate_params *p, int64_t T), (topk_idx, topk_w, prob,   \
        lse, totals, logits, bias, p, T))                                                                        \
    X(gate_backward, (float *dlogits, const float *dweights, const int32_t *topk_idx, const float *topk_w,       \
        const float *prob, const float *lse, const float *logits, const float *aux_grad, float z_coef_over_T,    \
        const moe_gate_params *p, int64_t T), (dlogits, dweights, topk_idx, topk_w, prob, lse, logits, aux_grad, \
        z_coef_over_T, p, T))                                                                                    \
    X(gate_seq_stats, (float *stats, const int32_t *topk_idx, const float *prob, const moe_gate_params *p,        \
        int64_t T), (stats, topk_idx, prob, p, T))                                                               \
    X(plan_build, (int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets, const int32_t *topk_idx,      \
        const int64_t *keep, void *scratch, int64_t T, int64_t k, int64_t E), (pair_row, row_token,              \
        expert_offsets, topk_idx, keep, scratch, T, k, E))                                                       \
    X(permute, (float *xp, const float *x, const int64_t *row_token, int64_t n_rows, int64_t d), (xp, x,         \
        row_token, n_rows, d))                                                                                   \
    X(combine, (float *y, const float *yp, const float *topk_w, const int64_t *pair_row, const float *shared,    \
        int64_t T, int64_t k, int64_t d), (y, yp, topk_w, pair_row, shared, T, k, d))                            \
    X(combine_backward, (float *dyp, float *dweights, const float *dy, const float *yp, const float *topk_w,     \
        const int64_t *pair_row, int64_t T, int64_t k, int64_t d), (dyp, dweights, dy, yp, topk_w, pair_row, T,  \
        k, d))                                                                                                   \
    X(unpermute_add, (float *dx, const float *dxp, const int64_t *pair_row, int64_t T, int64_t k, int64_t d),    \
        (dx, dxp, pair_row, T, k, d))                                                                            \
    X(experts_forward, (moe_expert_group *groups, int64_t n_groups, int64_t d), (groups, n_groups, d))           \
    X(experts_backward, (moe_expert_group *groups, int64_t n_groups, int64_t d), (groups, n_groups, d))          \
    X(embedding_forward, (float *out, const int32_t *tokens, const float *wte, int64_t N, int64_t C), (out,      \
        tokens, wte, N, C))                                                                                      \
    X(embedding_backward, (float *dwte, const float *dout, const int32_t *tokens, int64_t N, int64_t C), (dwte,  \
        dout, tokens, N, C))                                                                                     \
    X(rmsnorm_forward, (float *out, float *rstd, const float *inp, const float *weight, float eps, int64_t N,    \
        int64_t C), (out, rstd, inp, weight, eps, N, C))                                                         \
    X(rmsnorm_backward, (float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,  \
        const float *rstd, void *scratch, int64_t N, int64_t C), (dinp, dweight, dout, inp, weight, rstd,        \
        scratch, N, C))                                                                                          \
    X(matmul_forward, (float *out, const float *inp, const float *weight, int64_t N, int64_t C, int64_t OC),     \
        (out, inp, weight, N, C, OC))                                                                            \
    X(matmul_backward, (float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,   \
        int64_t N, int64_t C, int64_t OC), (dinp, dweight, dout, inp, weight, N, C, OC))                         \
    X(rope_forward, (float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t H,          \
        int64_t hd), (x, cos_t, sin_t, B, T, H, hd))                                                             \
    X(rope_backward, (float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t H,        \
        int64_t hd), (dx, cos_t, sin_t, B, T, H, hd))                                                            \
    X(attention_forward, (float *out, float *att, const float *q, const float *k, const float *v, int64_t B,     \
        int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, int64_t window), (out, att, q, k, v, B, T, Hq, Hkv, hd,  \
        window))                                                                                                 \
    X(attention_backward, (float *dq, float *dk, float *dv, float *datt, const float *dout, const float *q,      \
        const float *k, const float *v, const float *att, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,         \
        int64_t hd, int64_t window), (dq, dk, dv, datt, dout, q, k, v, att, B, T, Hq, Hkv, hd, window))          \
    X(attention_decode, (float *out, float *att, const float *q, const float *k, const float *v, int64_t T,      \
        int64_t Hq, int64_t Hkv, int64_t hd), (out, att, q, k, v, T, Hq, Hkv, hd))                               \
    X(crossentropy_forward, (float *losses, double *lse, const float *logits, const int32_t *targets, int64_t N, \
        int64_t V), (losses, lse, logits, targets, N, V))                                                        \
    X(crossentropy_backward, (float *dlogits, const float *logits, const double *lse, const int32_t *targets,    \
        const float *dloss, float z_coef, int64_t N, int64_t V), (dlogits, logits, lse, targets, dloss, z_coef,  \
        N, V))                                                                                                   \
    X(residual_forward, (float *out, const float *a, const float *b, int64_t n), (out, a, b, n))                 \
    X(residual_backward, (float *da, float *db, const float *dout, int64_t n), (da, db, dout, n))                \
    X(multiply, (float *out, const float *a, const float *b, int64_t n), (out, a, b, n))                         \
    X(sigmoid_gate_forward, (float *out, float *gate, const float *in, const float *logits, int64_t T,           \
        int64_t d), (out, gate, in, logits, T, d))                                                               \
    X(sigmoid_gate_backward, (float *din, float *dlogits, const float *dout, const float *out,                   \
        const float *gate, int64_t T, int64_t d), (din, dlogits, dout, out, gate, T, d))                         \
    X(uniform, (float *out, uint64_t seed, uint64_t stream, uint64_t first, float lo, float span, int64_t n),    \
        (out, seed, stream, first, lo, span, n))                                                                 \
    X(adamw, (float *params, float *m, float *v, const float *grads, float grad_scale, int64_t n,                \
        const moe_adamw_span *spans, int64_t n_spans, float lr, float beta1, float beta2, float eps,             \
        float weight_decay, int64_t t), (params, m, v, grads, grad_scale, n, spans, n_spans, lr, beta1, beta2,   \
        eps, weight_decay, t))                                                                                   \
    X(sumsq, (double *out, const float *x, int64_t n), (out, x, n))

#endif /* MOE_KERNELS_OP_LIST_H */
