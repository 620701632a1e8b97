/* The CPU kernels of sampan.embedding.collection's lookup: the deduplication of a batch's
 * row ids (one stable sort) and the per-row sum of their gradients (see
 * sampan/native/__init__.py for how they are built and called). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DIGIT 11
#define BUCKETS (1 << DIGIT)

/* keys [n] in [0, bound) (bound <= 2^32), sorted stably by an LSD radix sort on the bits
 * bound needs:
 *   order [n]: the positions of keys in ascending key order, ties in position order;
 *   uniq [u], counts [u]: the distinct keys ascending and how often each occurs;
 *   inverse [n]: the index in uniq of each key.
 * Returns u; -1 when memory could not be had, -2 when a key is outside [0, bound) (nothing
 * useful is written then: the caller takes the general path). */
int64_t sort_dedup(const int64_t *keys, int64_t n, int64_t bound, int64_t *order,
                   int64_t *uniq, int64_t *counts, int64_t *inverse) {
    if (n == 0) return 0;
    int bits = 0;
    while (bits < 32 && ((uint64_t)1 << bits) < (uint64_t)bound) bits++;
    uint32_t *k0 = malloc((size_t)n * sizeof(uint32_t)), *k1 = malloc((size_t)n * sizeof(uint32_t));
    uint32_t *p0 = malloc((size_t)n * sizeof(uint32_t)), *p1 = malloc((size_t)n * sizeof(uint32_t));
    int64_t *hist = malloc(BUCKETS * sizeof(int64_t));
    int64_t u = 0;
    if (!k0 || !k1 || !p0 || !p1 || !hist) {
        u = -1;
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        if (keys[i] < 0 || keys[i] >= bound) {
            u = -2;
            goto done;
        }
        k0[i] = (uint32_t)keys[i];
        p0[i] = (uint32_t)i;
    }
    for (int shift = 0; shift < bits; shift += DIGIT) {
        memset(hist, 0, BUCKETS * sizeof(int64_t));
        for (int64_t i = 0; i < n; i++) hist[(k0[i] >> shift) & (BUCKETS - 1)]++;
        int64_t at = 0;
        for (int b = 0; b < BUCKETS; b++) {
            int64_t c = hist[b];
            hist[b] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t to = hist[(k0[i] >> shift) & (BUCKETS - 1)]++;
            k1[to] = k0[i];
            p1[to] = p0[i];
        }
        uint32_t *t = k0; k0 = k1; k1 = t;
        t = p0; p0 = p1; p1 = t;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || k0[i] != k0[i - 1]) {
            uniq[u] = k0[i];
            counts[u] = 0;
            u++;
        }
        counts[u - 1]++;
        order[i] = p0[i];
        inverse[p0[i]] = u - 1;
    }
done:
    free(k0);
    free(k1);
    free(p0);
    free(p1);
    free(hist);
    return u;
}

/* out [u, d] = for each distinct row, the sum of the rows of grads [n, d] at its
 * positions (order, grouped by counts as sort_dedup gives them), added in position order;
 * the distinct rows are shared out over up to threads threads. Returns 0, -1 without
 * memory. */
int segment_sum(const float *grads, int64_t d, const int64_t *order, const int64_t *counts,
                int64_t u, float *out, int threads) {
    int64_t *start = malloc((size_t)(u + 1) * sizeof(int64_t));
    if (!start) return -1;
    start[0] = 0;
    for (int64_t r = 0; r < u; r++) start[r + 1] = start[r] + counts[r];
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (u > 1024)
    for (int64_t r = 0; r < u; r++) {
        float *o = out + r * d;
        const float *first = grads + order[start[r]] * d;
        for (int64_t j = 0; j < d; j++) o[j] = first[j];
        for (int64_t k = start[r] + 1; k < start[r + 1]; k++) {
            const float *g = grads + order[k] * d;
            for (int64_t j = 0; j < d; j++) o[j] += g[j];
        }
    }
    free(start);
    return 0;
}
