/* routing_core/decoder.c -- decoder and check (r3_decode, r3_check).
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

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
