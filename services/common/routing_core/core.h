/*
 * core.h -- private header of the routing codec's C core: includes, types, error codes,
 * format constants and the small inline helpers every section uses.
 *
 * The sections (*.c in this folder) are compiled as ONE translation unit by ../routing_core.c,
 * which includes them in order, so every static function stays visible to the optimiser exactly
 * as in the single file they were split from (same code, same speed). Not a public API.
 */
#ifndef R3_ROUTING_CORE_H
#define R3_ROUTING_CORE_H

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

#endif /* R3_ROUTING_CORE_H */
