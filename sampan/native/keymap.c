/* The CPU kernels of sampan.embedding.dynamic.KeyIndex: the probe of a batch of keys and
 * the insert of new ones, one pass over the keys each, on the map's own memory.
 *
 * Built by sampan/native/__init__.py with the system C compiler the first time a CPU map
 * needs it, and called through ctypes (the GIL is released for the call). The layout and
 * the hash are those of dynamic.py: slot s holds [salted key, index row] at 2s and 2s + 1
 * (row 0: empty, -1: deleted); a key's probe sequence starts at mix64(key) & mask and goes
 * one slot at a time; table t's keys are XORed with salts[t] and own the index rows
 * (starts[t], starts[t + 1]].
 */
#include <stdint.h>

#define LOW32 0xFFFFFFFFll
#define MAX_USES (2147483647ll - 1) /* a stamp never reaches int64 max: a free row's mark */
#define AHEAD 16                   /* keys whose home slot is prefetched ahead */

static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline int64_t salted(const int64_t *keys, const int64_t *tables,
                             const int64_t *salts, int64_t i) {
    return tables ? keys[i] ^ salts[tables[i]] : keys[i];
}

/* Rows of n keys (of tables: NULL for one table) -> out[i]: the row in the key's table
 * (starts subtracted), or 0 where it has none; the positions of those go to miss[] (in
 * order) and their number is returned. mode 0 reads only; 1 stamps each found row with
 * step (lru, ttl); 2 adds one use per occurrence and stamps step in the low 32 bits (lfu),
 * as KeyIndex._stamp does for a key's count. The search runs on up to threads threads
 * (OpenMP, when built with it); the stamps are written by one. */
int64_t keymap_probe(const int64_t *slots, int64_t mask, const int64_t *keys,
                     const int64_t *tables, const int64_t *salts, const int64_t *starts,
                     int64_t n, int64_t *out, int64_t *miss, int64_t *stamps, int mode,
                     int64_t step, int threads) {
    int64_t missing = 0;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 8192)
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            uint64_t ahead = mix64((uint64_t)salted(keys, tables, salts, i + AHEAD)) & mask;
            __builtin_prefetch(slots + 2 * ahead);
        }
        int64_t key = salted(keys, tables, salts, i);
        int64_t lo = tables ? starts[tables[i]] : 0;
        int64_t hi = tables ? starts[tables[i] + 1] : INT64_MAX;
        uint64_t pos = mix64((uint64_t)key) & mask;
        int64_t row = 0;
        for (;;) {
            int64_t r = slots[2 * pos + 1];
            if (r == 0) break;
            if (slots[2 * pos] == key && r > lo && r <= hi) { row = r; break; }
            pos = (pos + 1) & mask;
        }
        out[i] = row;
    }
    for (int64_t i = 0; i < n; i++) {
        if (mode && i + AHEAD < n && out[i + AHEAD] > 0)
            __builtin_prefetch(stamps + out[i + AHEAD], 1);
        int64_t row = out[i];
        if (row == 0) { miss[missing++] = i; continue; }
        if (mode == 1) {
            stamps[row] = step;
        } else if (mode == 2) {
            int64_t uses = (stamps[row] >> 32) + 1;
            if (uses > MAX_USES) uses = MAX_USES;
            stamps[row] = (uses << 32) + (step & LOW32);
        }
        if (tables) out[i] = row - starts[tables[i]];
    }
    return missing;
}

/* Put n absent, distinct salted keys in the map with their index rows, each at the first
 * empty or deleted slot of its probe sequence; row_slot[row] gets the slot. Returns how
 * many empty slots were used (deleted ones were already counted as used). */
int64_t keymap_insert(int64_t *slots, int64_t mask, const int64_t *keys,
                      const int64_t *rows, int64_t n, int64_t *row_slot) {
    int64_t fresh = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(slots + 2 * (mix64((uint64_t)keys[i + AHEAD]) & mask), 1);
        uint64_t pos = mix64((uint64_t)keys[i]) & mask;
        while (slots[2 * pos + 1] > 0) pos = (pos + 1) & mask;
        fresh += slots[2 * pos + 1] == 0;
        slots[2 * pos] = keys[i];
        slots[2 * pos + 1] = rows[i];
        row_slot[rows[i]] = (int64_t)pos;
    }
    return fresh;
}
