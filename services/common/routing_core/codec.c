/* routing_core/codec.c -- encoder records and per-shape codec constants.
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

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
