#include "common/crc32c.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE4_2__) && defined(__x86_64__)
#include <nmmintrin.h>
#define MOE_CRC32C_SSE42 1
#endif

#define POLY 0x82F63B78u /* x^32 + x^28 + ... + 1, bit-reversed */

/* table[0] is the CRC of each byte value; table[k][b] is table[0][b]
 * carried through k more zero bytes, so 8 lookups advance the CRC by 8
 * bytes at once (Intel's slicing-by-8). Built once, on first use: 8 KiB,
 * far from worth listing in the source. */
static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (uint32_t b = 0; b < 256; b++) table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFF];
}

static inline uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint32_t moe_crc32c_tables(uint32_t crc, const void *data, size_t n) {
    pthread_once(&table_once, build_tables);
    const unsigned char *p = data;
    uint32_t c = ~crc;
    for (; n > 0 && ((uintptr_t)p & 7) != 0; n--) c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    for (; n >= 8; n -= 8, p += 8) {
        const uint32_t lo = c ^ le32(p), hi = le32(p + 4);
        c = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^ table[4][lo >> 24] ^
            table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^ table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
    }
    for (; n > 0; n--) c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

uint32_t moe_crc32c(uint32_t crc, const void *data, size_t n) {
#ifdef MOE_CRC32C_SSE42
    /* The instruction computes this very polynomial, 8 bytes at a time:
     * about 4x the tables' speed (9.7 against 2.2 GB/s on one core of an
     * EPYC), and every save and load of a checkpoint checksums all of it. */
    const unsigned char *p = data;
    uint64_t c = ~crc;
    for (; n > 0 && ((uintptr_t)p & 7) != 0; n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, sizeof v);
        c = _mm_crc32_u64(c, v);
    }
    for (; n > 0; n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
#else
    return moe_crc32c_tables(crc, data, n);
#endif
}
