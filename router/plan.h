/* plan.h: routing policy: capacity, what each rank keeps under it, and the
 * balancing terms that act on whole-batch counts rather than on single
 * tokens. The dispatch plan itself is an op (kernels/ops.h plan_build). */
#ifndef MOE_ROUTER_PLAN_H
#define MOE_ROUTER_PLAN_H

#include <stdint.h>

/* Rows each expert may take: ceil(cf * T * k / E) in exact arithmetic (a
 * quotient within a few ulp of an integer is that integer), or -1 for
 * dropless (cf = 0). */
int64_t moe_capacity(double capacity_factor, int64_t T, int64_t k, int64_t E);

/* kept [N]: the pairs each of N ranks keeps for expert e under capacity cap
 * (< 0: dropless), when every rank's pairs count against one capacity in
 * the order of the global batch (rank 0's tokens first); rank_assigned
 * [N, E] holds each rank's pairs per expert before capacity. With one rank
 * this is min(assigned, cap). Returns the pairs kept over all ranks. */
int64_t moe_keep_counts(int64_t *kept, const int64_t *rank_assigned, int64_t N, int64_t e, int64_t E, int64_t cap);

/* d(coef * aux)/d(prob[t, e]) for the Switch/GShard loss aux = E sum f_e P_e,
 * f_e = assigned_e / (T k), P_e = mean_t prob[t, e]: coef * E * f_e / T. */
void moe_aux_grad(float *aux_grad, const int64_t *assigned, int64_t T, int64_t k, int64_t E,
                  double coef);

/* Auxiliary-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean
 * load - load_e), so an overloaded expert becomes less attractive. */
void moe_bias_update(float *bias, const int64_t *assigned, int64_t E, double rate);

#endif /* MOE_ROUTER_PLAN_H */
