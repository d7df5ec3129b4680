/* routing_core/rows.c -- rows and validation (r3_validate).
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

/* ------------------------------------------------------------------ rows and validation */

FORCE_INLINE void load_row(const void *ids, int itemsize, size_t off, int K, uint16_t *row)
{
    if (itemsize == 1) {
        const uint8_t *p = (const uint8_t *)ids + off;
        for (int j = 0; j < K; j++) row[j] = p[j];
    } else {
        const uint16_t *p = (const uint16_t *)ids + off;
        for (int j = 0; j < K; j++) row[j] = p[j];
    }
}

FORCE_INLINE void store_row(void *out, int itemsize, size_t off, int K, const uint16_t *row)
{
    if (itemsize == 1) {
        uint8_t *p = (uint8_t *)out + off;
        for (int j = 0; j < K; j++) p[j] = (uint8_t)row[j];
    } else {
        uint16_t *p = (uint16_t *)out + off;
        for (int j = 0; j < K; j++) p[j] = row[j];
    }
}

/* Expert bitmap of a row; returns 0, or an error with the offending slot in *bad_j. */
FORCE_INLINE int row_bitmap(const uint16_t *row, int K, int E, int W, uint64_t *bm, int *bad_j)
{
    for (int w = 0; w < W; w++) bm[w] = 0;
    for (int j = 0; j < K; j++) {
        unsigned e = row[j];
        if (e >= (unsigned)E) {
            *bad_j = j;
            return R3_ERR_ID_RANGE;
        }
        uint64_t bit = 1ull << (e & 63);
        if (bm[e >> 6] & bit) {
            *bad_j = j;
            return R3_ERR_DUPLICATE;
        }
        bm[e >> 6] |= bit;
    }
    return R3_OK;
}

/* Bitmap of K values below 64W (values must be < E, checked). Up to 128 experts the words
 * are built in registers: variable-index |= on memory would chain store-to-load stalls.
 * Returns R3_ERR_ID_RANGE / R3_ERR_DUPLICATE for bad rows. */
FORCE_INLINE int build_bits(const uint16_t *v, int K, int E, int W, uint64_t *bm)
{
    int n = 0;
    unsigned bad = 0;
    if (W <= 2) {
        uint64_t lo = 0, hi = 0;
        for (int j = 0; j < K; j++) {
            uint64_t bit = 1ull << (v[j] & 63), in_hi = 0 - (uint64_t)((v[j] >> 6) & 1);
            bad |= v[j] >= (unsigned)E;
            hi |= bit & in_hi;
            lo |= bit & ~in_hi;
        }
        bm[0] = lo;
        bm[1] = hi;
    } else {
        for (int w = 0; w < W; w++) bm[w] = 0;
        for (int j = 0; j < K; j++) {
            if (v[j] >= (unsigned)E) return R3_ERR_ID_RANGE;
            bm[v[j] >> 6] |= 1ull << (v[j] & 63);
        }
    }
    if (bad) return R3_ERR_ID_RANGE;
    for (int w = 0; w < W; w++) n += __builtin_popcountll(bm[w]);
    return n == K ? R3_OK : R3_ERR_DUPLICATE;
}

/* Number of set bits below position x: the rank of x within the row, without sorting. */
FORCE_INLINE int bits_below(const uint64_t *bm, int W, unsigned x)
{
    uint64_t below = (1ull << (x & 63)) - 1;
    if (W <= 2) {
        uint64_t in_hi = 0 - (uint64_t)(x >> 6);
        return __builtin_popcountll(bm[0] & (below | in_hi)) +
               __builtin_popcountll(bm[1] & below & in_hi);
    }
    int n = 0;
    for (unsigned w = 0; w < (x >> 6); w++) n += __builtin_popcountll(bm[w]);
    return n + __builtin_popcountll(bm[x >> 6] & below);
}

/* Scatter each value to its rank: ascending order with no data-dependent branches. */
FORCE_INLINE void sort_by_bits(const uint16_t *v, int K, const uint64_t *bm, int W, uint16_t *out)
{
    for (int j = 0; j < K; j++) out[bits_below(bm, W, v[j])] = v[j];
}

