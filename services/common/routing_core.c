/*
 * routing_core.c -- compiled core of the routed-expert codec (services/common/routing.py).
 *
 * Plain C99 plus GCC's unsigned __int128 and bit builtins; no CPython API (loaded with ctypes).
 * Shapes: ids are (tokens T, layers L, topk K) row-major; a "row" is one (token, layer) pair.
 *
 * Blob = 32-byte header + payload (format in routing.py). The payload is ONE rANS stream with
 * four interleaved 64-bit states and 32-bit words: 32 bytes of final states, then the words.
 * Blocks of up to 65,536 tokens are coded in order, and within a block the layers; each
 * (block, layer) is either
 *   - fallback: each row's colex rank among the C(E,K) subsets (+ its Lehmer permutation index
 *     in exact mode), coded near-uniformly -- within 0.001% of the information floor; or
 *   - adaptive: per row a "repeats the previous token's row" flag, else the row's K gaps in the
 *     layer's expert-popularity order, each coded with an adaptive frequency table per position
 *     (tables and popularity order are rebuilt at fixed row counts, identically on both sides).
 *     Format 2: all of a layer's flags come first, then the fresh rows' gaps, so the decoder
 *     knows which rows to walk before it walks them (no unpredictable branch on the rANS
 *     states' critical path).
 * A per-layer raw bit picks the cheaper (estimated) of the two; short inputs (< 64 tokens) use
 * fallback everywhere with no per-layer bits, so ANY input costs <= floor + a fixed overhead.
 *
 * rANS is LIFO: the encoder turns a layer into a list of "records" front to back (running the
 * same adaptive model as the decoder), then codes that list back to front; layers go last to
 * first. Every decoded value is range-checked and the stream must end exactly in the initial
 * state, so corrupted input yields an error code, never a crash or out-of-bounds access.
 */
#define _POSIX_C_SOURCE 200809L /* pthreads under -std=c99 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif
#if defined(__SSE4_1__)
#include <smmintrin.h>
#define HAVE_SORT8 1
#else
#define HAVE_SORT8 0
#endif

typedef unsigned __int128 u128;

#define FORCE_INLINE static inline __attribute__((always_inline))

enum {
    R3_OK = 0,
    R3_ERR_NOMEM = -1,
    R3_ERR_ARGS = -2,
    R3_ERR_ID_RANGE = -3,
    R3_ERR_DUPLICATE = -4,
    R3_ERR_HEADER = -5,
    R3_ERR_LENGTH = -6,
    R3_ERR_CHECKSUM = -7,
    R3_ERR_CORRUPT = -8,
};

/* Sub-codes of R3_ERR_CORRUPT, reported in info[0] so Python can say what was wrong. */
enum {
    BAD_OVERRUN = 1,     /* stream needs more words than the payload holds */
    BAD_RANK = 2,        /* subset rank or permutation index out of range */
    BAD_GAP = 3,         /* expert position past the end of the row */
    BAD_ESCAPE = 4,      /* escape used for a symbol the model already had */
    BAD_REPEAT = 5,      /* row coded explicitly although it repeats the previous row */
    BAD_FINAL = 6,       /* stream did not end in the encoder's initial state */
    BAD_OUTPUT = 7,      /* decoded ids failed validation */
    BAD_SYMBOL = 8,      /* uniform symbol in unused probability range */
};

/* Test builds only (-DR3_TEST_EXPLICIT_REPEATS): the encoder codes repeated rows explicitly,
 * which makes invalid streams that decoding must refuse (BAD_REPEAT). */
#ifdef R3_TEST_EXPLICIT_REPEATS
#define EXPLICIT_REPEATS 1
#else
#define EXPLICIT_REPEATS 0
#endif

#define HEADER_BYTES 32
#define FORMAT_VERSION 2
#define MAX_K 16
#define MAX_E 1024
#define MAX_W (MAX_E / 64)
#define MAX_ELEMENTS (1ull << 31)
#define NSTATES 4
#define RANS_L (1ull << 31)
#define MODEL_BITS 15
#define MODEL_TOTAL (1u << MODEL_BITS)
#define UNIF_BITS 31
#define LUT_BITS 9       /* decoder lookup table per context: 2^9 buckets on large inputs */
#define LUT_BITS_SMALL 8 /* ... and 2^8 below LUT_SMALL_ROWS rows, where rebuilds weigh more */
#define LUT_SMALL_ROWS 4096
#define PER_LAYER_MIN_TOKENS 64
/* Tokens are coded in blocks (each layer of a block with a fresh model), so the encoder's
 * record buffer stays bounded (~20 MB) however long the input is. */
#define BLOCK_TOKENS (1 << 16)
#define FIRST_REBUILD 8 /* and rebuild_after */
#define REBUILD_STEP 4096
/* Rows (both rebuild rows, so the cost tally is current) at which an adaptive attempt that
 * still costs more than the fallback is abandoned: learning costs are front-loaded, so it
 * rarely catches up, and giving up early saves the encoder the wasted pass. */
#define ABORT_CHECK(t) ((t) == 216 || (t) == 648)
#define HALVE_ABOVE (1u << 16)
#define PERM_COUNTING_MAX 512
#define GUESS_MANT_BITS 6
#define GUESS_MIN_ROWS 1024
#define RCP_MIN_ROWS (1 << 16)
#define UNRANK_CHUNK 32
#define Q12 4096

/* ------------------------------------------------------------------ small helpers */

