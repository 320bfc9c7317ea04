#include "router/plan.h"

#include <math.h>

int64_t moe_capacity(double capacity_factor, int64_t T, int64_t k, int64_t E) {
    if (capacity_factor <= 0.0) return -1;
    return (int64_t)ceil(capacity_factor * (double)T * (double)k / (double)E);
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
