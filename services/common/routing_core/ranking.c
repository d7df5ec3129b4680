/* routing_core/ranking.c -- Lehmer code (exact mode) and colex ranking of subsets.
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

/* ------------------------------------------------------------------ Lehmer code (exact mode) */

/* Index of the row's order among the K! orders of its set (bm = the row's bitmap). */
FORCE_INLINE uint64_t lehmer_rank(const uint16_t *row, const uint64_t *bm, int W, int K)
{
    uint32_t remaining = (1u << K) - 1;
    uint64_t idx = 0;
    for (int j = 0; j < K; j++) {
        int pos = bits_below(bm, W, row[j]);
        uint32_t d = (uint32_t)__builtin_popcount(remaining & ((1u << pos) - 1));
        remaining &= ~(1u << pos);
        idx = idx * (uint64_t)(K - j) + d;
    }
    return idx;
}

/* Inverse of lehmer_rank. The pool of unused slots is 4-bit indices packed in one word, so
 * taking the d-th one is shifts and masks (no memmove). */
FORCE_INLINE void lehmer_unrank(const Codec *cd, uint64_t idx, const uint16_t *sorted, int K,
                                uint16_t *row)
{
    uint32_t digit[MAX_K];
    for (int j = K - 1; j >= 0; j--) {
        uint64_t m = (uint64_t)(K - j);
        uint64_t q = m == 1 ? idx : mulhi64(idx, cd->divmagic[m]);
        digit[j] = (uint32_t)(idx - q * m);
        idx = q;
    }
    uint64_t pool = 0xFEDCBA9876543210ull;
    for (int j = 0; j < K; j++) {
        unsigned sh = 4 * digit[j];
        uint64_t below = (1ull << sh) - 1; /* sh <= 60 */
        row[j] = sorted[(pool >> sh) & 15];
        pool = (pool & below) | ((pool >> sh >> 4) << sh);
    }
}

/* ------------------------------------------------------------------ colex ranking */

/* rank = sum_i C(c_i, i) over the sorted ids c_1 < ... < c_K (combinatorial number system);
 * i comes from the bitmap, so the row need not be sorted. */
FORCE_INLINE u128 colex_rank(const Codec *cd, int K, int W, const uint16_t *row, const uint64_t *bm)
{
    int n = cd->stride;
    if (!cd->wide) {
        uint64_t r = 0;
        for (int j = 0; j < K; j++)
            r += cd->C64[(size_t)(1 + bits_below(bm, W, row[j])) * n + row[j]];
        return r;
    }
    u128 r = 0;
    for (int j = 0; j < K; j++) r += cd->C128[(size_t)(1 + bits_below(bm, W, row[j])) * n + row[j]];
    return r;
}

/* Log-linear bucket of r, branch-free: exact below 2^m, then m mantissa bits per octave. */
FORCE_INLINE uint32_t guess_bucket(u128 r)
{
    const int m = GUESS_MANT_BITS;
    int bl = bitlen128(r | 1), e = bl > m ? bl - m : 0;
    return (uint32_t)e << m | ((uint32_t)(r >> (e > 0 ? e - 1 : 0)) & ((1u << m) - 1));
}

FORCE_INLINE uint32_t guess_bucket64(uint64_t r)
{
    const int m = GUESS_MANT_BITS;
    int bl = bitlen64(r);
    if (bl <= m) return (uint32_t)r;
    int e = bl - m;
    return (uint32_t)e << m | ((uint32_t)(r >> (e - 1)) & ((1u << m) - 1));
}

static u128 guess_bucket_low(uint32_t idx)
{
    const int m = GUESS_MANT_BITS;
    if (idx < (1u << m)) return idx;
    uint32_t e = idx >> m, mant = idx & ((1u << m) - 1);
    return (u128)((1u << m) | mant) << (e - 1);
}

/* Per i, the largest c with C(c, i) <= the smallest r of each bucket. Unranking starts
 * there and steps forward; guess_steps is the most steps any bucket needs (1 up to ~128
 * experts), so the common case is one branch-free compare instead of a binary search. */
