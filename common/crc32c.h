/* crc32c.h: CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial
 * value and final xor 0xFFFFFFFF), the checksum of iSCSI, ext4 and SCTP,
 * which our safetensors writer records for each tensor (safetensors.h).
 * Its check value, the CRC of "123456789", is 0xE3069283. */
#ifndef MOE_COMMON_CRC32C_H
#define MOE_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* The CRC of data [n] continued from crc, the CRC of the bytes before it (0
 * to start): moe_crc32c(moe_crc32c(0, a, na), b, nb) is the CRC of a then b.
 * Uses the CPU's crc32 instruction where the build targets SSE4.2 (as the
 * x86-64-v3 build does), else tables; thread-safe. */
uint32_t moe_crc32c(uint32_t crc, const void *data, size_t n);

/* The same, always from the slicing-by-8 tables: the reference the
 * instruction's path is tested against. */
uint32_t moe_crc32c_tables(uint32_t crc, const void *data, size_t n);

#endif /* MOE_COMMON_CRC32C_H */
