/* CRC-32C against published check values, and against a bit-at-a-time
 * reference at every split point and alignment, for both the instruction's
 * path and the tables'. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "common/crc32c.h"

typedef uint32_t (*crc_fn)(uint32_t crc, const void *data, size_t n);

static const struct {
    const char *name;
    crc_fn fn;
} paths[] = {{"moe_crc32c", moe_crc32c}, {"moe_crc32c_tables", moe_crc32c_tables}};

/* The definition itself, one bit at a time: shares nothing with the code
 * under test but the polynomial. */
static uint32_t crc_bitwise(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

/* RFC 3720 (iSCSI) B.4's vectors and the usual check value. */
Test(crc32c, known_values) {
    unsigned char zeros[32] = {0}, ones[32], up[32], down[32];
    memset(ones, 0xFF, sizeof ones);
    for (int i = 0; i < 32; i++) up[i] = (unsigned char)i, down[i] = (unsigned char)(31 - i);
    const struct {
        const char *what;
        const void *data;
        size_t n;
        uint32_t want;
    } cases[] = {
        {"\"123456789\"", "123456789", 9, 0xE3069283u},
        {"32 zero bytes", zeros, 32, 0x8A9136AAu},
        {"32 0xFF bytes", ones, 32, 0x62A8AB43u},
        {"bytes 0..31", up, 32, 0x46DD794Eu},
        {"bytes 31..0", down, 32, 0x113FDB5Cu},
        {"nothing", "", 0, 0u},
    };
    for (size_t p = 0; p < sizeof paths / sizeof *paths; p++)
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            const uint32_t got = paths[p].fn(0, cases[i].data, cases[i].n);
            cr_expect_eq(got, cases[i].want, "%s of %s: 0x%08X, want 0x%08X", paths[p].name, cases[i].what, got,
                         cases[i].want);
            cr_expect_eq(crc_bitwise(cases[i].data, cases[i].n), cases[i].want, "the reference is wrong on %s",
                         cases[i].what);
        }
}

/* Every start offset (0..15, so every alignment of the 8-byte loop), every
 * length up to 80 and some longer, each split at every point into two calls
 * continued from the first's CRC: all equal to the reference. */
Test(crc32c, incremental_and_unaligned_match_the_reference) {
    enum { N = 1000 };
    static unsigned char buf[N + 16];
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sizeof buf; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        buf[i] = (unsigned char)(s >> 56);
    }
    static const size_t lengths[] = {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 80, 255, 513, 1000};
    int wrong = 0;
    for (size_t p = 0; p < sizeof paths / sizeof *paths; p++)
        for (size_t start = 0; start < 16; start++)
            for (size_t l = 0; l < sizeof lengths / sizeof *lengths; l++) {
                const size_t n = lengths[l];
                const unsigned char *d = buf + start;
                const uint32_t want = crc_bitwise(d, n);
                const uint32_t whole = paths[p].fn(0, d, n);
                if (whole != want && wrong++ < 5)
                    cr_expect_eq(whole, want, "%s at offset %zu, %zu bytes: 0x%08X, want 0x%08X", paths[p].name,
                                 start, n, whole, want);
                for (size_t cut = 0; cut <= n; cut += n > 80 ? 37 : 1) {
                    const uint32_t two = paths[p].fn(paths[p].fn(0, d, cut), d + cut, n - cut);
                    if (two != want && wrong++ < 5)
                        cr_expect_eq(two, want, "%s at offset %zu, %zu bytes cut at %zu: 0x%08X, want 0x%08X",
                                     paths[p].name, start, n, cut, two, want);
                }
            }
    cr_expect_eq(wrong, 0, "%d CRCs differ from the reference", wrong);
}

/* A CRC detects every single-bit error: flip each bit of a 64-byte block. */
Test(crc32c, every_single_bit_flip_changes_it) {
    unsigned char b[64];
    for (int i = 0; i < 64; i++) b[i] = (unsigned char)(i * 37 + 11);
    const uint32_t clean = moe_crc32c(0, b, sizeof b);
    for (int bit = 0; bit < 8 * 64; bit++) {
        b[bit / 8] ^= (unsigned char)(1u << (bit % 8));
        cr_expect_neq(moe_crc32c(0, b, sizeof b), clean, "flipping bit %d left the CRC unchanged", bit);
        b[bit / 8] ^= (unsigned char)(1u << (bit % 8));
    }
}
