/* shortest.h: a double in the fewest significant digits that read back as
 * it, for messages that must never print two different values alike. */
#ifndef MOE_COMMON_SHORTEST_H
#define MOE_COMMON_SHORTEST_H

#include <stdio.h>
#include <stdlib.h>

/* v into buf [size >= 32] (15 to 17 digits: %g drops trailing zeros, so
 * 0.1 stays "0.1"); returns buf. */
static inline const char *moe_shortest(char *buf, size_t size, double v) {
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(buf, size, "%.*g", digits, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

#endif /* MOE_COMMON_SHORTEST_H */
