/* test_lcg.h: the random inputs of the emulated kernels' tests: a 64-bit
 * linear congruential generator, the same draws on every machine. */
#ifndef MOE_TESTS_TEST_LCG_H
#define MOE_TESTS_TEST_LCG_H

#include <cstddef>
#include <cstdint>
#include <vector>

struct lcg {
    uint64_t s;
    float next() { /* uniform in [-1, 1) */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (float)((s >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
    }
    std::vector<float> fill(size_t n, float scale) { /* n draws, times scale */
        std::vector<float> v(n);
        for (float &x : v) x = scale * next();
        return v;
    }
};

#endif /* MOE_TESTS_TEST_LCG_H */