FORCE_INLINE int bitlen64(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

FORCE_INLINE int bitlen128(u128 v)
{
    uint64_t hi = (uint64_t)(v >> 64);
    return hi ? 128 - __builtin_clzll(hi) : bitlen64((uint64_t)v);
}

FORCE_INLINE uint64_t mulhi64(uint64_t a, uint64_t b) { return (uint64_t)(((u128)a * b) >> 64); }

FORCE_INLINE uint32_t load_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void store_le(uint8_t *p, uint64_t v, int nbytes)
{
    for (int i = 0; i < nbytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t load_le(const uint8_t *p, int nbytes)
{
    uint64_t v = 0;
    for (int i = nbytes - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

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

/* ------------------------------------------------------------------ near-uniform coding */

/* Uniform symbol in [0, T) at scale 2^31: frequency f = floor(2^31 / T) for every symbol, so
 * the unused mass wastes < T / 2^31 * 1.45 bits. Encoding divides by f with ryg's reciprocal
 * (rans64 / Alverson), decoding with a 64-bit magic multiply; both are exact. */
typedef struct {
    uint32_t T, f, cmpl, rcp_shift;
    uint64_t rcp, magic;
} Unif;

static void unif_init(Unif *u, uint32_t T)
{
    uint32_t shift = 0;
    u->T = T;
    u->f = (uint32_t)((1ull << UNIF_BITS) / T);
    u->cmpl = (uint32_t)((1ull << UNIF_BITS) - u->f);
    while (u->f > (1u << shift)) shift++;
    uint64_t x0 = u->f - 1, x1 = 1ull << (shift + 31);
    uint64_t t1 = x1 / u->f;
    x0 += (x1 % u->f) << 32;
    uint64_t t0 = x0 / u->f;
    u->rcp = t0 + (t1 << 32);
    u->rcp_shift = shift - 1;
    u->magic = (uint64_t)((((u128)1) << 64) / u->f) + 1;
}

/* A value below M split as top digit (< T <= 2^16, coded uniformly) and b raw low bits. */
typedef struct {
    u128 M;
    int b;   /* raw low bits */
    Unif top;
    int active; /* M > 1 */
} Split;

static void split_init(Split *s, u128 M)
{
    s->M = M;
    s->active = M > 1;
    if (!s->active) return;
    int bl = bitlen128(M - 1);
    s->b = bl > 16 ? bl - 16 : 0;
    unif_init(&s->top, (uint32_t)((M - 1) >> s->b) + 1);
}

/* ------------------------------------------------------------------ records (encoder) */

/* One coding step, packed: start/value (bits 0-31), freq/nbits/unif index (32-48),
 * kind (56-57), rANS state (58-59). */
enum { REC_MODEL = 0, REC_RAW = 1, REC_UNIF = 2 };
#define REC(kind, st, param, start)                                                     \
    ((uint64_t)(uint32_t)(start) | (uint64_t)(param) << 32 | (uint64_t)(kind) << 56 |  \
     (uint64_t)(st) << 58)

enum { UNIF_RANK = 0, UNIF_PERM = 1, UNIF_ESC = 2, N_UNIF = 3 };

/* ------------------------------------------------------------------ codec constants */

typedef struct {
    int E, K, W, exact, A;
    int wide;            /* ranks need 128 bits */
    int stride;          /* E + 2 (binomial table row) */
    uint64_t *C64;       /* [K+1][E+2]: C(c, i), sentinel "infinity" at c = E+1 */
    u128 *C128;
    Split rank, perm;
    Unif unif[N_UNIF];   /* [UNIF_RANK] = rank.top, [UNIF_PERM] = perm.top, [UNIF_ESC] */
    uint32_t log2frac[256];
    uint64_t fallback_q12; /* estimated fallback bits per row, Q12 */
    uint64_t divmagic[MAX_K + 1]; /* for small divisions in Lehmer decoding */
    uint16_t *guess[MAX_K + 1];   /* unranking start points (decoder, large inputs) */
    int guess_steps;
} Codec;

static int per_layer_coding(int64_t tokens, const Codec *cd)
{
    return tokens >= PER_LAYER_MIN_TOKENS && cd->fallback_q12 > 0;
}

/* log2(1 + i/256) in Q12, by repeated squaring (no libm needed). */
static void log2frac_init(uint32_t *frac)
{
    for (int i = 0; i < 256; i++) {
        uint64_t y = (uint64_t)(256 + i) << 22; /* Q30 */
        uint32_t r = 0;
        for (int bit = 15; bit >= 0; bit--) {
            y = (y * y) >> 30;
            if (y >= (2ull << 30)) {
                y >>= 1;
                r |= 1u << bit;
            }
        }
        frac[i] = (r + 8) >> 4; /* Q16 -> Q12 */
    }
}

FORCE_INLINE uint32_t log2_q12(const Codec *cd, uint64_t v)
{
    int bl = bitlen64(v) - 1;
    uint32_t mant = bl >= 8 ? (uint32_t)(v >> (bl - 8)) & 255 : (uint32_t)(v << (8 - bl)) & 255;
    return (uint32_t)bl * Q12 + cd->log2frac[mant];
}

static uint64_t split_cost_q12(const Codec *cd, const Split *s)
{
    return s->active ? log2_q12(cd, s->top.T) + (uint64_t)s->b * Q12 : 0;
}

static int binomials_init(Codec *cd)
{
    int E = cd->E, K = cd->K, n = cd->stride;
    cd->C128 = calloc((size_t)(K + 1) * n, sizeof(u128));
    if (!cd->C128) return R3_ERR_NOMEM;
    for (int i = 0; i <= K; i++) {
        u128 *row = cd->C128 + (size_t)i * n;
        for (int c = 0; c <= E; c++) {
            if (i == 0) row[c] = 1;
            else if (c == 0) row[c] = 0;
            else row[c] = row[c - 1] + cd->C128[(size_t)(i - 1) * n + c - 1];
        }
        row[E + 1] = ~(u128)0;
    }
    cd->wide = bitlen128(cd->C128[(size_t)K * n + E]) > 62;
    for (int i = 0; i <= K; i++)
        if (bitlen128(cd->C128[(size_t)i * n + E]) > 62) cd->wide = 1;
    if (cd->wide) return R3_OK;
    cd->C64 = malloc((size_t)(K + 1) * n * sizeof(uint64_t));
    if (!cd->C64) return R3_ERR_NOMEM;
    for (size_t j = 0; j < (size_t)(K + 1) * n; j++)
        cd->C64[j] = cd->C128[j] > UINT64_MAX ? UINT64_MAX : (uint64_t)cd->C128[j];
    return R3_OK;
}

static void codec_free(Codec *cd)
{
    free(cd->C64);
    free(cd->C128);
    for (int i = 0; i <= MAX_K; i++) free(cd->guess[i]);
}

static int codec_init(Codec *cd, int E, int K, int exact)
{
    memset(cd, 0, sizeof(*cd));
    cd->E = E;
    cd->K = K;
    cd->W = (E + 63) / 64;
    cd->exact = exact;
    cd->A = E - K + 1;
    cd->stride = E + 2;
    int rc = binomials_init(cd);
    if (rc) return rc;
    u128 fact = 1;
    for (int i = 2; i <= K; i++) fact *= (u128)i;
    split_init(&cd->rank, cd->C128[(size_t)K * cd->stride + E]);
    split_init(&cd->perm, exact ? fact : 1);
    if (cd->rank.active) cd->unif[UNIF_RANK] = cd->rank.top;
    if (cd->perm.active) cd->unif[UNIF_PERM] = cd->perm.top;
    if (cd->A > 1) unif_init(&cd->unif[UNIF_ESC], (uint32_t)cd->A);
    log2frac_init(cd->log2frac);
    cd->fallback_q12 = split_cost_q12(cd, &cd->rank) + split_cost_q12(cd, &cd->perm);
    for (int m = 2; m <= MAX_K; m++) cd->divmagic[m] = UINT64_MAX / (uint64_t)m + 1;
    return R3_OK;
}

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

/* ------------------------------------------------------------------ adaptive model */

/* Per-layer model: popularity order of experts, and per position i in the row a frequency
 * table over gaps g = pos_i - pos_{i-1} - 1 in that order (symbol A = escape: gap not seen
 * yet, sent uniformly). Tables change only in model_rebuild, at row counts both sides know. */
typedef struct {
    int K, A, E;
    uint32_t *cnt;  /* [K][A] gap counts */
    uint32_t *cum;  /* [K][A+2] cumulative frequencies, sum 2^15 */
    uint16_t *lut;  /* [K][2^lut_bits] first symbol whose range covers the bucket */
    int lut_bits, lut_shift; /* decoder-side choice; the format does not depend on it */
    int lut8;       /* r3_check, rows of 8, A < 255: lut holds bytes (half the table work) */
    /* Encoder only: */
    uint32_t *cost;  /* [K][A+1] code length, Q12 bits, for the per-layer method choice */
    uint64_t *rtab;  /* [K][A] ready-made record per gap (ESC_FOLLOWS: escape, then uniform) */
    uint32_t *snap;  /* [K][A] counts when costs were last accounted */
    uint32_t flag_snap[2];
    uint64_t cost_acc; /* Q12 bits of everything coded before the last accounting */
    uint32_t flag_cnt[2], flag_f0, flag_cost[2];
    uint32_t *ecnt;  /* [E] expert popularity */
    uint16_t *perm;  /* [E] popularity position -> expert */
    uint16_t *inv;   /* [E] expert -> popularity position */
    uint64_t *rcp;   /* [2^15 + 1] encoder, large inputs: reciprocal of each frequency used */
    uint8_t *rshift; /* [2^15 + 1] its shift */
    uint64_t rcp_done[(MODEL_TOTAL >> 6) + 1];
    int64_t next_rebuild;
    /* Decoder only: the layer's repeat flags, decoded ahead of its gaps. */
    uint8_t *rep;    /* [rows of a block] 1 = row repeats the previous one */
    uint32_t *fresh; /* [rows of a block] the rows that do not, in order */
    uint64_t *keys;  /* r3_check: [2 x rows between rebuilds] fresh rows' packed positions */
    int64_t nfresh;
} Model;

static void model_free(Model *m)
{
    free(m->cnt);
    free(m->cum);
    free(m->lut);
    free(m->cost);
    free(m->ecnt);
    free(m->perm);
    free(m->inv);
    free(m->rcp);
    free(m->rshift);
    free(m->rtab);
    free(m->snap);
    free(m->rep);
    free(m->fresh);
    free(m->keys);
}

static int model_alloc(Model *m, const Codec *cd, int with_cost, int with_rcp, int64_t tokens)
{
    memset(m, 0, sizeof(*m));
    m->lut_bits = tokens < LUT_SMALL_ROWS ? LUT_BITS_SMALL : LUT_BITS;
    m->lut_shift = MODEL_BITS - m->lut_bits;
    m->K = cd->K;
    m->A = cd->A;
    m->E = cd->E;
    m->cnt = malloc((size_t)cd->K * cd->A * sizeof(uint32_t));
    m->cum = malloc((size_t)cd->K * (cd->A + 2) * sizeof(uint32_t));
    m->lut = malloc((size_t)cd->K * (1u << LUT_BITS) * sizeof(uint16_t));
    m->cost = with_cost ? malloc((size_t)cd->K * (cd->A + 1) * sizeof(uint32_t)) : NULL;
    m->ecnt = malloc((size_t)cd->E * sizeof(uint32_t));
    m->perm = malloc((size_t)cd->E * sizeof(uint16_t));
    m->inv = malloc((size_t)cd->E * sizeof(uint16_t));
    if (with_cost) {
        m->rtab = malloc((size_t)cd->K * cd->A * sizeof(uint64_t));
        m->snap = malloc((size_t)cd->K * cd->A * sizeof(uint32_t));
        if (!m->rtab || !m->snap) return R3_ERR_NOMEM;
    }
    if (!with_cost) {
        size_t rows = (size_t)(tokens < BLOCK_TOKENS ? tokens : BLOCK_TOKENS) + 1;
        m->rep = malloc(rows);
        m->fresh = malloc(rows * sizeof(uint32_t));
        m->keys = malloc(2 * (rows < REBUILD_STEP ? rows : REBUILD_STEP) * sizeof(uint64_t));
        if (!m->rep || !m->fresh || !m->keys) return R3_ERR_NOMEM;
    }
    if (with_rcp) { /* 288 KB of tables: worth their page faults only on large inputs */
        m->rcp = malloc((MODEL_TOTAL + 1) * sizeof(uint64_t));
        m->rshift = malloc(MODEL_TOTAL + 1);
        if (!m->rcp || !m->rshift) return R3_ERR_NOMEM;
    }
    if (!m->cnt || !m->cum || !m->lut || (with_cost && !m->cost) || !m->ecnt || !m->perm ||
        !m->inv)
        return R3_ERR_NOMEM;
    return R3_OK;
}

/* ryg's rans64 reciprocal of f (Alverson): x / f == mulhi(x, rcp) >> shift for x < 2^63.
 * Filled as frequencies appear (rcp_done is a bitmap, cheap to test), so encoding needs no
 * division. */
FORCE_INLINE void need_rcp(Model *m, uint32_t f)
{
    uint64_t bit = 1ull << (f & 63);
    if (!m->rcp || f < 2 || (m->rcp_done[f >> 6] & bit)) return;
    m->rcp_done[f >> 6] |= bit;
    uint32_t shift = 0;
    while (f > (1u << shift)) shift++;
    uint64_t x0 = f - 1, x1 = 1ull << (shift + 31);
    uint64_t t1 = x1 / f;
    x0 += (x1 % f) << 32;
    m->rcp[f] = x0 / f + (t1 << 32);
    m->rshift[f] = (uint8_t)(shift - 1);
}

#define ESC_FOLLOWS (1ull << 60)

/* Encoder side of a table: code lengths for the method choice, reciprocals and ready-made
 * records for coding. Gap i is coded on rANS state (i + 1) & 3; an unseen gap costs the
 * escape plus the uniform fallback. */
/* Tables below take n = 1 + the largest gap seen: gaps n..A-1 have frequency 0, which early
 * in a layer (when rebuilds are frequent) is most of the alphabet. */
static void ctx_costs(Model *m, const Codec *cd, int i, const uint32_t *freq, const uint32_t *cum,
                      int n)
{
    const int A = m->A, st = (i + 1) & 3;
    uint64_t *rtab = m->rtab + (size_t)i * A;
    uint32_t *cost = m->cost + (size_t)i * (A + 1);
    uint64_t esc_rec = REC(REC_MODEL, st, freq[A], cum[A]) | ESC_FOLLOWS;
    uint32_t esc_cost = 0;
    if (freq[A]) {
        need_rcp(m, freq[A]);
        esc_cost = MODEL_BITS * Q12 - log2_q12(cd, freq[A]) + log2_q12(cd, (uint64_t)A);
    }
    for (int t = 0; t < n; t++) {
        uint32_t f = freq[t];
        if (!f) {
            rtab[t] = esc_rec;
            cost[t] = esc_cost;
            continue;
        }
        need_rcp(m, f);
        rtab[t] = REC(REC_MODEL, st, f, cum[t]);
        cost[t] = MODEL_BITS * Q12 - log2_q12(cd, f);
    }
    for (int t = n; t < A; t++) rtab[t] = esc_rec, cost[t] = esc_cost;
}

/* out[b] = max(in[0..b]); n is a multiple of 8. Eight lanes at a time (log-step shifts),
 * so the running maximum is a short dependency chain per vector instead of per entry. */
FORCE_INLINE void prefix_max_u16(const uint16_t *in, uint16_t *out, int n)
{
#if HAVE_SORT8
    /* The carry between vectors is a broadcast maximum, one instruction per step, so the
     * in-vector scans of successive vectors overlap. */
    __m128i carry = _mm_setzero_si128();
    for (int b = 0; b < n; b += 8) {
        __m128i v = _mm_loadu_si128((const __m128i *)(in + b));
        v = _mm_max_epu16(v, _mm_slli_si128(v, 2));
        v = _mm_max_epu16(v, _mm_slli_si128(v, 4));
        v = _mm_max_epu16(v, _mm_slli_si128(v, 8));
        __m128i top = _mm_shufflehi_epi16(_mm_unpackhi_epi64(v, v), 0xFF);
        _mm_storeu_si128((__m128i *)(out + b), _mm_max_epu16(v, carry));
        carry = _mm_max_epu16(carry, _mm_unpackhi_epi64(top, top));
    }
#else
    uint16_t run = 0;
    for (int b = 0; b < n; b++) out[b] = run = in[b] > run ? in[b] : run;
#endif
}

/* prefix_max_u16 for bytes; n is a multiple of 16. */
FORCE_INLINE void prefix_max_u8(const uint8_t *in, uint8_t *out, int n)
{
#if HAVE_SORT8
    const __m128i last_lane = _mm_set1_epi8(15);
    __m128i carry = _mm_setzero_si128();
    for (int b = 0; b < n; b += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(in + b));
        v = _mm_max_epu8(v, _mm_slli_si128(v, 1));
        v = _mm_max_epu8(v, _mm_slli_si128(v, 2));
        v = _mm_max_epu8(v, _mm_slli_si128(v, 4));
        v = _mm_max_epu8(v, _mm_slli_si128(v, 8));
        _mm_storeu_si128((__m128i *)(out + b), _mm_max_epu8(v, carry));
        carry = _mm_max_epu8(carry, _mm_shuffle_epi8(v, last_lane));
    }
#else
    uint8_t run = 0;
    for (int b = 0; b < n; b++) out[b] = run = in[b] > run ? in[b] : run;
#endif
}

/* The decoder's cumulative frequencies and lookup table of context i (bytes: m->lut8).
 * lut[b] = number of symbol ranges ending at or before slot b << lut_shift, i.e. the symbol
 * holding that slot. Range ends never decrease with the symbol, so that count is a running
 * maximum of (1 + the last symbol ending in bucket b): plain stores instead of a histogram's
 * increments, which chain store-to-load stalls when neighbours share a bucket. The empty
 * ranges n..A-1 end where symbol n-1 does; the escape ends at 2^15, past the last bucket. */
FORCE_INLINE void tables_build(Model *m, int i, uint32_t *cum, const uint32_t *freq, int n,
                               const int bytes)
{
    const int A = m->A, shift = m->lut_shift, nb = 1 << m->lut_bits;
    const uint32_t round = (1u << shift) - 1;
    uint16_t last16[(1u << LUT_BITS) + 1];
    uint8_t last8[(1u << LUT_BITS) + 1];
    uint32_t c = 0;
    if (bytes) memset(last8, 0, (size_t)nb + 1);
    else memset(last16, 0, (size_t)(nb + 1) * sizeof(uint16_t));
    cum[0] = 0;
    for (int s = 0; s < n; s++) { /* one pass: cumulative frequencies and range ends */
        cum[s + 1] = c += freq[s];
        if (bytes) last8[(c + round) >> shift] = (uint8_t)(s + 1);
        else last16[(c + round) >> shift] = (uint16_t)(s + 1);
    }
    for (int s = n; s < A; s++) cum[s + 1] = c;
    cum[A + 1] = c + freq[A];
    if (bytes) {
        last8[(c + round) >> shift] = (uint8_t)A;
        prefix_max_u8(last8, (uint8_t *)m->lut + ((size_t)i << m->lut_bits), nb);
    } else {
        last16[(c + round) >> shift] = (uint16_t)A;
        prefix_max_u16(last16, m->lut + ((size_t)i << m->lut_bits), nb);
    }
}

static void ctx_tables(Model *m, const Codec *cd, int i, const uint32_t *freq, int n)
{
    const int A = m->A;
    uint32_t *cum = m->cum + (size_t)i * (A + 2);
    uint16_t *lut = m->lut + ((size_t)i << m->lut_bits);
    if (m->cost) {
        cum[0] = 0;
        for (int s = 0; s < n; s++) cum[s + 1] = cum[s] + freq[s];
        for (int s = n; s < A; s++) cum[s + 1] = cum[n];
        cum[A + 1] = cum[A] + freq[A];
        ctx_costs(m, cd, i, freq, cum, n);
        return;
    }
    const int nb = 1 << m->lut_bits;
    if (n == 0) { /* a reset: every slot is the escape's */
        for (int s = 0; s <= A; s++) cum[s] = 0;
        cum[A + 1] = freq[A];
        if (m->lut8) memset((uint8_t *)m->lut + ((size_t)i << m->lut_bits), A, (size_t)nb);
        else
            for (int b = 0; b < nb; b++) lut[b] = (uint16_t)A;
        return;
    }
    if (m->lut8) tables_build(m, i, cum, freq, n, 1);
    else tables_build(m, i, cum, freq, n, 0);
}

/* Symbols 0..n-1 hold every nonzero count (n = 0 if none); four counts per test. */
static int used_symbols(const uint32_t *cnt, int A)
{
    int n = A;
    while (n >= 4) {
        uint64_t a, b;
        memcpy(&a, cnt + n - 4, 8);
        memcpy(&b, cnt + n - 2, 8);
        if (a | b) break;
        n -= 4;
    }
    while (n > 0 && cnt[n - 1] == 0) n--;
    return n;
}

/* Frequencies from counts: every seen symbol keeps >= 1 so it stays decodable. */
static void ctx_rebuild(Model *m, const Codec *cd, int i)
{
    uint32_t freq[MAX_E + 1];
    uint32_t *cnt = m->cnt + (size_t)i * m->A;
    uint32_t total = 0, d = 0, best_cnt = 0;
    int n = used_symbols(cnt, m->A);
    for (int s = 0; s < n; s++) { /* one vectorized pass for the three statistics */
        total += cnt[s];
        d += cnt[s] != 0;
        best_cnt = cnt[s] > best_cnt ? cnt[s] : best_cnt;
    }
    if (total > HALVE_ABOVE) { /* age old statistics so the model follows drift */
        total = d = best_cnt = 0;
        for (int s = 0; s < n; s++) {
            total += cnt[s] = (cnt[s] + 1) >> 1;
            d += cnt[s] != 0;
            best_cnt = cnt[s] > best_cnt ? cnt[s] : best_cnt;
        }
    }
    uint32_t esc = d < (uint32_t)m->A ? d / 2 + 1 : 0;
    uint32_t nsym = d + (esc > 0);
    /* Q16 scale: count * scale < 2^31 (count <= total), so the products fit 32-bit lanes. */
    uint32_t scale = (uint32_t)(((uint64_t)(MODEL_TOTAL - nsym) << 16) / (total + esc));
    uint32_t sum = 0;
    for (int s = 0; s < n; s++) { /* no loop-carried choice: vectorizes */
        freq[s] = (cnt[s] != 0) + ((cnt[s] * scale) >> 16);
        sum += freq[s];
    }
    int best_s = m->A; /* the first most frequent symbol */
    for (int s = 0; best_cnt && s < n; s++)
        if (cnt[s] == best_cnt) {
            best_s = s;
            break;
        }
    freq[m->A] = esc ? 1 + ((esc * scale) >> 16) : 0;
    sum += freq[m->A];
    /* The rounding remainder goes to the most frequent symbol (the escape if none seen). */
    freq[best_s] += MODEL_TOTAL - sum;
    ctx_tables(m, cd, i, freq, n);
}

/* The row after rebuild row r: x3 up to REBUILD_STEP (rows 8, 24, 72, ..., 5832), then every
 * REBUILD_STEP rows. Format 2: 8 and x3 (format 1: 16 and x2) is one rebuild fewer on a
 * 512-token segment for +0.9% bytes. */
static int64_t rebuild_after(int64_t r) { return r < REBUILD_STEP ? 3 * r : r + REBUILD_STEP; }

/* Frequency of "fresh row" (flag 0) from the flag counts. */
static uint32_t flag_freq(uint64_t n0, uint64_t n1)
{
    uint64_t f0 = (n0 << MODEL_BITS) / (n0 + n1);
    if (f0 < 1) f0 = 1;
    if (f0 > MODEL_TOTAL - 1) f0 = MODEL_TOTAL - 1;
    return (uint32_t)f0;
}

static void flag_rebuild(Model *m, const Codec *cd)
{
    uint32_t f0 = flag_freq(m->flag_cnt[0], m->flag_cnt[1]);
    m->flag_f0 = f0;
    need_rcp(m, m->flag_f0);
    need_rcp(m, MODEL_TOTAL - m->flag_f0);
    m->flag_cost[0] = MODEL_BITS * Q12 - log2_q12(cd, f0);
    m->flag_cost[1] = MODEL_BITS * Q12 - log2_q12(cd, MODEL_TOTAL - f0);
}

/* Experts by popularity, ties in their previous order. Early in a layer counts are small
 * and the order far from sorted: a counting sort. Later the order barely changes between
 * rebuilds: an insertion sort, near linear. */
static void perm_rebuild(Model *m)
{
    uint32_t maxc = 0;
    for (int e = 0; e < m->E; e++) maxc = m->ecnt[e] > maxc ? m->ecnt[e] : maxc;
    if (maxc <= PERM_COUNTING_MAX) {
        uint16_t start[PERM_COUNTING_MAX + 1], old[MAX_E];
        memset(start, 0, (maxc + 1) * sizeof(uint16_t));
        for (int e = 0; e < m->E; e++) start[m->ecnt[e]]++;
        uint16_t run = 0;
        for (int c = (int)maxc; c >= 0; c--) {
            uint16_t h = start[c];
            start[c] = run;
            run = (uint16_t)(run + h);
        }
        memcpy(old, m->perm, (size_t)m->E * sizeof(uint16_t));
        for (int p = 0; p < m->E; p++) m->perm[start[m->ecnt[old[p]]]++] = old[p];
    } else {
        for (int a = 1; a < m->E; a++) {
            uint16_t e = m->perm[a];
            uint32_t c = m->ecnt[e];
            int b = a;
            while (b > 0 && m->ecnt[m->perm[b - 1]] < c) {
                m->perm[b] = m->perm[b - 1];
                b--;
            }
            m->perm[b] = e;
        }
    }
    for (int p = 0; p < m->E; p++) m->inv[m->perm[p]] = (uint16_t)p;
}

#if HAVE_SORT8 /* used by r3_check's walk for rows of 8 */
/* Stable counting sort of positions by count, descending (counts <= maxc). Equal counts
 * sit next to each other (the order was sorted at the last rebuild), so one histogram would
 * chain store-to-load stalls on each bucket: the positions are split in four quarters, each
 * with its own histogram and, for placing, its own offsets (quarter q's run of count c after
 * the runs of quarters < q), and the quarters are walked in lockstep. */
static void pos_counting_sort(const uint32_t *old, uint32_t *pc, uint16_t *newpos, int E,
                              int maxc)
{
    enum { NQ = 4 };
    uint16_t off[NQ][PERM_COUNTING_MAX + 1];
    const int qs = (E + NQ - 1) / NQ;
    for (int q = 0; q < NQ; q++) memset(off[q], 0, (size_t)(maxc + 1) * sizeof(uint16_t));
    for (int i = 0; i < qs; i++)
        for (int q = 0; q < NQ; q++)
            if (q * qs + i < E) off[q][old[q * qs + i]]++;
    uint16_t run = 0;
    for (int c = maxc; c >= 0; c--)
        for (int q = 0; q < NQ; q++) {
            uint16_t h = off[q][c];
            off[q][c] = run;
            run = (uint16_t)(run + h);
        }
    for (int i = 0; i < qs; i++)
        for (int q = 0; q < NQ; q++) {
            int p = q * qs + i;
            if (p >= E) continue;
            uint16_t dst = off[q][old[p]]++;
            newpos[p] = dst;
            pc[dst] = old[p];
        }
}

/* perm_rebuild in popularity-position space (r3_check): pc[p] counts the expert at position
 * p. The same stable order by count; newpos[p] gets position p's new position and pc is
 * permuted to the new order. No expert ids are involved. */
static void pos_rebuild(uint32_t *pc, uint16_t *newpos, int E)
{
    uint32_t maxc = 0, old[MAX_E];
    for (int p = 0; p < E; p++) maxc = pc[p] > maxc ? pc[p] : maxc;
    memcpy(old, pc, (size_t)E * sizeof(uint32_t));
    if (maxc <= PERM_COUNTING_MAX) {
        pos_counting_sort(old, pc, newpos, E, (int)maxc);
        return;
    }
    uint16_t ord[MAX_E];
    for (int a = 0; a < E; a++) {
        uint32_t c = old[a];
        int b = a;
        for (; b > 0 && old[ord[b - 1]] < c; b--) ord[b] = ord[b - 1];
        ord[b] = (uint16_t)a;
    }
    for (int q = 0; q < E; q++) {
        newpos[ord[q]] = (uint16_t)q;
        pc[q] = old[ord[q]];
    }
}
#endif

/* Encoder: adds the code length of everything coded since the last call, from count deltas
 * (cheaper than summing per symbol). */
static void model_snapshot(Model *m)
{
    if (!m->cost) return;
    memcpy(m->snap, m->cnt, (size_t)m->K * m->A * sizeof(uint32_t));
    memcpy(m->flag_snap, m->flag_cnt, sizeof(m->flag_snap));
}

/* Idempotent: counted symbols are snapshotted, so a second call adds nothing. */
static void model_account(Model *m)
{
    if (!m->cost) return;
    for (int i = 0; i < m->K; i++) {
        const uint32_t *cnt = m->cnt + (size_t)i * m->A, *snap = m->snap + (size_t)i * m->A;
        const uint32_t *cost = m->cost + (size_t)i * (m->A + 1);
        for (int s = 0; s < m->A; s++) m->cost_acc += (uint64_t)(cnt[s] - snap[s]) * cost[s];
    }
    for (int f = 0; f < 2; f++)
        m->cost_acc += (uint64_t)(m->flag_cnt[f] - m->flag_snap[f]) * m->flag_cost[f];
    model_snapshot(m);
}

/* Everything a rebuild does but the popularity order (r3_check keeps that its own way). */
static void model_rebuild_tables(Model *m, const Codec *cd)
{
    model_account(m);
    for (int i = 0; i < m->K; i++) ctx_rebuild(m, cd, i);
    flag_rebuild(m, cd);
    model_snapshot(m);
    m->next_rebuild = rebuild_after(m->next_rebuild);
}

static void model_rebuild(Model *m, const Codec *cd)
{
    model_rebuild_tables(m, cd);
    perm_rebuild(m);
}

static void model_reset(Model *m, const Codec *cd)
{
    uint32_t freq[MAX_E + 1];
    memset(m->cnt, 0, (size_t)m->K * m->A * sizeof(uint32_t));
    memset(m->ecnt, 0, (size_t)m->E * sizeof(uint32_t));
    for (int p = 0; p < m->E; p++) m->perm[p] = m->inv[p] = (uint16_t)p;
    memset(freq, 0, (size_t)(m->A + 1) * sizeof(uint32_t));
    freq[m->A] = MODEL_TOTAL; /* nothing seen: every gap escapes */
    for (int i = 0; i < m->K; i++) ctx_tables(m, cd, i, freq, 0);
    m->flag_cnt[0] = m->flag_cnt[1] = 1;
    flag_rebuild(m, cd);
    m->cost_acc = 0;
    model_snapshot(m);
    m->next_rebuild = FIRST_REBUILD;
}

FORCE_INLINE void model_count_gap(Model *m, int i, int g) { m->cnt[(size_t)i * m->A + g]++; }

/* ------------------------------------------------------------------ header */

typedef struct {
    int mode, coding, K, E;
    int64_t tokens, layers;
    uint64_t payload_len;
} Header;

static const uint8_t MAGIC[4] = {'R', '3', 'R', 'C'};

static void header_write(uint8_t *h, const Header *hd)
{
    memcpy(h, MAGIC, 4);
    h[4] = FORMAT_VERSION;
    h[5] = (uint8_t)hd->mode;
    h[6] = (uint8_t)hd->coding;
    h[7] = (uint8_t)hd->K;
    store_le(h + 8, (uint64_t)hd->E, 2);
    store_le(h + 10, 0, 2);
    store_le(h + 12, (uint64_t)hd->tokens, 4);
    store_le(h + 16, (uint64_t)hd->layers, 4);
    store_le(h + 20, hd->payload_len, 8);
}

/* Field checks that need no codec tables (Python's peek_header repeats them with messages). */
static int header_read(const uint8_t *blob, int64_t len, Header *hd)
{
    if (len < HEADER_BYTES) return R3_ERR_LENGTH;
    if (memcmp(blob, MAGIC, 4) || blob[4] != FORMAT_VERSION) return R3_ERR_HEADER;
    hd->mode = blob[5];
    hd->coding = blob[6];
    hd->K = blob[7];
    hd->E = (int)load_le(blob + 8, 2);
    hd->tokens = (int64_t)load_le(blob + 12, 4);
    hd->layers = (int64_t)load_le(blob + 16, 4);
    hd->payload_len = load_le(blob + 20, 8);
    if (hd->mode > 1 || hd->coding > 1 || load_le(blob + 10, 2) != 0) return R3_ERR_HEADER;
    if (hd->K < 1 || hd->K > MAX_K || hd->E < 2 || hd->E > MAX_E || hd->K > hd->E)
        return R3_ERR_HEADER;
    if (hd->layers < 1 || (uint64_t)hd->tokens * hd->layers * hd->K > MAX_ELEMENTS)
        return R3_ERR_HEADER;
    if (hd->payload_len < 8 * NSTATES || (hd->payload_len - 8 * NSTATES) % 4) return R3_ERR_HEADER;
    if ((uint64_t)len - HEADER_BYTES != hd->payload_len) return R3_ERR_LENGTH;
    return R3_OK;
}

/* Checks that need the codec: the coding byte must be the one the encoder would pick, and
 * a row costs at least 2^-15 bits whenever rows carry information, so a short payload cannot
 * claim a huge array (refused before the caller's output is touched). */
static int header_consistent(const Header *hd, const Codec *cd)
{
    if (hd->coding != per_layer_coding(hd->tokens, cd)) return 0;
    if (cd->fallback_q12 == 0) return 1;
    uint64_t rows = (uint64_t)hd->tokens * hd->layers;
    return rows <= (uint64_t)hd->layers + (hd->payload_len * 8 + 64 * NSTATES) * 32768;
}

/* ------------------------------------------------------------------ encoder */

typedef struct {
    uint32_t *words; /* emitted words, in reverse of reading order */
    size_t nwords, cap;
    uint64_t x[NSTATES];
    uint64_t *rec; /* current layer's records, in decoding order */
    size_t nrec, rec_cap;
    uint64_t *flags; /* current adaptive layer's repeat flags (rows 1..), in decoding order */
    size_t nflags;
} Enc;

typedef struct {
    const void *ids;
    int itemsize;
    int64_t tokens, layers;
} Input;

/* Upper bound of records per row: flag, K gaps with escapes, permutation index. */
#define MAX_RECS_PER_ROW (1 + 2 * MAX_K + 8)

/* Grows the record buffer so *rp has room for another row; hot loops keep the cursor in a
 * local (a store through e->rec could alias e->nrec and force reloads). */
static int rec_room(Enc *e, uint64_t **rp, uint64_t **limit)
{
    size_t used = (size_t)(*rp - e->rec);
    if (e->rec && used + MAX_RECS_PER_ROW <= e->rec_cap) return R3_OK;
    size_t cap = e->rec_cap ? 2 * e->rec_cap : 1u << 14;
    uint64_t *p = realloc(e->rec, cap * sizeof(uint64_t));
    if (!p) return R3_ERR_NOMEM;
    e->rec = p;
    e->rec_cap = cap;
    *rp = p + used;
    *limit = p + cap - MAX_RECS_PER_ROW;
    return R3_OK;
}

/* Top digit, then the low bits in chunks of <= 31 (the rANS limit for raw bits). */
FORCE_INLINE uint64_t *push_split(uint64_t *rp, const Split *s, int unif_idx, u128 v, int st_top,
                                  int st_raw)
{
    if (!s->active) return rp;
    *rp++ = REC(REC_UNIF, st_top, unif_idx, (uint32_t)(v >> s->b));
    for (int lo = 0; lo < s->b; lo += 31) {
        int n = s->b - lo < 31 ? s->b - lo : 31;
        *rp++ = REC(REC_RAW, st_raw, n, (uint32_t)(v >> lo) & ((1u << n) - 1));
    }
    return rp;
}

/* Each record emits at most one word, so one reservation covers a whole layer. */
static int reserve_words(Enc *e, size_t extra)
{
    if (e->nwords + extra <= e->cap) return R3_OK;
    size_t cap = e->cap ? e->cap : 1u << 16;
    while (cap < e->nwords + extra) cap *= 2;
    uint32_t *p = realloc(e->words, cap * sizeof(uint32_t));
    if (!p) return R3_ERR_NOMEM;
    e->words = p;
    e->cap = cap;
    return R3_OK;
}

/* Branch-free renormalization: the low word is always stored, kept only if x >= lim. */
FORCE_INLINE uint64_t emit_if(uint32_t *words, size_t *n, uint64_t x, uint64_t lim)
{
    int c = x >= lim;
    words[*n] = (uint32_t)x;
    *n += (size_t)c;
    return c ? x >> 32 : x;
}

/* Codes the layer's records back to front (rANS is LIFO); no divisions. */
static int flush_records(Enc *e, const Codec *cd, const Model *m, const uint64_t *rec, size_t n)
{
    uint64_t xs[NSTATES];
    memcpy(xs, e->x, sizeof(xs));
    if (reserve_words(e, n + 1)) return R3_ERR_NOMEM;
    uint32_t *words = e->words;
    size_t nw = e->nwords;
    for (size_t j = n; j-- > 0;) {
        uint64_t r = rec[j];
        uint32_t start = (uint32_t)r, param = (uint32_t)(r >> 32) & 0x1ffff;
        int kind = (int)(r >> 56) & 3, st = (int)(r >> 58) & 3;
        uint64_t x = xs[st];
        if (kind == REC_MODEL) {
            x = emit_if(words, &nw, x, (uint64_t)param << (63 - MODEL_BITS));
            if (!m->rcp || param == 1) { /* small inputs skip the reciprocal tables */
                x = ((x / param) << MODEL_BITS) + (x % param) + start;
            } else {
                uint64_t q = mulhi64(x, m->rcp[param]) >> m->rshift[param];
                x += start + q * (MODEL_TOTAL - param);
            }
        } else if (kind == REC_RAW) {
            x = emit_if(words, &nw, x, 1ull << (63 - param));
            x = (x << param) | start;
        } else {
            const Unif *u = &cd->unif[param];
            x = emit_if(words, &nw, x, (uint64_t)u->f << 32);
            uint64_t q = mulhi64(x, u->rcp) >> u->rcp_shift;
            x += (uint64_t)start * u->f + q * u->cmpl;
        }
        xs[st] = x;
    }
    e->nwords = nw;
    memcpy(e->x, xs, sizeof(xs));
    return R3_OK;
}

FORCE_INLINE void enc_load(const Input *in, int64_t t, int64_t layer, int K, uint16_t *row)
{
    prefetch_row(in->ids, in->itemsize, t, in->tokens, in->layers, layer, K, 0);
    load_row(in->ids, in->itemsize, (size_t)(t * in->layers + layer) * K, K, row);
}

/* Loads row t and tells whether it equals row t-1 element by element. Compares against the
 * input itself: a wide compare of the just-stored row would stall on store forwarding. */
FORCE_INLINE int enc_load_same(const Input *in, int64_t t, int64_t layer, int K, uint16_t *row)
{
    size_t off = (size_t)(t * in->layers + layer) * K, back = (size_t)in->layers * K;
    unsigned diff = 0;
    prefetch_row(in->ids, in->itemsize, t, in->tokens, in->layers, layer, K, 0);
    if (in->itemsize == 1) {
        const uint8_t *p = (const uint8_t *)in->ids + off;
        for (int j = 0; j < K; j++) row[j] = p[j], diff |= (unsigned)(p[j] ^ p[(ptrdiff_t)j - (ptrdiff_t)back]);
    } else {
        const uint16_t *p = (const uint16_t *)in->ids + off;
        for (int j = 0; j < K; j++) row[j] = p[j], diff |= (unsigned)(p[j] ^ p[(ptrdiff_t)j - (ptrdiff_t)back]);
    }
    return diff == 0;
}

FORCE_INLINE int enc_fallback_impl(Enc *e, const Codec *cd, const Input *in, int64_t layer,
                                   const int K, const int W)
{
    const int E = cd->E, exact = cd->exact;
    uint16_t row[MAX_K];
    uint64_t bm[MAX_W], *rp = e->rec + e->nrec, *limit = rp;
    for (int64_t t = 0; t < in->tokens; t++) {
        int rc = rp >= limit ? rec_room(e, &rp, &limit) : R3_OK;
        enc_load(in, t, layer, K, row);
        if (rc || (rc = build_bits(row, K, E, W, bm))) return rc;
        rp = push_split(rp, &cd->rank, UNIF_RANK, colex_rank(cd, K, W, row, bm), 0, 1);
        if (exact) rp = push_split(rp, &cd->perm, UNIF_PERM, lehmer_rank(row, bm, W, K), 2, 3);
    }
    e->nrec = (size_t)(rp - e->rec);
    return R3_OK;
}

static int enc_layer_fallback(Enc *e, const Codec *cd, const Input *in, int64_t layer)
{
    if (cd->K == 8 && cd->W == 2) return enc_fallback_impl(e, cd, in, layer, 8, 2);
    if (cd->K == 8 && cd->W == 4) return enc_fallback_impl(e, cd, in, layer, 8, 4);
    return enc_fallback_impl(e, cd, in, layer, cd->K, cd->W);
}

/* A row's popularity positions and their bitmap; validates ids (the order is a bijection,
 * so K distinct ids give K distinct positions). */
FORCE_INLINE int pop_bitmap(int K, int W, int E, const uint16_t *inv, const uint16_t *row,
                            uint16_t *pos, uint64_t *pbm)
{
    unsigned bad = 0;
    for (int j = 0; j < K; j++) {
        bad |= row[j] >= E;
        pos[j] = inv[row[j] < E ? row[j] : 0];
    }
    return bad ? R3_ERR_ID_RANGE : build_bits(pos, K, E, W, pbm);
}

/* Gaps of a fresh row in popularity order (records prepared by ctx_costs). */
FORCE_INLINE uint64_t *enc_gaps(uint64_t *rp, int K, int W, int A, Model *m, const uint16_t *pos,
                                const uint64_t *pbm)
{
    const uint64_t *rtab = m->rtab;
    uint32_t *cnt = m->cnt;
    uint16_t sorted[MAX_K];
    int prev = -1;
    sort_by_bits(pos, K, pbm, W, sorted);
    for (int i = 0; i < K; i++, rtab += A, cnt += A) {
        int g = sorted[i] - prev - 1;
        uint64_t r = rtab[g];
        *rp++ = r & ~ESC_FOLLOWS;
        if (r & ESC_FOLLOWS) *rp++ = REC(REC_UNIF, (i + 1) & 3, UNIF_ESC, g);
        cnt[g]++;
        prev = sorted[i];
    }
    return rp;
}

/* Does row t repeat row t-1 (same set; same order in exact mode)? Builds the row's
 * popularity bitmap when it had to look (canonical rows that differ as sequences). */
FORCE_INLINE int enc_is_repeat(int K, int W, const Codec *cd, const Model *m, const uint16_t *row,
                               int same, uint16_t *pos, uint64_t *pbm, const uint64_t *prev_pbm,
                               int *have_pbm, int *rc)
{
    if (same) return 1;
    if (cd->exact) return 0;
    if ((*rc = pop_bitmap(K, W, cd->E, m->inv, row, pos, pbm))) return 0;
    *have_pbm = 1;
    return bitmaps_equal(pbm, prev_pbm, W);
}

/* Returns 1 if the adaptive model beat the fallback (records kept), 0 if not, or an error.
 * K and W are passed separately so common shapes get constant-folded copies. */
FORCE_INLINE int enc_adaptive_impl(Enc *e, const Codec *cd, Model *m, const Input *in,
                                   int64_t layer, const int K, const int W)
{
    const int E = cd->E, exact = cd->exact, A = cd->A;
    uint16_t row[MAX_K] = {0}, pos[MAX_K];
    uint64_t pbm[MAX_W], prev_pbm[MAX_W] = {0}, bm[MAX_W], nfresh = 0;
    uint64_t *rp = e->rec + e->nrec, *limit = rp, perm_cost = split_cost_q12(cd, &cd->perm);
    uint64_t *fp = e->flags;
    model_reset(m, cd);
    for (int64_t t = 0; t < in->tokens; t++) {
        int rc = rp >= limit ? rec_room(e, &rp, &limit) : R3_OK, have_pbm = 0, rep = 0;
        if (rc) return rc;
        if (t == m->next_rebuild) {
            model_account(m);
            uint64_t cost = m->cost_acc + nfresh * perm_cost;
            if (ABORT_CHECK(t) && cost > (uint64_t)t * cd->fallback_q12) return 0;
            model_rebuild(m, cd);
            enc_load(in, t - 1, layer, K, row); /* the popularity order changed */
            pop_bitmap(K, W, E, m->inv, row, pos, prev_pbm);
        }
        if (t == 0) enc_load(in, t, layer, K, row);
        if (t > 0) {
            int same = enc_load_same(in, t, layer, K, row);
            rep = enc_is_repeat(K, W, cd, m, row, same, pos, pbm, prev_pbm, &have_pbm, &rc);
            rep &= !EXPLICIT_REPEATS;
            uint32_t f0 = m->flag_f0;
            int st = (int)(t & 3);
            *fp++ = rep ? REC(REC_MODEL, st, MODEL_TOTAL - f0, f0) : REC(REC_MODEL, st, f0, 0);
            m->flag_cnt[rep]++;
        }
        if (rep) continue;
        if (rc || (!have_pbm && (rc = pop_bitmap(K, W, E, m->inv, row, pos, pbm)))) return rc;
        for (int j = 0; j < K; j++) m->ecnt[row[j]]++;
        if (A > 1) rp = enc_gaps(rp, K, W, A, m, pos, pbm);
        if (exact) {
            build_bits(row, K, E, W, bm);
            rp = push_split(rp, &cd->perm, UNIF_PERM, lehmer_rank(row, bm, W, K), 2, 3);
        }
        nfresh++;
        copy_bits(prev_pbm, pbm, W);
    }
    e->nrec = (size_t)(rp - e->rec);
    e->nflags = (size_t)(fp - e->flags);
    model_account(m);
    uint64_t cost = m->cost_acc + nfresh * perm_cost, fallback = in->tokens * cd->fallback_q12;
    return cost + fallback / 256 < fallback;
}

#if HAVE_SORT8
/* Positions of a row of 8 in popularity order, sorted; 0 if an id is out of range. */
FORCE_INLINE int sorted_positions8(const Codec *cd, const Model *m, const uint16_t *row,
                                   __m128i *s)
{
    unsigned bad = 0;
    for (int j = 0; j < 8; j++) bad |= row[j] >= cd->E;
    if (bad) return 0;
    const uint16_t *inv = m->inv;
    *s = sort8_u16(_mm_setr_epi16((short)inv[row[0]], (short)inv[row[1]], (short)inv[row[2]],
                                  (short)inv[row[3]], (short)inv[row[4]], (short)inv[row[5]],
                                  (short)inv[row[6]], (short)inv[row[7]]));
    return 1;
}

/* Lehmer digits straight from the row: how many later ids are smaller. */
FORCE_INLINE uint64_t lehmer_rank8(const uint16_t *row)
{
    uint64_t idx = 0;
    for (int j = 0; j < 8; j++) {
        uint32_t d = 0;
        for (int m = j + 1; m < 8; m++) d += row[m] < row[j];
        idx = idx * (uint64_t)(8 - j) + d;
    }
    return idx;
}

/* enc_adaptive_impl for rows of 8: the set is one sorted register, so checks for duplicates
 * and repeats and the gaps are a few vector instructions. */
static int enc_adaptive_k8(Enc *e, const Codec *cd, Model *m, const Input *in, int64_t layer)
{
    const int A = cd->A, exact = cd->exact;
    uint16_t row[MAX_K] = {0}, gap[8];
    uint64_t *rp = e->rec + e->nrec, *limit = rp, nfresh = 0;
    const uint64_t perm_cost = split_cost_q12(cd, &cd->perm);
    __m128i s = _mm_setzero_si128(), prev_s = s;
    uint64_t *fp = e->flags;
    model_reset(m, cd);
    for (int64_t t = 0; t < in->tokens; t++) {
        int rc = rp >= limit ? rec_room(e, &rp, &limit) : R3_OK, same = 0;
        if (rc) return rc;
        if (t == m->next_rebuild) {
            model_account(m);
            uint64_t cost = m->cost_acc + nfresh * perm_cost;
            if (ABORT_CHECK(t) && cost > (uint64_t)t * cd->fallback_q12) return 0;
            model_rebuild(m, cd);
            enc_load(in, t - 1, layer, 8, row); /* the popularity order changed */
            sorted_positions8(cd, m, row, &prev_s);
        }
        if (t > 0) same = enc_load_same(in, t, layer, 8, row);
        else enc_load(in, t, layer, 8, row);
        if (!same || EXPLICIT_REPEATS) {
            if (!sorted_positions8(cd, m, row, &s)) return R3_ERR_ID_RANGE;
            if (sorted8_has_repeat(s)) return R3_ERR_DUPLICATE;
        }
        int rep = t > 0 && !EXPLICIT_REPEATS && (same || (!exact && vec_equal(s, prev_s)));
        if (t > 0) {
            uint32_t f0 = m->flag_f0;
            int st = (int)(t & 3);
            *fp++ = rep ? REC(REC_MODEL, st, MODEL_TOTAL - f0, f0) : REC(REC_MODEL, st, f0, 0);
            m->flag_cnt[rep]++;
        }
        if (rep) continue;
        for (int j = 0; j < 8; j++) m->ecnt[row[j]]++;
        _mm_storeu_si128((__m128i *)gap, gaps8(s));
        const uint64_t *rtab = m->rtab;
        uint32_t *cnt = m->cnt;
        for (int i = 0; i < 8; i++, rtab += A, cnt += A) {
            uint64_t r = rtab[gap[i]];
            *rp++ = r & ~ESC_FOLLOWS;
            if (r & ESC_FOLLOWS) *rp++ = REC(REC_UNIF, (i + 1) & 3, UNIF_ESC, gap[i]);
            cnt[gap[i]]++;
        }
        if (exact) rp = push_split(rp, &cd->perm, UNIF_PERM, lehmer_rank8(row), 2, 3);
        nfresh++;
        prev_s = s;
    }
    e->nrec = (size_t)(rp - e->rec);
    e->nflags = (size_t)(fp - e->flags);
    model_account(m);
    uint64_t cost = m->cost_acc + nfresh * perm_cost, fallback = in->tokens * cd->fallback_q12;
    return cost + fallback / 256 < fallback;
}
#endif

static int enc_layer_adaptive(Enc *e, const Codec *cd, Model *m, const Input *in, int64_t layer)
{
#if HAVE_SORT8
    if (cd->K == 8 && cd->A > 1) return enc_adaptive_k8(e, cd, m, in, layer);
#endif
    if (cd->K == 8 && cd->W == 2) return enc_adaptive_impl(e, cd, m, in, layer, 8, 2);
    if (cd->K == 8 && cd->W == 4) return enc_adaptive_impl(e, cd, m, in, layer, 8, 4);
    return enc_adaptive_impl(e, cd, m, in, layer, cd->K, cd->W);
}

static int enc_layer(Enc *e, const Codec *cd, Model *m, const Input *in, int64_t layer, int per_layer)
{
    int adaptive = 0, rc;
    uint64_t *rp = e->rec, *limit = rp;
    if ((rc = rec_room(e, &rp, &limit))) return rc;
    e->nrec = 0;
    if (per_layer) {
        e->nrec = 1; /* record 0: the layer's method bit, set below */
        adaptive = enc_layer_adaptive(e, cd, m, in, layer);
        if (adaptive < 0) return adaptive;
        e->rec[0] = REC(REC_RAW, 0, 1, adaptive);
    }
    if (!adaptive) {
        e->nrec = per_layer;
        if ((rc = enc_layer_fallback(e, cd, in, layer))) return rc;
        return flush_records(e, cd, m, e->rec, e->nrec);
    }
    /* Decoding order: the method bit, all the layer's repeat flags, then the fresh rows' gaps
     * (the decoder knows every row's flag before it walks the gaps). */
    if ((rc = flush_records(e, cd, m, e->rec + 1, e->nrec - 1))) return rc;
    if ((rc = flush_records(e, cd, m, e->flags, e->nflags))) return rc;
    return flush_records(e, cd, m, e->rec, 1);
}

static int64_t enc_finish(Enc *e, const Header *hd_in, uint8_t **out)
{
    Header hd = *hd_in;
    hd.payload_len = 8 * NSTATES + 4 * (uint64_t)e->nwords;
    size_t len = HEADER_BYTES + hd.payload_len;
    uint8_t *blob = malloc(len);
    if (!blob) return R3_ERR_NOMEM;
    header_write(blob, &hd);
    uint8_t *p = blob + HEADER_BYTES;
    for (int s = 0; s < NSTATES; s++, p += 8) store_le(p, e->x[s], 8);
    for (size_t j = e->nwords; j-- > 0; p += 4) store_le(p, e->words[j], 4);
    store_le(blob + HEADER_BYTES - 4, blob_crc(blob, len), 4);
    *out = blob;
    return (int64_t)len;
}

/* Encodes ids (uint8 or uint16, shape tokens x layers x K, C order) into a malloc'd blob
 * (*out, free with r3_free). Returns the blob length or a negative R3_ERR_* code; on
 * R3_ERR_ID_RANGE / R3_ERR_DUPLICATE call r3_validate for the first offending row. */
int64_t r3_encode(const void *ids, int32_t itemsize, int64_t tokens, int64_t layers, int32_t K,
                  int32_t E, int32_t mode, uint8_t **out, int64_t *info)
{
    Codec cd;
    Model m;
    Enc e;
    (void)info;
    if ((itemsize != 1 && itemsize != 2) || K < 1 || K > MAX_K || E < 2 || E > MAX_E || K > E ||
        mode < 0 || mode > 1 || tokens < 0 || tokens > UINT32_MAX || layers < 1 ||
        layers > UINT32_MAX || (uint64_t)tokens * layers * K > MAX_ELEMENTS)
        return R3_ERR_ARGS;
    memset(&e, 0, sizeof(e));
    memset(&m, 0, sizeof(m));
    int64_t rc = codec_init(&cd, E, K, mode);
    Header hd = {mode, 0, K, E, tokens, layers, 0};
    Input in = {ids, itemsize, tokens, layers};
    hd.coding = per_layer_coding(tokens, &cd);
    if (!rc && hd.coding) rc = model_alloc(&m, &cd, 1, tokens * layers >= RCP_MIN_ROWS, tokens);
    if (!rc && hd.coding) {
        size_t rows = (size_t)(tokens < BLOCK_TOKENS ? tokens : BLOCK_TOKENS);
        e.flags = malloc(rows * sizeof(uint64_t));
        if (!e.flags) rc = R3_ERR_NOMEM;
    }
    for (int s = 0; s < NSTATES; s++) e.x[s] = RANS_L;
    /* rANS is LIFO: the last block's last layer is coded first. */
    for (int64_t b = (tokens - 1) / BLOCK_TOKENS; b >= 0 && !rc; b--) {
        Input blk = in;
        blk.ids = (const uint8_t *)ids + (size_t)(b * BLOCK_TOKENS * layers * K * itemsize);
        blk.tokens = tokens - b * BLOCK_TOKENS < BLOCK_TOKENS ? tokens - b * BLOCK_TOKENS
                                                              : BLOCK_TOKENS;
        for (int64_t l = layers - 1; l >= 0 && !rc; l--)
            rc = enc_layer(&e, &cd, &m, &blk, l, hd.coding);
    }
    if (!rc) rc = enc_finish(&e, &hd, out);
    free(e.words);
    free(e.rec);
    free(e.flags);
    model_free(&m);
    codec_free(&cd);
    return rc;
}

void r3_free(void *p) { free(p); }

/* ------------------------------------------------------------------ decoder */

typedef struct {
    const uint8_t *p, *end;
    uint64_t x0, x1, x2, x3; /* rANS states */
    int bad;         /* BAD_* sub-code of the first problem, 0 if none */
} Dec;

FORCE_INLINE void dec_fail(Dec *d, int why) { d->bad = d->bad ? d->bad : why; }

FORCE_INLINE void dec_renorm(Dec *d, uint64_t *x)
{
    if (*x >= RANS_L) return;
    if (d->p >= d->end) { /* keep the state in range so decoding stays well-defined */
        dec_fail(d, BAD_OVERRUN);
        *x |= RANS_L;
        return;
    }
    *x = (*x << 32) | load_le32(d->p);
    d->p += 4;
}

FORCE_INLINE uint32_t dec_raw(Dec *d, uint64_t *x, int n)
{
    uint32_t v = (uint32_t)(*x & ((1ull << n) - 1));
    *x >>= n;
    dec_renorm(d, x);
    return v;
}

FORCE_INLINE uint32_t dec_unif(Dec *d, uint64_t *x, const Unif *u)
{
    uint32_t slot = (uint32_t)(*x & ((1ull << UNIF_BITS) - 1));
    uint32_t s = (uint32_t)mulhi64(slot, u->magic);
    if (s >= u->T) { /* slot in the unused tail of the range */
        dec_fail(d, BAD_SYMBOL);
        s = 0;
    }
    *x = (uint64_t)u->f * (*x >> UNIF_BITS) + slot - (uint64_t)s * u->f;
    dec_renorm(d, x);
    return s;
}

FORCE_INLINE uint32_t dec_model(Dec *d, uint64_t *x, const uint32_t *cum, const uint16_t *lut,
                                int lut_shift)
{
    uint32_t slot = (uint32_t)(*x & (MODEL_TOTAL - 1));
    uint32_t s = lut[slot >> lut_shift];
    while (cum[s + 1] <= slot) s++;
    *x = (uint64_t)(cum[s + 1] - cum[s]) * (*x >> MODEL_BITS) + slot - cum[s];
    dec_renorm(d, x);
    return s;
}

/* Mirror of push_split; values >= M are corrupt. */
FORCE_INLINE u128 dec_split(Dec *d, const Split *s, const Unif *u, uint64_t *x_top,
                            uint64_t *x_raw)
{
    if (!s->active) return 0;
    u128 v = (u128)dec_unif(d, x_top, u) << s->b;
    for (int lo = 0; lo < s->b; lo += 31) {
        int n = s->b - lo < 31 ? s->b - lo : 31;
        v |= (u128)dec_raw(d, x_raw, n) << lo;
    }
    if (v >= s->M) {
        dec_fail(d, BAD_RANK);
        v = 0;
    }
    return v;
}

typedef struct {
    void *out;
    int itemsize;
    int64_t tokens, layers;
} Output;

FORCE_INLINE size_t out_offset(const Codec *cd, const Output *o, int64_t t, int64_t layer)
{
    return (size_t)(t * o->layers + layer) * cd->K;
}

/* Re-validation of a decoded sorted row: strictly increasing and below E. */
FORCE_INLINE int sorted_row_ok(const uint16_t *sorted, int K, int E)
{
    int bad = sorted[K - 1] >= E;
    for (int j = 1; j < K; j++) bad |= sorted[j] <= sorted[j - 1];
    return !bad;
}

/* Re-validates a decoded row (cheap) and writes it. */
FORCE_INLINE void dec_store_sorted(Dec *d, const Codec *cd, const Output *o, int64_t t,
                                   int64_t layer, int K, const uint16_t *row)
{
    prefetch_row(o->out, o->itemsize, t, o->tokens, o->layers, layer, K, 1);
    if (!cd->exact && !sorted_row_ok(row, K, cd->E)) dec_fail(d, BAD_OUTPUT);
    store_row(o->out, o->itemsize, out_offset(cd, o, t, layer), K, row);
}

static void dec_chunk_ranks(Dec *d, const Codec *cd, int n, u128 *rank, uint64_t *pidx)
{
    for (int j = 0; j < n; j++) {
        rank[j] = dec_split(d, &cd->rank, &cd->unif[UNIF_RANK], &d->x0, &d->x1);
        if (cd->exact)
            pidx[j] = (uint64_t)dec_split(d, &cd->perm, &cd->unif[UNIF_PERM], &d->x2, &d->x3);
    }
}

FORCE_INLINE void dec_fallback_impl(Dec *dp, const Codec *cd, const Output *o, int64_t layer,
                                    const int K)
{
    u128 rank[UNRANK_CHUNK];
    uint64_t pidx[UNRANK_CHUNK];
    uint16_t sorted[MAX_K], row[MAX_K], lanes[LANES][MAX_K];
    Dec d = *dp;
    for (int64_t t0 = 0; t0 < o->tokens && !d.bad; t0 += UNRANK_CHUNK) {
        int n = o->tokens - t0 < UNRANK_CHUNK ? (int)(o->tokens - t0) : UNRANK_CHUNK;
        /* Entropy-decode a chunk first, so the independent unranks below can overlap. */
        dec_chunk_ranks(&d, cd, n, rank, pidx);
        if (d.bad) break;
        for (int j = 0; j < n;) {
            if (j + LANES <= n && !cd->wide) {
                colex_unrank64_lanes(cd, K, rank + j, lanes);
                for (int l = 0; l < LANES; l++, j++) {
                    if (cd->exact) lehmer_unrank(cd, pidx[j], lanes[l], K, row);
                    dec_store_sorted(&d, cd, o, t0 + j, layer, K, cd->exact ? row : lanes[l]);
                }
                continue;
            }
            colex_unrank(cd, K, rank[j], sorted);
            if (cd->exact) lehmer_unrank(cd, pidx[j], sorted, K, row);
            dec_store_sorted(&d, cd, o, t0 + j, layer, K, cd->exact ? row : sorted);
            j++;
        }
    }
    *dp = d;
}

static void dec_layer_fallback(Dec *dp, const Codec *cd, const Output *o, int64_t layer)
{
    if (cd->K == 8) dec_fallback_impl(dp, cd, o, layer, 8);
    else dec_fallback_impl(dp, cd, o, layer, cd->K);
}

/* One gap at row position i: escape means the gap follows uniformly and must be one the
 * model lacked. Returns the expert, or -1 if the position runs past the row's end. */
FORCE_INLINE int dec_gap(Dec *d, uint64_t *x, const Codec *cd, Model *m, int K, int i, int *pos,
                         int lut_bits)
{
    int A = cd->A;
    const uint32_t *cum = m->cum + (size_t)i * (A + 2);
    int g = (int)dec_model(d, x, cum, m->lut + ((size_t)i << lut_bits), MODEL_BITS - lut_bits);
    if (g == A) {
        g = (int)dec_unif(d, x, &cd->unif[UNIF_ESC]);
        if (cum[g + 1] != cum[g]) dec_fail(d, BAD_ESCAPE);
    }
    model_count_gap(m, i, g);
    *pos += 1 + g;
    if (*pos > cd->E - K + i) {
        dec_fail(d, BAD_GAP);
        return -1;
    }
    int e = m->perm[*pos];
    m->ecnt[e]++;
    return e;
}

/* Sets bit e: in registers lo/hi up to 128 experts (no store-to-load chains), else in bm. */
FORCE_INLINE void set_expert(int W, int e, uint64_t *lo, uint64_t *hi, uint64_t *bm)
{
    uint64_t bit = 1ull << (e & 63);
    if (W <= 2) {
        uint64_t in_hi = 0 - (uint64_t)(e >> 6);
        *hi |= bit & in_hi;
        *lo |= bit & ~in_hi;
    } else {
        bm[e >> 6] |= bit;
    }
}

/* Mirror of enc_gaps: the row's experts (in popularity order) in ex, their bitmap in bm.
 * Returns 0 if the stream went bad. */
FORCE_INLINE int dec_gaps(Dec *d, const Codec *cd, Model *m, int K, int W, uint16_t *ex,
                          uint64_t *bm)
{
    int pos = -1, e;
    uint64_t lo = 0, hi = 0;
    for (int w = 0; w < W; w++) bm[w] = 0;
    if (cd->A == 1) { /* E == K: the set is always all experts */
        for (e = 0; e < cd->E; e++) ex[e] = (uint16_t)e, bm[e >> 6] |= 1ull << (e & 63);
        return 1;
    }
#define DEC_GAP(X, I)                                                  \
    if ((I) == K) break;                                               \
    if ((e = dec_gap(d, &d->X, cd, m, K, (I), &pos, m->lut_bits)) < 0) return 0; \
    set_expert(W, e, &lo, &hi, bm);                                    \
    ex[I] = (uint16_t)e;
    for (int i = 0; i < K; i += 4) { /* gap i on state (i + 1) & 3 */
        DEC_GAP(x1, i)
        DEC_GAP(x2, i + 1)
        DEC_GAP(x3, i + 2)
        DEC_GAP(x0, i + 3)
    }
#undef DEC_GAP
    if (W <= 2) {
        bm[0] = lo;
        bm[1] = hi;
    }
    int n = 0;
    for (int w = 0; w < W; w++) n += __builtin_popcountll(bm[w]);
    return n == K; /* distinct by construction; re-checked cheaply */
}

/* The layer's repeat flags (rows 1..tokens-1; flag t on state t & 3), decoded ahead of its
 * gaps with the flag model's own rebuild schedule (it depends on the flags alone): m->rep[t]
 * and the list of fresh rows m->fresh. The gap walks then branch on a byte that is ready
 * long before the rANS states are, or (r3_check) visit only the fresh rows. */
#define DEC_FLAG(X)                                                                         \
    {                                                                                       \
        if (t == next) {                                                                    \
            f0 = flag_freq((uint64_t)t + 1 - n1, n1); /* counts start at 1 each */          \
            f1 = MODEL_TOTAL - f0;                                                          \
            next = rebuild_after(next);                                                     \
        }                                                                                   \
        uint32_t slot = (uint32_t)(X) & (MODEL_TOTAL - 1), r = slot >= f0;                  \
        uint32_t mask = 0u - r, f = f0 ^ ((f0 ^ f1) & mask);                                \
        (X) = (uint64_t)f * ((X) >> MODEL_BITS) + slot - (f0 & mask);                       \
        dec_renorm(&d, &(X));                                                               \
        n1 += r;                                                                            \
        rep[t] = (uint8_t)r;                                                                \
        fresh[nf] = (uint32_t)t;                                                            \
        nf += !r;                                                                           \
        if (++t >= tokens) break;                                                           \
    }
/* Branch-free but for renormalization: a flag is as unpredictable as the data. */
static void dec_flags(Dec *dp, Model *m, int64_t tokens)
{
    Dec d = *dp;
    uint8_t *rep = m->rep;
    uint32_t *fresh = m->fresh, f0 = flag_freq(1, 1), f1 = MODEL_TOTAL - f0;
    uint64_t n1 = 1;
    int64_t t = 1, nf = 1, next = FIRST_REBUILD;
    rep[0] = 0;
    fresh[0] = 0;
    while (t < tokens && !d.bad) {
        DEC_FLAG(d.x1)
        DEC_FLAG(d.x2)
        DEC_FLAG(d.x3)
        DEC_FLAG(d.x0)
    }
    m->nfresh = nf;
    *dp = d;
}
#undef DEC_FLAG

/* The previous row is re-read from the output (scalar loads of scalar stores): a copy in a
 * local buffer would cost a store-forwarding stall per row. */
FORCE_INLINE void copy_prev_row(const Output *o, size_t off, size_t back, int K)
{
    if (o->itemsize == 1) {
        uint8_t *p = (uint8_t *)o->out + off;
        for (int j = 0; j < K; j++) p[j] = p[(ptrdiff_t)j - (ptrdiff_t)back];
    } else {
        uint16_t *p = (uint16_t *)o->out + off;
        for (int j = 0; j < K; j++) p[j] = p[(ptrdiff_t)j - (ptrdiff_t)back];
    }
}

FORCE_INLINE int same_as_prev_row(const Output *o, size_t off, size_t back, int K,
                                  const uint16_t *row)
{
    unsigned diff = 0;
    if (o->itemsize == 1) {
        const uint8_t *p = (const uint8_t *)o->out + off - back;
        for (int j = 0; j < K; j++) diff |= p[j] ^ row[j];
    } else {
        const uint16_t *p = (const uint16_t *)o->out + off - back;
        for (int j = 0; j < K; j++) diff |= p[j] ^ row[j];
    }
    return diff == 0;
}

FORCE_INLINE void dec_adaptive_impl(Dec *dp, const Codec *cd, Model *m, const Output *o,
                                    int64_t layer, const int K, const int W, const int emit)
{
    uint16_t row[MAX_K], sorted[MAX_K], ex[MAX_K];
    uint64_t bm[MAX_W], prev_bm[MAX_W] = {0};
    u128 prev_idx = 0;
    size_t back = (size_t)o->layers * K;
    Dec d = *dp;
    model_reset(m, cd);
    for (int64_t t = 0; t < o->tokens && !d.bad; t++) {
        if (t == m->next_rebuild) model_rebuild(m, cd);
        size_t off = 0;
        if (emit) {
            prefetch_row(o->out, o->itemsize, t, o->tokens, o->layers, layer, K, 1);
            off = out_offset(cd, o, t, layer);
        }
        if (m->rep[t]) {
            if (emit) copy_prev_row(o, off, back, K);
            continue;
        }
        if (!dec_gaps(&d, cd, m, K, W, ex, bm)) {
            dec_fail(&d, BAD_OUTPUT);
            break;
        }
        if (cd->exact) {
            u128 idx = dec_split(&d, &cd->perm, &cd->unif[UNIF_PERM], &d.x2, &d.x3);
            if (emit) {
                sort_by_bits(ex, K, bm, W, sorted);
                lehmer_unrank(cd, (uint64_t)idx, sorted, K, row);
                if (t > 0 && same_as_prev_row(o, off, back, K, row)) dec_fail(&d, BAD_REPEAT);
                store_row(o->out, o->itemsize, off, K, row);
            } else if (t > 0 && idx == prev_idx && bitmaps_equal(bm, prev_bm, W)) {
                dec_fail(&d, BAD_REPEAT); /* same set, same order */
            }
            prev_idx = idx;
        } else {
            if (t > 0 && bitmaps_equal(bm, prev_bm, W)) dec_fail(&d, BAD_REPEAT);
            if (emit) {
                sort_by_bits(ex, K, bm, W, sorted);
                store_row(o->out, o->itemsize, off, K, sorted);
            }
        }
        copy_bits(prev_bm, bm, W);
    }
    *dp = d;
}

#if HAVE_SORT8
FORCE_INLINE void store_row8(const Output *o, size_t off, __m128i s)
{
    if (o->itemsize == 1) _mm_storel_epi64((__m128i *)((uint8_t *)o->out + off), _mm_packus_epi16(s, s));
    else _mm_storeu_si128((__m128i *)((uint16_t *)o->out + off), s);
}

/* dec_adaptive_impl for rows of 8: the set is sorted, checked and (canonical mode) stored as
 * one SSE register; a repeated canonical row is that register stored again. With emit = 0
 * (r3_check) nothing is stored: an exact-mode row repeats the previous one iff its set and
 * its Lehmer index do (the index is a bijection onto the set's orders). */
FORCE_INLINE void dec_k8_impl(Dec *dp, const Codec *cd, Model *m, const Output *o, int64_t layer,
                              const int lut_bits, const int emit)
{
    const int exact = cd->exact;
    const size_t back = (size_t)o->layers * 8;
    uint16_t sorted[8], row[MAX_K];
    __m128i prev_s = _mm_setzero_si128();
    u128 prev_idx = 0;
    Dec d = *dp;
    model_reset(m, cd);
    for (int64_t t = 0; t < o->tokens && !d.bad; t++) {
        if (t == m->next_rebuild) model_rebuild(m, cd);
        size_t off = 0;
        if (emit) {
            prefetch_row(o->out, o->itemsize, t, o->tokens, o->layers, layer, 8, 1);
            off = out_offset(cd, o, t, layer);
        }
        if (m->rep[t]) {
            if (emit && exact) copy_prev_row(o, off, back, 8);
            else if (emit) store_row8(o, off, prev_s);
            continue;
        }
        int pos = -1, e0, e1, e2, e3, e4, e5, e6, e7; /* gap i on state (i + 1) & 3 */
        if ((e0 = dec_gap(&d, &d.x1, cd, m, 8, 0, &pos, lut_bits)) < 0 ||
            (e1 = dec_gap(&d, &d.x2, cd, m, 8, 1, &pos, lut_bits)) < 0 ||
            (e2 = dec_gap(&d, &d.x3, cd, m, 8, 2, &pos, lut_bits)) < 0 ||
            (e3 = dec_gap(&d, &d.x0, cd, m, 8, 3, &pos, lut_bits)) < 0 ||
            (e4 = dec_gap(&d, &d.x1, cd, m, 8, 4, &pos, lut_bits)) < 0 ||
            (e5 = dec_gap(&d, &d.x2, cd, m, 8, 5, &pos, lut_bits)) < 0 ||
            (e6 = dec_gap(&d, &d.x3, cd, m, 8, 6, &pos, lut_bits)) < 0 ||
            (e7 = dec_gap(&d, &d.x0, cd, m, 8, 7, &pos, lut_bits)) < 0)
            break;
        __m128i s = sort8_u16(_mm_setr_epi16((short)e0, (short)e1, (short)e2, (short)e3,
                                             (short)e4, (short)e5, (short)e6, (short)e7));
        if (sorted8_has_repeat(s)) dec_fail(&d, BAD_OUTPUT); /* distinct by construction */
        if (exact) {
            u128 idx = dec_split(&d, &cd->perm, &cd->unif[UNIF_PERM], &d.x2, &d.x3);
            if (!emit) {
                if (t > 0 && idx == prev_idx && vec_equal(s, prev_s)) dec_fail(&d, BAD_REPEAT);
                prev_s = s;
                prev_idx = idx;
                continue;
            }
            _mm_storeu_si128((__m128i *)sorted, s);
            lehmer_unrank(cd, (uint64_t)idx, sorted, 8, row);
            if (t > 0 && same_as_prev_row(o, off, back, 8, row)) dec_fail(&d, BAD_REPEAT);
            store_row(o->out, o->itemsize, off, 8, row);
            continue;
        }
        if (t > 0 && vec_equal(s, prev_s)) dec_fail(&d, BAD_REPEAT);
        if (emit) store_row8(o, off, s);
        prev_s = s;
    }
    *dp = d;
}

/* The lookup-table size is a compile-time constant in each copy (a variable shift costs 3%). */
static void dec_adaptive_k8(Dec *dp, const Codec *cd, Model *m, const Output *o, int64_t layer)
{
    if (m->lut_bits == LUT_BITS) dec_k8_impl(dp, cd, m, o, layer, LUT_BITS, 1);
    else dec_k8_impl(dp, cd, m, o, layer, LUT_BITS_SMALL, 1);
}

/* r3_check's walk of an adaptive layer with rows of 8: dec_k8_impl with emit = 0, written for
 * registers. It works in popularity-position space: positions grow strictly within a row, so
 * a row's set is its 8 positions packed into two words (no expert lookup, no sort), and expert
 * popularity is counted per position (pcnt, reordered with the positions at each rebuild by
 * pos_rebuild; the expert ids themselves are never needed). Model fields are copied into
 * locals, so stores cannot force reloads of them. Failure sub-codes come in dec_k8_impl's
 * order. */
#define CHK_FAIL(why) (bad = bad ? bad : (why))
#define CHK_RENORM(X)                                                                       \
    if ((X) < RANS_L) {                                                                     \
        if (p < end) {                                                                      \
            (X) = (X) << 32 | load_le32(p);                                                 \
            p += 4;                                                                         \
        } else {                                                                            \
            CHK_FAIL(BAD_OVERRUN);                                                          \
            (X) |= RANS_L;                                                                  \
        }                                                                                   \
    }
#define CHK_GAP(X, I, KEY)                                                                  \
    {                                                                                       \
        const uint32_t *cum = cum0 + (I) * (A + 2);                                         \
        uint32_t slot = (uint32_t)(X) & (MODEL_TOTAL - 1);                                  \
        uint32_t b = ((I) << lut_bits) + (slot >> (MODEL_BITS - lut_bits));                \
        uint32_t g = lut8 ? ((const uint8_t *)lut0)[b] : lut0[b];                           \
        while (cum[g + 1] <= slot) g++;                                                     \
        uint32_t lo = cum[g];                                                               \
        (X) = (uint64_t)(cum[g + 1] - lo) * ((X) >> MODEL_BITS) + slot - lo;                \
        CHK_RENORM(X)                                                                       \
        if (g == (uint32_t)A) {                                                             \
            uint32_t us = (uint32_t)(X) & ((1u << UNIF_BITS) - 1);                          \
            g = (uint32_t)mulhi64(us, esc.magic);                                           \
            if (g >= esc.T) {                                                               \
                CHK_FAIL(BAD_SYMBOL);                                                       \
                g = 0;                                                                      \
            }                                                                               \
            (X) = (uint64_t)esc.f * ((X) >> UNIF_BITS) + us - (uint64_t)g * esc.f;          \
            CHK_RENORM(X)                                                                   \
            if (cum[g + 1] != cum[g]) CHK_FAIL(BAD_ESCAPE);                                 \
        }                                                                                   \
        pos += 1 + (int)g;                                                                  \
        if (pos > E - 8 + (I)) {                                                            \
            CHK_FAIL(BAD_GAP);                                                              \
            break;                                                                          \
        }                                                                                   \
        KEY |= (uint64_t)pos << (16 * ((I) & 3));                                           \
    }

/* The statistics of the fresh rows walked since the last rebuild, from their positions: a gap
 * is the distance to the previous position less one. Counted here rather than in the walk,
 * and rows after a layer's last rebuild are never counted (nothing reads those counts). */
static void chk_count_rows(Model *m, uint32_t *pc, int64_t nrows)
{
    const uint64_t *keys = m->keys;
    uint32_t *cnt = m->cnt;
    const int A = m->A;
    for (int64_t r = 0; r < nrows; r++) {
        int prev = -1;
        for (int j = 0; j < 8; j++) {
            int pos = (int)(keys[2 * r + (j >> 2)] >> (16 * (j & 3))) & 0xFFFF;
            pc[pos]++;
            cnt[j * A + pos - prev - 1]++;
            prev = pos;
        }
    }
}

/* A rebuild for r3_check: the buffered rows' counts, the tables, then the order in position
 * space; the previous row's key (its positions, ascending, 16 bits each) is carried over to
 * the new positions. */
static void chk_rebuild(Model *m, const Codec *cd, uint32_t *pc, uint64_t *key, int64_t have_key,
                        int64_t nrows)
{
    uint16_t newpos[MAX_E], s[8];
    chk_count_rows(m, pc, nrows);
    model_rebuild_tables(m, cd);
    pos_rebuild(pc, newpos, cd->E);
    if (!have_key) return;
    for (int j = 0; j < 8; j++) {
        uint16_t v = newpos[(key[j >> 2] >> (16 * (j & 3))) & 0xFFFF];
        int b = j;
        for (; b > 0 && s[b - 1] > v; b--) s[b] = s[b - 1];
        s[b] = v;
    }
    key[0] = key[1] = 0;
    for (int j = 0; j < 8; j++) key[j >> 2] |= (uint64_t)s[j] << (16 * (j & 3));
}

FORCE_INLINE void chk_k8_impl(Dec *dp, const Codec *cd, Model *m, const int lut_bits,
                              const int lut8)
{
    const int A = cd->A, E = cd->E, exact = cd->exact;
    const Unif esc = cd->unif[UNIF_ESC];
    const uint32_t *cum0 = m->cum;
    const uint16_t *lut0 = m->lut;
    uint32_t pcnt[MAX_E];
    uint64_t x0 = dp->x0, x1 = dp->x1, x2 = dp->x2, x3 = dp->x3, key[2] = {0, 0};
    const uint8_t *p = dp->p, *end = dp->end;
    int bad = dp->bad;
    u128 prev_idx = 0;
    const uint32_t *fresh = m->fresh;
    const int64_t nfresh = m->nfresh;
    uint64_t *keys = m->keys;
    int64_t nrows = 0; /* fresh rows walked since the last rebuild */
    memset(pcnt, 0, (size_t)E * sizeof(uint32_t));
    model_reset(m, cd);
    /* Rows between fresh ones repeat and change no gap statistics, so each rebuild point up
     * to row t is run (once, in order) just before fresh row t. */
    for (int64_t j = 0; j < nfresh && !bad; j++) {
        const int64_t t = fresh[j];
        while (t >= m->next_rebuild) {
            chk_rebuild(m, cd, pcnt, key, j, nrows);
            nrows = 0;
        }
        uint64_t k0 = 0, k1 = 0;
        int pos = -1;
        do { /* gap i on state (i + 1) & 3; a position past the row's end breaks out */
            CHK_GAP(x1, 0, k0)
            CHK_GAP(x2, 1, k0)
            CHK_GAP(x3, 2, k0)
            CHK_GAP(x0, 3, k0)
            CHK_GAP(x1, 4, k1)
            CHK_GAP(x2, 5, k1)
            CHK_GAP(x3, 6, k1)
            CHK_GAP(x0, 7, k1)
        } while (0);
        if (bad == BAD_GAP) break;
        int same = j > 0 && k0 == key[0] && k1 == key[1];
        if (exact) {
            Dec d = {p, end, x0, x1, x2, x3, bad};
            u128 idx = dec_split(&d, &cd->perm, &cd->unif[UNIF_PERM], &d.x2, &d.x3);
            p = d.p;
            x2 = d.x2;
            x3 = d.x3;
            bad = d.bad;
            same &= idx == prev_idx;
            prev_idx = idx;
        }
        if (same) CHK_FAIL(BAD_REPEAT);
        key[0] = keys[2 * nrows] = k0;
        key[1] = keys[2 * nrows + 1] = k1;
        nrows++;
    }
    dp->x0 = x0, dp->x1 = x1, dp->x2 = x2, dp->x3 = x3, dp->p = p, dp->bad = bad;
}
#undef CHK_GAP
#undef CHK_RENORM
#undef CHK_FAIL

static void chk_adaptive_k8(Dec *dp, const Codec *cd, Model *m, const Output *o, int64_t layer)
{
    (void)o, (void)layer; /* the fresh-row list (dec_flags) says which rows to walk */
    if (m->lut8 && m->lut_bits == LUT_BITS) chk_k8_impl(dp, cd, m, LUT_BITS, 1);
    else if (m->lut8) chk_k8_impl(dp, cd, m, LUT_BITS_SMALL, 1);
    else if (m->lut_bits == LUT_BITS) chk_k8_impl(dp, cd, m, LUT_BITS, 0);
    else chk_k8_impl(dp, cd, m, LUT_BITS_SMALL, 0);
}
#endif

static void dec_layer_adaptive(Dec *dp, const Codec *cd, Model *m, const Output *o, int64_t layer)
{
#if HAVE_SORT8
    if (cd->K == 8 && cd->A > 1) {
        dec_adaptive_k8(dp, cd, m, o, layer);
        return;
    }
#endif
    if (cd->K == 8 && cd->W == 2) dec_adaptive_impl(dp, cd, m, o, layer, 8, 2, 1);
    else if (cd->K == 8 && cd->W == 4) dec_adaptive_impl(dp, cd, m, o, layer, 8, 4, 1);
    else dec_adaptive_impl(dp, cd, m, o, layer, cd->K, cd->W, 1);
}

static void chk_layer_adaptive(Dec *dp, const Codec *cd, Model *m, const Output *o, int64_t layer)
{
#if HAVE_SORT8
    if (cd->K == 8 && cd->A > 1) {
        chk_adaptive_k8(dp, cd, m, o, layer);
        return;
    }
#endif
    if (cd->K == 8 && cd->W == 2) dec_adaptive_impl(dp, cd, m, o, layer, 8, 2, 0);
    else dec_adaptive_impl(dp, cd, m, o, layer, cd->K, cd->W, 0);
}

/* r3_check's fallback layer: the ranks (and Lehmer indices) alone. A rank below C(E, K) (an
 * index below K!) unranks to K distinct ids < E (one order), so range-checking them, as
 * dec_split does, is what decoding checks; the unrank itself only builds the output. */
static void chk_layer_fallback(Dec *dp, const Codec *cd, const Output *o)
{
    u128 rank[UNRANK_CHUNK];
    uint64_t pidx[UNRANK_CHUNK];
    Dec d = *dp;
    for (int64_t t0 = 0; t0 < o->tokens && !d.bad; t0 += UNRANK_CHUNK) {
        int n = o->tokens - t0 < UNRANK_CHUNK ? (int)(o->tokens - t0) : UNRANK_CHUNK;
        dec_chunk_ranks(&d, cd, n, rank, pidx);
    }
    *dp = d;
}

/* o->out == NULL: check only (r3_check), nothing is written. */
static int dec_payload(Dec *d, Codec *cd, const Header *hd, const Output *o)
{
    Model m;
    int rc = R3_OK, guessed = 0, emit = o->out != NULL;
    memset(&m, 0, sizeof(m));
    uint64_t *xs[NSTATES] = {&d->x0, &d->x1, &d->x2, &d->x3};
    for (int s = 0; s < NSTATES; s++, d->p += 8) {
        *xs[s] = load_le(d->p, 8);
        if (*xs[s] < RANS_L || *xs[s] >> 63) dec_fail(d, BAD_FINAL);
    }
    if (hd->coding) rc = model_alloc(&m, cd, 0, 0, hd->tokens);
    /* r3_check's walk for rows of 8 (chk_adaptive_k8) reads byte tables where symbols fit. */
    m.lut8 = !emit && HAVE_SORT8 && cd->K == 8 && cd->A > 1 && cd->A < 255;
    for (int64_t b = 0; b * BLOCK_TOKENS < hd->tokens && !rc && !d->bad; b++) {
        Output blk = *o;
        if (emit)
            blk.out = (uint8_t *)o->out + (size_t)(b * BLOCK_TOKENS * o->layers * cd->K * o->itemsize);
        blk.tokens = o->tokens - b * BLOCK_TOKENS < BLOCK_TOKENS ? o->tokens - b * BLOCK_TOKENS
                                                                  : BLOCK_TOKENS;
        for (int64_t l = 0; l < hd->layers && !rc && !d->bad; l++) {
            if (hd->coding && dec_raw(d, &d->x0, 1)) {
                dec_flags(d, &m, blk.tokens);
                if (d->bad) break;
                if (emit) dec_layer_adaptive(d, cd, &m, &blk, l);
                else chk_layer_adaptive(d, cd, &m, &blk, l);
                continue;
            }
            if (!emit) {
                chk_layer_fallback(d, cd, &blk);
                continue;
            }
            if (!guessed && hd->tokens * hd->layers >= GUESS_MIN_ROWS) {
                guessed = 1;
                if ((rc = guess_init(cd))) break;
            }
            dec_layer_fallback(d, cd, &blk, l);
        }
    }
    model_free(&m);
    uint64_t ends = (d->x0 ^ RANS_L) | (d->x1 ^ RANS_L) | (d->x2 ^ RANS_L) | (d->x3 ^ RANS_L);
    if (!rc && (ends || d->p != d->end)) dec_fail(d, BAD_FINAL);
    return rc;
}

static int32_t decode_blob(const uint8_t *blob, int64_t len, void *out, int32_t out_itemsize,
                           int64_t *info)
{
    Header hd;
    Codec cd;
    int rc = header_read(blob, len, &hd);
    if (rc) return rc;
    if (out && out_itemsize != (hd.E <= 256 ? 1 : 2)) return R3_ERR_ARGS;
    if (load_le(blob + HEADER_BYTES - 4, 4) != blob_crc(blob, (size_t)len)) return R3_ERR_CHECKSUM;
    rc = codec_init(&cd, hd.E, hd.K, hd.mode);
    if (!rc && !header_consistent(&hd, &cd)) rc = R3_ERR_HEADER;
    Dec d = {blob + HEADER_BYTES, blob + len, 0, 0, 0, 0, 0};
    Output o = {out, out_itemsize, hd.tokens, hd.layers};
    if (!rc) rc = dec_payload(&d, &cd, &hd, &o);
    codec_free(&cd);
    if (!rc && d.bad) {
        info[0] = d.bad;
        rc = R3_ERR_CORRUPT;
    }
    return rc;
}

/* Decodes a blob into out (uint8 if E <= 256 else uint16, shape from the header). Returns 0
 * or a negative R3_ERR_* code; for R3_ERR_CORRUPT, info[0] holds the BAD_* sub-code. */
int32_t r3_decode(const uint8_t *blob, int64_t len, void *out, int32_t out_itemsize, int64_t *info)
{
    if (!out) return R3_ERR_ARGS;
    return decode_blob(blob, len, out, out_itemsize, info);
}

/* Everything r3_decode checks, with the same return codes and sub-codes, but no output: the
 * stream is walked (model updates, range checks, repeat checks, final state) and the ids are
 * never materialised. For a store that must refuse bad routing but does not need the ids. */
int32_t r3_check(const uint8_t *blob, int64_t len, int64_t *info)
{
    return decode_blob(blob, len, NULL, 0, info);
}

/* ------------------------------------------------------------------ batch check */

#define MAX_CHECK_THREADS 64

typedef struct {
    const uint8_t *const *blobs;
    const int64_t *lens;
    int32_t n, next; /* next: index of the next blob to take (atomic) */
    int32_t *rcs;
    int64_t *infos;
} Batch;

static void *batch_worker(void *arg)
{
    Batch *b = arg;
    for (;;) {
        int32_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->n) return NULL;
        b->rcs[i] = r3_check(b->blobs[i], b->lens[i], b->infos + 4 * (size_t)i);
    }
}

/* r3_check of n blobs on up to `threads` threads (the caller's included): rcs[i] and
 * infos[4i..4i+3] are blob i's results. One call per batch, so a caller that releases a lock
 * around foreign calls (Python's GIL under ctypes) releases it once. Returns the number of
 * threads used; if thread creation fails, the caller's thread does the rest. */
int32_t r3_check_many(const uint8_t *const *blobs, const int64_t *lens, int32_t n, int32_t threads,
                      int32_t *rcs, int64_t *infos)
{
    pthread_t tids[MAX_CHECK_THREADS];
    Batch b = {blobs, lens, n, 0, rcs, infos};
    int32_t want = threads < n ? threads : n, started = 0;
    if (want > MAX_CHECK_THREADS) want = MAX_CHECK_THREADS;
    while (started + 1 < want && !pthread_create(&tids[started], NULL, batch_worker, &b)) started++;
    batch_worker(&b);
    for (int32_t t = 0; t < started; t++) pthread_join(tids[t], NULL);
    return started + 1;
}
