/* routing_core/encoder.c -- blob header and encoder (r3_encode, r3_free).
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

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

/* One record coded into its state (scalar); see flush_records. */
FORCE_INLINE void flush_one(uint64_t *xs, uint32_t *words, size_t *nw, const Codec *cd,
                            const Model *m, uint64_t r)
{
    uint32_t start = (uint32_t)r, param = (uint32_t)(r >> 32) & 0x1ffff;
    int kind = (int)(r >> 56) & 3, st = (int)(r >> 58) & 3;
    uint64_t x = xs[st];
    if (kind == REC_MODEL) {
        x = emit_if(words, nw, x, (uint64_t)param << (63 - MODEL_BITS));
        if (!m->rcp || param == 1) { /* small inputs skip the reciprocal tables */
            x = ((x / param) << MODEL_BITS) + (x % param) + start;
        } else {
            uint64_t q = mulhi64(x, m->rcp[param]) >> m->rshift[param];
            x += start + q * (MODEL_TOTAL - param);
        }
    } else if (kind == REC_RAW) {
        x = emit_if(words, nw, x, 1ull << (63 - param));
        x = (x << param) | start;
    } else {
        const Unif *u = &cd->unif[param];
        x = emit_if(words, nw, x, (uint64_t)u->f << 32);
        uint64_t q = mulhi64(x, u->rcp) >> u->rcp_shift;
        x += (uint64_t)start * u->f + q * u->cmpl;
    }
    xs[st] = x;
}

/* Test switch (ctypes): 1 = always the scalar flush, whatever the CPU (the bytes must not
 * change; tests compare the two). */
int32_t r3_scalar_flush = 0;

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_FLUSH4 1
/* FLUSH4_PICK[mask]: dword indices (2 x lane) of the lanes whose renormalization emits a
 * word, lane 3 first (lane 3 is record j, which the scalar loop codes first), for
 * _mm256_permutevar8x32_epi32; the rest 0 (stored past the words kept, then overwritten). */
static const uint32_t FLUSH4_PICK[16][8] = {
#define P(a, b, c, d) {a, b, c, d, 0, 0, 0, 0}
    P(0, 0, 0, 0), P(0, 0, 0, 0), P(2, 0, 0, 0), P(2, 0, 0, 0), P(4, 0, 0, 0), P(4, 0, 0, 0),
    P(4, 2, 0, 0), P(4, 2, 0, 0), P(6, 0, 0, 0), P(6, 0, 0, 0), P(6, 2, 0, 0), P(6, 2, 0, 0),
    P(6, 4, 0, 0), P(6, 4, 0, 0), P(6, 4, 2, 0), P(6, 4, 2, 0)
#undef P
};

/* mulhi64 of four lanes from 32-bit products. */
__attribute__((target("avx2"))) static inline __m256i mulhi64x4(__m256i a, __m256i b)
{
    const __m256i lo32 = _mm256_set1_epi64x(0xffffffff);
    __m256i ah = _mm256_srli_epi64(a, 32), bh = _mm256_srli_epi64(b, 32);
    __m256i ll = _mm256_mul_epu32(a, b), hl = _mm256_mul_epu32(ah, b);
    __m256i lh = _mm256_mul_epu32(a, bh), hh = _mm256_mul_epu32(ah, bh);
    __m256i mid = _mm256_add_epi64(_mm256_add_epi64(_mm256_srli_epi64(ll, 32),
                                                    _mm256_and_si256(hl, lo32)),
                                   _mm256_and_si256(lh, lo32));
    return _mm256_add_epi64(_mm256_add_epi64(hh, _mm256_srli_epi64(hl, 32)),
                            _mm256_add_epi64(_mm256_srli_epi64(lh, 32),
                                             _mm256_srli_epi64(mid, 32)));
}

/* A lane order: byte l of `order` is the state lane l holds. Returns the lane of each state
 * (byte s), or 0 if the four states are not all different. */
FORCE_INLINE uint32_t lanes_of_states(uint32_t order)
{
    uint32_t seen = 0, lanes = 0;
    for (uint32_t l = 0; l < 4; l++) {
        uint32_t s = order >> (8 * l) & 3;
        seen |= 1u << s;
        lanes |= l << (8 * s);
    }
    return seen == 15 ? lanes | 1u << 31 : 0;
}

/* Dword indices for _mm256_permutevar8x32_epi32: lane l takes lane src[l] (byte l). */
__attribute__((target("avx2"))) static inline __m256i lane_moves(uint32_t src)
{
    __m256i two = _mm256_slli_epi64(_mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)(src & 0x03030303))), 1);
    return _mm256_or_si256(two, _mm256_add_epi64(_mm256_slli_epi64(two, 32),
                                                 _mm256_set1_epi64x(1ll << 32)));
}

/* flush_records where the CPU has AVX2: four model records on four different states (the
 * gaps i..i+3 of a row, the flags of rows t..t+3) are coded at once: they are independent,
 * and their words are stored in the scalar order, so the bytes are the same. Between such
 * steps the states stay in one register, lane l holding the state of record j - 3 + l of the
 * last step (the next step mostly needs the same order: gaps i and i + 4, flags t and t + 4
 * share states). Anything else (escapes, raw bits, uniform digits, frequency 1) takes the
 * scalar step, with the states in memory until the next 4-lane step. */
