/*
 * pack_core.c -- CPU fast path of the weight push (services/common/weight_sync/native.py).
 *
 * ws_pack_sum: pack tensors into a bucket and checksum them in ONE pass over the bytes.
 * On a CPU push the link (gloo over loopback, or a NIC) is driven by transport threads on
 * the same cores, so every byte the packing touches is taken from them: the torch path copies
 * (read + write, plus the read-for-ownership of the destination) and then sums the bucket
 * again. Here each 64-byte block is loaded once, summed in registers and written with
 * non-temporal stores (no read-for-ownership, no eviction of what the transport reads).
 *
 * ws_sum: the checksums alone (a sent-in-place tensor, a received bucket), one call for a
 * whole bucket instead of one torch reduction per tensor.
 *
 * Checksum (see buckets.py): sum64 = wrapping sum of the little-endian 64-bit words of an
 * extent [start, end), end - start a multiple of 8. Plain C99 + SSE2; no CPython API (ctypes).
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { WS_OK = 0, WS_ERR_EXTENT = -1 };

/* Sum of n bytes (n a multiple of 8) at p. */
static uint64_t sum_words(const uint8_t *p, int64_t n)
{
    uint64_t acc = 0;
    int64_t i = 0;
#if defined(__SSE2__)
    __m128i a0 = _mm_setzero_si128(), a1 = _mm_setzero_si128();
    for (; i + 64 <= n; i += 64) {
        a0 = _mm_add_epi64(a0, _mm_loadu_si128((const __m128i *)(p + i)));
        a1 = _mm_add_epi64(a1, _mm_loadu_si128((const __m128i *)(p + i + 16)));
        a0 = _mm_add_epi64(a0, _mm_loadu_si128((const __m128i *)(p + i + 32)));
        a1 = _mm_add_epi64(a1, _mm_loadu_si128((const __m128i *)(p + i + 48)));
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(a0, a1));
    acc = lanes[0] + lanes[1];
#endif
    for (; i < n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        acc += w;
    }
    return acc;
}

/* Copy n bytes (a multiple of 64) src -> dst and return their sum; dst 16-byte aligned. */
static uint64_t copy_sum_blocks(uint8_t *dst, const uint8_t *src, int64_t n)
{
#if defined(__SSE2__)
    __m128i a0 = _mm_setzero_si128(), a1 = _mm_setzero_si128();
    for (int64_t i = 0; i < n; i += 64) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i v1 = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i v2 = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i v3 = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), v0);
        _mm_stream_si128((__m128i *)(dst + i + 16), v1);
        _mm_stream_si128((__m128i *)(dst + i + 32), v2);
        _mm_stream_si128((__m128i *)(dst + i + 48), v3);
        a0 = _mm_add_epi64(_mm_add_epi64(a0, v0), v2);
        a1 = _mm_add_epi64(_mm_add_epi64(a1, v1), v3);
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(a0, a1));
    return lanes[0] + lanes[1];
#else
    memcpy(dst, src, (size_t)n);
    return sum_words(dst, n);
#endif
}

/*
 * Pack entry k: copy nbytes[k] bytes from src[k] to bucket + offset[k] (src[k] == NULL: the
 * bytes are in place already), zero the rest of its extent [offset[k] + nbytes[k], end[k])
 * (the alignment gap: deterministic bytes on the wire), and write the extent's sum64 to
 * sums[k]. Extents must lie in the bucket, start 64-byte aligned, and end a multiple of 8
 * bytes past the start, covering the tensor, at most 64 bytes past its last full block.
 * Returns WS_OK, or WS_ERR_EXTENT (nothing checked after the bad entry was written).
 */
int32_t ws_pack_sum(uint8_t *bucket, int64_t bucket_nbytes, int64_t n, const uint64_t *src,
                    const int64_t *offset, const int64_t *nbytes, const int64_t *end,
                    int64_t *sums)
{
    for (int64_t k = 0; k < n; k++) {
        int64_t off = offset[k], len = nbytes[k], stop = end[k];
        if (off < 0 || len < 0 || off % 64 || stop > bucket_nbytes || (stop - off) % 8 ||
            stop < off + len || stop - off - len / 64 * 64 > 64 ||
            ((uintptr_t)(bucket + off) & 15))
            return WS_ERR_EXTENT;
        uint8_t *dst = bucket + off;
        const uint8_t *from = src[k] ? (const uint8_t *)(uintptr_t)src[k] : NULL;
        int64_t body = len / 64 * 64;
        uint64_t acc = from ? copy_sum_blocks(dst, from, body) : sum_words(dst, body);
        uint8_t tail[64] = {0};
        int64_t rest = stop - off - body;
        if (from) memcpy(tail, from + body, (size_t)(len - body));
        else memcpy(tail, dst + body, (size_t)(len - body));
        memcpy(dst + body, tail, (size_t)rest);
        acc += sum_words(tail, rest);
        sums[k] = (int64_t)acc;
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the transport thread reads */
#endif
    return WS_OK;
}

/* sums[k] = sum64 of [start[k], end[k]) of buf; WS_ERR_EXTENT if an extent is malformed. */
int32_t ws_sum(const uint8_t *buf, int64_t buf_nbytes, int64_t n, const int64_t *start,
               const int64_t *end, int64_t *sums)
{
    for (int64_t k = 0; k < n; k++) {
        if (start[k] < 0 || end[k] < start[k] || end[k] > buf_nbytes || (end[k] - start[k]) % 8)
            return WS_ERR_EXTENT;
        sums[k] = (int64_t)sum_words(buf + start[k], end[k] - start[k]);
    }
    return WS_OK;
}
