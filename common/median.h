/* median.h: the median of a handful of timings. */
#ifndef MOE_COMMON_MEDIAN_H
#define MOE_COMMON_MEDIAN_H

#include <stdlib.h>

static inline int moe_compare_doubles(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v [n > 0] ascending and returns its lower middle value: the median
 * of an odd count; of an even one the lower of the two middle values, so
 * that one slow value of two stands against the other, not their mean. */
static inline double moe_sort_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, moe_compare_doubles);
    return v[(n - 1) / 2];
}

#endif /* MOE_COMMON_MEDIAN_H */
