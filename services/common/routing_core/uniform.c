/* routing_core/uniform.c -- near-uniform coding (Unif, Split).
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

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