/* Word by word: a wide memcpy right after narrow stores would stall on store forwarding. */
FORCE_INLINE void copy_bits(uint64_t *dst, const uint64_t *src, int W)
{
    for (int w = 0; w < W; w++) dst[w] = src[w];
}

FORCE_INLINE int bitmaps_equal(const uint64_t *a, const uint64_t *b, int W)
{
    uint64_t d = 0;
    for (int w = 0; w < W; w++) d |= a[w] ^ b[w];
    return d == 0;
}

#if HAVE_SORT8
/* Rows of 8 (the common top-8) as 8 u16 lanes of one SSE register. Bitonic sort: 6
 * compare-exchange stages of shuffle + min + max + blend, no branches. */
#define CMPX(v, p, mask) _mm_blend_epi16(_mm_min_epu16(v, p), _mm_max_epu16(v, p), mask)
#define SWAP_LANES(v, imm) _mm_shufflehi_epi16(_mm_shufflelo_epi16(v, imm), imm)
FORCE_INLINE __m128i sort8_u16(__m128i v)
{
    v = CMPX(v, SWAP_LANES(v, 0xB1), 0x66); /* pairs, alternating direction */
    v = CMPX(v, SWAP_LANES(v, 0x4E), 0x3C); /* quads: distance 2 */
    v = CMPX(v, SWAP_LANES(v, 0xB1), 0x5A); /* quads: distance 1 */
    v = CMPX(v, _mm_shuffle_epi32(v, 0x4E), 0xF0); /* merge: distance 4 */
    v = CMPX(v, SWAP_LANES(v, 0x4E), 0xCC);
    v = CMPX(v, SWAP_LANES(v, 0xB1), 0xAA);
    return v;
}
#undef CMPX
#undef SWAP_LANES

FORCE_INLINE int sorted8_has_repeat(__m128i s)
{
    return (_mm_movemask_epi8(_mm_cmpeq_epi16(s, _mm_srli_si128(s, 2))) & 0x3FFF) != 0;
}

FORCE_INLINE int vec_equal(__m128i a, __m128i b)
{
    return _mm_movemask_epi8(_mm_cmpeq_epi16(a, b)) == 0xFFFF;
}

/* g_i = s_i - s_{i-1} - 1 with s_{-1} = -1 (u16 arithmetic wraps exactly). */
FORCE_INLINE __m128i gaps8(__m128i s)
{
    __m128i before = _mm_or_si128(_mm_slli_si128(s, 2), _mm_setr_epi16(-1, 0, 0, 0, 0, 0, 0, 0));
    return _mm_sub_epi16(_mm_sub_epi16(s, before), _mm_set1_epi16(1));
}
#endif

#define PREFETCH_ROWS 16

/* Rows of one layer are L*K elements apart; fetch ahead so the strided walk does not stall. */
FORCE_INLINE void prefetch_row(const void *base, int itemsize, int64_t t, int64_t tokens,
                               int64_t layers, int64_t layer, int K, int for_write)
{
    if (t + PREFETCH_ROWS >= tokens) return;
    const char *p = (const char *)base + ((t + PREFETCH_ROWS) * layers + layer) * K * itemsize;
    if (for_write) __builtin_prefetch(p, 1);
    else __builtin_prefetch(p, 0);
}

/* First invalid row in row-major order (info = token, layer, slot, id); used for messages. */
int r3_validate(const void *ids, int32_t itemsize, int64_t tokens, int64_t layers, int32_t K,
                int32_t E, int64_t *info)
{
    uint16_t row[MAX_K];
    uint64_t bm[MAX_W];
    int W = (E + 63) / 64, bad_j = 0;
    if (K < 1 || K > MAX_K || E < 1 || E > MAX_E || (itemsize != 1 && itemsize != 2))
        return R3_ERR_ARGS;
    for (int64_t r = 0; r < tokens * layers; r++) {
        load_row(ids, itemsize, (size_t)r * K, K, row);
        int rc = row_bitmap(row, K, E, W, bm, &bad_j);
        if (rc) {
            info[0] = r / layers;
            info[1] = r % layers;
            info[2] = bad_j;
            info[3] = row[bad_j];
            return rc;
        }
    }
    return R3_OK;
}