static int guess_init(Codec *cd)
{
    int n = cd->stride, E = cd->E;
    for (int i = 2; i <= cd->K; i++) {
        const u128 *Ci = cd->C128 + (size_t)i * n;
        uint32_t nb = guess_bucket(Ci[E] - 1) + 1;
        uint16_t *tab = malloc((size_t)nb * sizeof(uint16_t));
        if (!tab) return R3_ERR_NOMEM;
        int c = i - 1, c_hi = i - 1;
        for (uint32_t idx = 0; idx < nb; idx++) {
            u128 lo = guess_bucket_low(idx), hi = guess_bucket_low(idx + 1) - 1;
            while (c + 1 <= E && Ci[c + 1] <= lo) c++;
            while (c_hi + 1 <= E && Ci[c_hi + 1] <= hi) c_hi++;
            tab[idx] = (uint16_t)c;
            if (c_hi - c > cd->guess_steps) cd->guess_steps = c_hi - c;
        }
        cd->guess[i] = tab;
    }
    return R3_OK;
}

/* Largest c in [lo, hi] with C(c, i) <= r, given C(lo, i) <= r < C(hi + 1, i). */
FORCE_INLINE int search64(const Codec *cd, int i, uint64_t r, int lo, int hi)
{
    const uint64_t *Ci = cd->C64 + (size_t)i * cd->stride;
    if (cd->guess[i]) {
        int c = cd->guess[i][guess_bucket64(r)];
        while (Ci[c + 1] <= r) c++; /* rarely taken: speculation hides the check */
        return c;
    }
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (Ci[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

FORCE_INLINE int search128(const Codec *cd, int i, u128 r, int lo, int hi)
{
    const u128 *Ci = cd->C128 + (size_t)i * cd->stride;
    if (cd->guess[i]) {
        int c = cd->guess[i][guess_bucket(r)];
        while (Ci[c + 1] <= r) c++; /* rarely taken: speculation hides the check */
        return c;
    }
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (Ci[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

#define LANES 4

/* Four independent 64-bit unranks in lockstep: each is a serial chain of dependent loads,
 * so interleaving keeps four chains in flight (1.4x over one at a time; written out by
 * hand because GCC keeps lane arrays in memory). */
FORCE_INLINE void colex_unrank64_lanes(const Codec *cd, int K, const u128 *r,
                                       uint16_t (*sorted)[MAX_K])
{
    uint64_t r0 = (uint64_t)r[0], r1 = (uint64_t)r[1], r2 = (uint64_t)r[2], r3 = (uint64_t)r[3];
    int h0 = cd->E - 1, h1 = h0, h2 = h0, h3 = h0;
#define UNRANK_LANE(L)                                        \
    {                                                         \
        int c = search64(cd, i, r##L, i - 1, h##L);           \
        sorted[L][i - 1] = (uint16_t)c;                       \
        r##L -= Ci[c];                                        \
        h##L = c - 1;                                         \
    }
    for (int i = K; i >= 2; i--) {
        const uint64_t *Ci = cd->C64 + (size_t)i * cd->stride;
        UNRANK_LANE(0)
        UNRANK_LANE(1)
        UNRANK_LANE(2)
        UNRANK_LANE(3)
    }
#undef UNRANK_LANE
    sorted[0][0] = (uint16_t)r0;
    sorted[1][0] = (uint16_t)r1;
    sorted[2][0] = (uint16_t)r2;
    sorted[3][0] = (uint16_t)r3;
}

/* Inverse of colex_rank for r < C(E, K); writes ids ascending. */
FORCE_INLINE void colex_unrank(const Codec *cd, int K, u128 r, uint16_t *sorted)
{
    int hi = cd->E - 1, n = cd->stride;
    if (!cd->wide) {
        uint64_t r64 = (uint64_t)r;
        for (int i = K; i >= 2; i--) {
            int c = search64(cd, i, r64, i - 1, hi);
            sorted[i - 1] = (uint16_t)c;
            r64 -= cd->C64[(size_t)i * n + c];
            hi = c - 1;
        }
        sorted[0] = (uint16_t)r64;
        return;
    }
    for (int i = K; i >= 2; i--) {
        int c = search128(cd, i, r, i - 1, hi);
        sorted[i - 1] = (uint16_t)c;
        r -= cd->C128[(size_t)i * n + c];
        hi = c - 1;
    }
    sorted[0] = (uint16_t)r;
}
