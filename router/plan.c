#include "router/plan.h"

#include <float.h>
#include <math.h>

int64_t moe_capacity(double capacity_factor, int64_t T, int64_t k, int64_t E) {
    if (capacity_factor <= 0.0) return -1;
    const double x = capacity_factor * (double)T * (double)k / (double)E, nearest = nearbyint(x);
    /* cf is a decimal that binary floating point holds only nearly, so an
     * exact quotient can land a few ulp above its integer (1.1 * 100 * 2 / 10
     * = 22.000000000000004): such a quotient is that integer. */
    if (fabs(x - nearest) <= 8.0 * DBL_EPSILON * nearest) return (int64_t)nearest;
    return (int64_t)ceil(x);
}

int64_t moe_keep_counts(int64_t *kept, const int64_t *rank_assigned, int64_t N, int64_t e, int64_t E, int64_t cap) {
    int64_t before = 0, total = 0;
    for (int64_t r = 0; r < N; r++) {
        const int64_t mine = rank_assigned[r * E + e], room = cap - before;
        kept[r] = cap < 0 ? mine : room <= 0 ? 0 : room < mine ? room : mine;
        before += mine;
        total += kept[r];
    }
    return total;
}

void moe_aux_grad(float *aux_grad, const int64_t *assigned, int64_t T, int64_t k, int64_t E,
                  double coef) {
    for (int64_t e = 0; e < E; e++)
        aux_grad[e] = (float)(coef * (double)E * ((double)assigned[e] / (double)(T * k)) / (double)T);
}

void moe_bias_update(float *bias, const int64_t *assigned, int64_t E, double rate) {
    double mean = 0.0;
    for (int64_t e = 0; e < E; e++) mean += (double)assigned[e];
    mean /= (double)E;
    for (int64_t e = 0; e < E; e++) {
        double err = mean - (double)assigned[e];
        bias[e] += (float)(rate * (err > 0.0 ? 1.0 : err < 0.0 ? -1.0 : 0.0));
    }
}
