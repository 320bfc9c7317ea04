/* rng.h: counter-based random numbers. A value depends only on (seed,
 * stream, index), never on which thread asks or in what order, so parallel
 * initialisation and noise are reproducible for any thread count. */
#ifndef MOE_COMMON_RNG_H
#define MOE_COMMON_RNG_H

#include <math.h>
#include <stdint.h>

#include "common/host_device.h" /* a device draws the host's bits */

MOE_HD uint64_t moe_splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

MOE_HD uint64_t moe_rng_bits(uint64_t seed, uint64_t stream, uint64_t index) {
    return moe_splitmix64(moe_splitmix64(seed ^ moe_splitmix64(stream)) + index);
}

/* Uniform in [0, 1) with 24 random bits: exactly representable in float. */
MOE_HD float moe_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    return (float)(moe_rng_bits(seed, stream, index) >> 40) * (1.0f / 16777216.0f);
}

/* Uniform in [0, 1) with 53 random bits, every double of the grid k 2^-53:
 * sampling from a large vocabulary (10^5 tokens and more) reaches tokens
 * whose probability is far below the 2^-24 steps of moe_rng_uniform. */
MOE_HD double moe_rng_uniform_double(uint64_t seed, uint64_t stream, uint64_t index) {
    return (double)(moe_rng_bits(seed, stream, index) >> 11) * (1.0 / 9007199254740992.0);
}

/* Standard normal by Box-Muller from two independent draws. */
MOE_HD float moe_rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t bits = moe_rng_bits(seed, stream, index);
    double u1 = ((double)(bits >> 40) + 1.0) / 16777217.0; /* (0, 1] */
    double u2 = (double)(bits & 0xFFFFFFull) / 16777216.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* lo + span * U[0, 1) as a float, the same bits wherever it is computed:
 * the 24-bit draw times a float is exact in double, so a fused multiply-add
 * and a separate one agree, and one rounding gives the float. */
MOE_HD float moe_rng_uniform_in(uint64_t seed, uint64_t stream, uint64_t index, float lo, float span) {
    return (float)((double)lo + (double)span * (double)moe_rng_uniform(seed, stream, index));
}

#endif /* MOE_COMMON_RNG_H */
