/*
 * pack_core.c -- CPU fast path of the weight push (services/common/weight_sync/native.py).
 *
 * ws_pack_sum: pack tensors into a bucket and checksum them in ONE pass over the bytes.
 * On a CPU push the link (gloo over loopback, or a NIC) is driven by transport threads on
 * the same cores, so every byte the packing touches is taken from them: the torch path copies
 * (read + write, plus the read-for-ownership of the destination) and then sums the bucket
 * again. Here each 64-byte block is loaded once, summed in registers and written with
 * non-temporal stores (no read-for-ownership, no eviction of what the transport reads); the
 * `stream` flag switches to plain stores for A/B runs (bench_weights.py --pack-stores: on the
 * lent Intel Xeon plain stores slow the pack and do not speed the transport, BENCHMARKS.md).
 *
 * ws_sum: the checksums alone (a sent-in-place tensor, a received bucket), one call for a
 * whole bucket instead of one torch reduction per tensor; `threads` > 1 splits the bytes
 * among that many threads (the receiver's last bucket: nothing else runs then, and its sum is
 * all that stands between the last byte landing and the ack).
 *
 * Checksum (see buckets.py): sum64 = wrapping sum of the little-endian 64-bit words of an
 * extent [start, end), end - start a multiple of 8. C99 + SSE2; no CPython API (ctypes).
 *
 * Where the CPU has AVX-512 (AVX2: the sums), the passes use 64-byte (32-byte) loads and
 * stores, asked at run time (the build stays x86-64-v2; nothing depends on the vendor). One
 * core, cold 64 MiB buffers, on the lent machines' Intel Xeon: sums 9.0-11.8 -> 14.1-18.9
 * GB/s, copy + sum 7.1-10.8 -> 9.5-11.5 GB/s; on AMD EPYC (Zen 4) about the same either way.
 * On a 2-core push every byte these passes read is CPU taken from the transport threads.
 */
#define _POSIX_C_SOURCE 200809L /* pthreads under -std=c99 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WS_WIDE 1
#else
#define WS_WIDE 0
#endif

enum { WS_OK = 0, WS_ERR_EXTENT = -1 };

/* Sum of n bytes (n a multiple of 8) at p, 16-byte loads. */
static uint64_t sum_words_sse2(const uint8_t *p, int64_t n)
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

#if WS_WIDE
__attribute__((target("avx512f"))) static uint64_t sum_words_avx512(const uint8_t *p, int64_t n)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1)) +
           sum_words_sse2(p + i, n - i);
}

__attribute__((target("avx2"))) static uint64_t sum_words_avx2(const uint8_t *p, int64_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a0, a1));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_words_sse2(p + i, n - i);
}
#endif

/* Sum of n bytes (n a multiple of 8) at p: the widest loads the CPU supports, for extents
 * long enough to pay for the check. */
static uint64_t sum_words(const uint8_t *p, int64_t n)
{
#if WS_WIDE
    if (n >= 4096) {
        __builtin_cpu_init(); /* idempotent; fills the feature bits libgcc's checks read */
        if (__builtin_cpu_supports("avx512f")) return sum_words_avx512(p, n);
        if (__builtin_cpu_supports("avx2")) return sum_words_avx2(p, n);
    }
#endif
    return sum_words_sse2(p, n);
}

#if WS_WIDE
/* copy_sum_blocks with 64-byte loads and non-temporal stores; dst 64-byte aligned. */
__attribute__((target("avx512f"))) static uint64_t copy_sum_avx512(uint8_t *dst,
                                                                   const uint8_t *src, int64_t n,
                                                                   int stream)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    int64_t i = 0;
#define WS_COPY_SUM_512(STORE)                                                                 \
    for (; i + 128 <= n; i += 128) {                                                           \
        __m512i v0 = _mm512_loadu_si512((const void *)(src + i));                              \
        __m512i v1 = _mm512_loadu_si512((const void *)(src + i + 64));                         \
        STORE((void *)(dst + i), v0);                                                          \
        STORE((void *)(dst + i + 64), v1);                                                     \
        a0 = _mm512_add_epi64(a0, v0);                                                         \
        a1 = _mm512_add_epi64(a1, v1);                                                         \
    }                                                                                          \
    if (i < n) { /* one 64-byte block left */                                                  \
        __m512i v0 = _mm512_loadu_si512((const void *)(src + i));                              \
        STORE((void *)(dst + i), v0);                                                          \
        a0 = _mm512_add_epi64(a0, v0);                                                         \
    }
    if (stream) {
        WS_COPY_SUM_512(_mm512_stream_si512)
    } else {
        WS_COPY_SUM_512(_mm512_store_si512)
    }
#undef WS_COPY_SUM_512
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
}
#endif

/* Copy n bytes (a multiple of 64) src -> dst and return their sum; dst 16-byte aligned.
 * `stream`: non-temporal stores (the bytes go to memory, not the cache), else plain ones. */
