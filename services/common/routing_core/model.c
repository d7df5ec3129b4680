/* routing_core/model.c -- adaptive model.
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

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
