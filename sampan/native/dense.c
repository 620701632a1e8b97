/* The CPU kernel of sampan.layers.linear's backward: the gradient at a linear layer's
 * output made ready for its two GEMMs in one pass over it (see sampan/native/__init__.py
 * for how it is built and called). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __SSE2__
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#define ROWS 16 /* rows a block: transposed while they are in the L1 cache */
#define MAX_THREADS 256

static void relu_row(const float *restrict g, const float *restrict y, float *restrict out,
                     int64_t o) {
    for (int64_t j = 0; j < o; j++) {
        float gv = g[j], yv = y[j]; /* both loaded: the select vectorizes */
        out[j] = yv <= 0.0f ? 0.0f : gv;
    }
}

static void add_row(float *restrict acc, const float *restrict x, int64_t o) {
    for (int64_t j = 0; j < o; j++) acc[j] += x[j];
}

/* g [n, o] row-major, the gradient at the layer's output (after its ReLU, if it has one).
 *   y [n, o]: the layer's output, for the ReLU's backward (NULL: no ReLU);
 *   gr [n, o]: g where y > 0, else 0, as aten::threshold_backward(g, y, 0); needed with
 *     y, NULL without (the caller then uses g itself);
 *   gt [o, n]: that gradient transposed, what oneDNN's weight-gradient GEMM reads (NULL:
 *     not wanted);
 *   bias [o]: its sum over the rows, the bias's gradient (NULL: not wanted): each block's
 *     rows summed in fp32, the blocks in double, the threads' sums in thread order.
 * Returns 0, -1 when memory for the sums could not be had, -2 for y without gr (nothing
 * written then). */
int dense_grad(const float *g, const float *y, int64_t n, int64_t o, float *gr, float *gt,
               float *bias, int threads) {
    if (y && !gr) return -2;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    double *sums = 0;
    float *part = 0;
    if (bias) {
        sums = calloc((size_t)threads * (size_t)o, sizeof(double));
        part = malloc((size_t)threads * (size_t)o * sizeof(float));
        if (!sums || !part) {
            free(sums);
            free(part);
            return -1;
        }
    }
    int64_t blocks = (n + ROWS - 1) / ROWS;
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
#pragma omp single
        used = nt;
        double *acc = sums ? sums + (size_t)t * o : 0;
        float *blk = part ? part + (size_t)t * o : 0;
        int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        for (int64_t b = b0; b < b1; b++) {
            int64_t r0 = b * ROWS, h = n - r0 < ROWS ? n - r0 : ROWS;
            if (blk) memset(blk, 0, (size_t)o * sizeof(float));
            for (int64_t i = 0; i < h; i++) {
                const float *restrict gi = g + (r0 + i) * o;
                if (y) {
                    relu_row(gi, y + (r0 + i) * o, gr + (r0 + i) * o, o);
                    gi = gr + (r0 + i) * o;
                }
                if (blk) add_row(blk, gi, o);
            }
            if (acc) {
                for (int64_t j = 0; j < o; j++) acc[j] += blk[j];
            }
            if (gt) {  /* the block's rows, as written (or g itself), into columns r0.. */
                const float *src = y ? gr : g;
                int64_t j0 = 0;
#ifdef __SSE2__
                if (h == ROWS) { /* 4 x 4 blocks through registers */
                    for (; j0 + 4 <= o; j0 += 4) {
                        for (int64_t i = 0; i < ROWS; i += 4) {
                            const float *s0 = src + (r0 + i) * o + j0;
                            __m128 a = _mm_loadu_ps(s0), b = _mm_loadu_ps(s0 + o),
                                   c = _mm_loadu_ps(s0 + 2 * o), d = _mm_loadu_ps(s0 + 3 * o);
                            _MM_TRANSPOSE4_PS(a, b, c, d);
                            float *t0 = gt + j0 * n + r0 + i;
                            _mm_storeu_ps(t0, a);
                            _mm_storeu_ps(t0 + n, b);
                            _mm_storeu_ps(t0 + 2 * n, c);
                            _mm_storeu_ps(t0 + 3 * n, d);
                        }
                    }
                }
#endif
                for (int64_t j = j0; j < o; j++) {
                    float *tj = gt + j * n + r0;
                    const float *sj = src + r0 * o + j;
                    for (int64_t i = 0; i < h; i++) tj[i] = sj[i * o];
                }
            }
        }
    }
    if (bias) {
        for (int64_t j = 0; j < o; j++) {
            double s = 0.0;
            for (int t = 0; t < used; t++) s += sums[(size_t)t * o + j];
            bias[j] = (float)s;
        }
        free(sums);
        free(part);
    }
    return 0;
}
