/*
 * routing_core.c -- compiled core of the routed-expert codec (services/common/routing.py).
 *
 * The code lives in routing_core/, one file per section, and is compiled as ONE translation
 * unit from here (`python -m services.common._build`, run by `make setup` and the images), so
 * the compiler sees every static function exactly as before the split. core.h: shared types
 * and constants.
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
#include "routing_core/core.h"

#include "routing_core/crc32c.c"
#include "routing_core/uniform.c"
#include "routing_core/codec.c"
#include "routing_core/rows.c"
#include "routing_core/ranking.c"
#include "routing_core/model.c"
#include "routing_core/encoder.c"
#include "routing_core/decoder.c"
#include "routing_core/check.c"