__attribute__((target("avx2"))) static void flush_avx2(uint64_t *xs, uint32_t *words,
                                                       size_t *nwp, const Codec *cd,
                                                       const Model *m, const uint64_t *rec,
                                                       size_t n)
{
    const __m256i fmask = _mm256_set1_epi64x(0x1ffff), smask = _mm256_set1_epi64x(0xffffffff);
    const __m256i one = _mm256_set1_epi64x(1), total = _mm256_set1_epi64x(MODEL_TOTAL);
    const uint64_t *rcp = m->rcp;
    const uint8_t *rshift = m->rshift;
    size_t nw = *nwp, j = n;
    uint32_t cur = 0; /* 0: the states are in xs; else byte l = the state lane l holds */
    __m256i x = _mm256_setzero_si256();
    while (j >= 4) {
        const uint64_t *rq = rec + j - 4;
        uint64_t r0 = rq[0], r1 = rq[1], r2 = rq[2], r3 = rq[3];
        if (r3 >> 56 & 3) { /* the next record is not a model one (fallback layers: none are) */
            if (cur) {
                _mm256_storeu_si256((__m256i *)xs,
                                    _mm256_permutevar8x32_epi32(x, lane_moves(lanes_of_states(cur))));
                cur = 0;
            }
            flush_one(xs, words, &nw, cd, m, r3);
            j--;
            continue;
        }
        uint32_t f0 = (uint32_t)(r0 >> 32) & 0x1ffff, f1 = (uint32_t)(r1 >> 32) & 0x1ffff;
        uint32_t f2 = (uint32_t)(r2 >> 32) & 0x1ffff, f3 = (uint32_t)(r3 >> 32) & 0x1ffff;
        uint32_t order = (uint32_t)(r0 >> 58 & 3) | (uint32_t)(r1 >> 50 & 0x300) |
                         (uint32_t)(r2 >> 42 & 0x30000) | (uint32_t)(r3 >> 34 & 0x3000000);
        uint32_t want = order == cur ? 1 : lanes_of_states(order);
        if (!want || ((r0 | r1 | r2 | r3) >> 56 & 3) || f0 == 1 || f1 == 1 || f2 == 1 ||
            f3 == 1) { /* not four model records on four states: one scalar step */
            if (cur) {
                _mm256_storeu_si256((__m256i *)xs,
                                    _mm256_permutevar8x32_epi32(x, lane_moves(lanes_of_states(cur))));
                cur = 0;
            }
            flush_one(xs, words, &nw, cd, m, rec[--j]);
            continue;
        }
        if (!cur) {
            x = _mm256_loadu_si256((const __m256i *)xs);
            cur = 0x03020100;
        }
        if (order != cur) { /* lane l takes the lane that holds state order[l] */
            uint32_t have = lanes_of_states(cur), src = 0;
            for (int l = 0; l < 4; l++) src |= (have >> (8 * (order >> (8 * l) & 3)) & 3) << (8 * l);
            x = _mm256_permutevar8x32_epi32(x, lane_moves(src));
            cur = order;
        }
        __m256i r = _mm256_loadu_si256((const __m256i *)rq);
        __m256i f = _mm256_and_si256(_mm256_srli_epi64(r, 32), fmask);
        __m256i lim = _mm256_slli_epi64(f, 63 - MODEL_BITS);
        __m256i c = _mm256_cmpgt_epi64(x, _mm256_sub_epi64(lim, one)); /* x >= lim (< 2^63) */
        int mk = _mm256_movemask_pd(_mm256_castsi256_pd(c));
        __m256i pick = _mm256_loadu_si256((const __m256i *)FLUSH4_PICK[mk]);
        _mm_storeu_si128((__m128i *)(words + nw),
                         _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x, pick)));
        nw += (size_t)__builtin_popcount((unsigned)mk);
        x = _mm256_blendv_epi8(x, _mm256_srli_epi64(x, 32), c);
        __m256i rc = _mm256_setr_epi64x((long long)rcp[f0], (long long)rcp[f1],
                                        (long long)rcp[f2], (long long)rcp[f3]);
        __m256i sh = _mm256_setr_epi64x(rshift[f0], rshift[f1], rshift[f2], rshift[f3]);
        __m256i q = _mm256_srlv_epi64(mulhi64x4(x, rc), sh);
        __m256i b = _mm256_sub_epi64(total, f); /* < 2^15; q < 2^48: two 32-bit products */
        __m256i qb = _mm256_add_epi64(
            _mm256_mul_epu32(q, b), _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(q, 32), b), 32));
        x = _mm256_add_epi64(x, _mm256_add_epi64(_mm256_and_si256(r, smask), qb));
        j -= 4;
    }
    if (cur)
        _mm256_storeu_si256((__m256i *)xs, _mm256_permutevar8x32_epi32(x, lane_moves(lanes_of_states(cur))));
    while (j > 0) flush_one(xs, words, &nw, cd, m, rec[--j]);
    *nwp = nw;
}
#else
#define HAVE_FLUSH4 0
#endif

/* Codes the layer's records back to front (rANS is LIFO); no divisions. */
static int flush_records(Enc *e, const Codec *cd, const Model *m, const uint64_t *rec, size_t n)
{
    uint64_t xs[NSTATES];
    memcpy(xs, e->x, sizeof(xs));
    if (reserve_words(e, n + 4)) return R3_ERR_NOMEM; /* the 4-lane step stores 4 words */
    uint32_t *words = e->words;
    size_t nw = e->nwords;
#if HAVE_FLUSH4
    __builtin_cpu_init(); /* idempotent; fills the feature bits the check reads */
    if (m->rcp && !r3_scalar_flush && __builtin_cpu_supports("avx2")) {
        flush_avx2(xs, words, &nw, cd, m, rec, n);
    } else
#endif
    {
        for (size_t j = n; j-- > 0;) flush_one(xs, words, &nw, cd, m, rec[j]);
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
