/* Few-row float32 linear for CPU verify forwards (see ddtree/cpu_linear.py).
 *
 * y[m, j] = sum_k x[m, k] * w[j, k] (+ bias[j]).  Each weight row is streamed from
 * memory once and applied to every input row while it sits in L1, which is what a
 * 2-32 row forward needs and what BLAS small-M paths do poorly.  Every output is
 * summed in the same order whatever the number of rows, so a row's result does not
 * depend on the rows it is batched with (the tree verify and one-token decode agree
 * bit for bit in these layers).
 */
#include <immintrin.h>
#include <stddef.h>

#define PREFETCH_ROWS 4 /* how far ahead (in weight rows) to prefetch */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* MB input rows (at x, stride K) against weight rows w0 and, if two, w1. */
#define ROW_BLOCK(MB)                                                                      \
    static void rows_##MB(const float *x, const float *w0, const float *w1, float *y,      \
                          long K, long N, long j, int two, const float *pf) {              \
        __m256 a0[MB], a1[MB];                                                             \
        for (int m = 0; m < MB; m++) {                                                     \
            a0[m] = _mm256_setzero_ps();                                                   \
            a1[m] = _mm256_setzero_ps();                                                   \
        }                                                                                  \
        long k = 0;                                                                        \
        if (two) {                                                                         \
            for (; k + 8 <= K; k += 8) {                                                   \
                if (pf && (k & 15) == 0) {                                                 \
                    _mm_prefetch((const char *)(pf + k), _MM_HINT_T0);                     \
                    _mm_prefetch((const char *)(pf + K + k), _MM_HINT_T0);                 \
                }                                                                          \
                __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);         \
                for (int m = 0; m < MB; m++) {                                             \
                    __m256 xv = _mm256_loadu_ps(x + m * K + k);                            \
                    a0[m] = _mm256_fmadd_ps(xv, v0, a0[m]);                                \
                    a1[m] = _mm256_fmadd_ps(xv, v1, a1[m]);                                \
                }                                                                          \
            }                                                                              \
        } else {                                                                           \
            for (; k + 8 <= K; k += 8) {                                                   \
                __m256 v0 = _mm256_loadu_ps(w0 + k);                                       \
                for (int m = 0; m < MB; m++)                                               \
                    a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), v0, a0[m]);    \
            }                                                                              \
        }                                                                                  \
        for (int m = 0; m < MB; m++) {                                                     \
            float s0 = hsum(a0[m]), s1 = two ? hsum(a1[m]) : 0.f;                          \
            for (long t = k; t < K; t++) {                                                 \
                s0 += x[m * K + t] * w0[t];                                                \
                if (two) s1 += x[m * K + t] * w1[t];                                       \
            }                                                                              \
            y[m * N + j] = s0;                                                             \
            if (two) y[m * N + j + 1] = s1;                                                \
        }                                                                                  \
    }
ROW_BLOCK(1)
ROW_BLOCK(2)
ROW_BLOCK(3)
ROW_BLOCK(4)

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all contiguous float32. */
void ddtree_skinny_linear(const float *x, const float *w, const float *bias, float *y,
                          long M, long K, long N, int threads) {
    long pairs = (N + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < pairs; p++) {
        long j = 2 * p;
        int two = j + 1 < N;
        const float *w0 = w + j * K, *w1 = two ? w0 + K : w0;
        const float *pf = j + PREFETCH_ROWS + 1 < N ? w0 + PREFETCH_ROWS * K : NULL;
        for (long m = 0; m < M; m += 4) {
            long mb = M - m < 4 ? M - m : 4;
            const float *xm = x + m * K, *pfm = m == 0 ? pf : NULL;
            float *ym = y + m * N;
            switch (mb) {
                case 4: rows_4(xm, w0, w1, ym, K, N, j, two, pfm); break;
                case 3: rows_3(xm, w0, w1, ym, K, N, j, two, pfm); break;
                case 2: rows_2(xm, w0, w1, ym, K, N, j, two, pfm); break;
                default: rows_1(xm, w0, w1, ym, K, N, j, two, pfm); break;
            }
        }
        if (bias)
            for (long m = 0; m < M; m++) {
                y[m * N + j] += bias[j];
                if (two) y[m * N + j + 1] += bias[j + 1];
            }
    }
}
