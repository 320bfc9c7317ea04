/* clock.h: the one wall clock the library times itself with. */
#ifndef MOE_COMMON_CLOCK_H
#define MOE_COMMON_CLOCK_H

/* Seconds on CLOCK_MONOTONIC: differences are elapsed time, unmoved by
 * changes to the date. */
double moe_monotonic_seconds(void);

#endif /* MOE_COMMON_CLOCK_H */