static uint64_t copy_sum_blocks(uint8_t *dst, const uint8_t *src, int64_t n, int stream)
{
#if WS_WIDE
    if (n >= 4096 && !((uintptr_t)dst & 63)) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f")) return copy_sum_avx512(dst, src, n, stream);
    }
#endif
#if defined(__SSE2__)
    __m128i a0 = _mm_setzero_si128(), a1 = _mm_setzero_si128();
#define WS_COPY_SUM_128(STORE)                                                                 \
    for (int64_t i = 0; i < n; i += 64) {                                                      \
        __m128i v0 = _mm_loadu_si128((const __m128i *)(src + i));                              \
        __m128i v1 = _mm_loadu_si128((const __m128i *)(src + i + 16));                         \
        __m128i v2 = _mm_loadu_si128((const __m128i *)(src + i + 32));                         \
        __m128i v3 = _mm_loadu_si128((const __m128i *)(src + i + 48));                         \
        STORE((__m128i *)(dst + i), v0);                                                       \
        STORE((__m128i *)(dst + i + 16), v1);                                                  \
        STORE((__m128i *)(dst + i + 32), v2);                                                  \
        STORE((__m128i *)(dst + i + 48), v3);                                                  \
        a0 = _mm_add_epi64(_mm_add_epi64(a0, v0), v2);                                         \
        a1 = _mm_add_epi64(_mm_add_epi64(a1, v1), v3);                                         \
    }
    if (stream) {
        WS_COPY_SUM_128(_mm_stream_si128)
    } else {
        WS_COPY_SUM_128(_mm_store_si128)
    }
#undef WS_COPY_SUM_128
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(a0, a1));
    return lanes[0] + lanes[1];
#else
    (void)stream;
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
 * `stream` != 0: the copies use non-temporal stores, else plain (cached) ones.
 * Returns WS_OK, or WS_ERR_EXTENT (nothing checked after the bad entry was written).
 */
int32_t ws_pack_sum(uint8_t *bucket, int64_t bucket_nbytes, int64_t n, const uint64_t *src,
                    const int64_t *offset, const int64_t *nbytes, const int64_t *end,
                    int64_t *sums, int32_t stream)
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
        uint64_t acc = from ? copy_sum_blocks(dst, from, body, stream) : sum_words(dst, body);
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

/* The part of the concatenated extents a thread sums: bytes [lo, hi) of their concatenation
 * (multiples of 8, so every piece of an extent is whole words), added into sums. */
typedef struct {
    const uint8_t *buf;
    const int64_t *start, *end;
    int64_t n, lo, hi;
    uint64_t *sums;
} SumPart;

static void *sum_part(void *arg)
{
    const SumPart *p = arg;
    int64_t pos = 0; /* offset of extent k in the concatenation */
    for (int64_t k = 0; k < p->n && pos < p->hi; k++) {
        int64_t len = p->end[k] - p->start[k];
        int64_t a = p->lo > pos ? p->lo - pos : 0, b = p->hi - pos < len ? p->hi - pos : len;
        if (a < b) /* wrapping addition commutes: the pieces may be added in any order */
            __atomic_fetch_add(&p->sums[k], sum_words(p->buf + p->start[k] + a, b - a),
                               __ATOMIC_RELAXED);
        pos += len;
    }
    return NULL;
}

enum { WS_MAX_THREADS = 16, WS_MIN_PART = 1 << 20 };

/* sums[k] = sum64 of [start[k], end[k]) of buf, over up to `threads` threads (parts of at
 * least 1 MiB); WS_ERR_EXTENT if an extent is malformed. */
int32_t ws_sum(const uint8_t *buf, int64_t buf_nbytes, int64_t n, const int64_t *start,
               const int64_t *end, int64_t *sums, int32_t threads)
{
    int64_t total = 0;
    for (int64_t k = 0; k < n; k++) {
        if (start[k] < 0 || end[k] < start[k] || end[k] > buf_nbytes || (end[k] - start[k]) % 8)
            return WS_ERR_EXTENT;
        total += end[k] - start[k];
        sums[k] = 0;
    }
    int64_t parts = total / WS_MIN_PART;
    if (threads > WS_MAX_THREADS) threads = WS_MAX_THREADS;
    if (parts > threads) parts = threads;
    if (parts < 1) parts = 1;
    SumPart part[WS_MAX_THREADS];
    pthread_t tid[WS_MAX_THREADS];
    int started[WS_MAX_THREADS] = {0};
    for (int64_t t = 0; t < parts; t++) {
        part[t] = (SumPart){buf, start, end, n, total / 8 * t / parts * 8,
                            total / 8 * (t + 1) / parts * 8, (uint64_t *)sums};
        /* part 0 runs here; a thread that cannot be started runs here too */
        if (t > 0) started[t] = !pthread_create(&tid[t], NULL, sum_part, &part[t]);
    }
    for (int64_t t = 0; t < parts; t++)
        if (!started[t]) sum_part(&part[t]);
    for (int64_t t = 1; t < parts; t++)
        if (started[t]) pthread_join(tid[t], NULL);
    return WS_OK;
}
