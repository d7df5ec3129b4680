/* routing_core/check.c -- batch check on threads (r3_check_many).
 * A section of ../routing_core.c (one translation unit; see core.h). */
#include "core.h"

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
