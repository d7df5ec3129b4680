/*
 * flush8_probe.c -- what a second rANS state chain (8 states, a format change) would buy the
 * encoder's flush (issue 16, BENCHMARKS.md "Routing codec", round 3). Not part of the product.
 *
 * flush8_probe.patch adds a switch `r3_probe_flush` to the encoder: 1 codes every record of a
 * flush as a model step on state j & 3 (one 4-lane AVX2 chain, as the real flush does for 98%
 * of the skewed records), 2 on state j & 7 (two independent 4-lane chains). The blobs are not
 * decodable; the record pass is the real one, so the three timings differ in the flush only.
 * Run on a scratch copy of the tree (x86-64 with AVX2):
 *
 *   git worktree add /tmp/probe HEAD && cd /tmp/probe && git apply tests/bench/flush8_probe.patch
 *   python3 -m services.common._build
 *   python3 -c "import sys; sys.path.insert(0, 'tests/bench'); from routing_data import *; \
 *               skewed_routing(16384).tofile('/tmp/sk.u8')"
 *   gcc -O2 -o /tmp/probe8 tests/bench/flush8_probe.c services/common/_routing_core.so \
 *       -Wl,-rpath,$PWD/services/common
 *   taskset -c 0 /tmp/probe8 /tmp/sk.u8 5
 *
 * Prints the best encode MB/s (thread CPU time, 7 calls per round, variants alternating over
 * the rounds) of the real flush and of the probe's one- and two-chain flushes.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int64_t r3_encode(const void *ids, int32_t itemsize, int64_t tokens, int64_t layers, int32_t K,
                  int32_t E, int32_t mode, uint8_t **out, int64_t *info);
void r3_free(void *p);
extern int32_t r3_probe_flush;

static double cpu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const int64_t T = 16384, L = 48, K = 8;
    const size_t n = (size_t)(T * L * K);
    if (argc < 2) {
        fprintf(stderr, "usage: %s ROUTING.u8 [ROUNDS]\n", argv[0]);
        return 2;
    }
    uint8_t *ids = malloc(n);
    FILE *f = fopen(argv[1], "rb");
    if (!ids || !f || fread(ids, 1, n, f) != n) {
        fprintf(stderr, "%s: need %zu bytes (16,384 tokens x 48 layers x top-8)\n", argv[1], n);
        return 2;
    }
    fclose(f);
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    double best[3] = {1e9, 1e9, 1e9};
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < 3; v++) {
            r3_probe_flush = v;
            for (int k = 0; k < 7; k++) {
                uint8_t *blob = NULL;
                double t = cpu_now();
                int64_t len = r3_encode(ids, 1, T, L, (int32_t)K, 128, 0, &blob, NULL);
                t = cpu_now() - t;
                if (len < 0) {
                    fprintf(stderr, "r3_encode: error %lld\n", (long long)len);
                    return 1;
                }
                r3_free(blob);
                if (t < best[v]) best[v] = t;
            }
        }
    printf("%s: real %.1f MB/s, probe one chain (4 states) %.1f MB/s, two chains (8 states) "
           "%.1f MB/s; two vs one chain %.3fx, two chains vs real %.3fx\n", argv[1],
           (double)n / best[0] / 1e6, (double)n / best[1] / 1e6, (double)n / best[2] / 1e6,
           best[1] / best[2], best[0] / best[2]);
    return 0;
}
