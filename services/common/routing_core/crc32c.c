/* routing_core/crc32c.c -- CRC-32C of the blob (SSE4.2 instruction or table).
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

/* ------------------------------------------------------------------ CRC-32C */

static uint32_t crc32c_update(uint32_t crc, const uint8_t *p, size_t n)
{
#if defined(__SSE4_2__)
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    crc = (uint32_t)c;
    for (; n; n--) crc = _mm_crc32_u8(crc, *p++);
#else
    /* Portable bitwise fallback; only used where the SSE4.2 instruction is unavailable. */
    for (; n; n--) {
        crc ^= *p++;
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
    }
#endif
    return crc;
}

uint32_t r3_crc32c(const uint8_t *p, int64_t n)
{
    return ~crc32c_update(~0u, p, (size_t)n);
}

/* Checksum of a blob: header bytes before the CRC field, then the payload. */
static uint32_t blob_crc(const uint8_t *blob, size_t len)
{
    uint32_t c = crc32c_update(~0u, blob, HEADER_BYTES - 4);
    return ~crc32c_update(c, blob + HEADER_BYTES, len - HEADER_BYTES);
}
