/* cpu_ops.h: the CPU implementations behind the op table (see ops.h for
 * what each computes). fp32, OpenBLAS for GEMMs, OpenMP for loops. */
#ifndef MOE_KERNELS_CPU_OPS_H
#define MOE_KERNELS_CPU_OPS_H

#include "kernels/ops.h"

/* Elements below which an elementwise or row loop runs on one thread: a
 * parallel region's fork and join cost more than such work (decoding's
 * rows of a few tokens), and far more when other processes hold cores. */
#define MOE_CPU_PAR_MIN ((int64_t)1 << 14)

/* One OpenBLAS call: inside a parallel region, one thread's. */
void moe_cpu_gemm(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k,
                  int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha,
                  float beta);
/* The op table's GEMM: small ones cut into row blocks the threads share
 * (gemm.c), whose bits do not depend on the number of threads (OpenBLAS's
 * own threads, for the rest, may round some shapes otherwise). */
void moe_cpu_gemm_split(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k, int64_t lda,
                        int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha, float beta);
void moe_cpu_gate_forward(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                          moe_gate_totals *totals, const float *logits, const float *bias,
                          const moe_gate_params *p, int64_t T);
void moe_cpu_gate_backward(float *dlogits, const float *dweights, const int32_t *topk_idx,
                           const float *topk_w, const float *prob, const float *lse,
                           const float *logits, const float *aux_grad, float z_coef_over_T,
                           const moe_gate_params *p, int64_t T);
void moe_cpu_gate_seq_stats(float *stats, const int32_t *topk_idx, const float *prob, const moe_gate_params *p,
                            int64_t T);
size_t moe_cpu_plan_scratch_bytes(int64_t T, int64_t k, int64_t E);
void moe_cpu_plan_build(int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets, const int32_t *topk_idx,
                        const int64_t *keep, void *scratch, int64_t T, int64_t k, int64_t E);
void moe_cpu_permute(float *xp, const float *x, const int64_t *row_token, int64_t n_rows,
                     int64_t d);
void moe_cpu_combine(float *y, const float *yp, const float *topk_w, const int64_t *pair_row,
                     const float *shared, int64_t T, int64_t k, int64_t d);
void moe_cpu_combine_backward(float *dyp, float *dweights, const float *dy, const float *yp,
                              const float *topk_w, const int64_t *pair_row, int64_t T, int64_t k,
                              int64_t d);
void moe_cpu_unpermute_add(float *dx, const float *dxp, const int64_t *pair_row, int64_t T,
                           int64_t k, int64_t d);
void moe_cpu_experts_forward(moe_expert_group *groups, int64_t n_groups, int64_t d);
void moe_cpu_experts_backward(moe_expert_group *groups, int64_t n_groups, int64_t d);

#endif /* MOE_KERNELS_CPU_OPS_H */
