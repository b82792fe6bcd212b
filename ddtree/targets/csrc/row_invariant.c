/* Row-invariant CPU kernels: a linear layer and tree attention (see ddtree/targets/row_kernels.py).
 *
 * Every output is reduced in one fixed order that depends only on the output's own inputs, never on how
 * many rows, nodes or threads share the call. So a token's logits from a tree-verify forward are bit for
 * bit what a one-token forward computes for it, in every dtype: float32, bfloat16 and float16 are computed
 * in float32 and rounded once (to nearest even), float64 in float64.
 *
 * linear:    y[m, j] = sum_k x[m, k] * w[j, k] (+ bias[j])   (w row-major [N, K]; or [K, N] with transposed)
 * attention: for each query, softmax over its visible keys in logical order (the row's committed prefix
 *            from its first visible column, then its tree ancestors and itself in index order), then the
 *            weighted sum of their values. The plain decode step passes the same keys in the same order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_F64 = 3 };

/* The product tiles are inlined into their callers: as functions of their own, GCC keeps their 24 accumulators
 * in memory (a store per sum per step, half the speed). */
#define TILE_INLINE inline __attribute__((always_inline))

/* ------------------------------------------------------------------ conversions */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

static inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

static inline float load_one(const void *p, long i, int dt) {
    switch (dt) {
        case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
        case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
        default: return ((const float *)p)[i];
    }
}

static inline void store_one(void *p, long i, float v, int dt) {
    switch (dt) {
        case DT_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
        case DT_F16: ((uint16_t *)p)[i] = f32_to_f16(v); break;
        default: ((float *)p)[i] = v;
    }
}

/* 8 consecutive elements of a float32, bfloat16 or float16 array as float32 lanes */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline float load1_f32(const float *p) { return *p; }
static inline float load1_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline float load1_f16(const uint16_t *p) { return f16_to_f32(*p); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline double hsum_pd(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* One fixed-order dot product of float32 x with a weight row of type T: 8 lanes over whole blocks of 8,
 * their fixed horizontal sum, then the tail in order. Every linear output and attention score uses it. */
#define DOT(T)                                                                                   \
    static inline float dot_##T(const float *x, const T##_t *w, long K) {                       \
        __m256 acc = _mm256_setzero_ps();                                                        \
        long k = 0;                                                                              \
        for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8_##T(w + k), acc); \
        float s = hsum(acc);                                                                     \
        for (; k < K; k++) s = fmaf(x[k], load1_##T(w + k), s);                                  \
        return s;                                                                                \
    }
typedef float f32_t;
typedef uint16_t bf16_t;
typedef uint16_t f16_t;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define WIDE 1 /* a -march=native build on an AVX-512 CPU: 16 lanes, tails masked in the same lanes */
static inline __mmask16 tail16(long left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
static inline __m512 load16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 load16_f16(const uint16_t *p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

static inline float dot_f32(const float *x, const float *w, long K) {
    __m512 acc = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        __mmask16 m = tail16(K - k);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#else
DOT(f32)
#endif

/* ------------------------------------------------------------------ linear, weight [N, K] */

/* MB float32 input rows against the weight rows w0 and w1 (w1 == w0 when there is one): each output is
 * exactly dot_T(x row, weight row), the weight rows read once for all MB input rows. */
#define ROWS(T, MB)                                                                              \
    static void rows8_##T##_##MB(const float *x, const T##_t *w0, const T##_t *w1, float *y2,    \
                                 long K) {                                                       \
        __m256 a0[MB], a1[MB];                                                                   \
        for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm256_setzero_ps();                        \
        long k = 0;                                                                              \
        for (; k + 8 <= K; k += 8) {                                                             \
            __m256 v0 = load8_##T(w0 + k), v1 = load8_##T(w1 + k);                              \
            for (int m = 0; m < MB; m++) {                                                       \
                __m256 xv = _mm256_loadu_ps(x + m * K + k);                                      \
                a0[m] = _mm256_fmadd_ps(xv, v0, a0[m]);                                          \
                a1[m] = _mm256_fmadd_ps(xv, v1, a1[m]);                                          \
            }                                                                                    \
        }                                                                                        \
        for (int m = 0; m < MB; m++) {                                                           \
            float s0 = hsum(a0[m]), s1 = hsum(a1[m]);                                            \
            for (long t = k; t < K; t++) {                                                       \
                s0 = fmaf(x[m * K + t], load1_##T(w0 + t), s0);                                  \
                s1 = fmaf(x[m * K + t], load1_##T(w1 + t), s1);                                  \
            }                                                                                    \
            y2[2 * m] = s0;                                                                      \
            y2[2 * m + 1] = s1;                                                                  \
        }                                                                                        \
    }

/* y [M, N] = x [M, K] . w [N, K]^T with ROWFN(x rows, w0, w1, out, K) computing up to 6 input rows against two
 * weight rows: every output is ROWFN's fixed-order sum for its own row, whatever M is. */
#define LINEAR_NK(NAME, WT, XT, ROWFN)                                                           \
    static void NAME(const XT *x, const WT *w, const float *bias, void *y, int ydt, long M, long K, long N, \
                     int threads) {                                                              \
        long pairs = (N + 1) / 2;                                                                \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 16)")                   \
        for (long p = 0; p < pairs; p++) {                                                       \
            long j = 2 * p;                                                                      \
            int two = j + 1 < N;                                                                 \
            const WT *w0 = w + j * K, *w1 = two ? w0 + K : w0;                                   \
            if (j + 12 < N) _mm_prefetch((const char *)(w0 + 10 * K), _MM_HINT_T0);              \
            float out[12];                                                                       \
            for (long m = 0; m < M; m += 6) {                                                    \
                long mb = M - m < 6 ? M - m : 6;                                                 \
                const XT *xm = x + m * K;                                                        \
                switch (mb) {                                                                    \
                    case 6: ROWFN##_6(xm, w0, w1, out, K); break;                                \
                    case 5: ROWFN##_5(xm, w0, w1, out, K); break;                                \
                    case 4: ROWFN##_4(xm, w0, w1, out, K); break;                                \
                    case 3: ROWFN##_3(xm, w0, w1, out, K); break;                                \
                    case 2: ROWFN##_2(xm, w0, w1, out, K); break;                                \
                    default: ROWFN##_1(xm, w0, w1, out, K); break;                               \
                }                                                                                \
                for (long r = 0; r < mb; r++) {                                                  \
                    float s0 = out[2 * r], s1 = out[2 * r + 1];                                  \
                    if (bias) { s0 += bias[j]; if (two) s1 += bias[j + 1]; }                     \
                    store_one(y, (m + r) * N + j, s0, ydt);                                      \
                    if (two) store_one(y, (m + r) * N + j + 1, s1, ydt);                         \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
#ifndef WIDE
#define ROWS_ALL(T) ROWS(T, 1) ROWS(T, 2) ROWS(T, 3) ROWS(T, 4) ROWS(T, 5) ROWS(T, 6)
ROWS_ALL(f32)
ROWS_ALL(bf16)
ROWS_ALL(f16)
LINEAR_NK(linear_nk_f32, float, float, rows8_f32)
LINEAR_NK(linear_nk_bf16, uint16_t, float, rows8_bf16)
LINEAR_NK(linear_nk_f16, uint16_t, float, rows8_f16)
#endif

#ifdef WIDE
/* The same contract with 16 lanes: each output is one masked 16-lane accumulation over k and its fixed
 * reduction, whatever the number of rows. */
#define ROWS16(T, MB)                                                                            \
    static void rows16_##T##_##MB(const float *x, const T##_t *w0, const T##_t *w1, float *y2, long K) { \
        __m512 a0[MB], a1[MB];                                                                   \
        for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm512_setzero_ps();                        \
        for (long k = 0; k < K; k += 16) {                                                       \
            __mmask16 msk = tail16(K - k);                                                       \
            __m512 v0 = load16_##T(w0 + k, msk), v1 = load16_##T(w1 + k, msk);                  \
            for (int m = 0; m < MB; m++) {                                                       \
                __m512 xv = _mm512_maskz_loadu_ps(msk, x + m * K + k);                           \
                a0[m] = _mm512_fmadd_ps(xv, v0, a0[m]);                                          \
                a1[m] = _mm512_fmadd_ps(xv, v1, a1[m]);                                          \
            }                                                                                    \
        }                                                                                        \
        for (int m = 0; m < MB; m++) {                                                           \
            y2[2 * m] = _mm512_reduce_add_ps(a0[m]);                                             \
            y2[2 * m + 1] = _mm512_reduce_add_ps(a1[m]);                                         \
        }                                                                                        \
    }

#define ROWS16_ALL(T) ROWS16(T, 1) ROWS16(T, 2) ROWS16(T, 3) ROWS16(T, 4) ROWS16(T, 5) ROWS16(T, 6)
ROWS16_ALL(f32)
#ifndef __AVX512BF16__
ROWS16_ALL(bf16)
#endif
ROWS16_ALL(f16)
LINEAR_NK(linear_nk16_f32, float, float, rows16_f32)
#ifndef __AVX512BF16__
LINEAR_NK(linear_nk16_bf16, uint16_t, float, rows16_bf16)
#endif
LINEAR_NK(linear_nk16_f16, uint16_t, float, rows16_f16)

#ifdef __AVX512BF16__
/* bfloat16 inputs and weights on a CPU with AVX512-BF16: each step multiplies 32 pairs exactly and adds them
 * into 16 float32 lanes (two products per lane, in a fixed order), so 4x the float32 lanes' work per op. */
#define ROWSDP(MB)                                                                               \
    static void rowsdp_##MB(const uint16_t *x, const uint16_t *w0, const uint16_t *w1, float *y2, long K) { \
        __m512 a0[MB], a1[MB];                                                                   \
        for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm512_setzero_ps();                        \
        for (long k = 0; k < K; k += 32) {                                                       \
            __mmask32 msk = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << (K - k)) - 1); \
            __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(msk, w0 + k);                      \
            __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(msk, w1 + k);                      \
            for (int m = 0; m < MB; m++) {                                                       \
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(msk, x + m * K + k);            \
                a0[m] = _mm512_dpbf16_ps(a0[m], xv, v0);                                         \
                a1[m] = _mm512_dpbf16_ps(a1[m], xv, v1);                                         \
            }                                                                                    \
        }                                                                                        \
        for (int m = 0; m < MB; m++) {                                                           \
            y2[2 * m] = _mm512_reduce_add_ps(a0[m]);                                             \
            y2[2 * m + 1] = _mm512_reduce_add_ps(a1[m]);                                         \
        }                                                                                        \
    }
ROWSDP(1) ROWSDP(2) ROWSDP(3) ROWSDP(4) ROWSDP(5) ROWSDP(6)
LINEAR_NK(linear_nk16_dp, uint16_t, uint16_t, rowsdp)
#endif
#endif

/* ------------------------------------------------------------------ linear, weight [K, N] (x @ w) */

/* Each output y[m, j] is sum_k x[m, k] * w[k, j] accumulated in k order, 8 outputs j at a time. */
#define LINEAR_KN(T)                                                                             \
    static void linear_kn_##T(const float *x, const T##_t *w, const float *bias, void *y, int ydt, \
                              long M, long K, long N, int threads) {                             \
        long blocks = (N + 7) / 8;                                                               \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 16)")                        \
        for (long bj = 0; bj < blocks; bj++) {                                                   \
            long j = bj * 8, width = N - j < 8 ? N - j : 8;                                      \
            float out[8];                                                                        \
            for (long m = 0; m < M; m++) {                                                       \
                const float *xm = x + m * K;                                                     \
                if (width == 8) {                                                                \
                    __m256 acc = _mm256_setzero_ps();                                            \
                    for (long k = 0; k < K; k++)                                                 \
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(xm[k]), load8_##T(w + k * N + j), acc); \
                    _mm256_storeu_ps(out, acc);                                                  \
                } else {                                                                         \
                    for (long c = 0; c < width; c++) out[c] = 0.f;                               \
                    for (long k = 0; k < K; k++)                                                 \
                        for (long c = 0; c < width; c++)                                         \
                            out[c] = fmaf(xm[k], load1_##T(w + k * N + j + c), out[c]);          \
                }                                                                                \
                for (long c = 0; c < width; c++)                                                 \
                    store_one(y, m * N + j + c, bias ? out[c] + bias[j + c] : out[c], ydt);      \
            }                                                                                    \
        }                                                                                        \
    }
LINEAR_KN(f32)
LINEAR_KN(bf16)
LINEAR_KN(f16)

/* ------------------------------------------------------------------ linear, packed weight

 * A weight packed once into panels of 64 output columns, each panel K consecutive 64-column rows (so one pass
 * streams it in order), columns past N zero. Each output y[m, j] is one accumulation over k in order in its
 * own lane: the tile shape (rows per block, columns per vector) never changes which products meet in which
 * order, so any number of rows and threads gives the same bits. bfloat16 on an AVX512-BF16 CPU packs k in
 * pairs ([K/2][64][2], K padded with a zero) for the dot-product instruction, which adds each pair's two
 * products into the lane: again one fixed order per output. */
#define PANEL 64
#if defined(WIDE) && defined(__AVX512BF16__)
#define PAIRED_BF16 1
#else
#define PAIRED_BF16 0
#endif

static long panel_rows(long K, int dt) { return (PAIRED_BF16 && dt == DT_BF16) ? (K + 1) / 2 : K; }
static long elem_bytes(int dt) { return dt == DT_F32 ? 4 : 2; }

/* Bytes a packed [N, K] weight of dtype dt takes (0: this dtype is not packed, float64). */
long ddtree_packed_bytes(long N, long K, int dt) {
    if (dt == DT_F64) return 0;
    long panels = (N + PANEL - 1) / PANEL;
    long per_row = (PAIRED_BF16 && dt == DT_BF16) ? 2 * PANEL : PANEL;
    return panels * panel_rows(K, dt) * per_row * elem_bytes(dt);
}

/* Pack w ([N, K], or [K, N] with transposed) into dst (ddtree_packed_bytes long). */
void ddtree_pack_weight(const void *w, void *dst, long N, long K, int dt, int transposed) {
    long rows = panel_rows(K, dt), panels = (N + PANEL - 1) / PANEL;
    int paired = PAIRED_BF16 && dt == DT_BF16;
    long per_row = paired ? 2 * PANEL : PANEL, eb = elem_bytes(dt);
    memset(dst, 0, (size_t)(panels * rows * per_row * eb));
    for (long n = 0; n < N; n++) {
        long p = n / PANEL, c = n % PANEL;
        for (long k = 0; k < K; k++) {
            long src = transposed ? k * N + n : n * K + k;
            long at = p * rows * per_row + (paired ? (k / 2) * per_row + 2 * c + (k % 2) : k * per_row + c);
            if (eb == 4)
                ((float *)dst)[at] = ((const float *)w)[src];
            else
                ((uint16_t *)dst)[at] = ((const uint16_t *)w)[src];
        }
    }
}

/* Ask for the weight row PREFETCH_K rows ahead while this one is multiplied: the loads stream from memory
 * behind the arithmetic instead of after it, one k-block ahead. Only loads move; the sums and their order do not
 * change. */
#define PREFETCH_K 32
#define PREFETCH_ROW(p, bytes)                                                                   \
    for (long pf = 0; pf < (long)(bytes); pf += 64) _mm_prefetch((const char *)(p) + pf, _MM_HINT_T0)

#ifdef WIDE
/* MR rows against k in [k0, k1) of one panel, continuing sums held in acc (MR x PANEL floats; from zero where k0
 * is 0, acc unread): a float32 accumulator stored and loaded again is the same float, so splitting k this way
 * keeps every sum's order. */
#define PACKED_SPAN(T, MR)                                                                       \
    static TILE_INLINE void span_##T##_##MR(const float *x, const T##_t *wp, float *acc, long K, long k0, long k1) { \
        __m512 a[MR][4];                                                                         \
        for (int r = 0; r < MR; r++)                                                             \
            for (int c = 0; c < 4; c++) a[r][c] = k0 ? _mm512_loadu_ps(acc + r * PANEL + 16 * c) : _mm512_setzero_ps(); \
        for (long k = k0; k < k1; k++) {                                                         \
            const T##_t *wk = wp + k * PANEL;                                                    \
            PREFETCH_ROW(wk + PREFETCH_K * PANEL, PANEL * sizeof(T##_t));                          \
            __m512 w0 = load16_##T(wk, 0xFFFF), w1 = load16_##T(wk + 16, 0xFFFF);               \
            __m512 w2 = load16_##T(wk + 32, 0xFFFF), w3 = load16_##T(wk + 48, 0xFFFF);          \
            for (int r = 0; r < MR; r++) {                                                       \
                __m512 xb = _mm512_set1_ps(x[r * K + k]);                                        \
                a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);                                      \
                a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);                                      \
                a[r][2] = _mm512_fmadd_ps(xb, w2, a[r][2]);                                      \
                a[r][3] = _mm512_fmadd_ps(xb, w3, a[r][3]);                                      \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < MR; r++)                                                             \
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * PANEL + 16 * c, a[r][c]);     \
    }
#define PACKED_SPAN_ALL(T) PACKED_SPAN(T, 1) PACKED_SPAN(T, 2) PACKED_SPAN(T, 3) PACKED_SPAN(T, 4) \
    PACKED_SPAN(T, 5) PACKED_SPAN(T, 6)
PACKED_SPAN_ALL(f32)
PACKED_SPAN_ALL(bf16)
PACKED_SPAN_ALL(f16)
/* MR rows against one whole panel: the span from zero. */
#define PACKED_TILE(T, MR)                                                                       \
    static TILE_INLINE void packed_##T##_##MR(const float *x, const T##_t *wp, float *out, long K) { \
        span_##T##_##MR(x, wp, out, K, 0, K);                                                    \
    }
/* One row against MULTI panels at once: 4 * MULTI independent sums instead of 4 (the same order for each). */
#define MULTI 4
#define PACKED_MULTI(T)                                                                          \
    static TILE_INLINE void packed_multi_##T(const float *x, const T##_t *w, long stride, float *out, long K) { \
        __m512 a[MULTI][4];                                                                      \
        for (int p = 0; p < MULTI; p++) a[p][0] = a[p][1] = a[p][2] = a[p][3] = _mm512_setzero_ps(); \
        for (long k = 0; k < K; k++) {                                                           \
            __m512 xb = _mm512_set1_ps(x[k]);                                                    \
            for (int p = 0; p < MULTI; p++) {                                                    \
                const T##_t *wk = w + p * stride + k * PANEL;                                    \
                PREFETCH_ROW(wk + PREFETCH_K * PANEL, PANEL * sizeof(T##_t));                      \
                for (int c = 0; c < 4; c++) a[p][c] = _mm512_fmadd_ps(xb, load16_##T(wk + 16 * c, 0xFFFF), a[p][c]); \
            }                                                                                    \
        }                                                                                        \
        for (int p = 0; p < MULTI; p++)                                                          \
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + p * PANEL + 16 * c, a[p][c]);     \
    }
PACKED_MULTI(f32)
#define HAVE_MULTI 1
#define PACKED_ROWS 6
#define HAVE_SPAN 1
#define SPAN_ROWS 48 /* rows up to which a product runs k-blocked (acc on the stack: 12 KB) */
#define KBLOCK 32    /* k per block: 8 KB of a float32 panel, held in L1 across the row blocks */
#else
/* One row against one panel: 8 accumulators of 8 lanes (AVX2 has 16 registers). */
#define PACKED_TILE(T, MR)                                                                       \
    static TILE_INLINE void packed_##T##_##MR(const float *x, const T##_t *wp, float *out, long K) {        \
        for (int r = 0; r < MR; r++) {                                                           \
            __m256 a[8];                                                                         \
            for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();                              \
            for (long k = 0; k < K; k++) {                                                       \
                __m256 xb = _mm256_set1_ps(x[r * K + k]);                                        \
                for (int c = 0; c < 8; c++)                                                      \
                    a[c] = _mm256_fmadd_ps(xb, load8_##T(wp + k * PANEL + 8 * c), a[c]);         \
            }                                                                                    \
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + r * PANEL + 8 * c, a[c]);         \
        }                                                                                        \
    }
#define PACKED_ROWS 1
#endif
#define PACKED_ALL(T) PACKED_TILE(T, 1) PACKED_TILE(T, 2) PACKED_TILE(T, 3) PACKED_TILE(T, 4) \
    PACKED_TILE(T, 5) PACKED_TILE(T, 6)
PACKED_ALL(f32)
PACKED_ALL(bf16)
PACKED_ALL(f16)

#if PAIRED_BF16
/* bfloat16 rows (x padded to an even K) against a paired panel over pairs [k0, k1), continuing the sums in acc
 * (see PACKED_SPAN): 32 products per instruction. */
#define PAIRED_SPAN(MR)                                                                          \
    static TILE_INLINE void pspan_##MR(const uint16_t *x, const uint16_t *wp, float *acc, long K2, long k0, long k1) { \
        __m512 a[MR][4];                                                                         \
        for (int r = 0; r < MR; r++)                                                             \
            for (int c = 0; c < 4; c++) a[r][c] = k0 ? _mm512_loadu_ps(acc + r * PANEL + 16 * c) : _mm512_setzero_ps(); \
        for (long k = k0; k < k1; k++) {                                                         \
            const uint16_t *wk = wp + k * 2 * PANEL;                                             \
            PREFETCH_ROW(wk + PREFETCH_K * 2 * PANEL, 2 * PANEL * sizeof(uint16_t));               \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32); \
            __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96); \
            for (int r = 0; r < MR; r++) {                                                       \
                uint32_t two;                                                                    \
                memcpy(&two, x + r * 2 * K2 + 2 * k, 4);                                         \
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)two);                             \
                a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, w0);                                     \
                a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, w1);                                     \
                a[r][2] = _mm512_dpbf16_ps(a[r][2], xb, w2);                                     \
                a[r][3] = _mm512_dpbf16_ps(a[r][3], xb, w3);                                     \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < MR; r++)                                                             \
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * PANEL + 16 * c, a[r][c]);     \
    }
PAIRED_SPAN(1) PAIRED_SPAN(2) PAIRED_SPAN(3) PAIRED_SPAN(4) PAIRED_SPAN(5) PAIRED_SPAN(6)
/* The paired rows against one whole panel: the span from zero. */
#define PAIRED_TILE(MR)                                                                          \
    static TILE_INLINE void paired_##MR(const uint16_t *x, const uint16_t *wp, float *out, long K2) { \
        pspan_##MR(x, wp, out, K2, 0, K2);                                                       \
    }
PAIRED_TILE(1) PAIRED_TILE(2) PAIRED_TILE(3) PAIRED_TILE(4) PAIRED_TILE(5) PAIRED_TILE(6)
/* One bfloat16 row against MULTI paired panels at once (the same order for each sum). */
static TILE_INLINE void paired_multi(const uint16_t *x, const uint16_t *w, long stride, float *out, long K2) {
    __m512 a[MULTI][4];
    for (int p = 0; p < MULTI; p++) a[p][0] = a[p][1] = a[p][2] = a[p][3] = _mm512_setzero_ps();
    for (long k = 0; k < K2; k++) {
        uint32_t two;
        memcpy(&two, x + 2 * k, 4);
        __m512bh xb = (__m512bh)_mm512_set1_epi32((int)two);
        for (int p = 0; p < MULTI; p++) {
            const uint16_t *wk = w + p * stride + k * 2 * PANEL;
            PREFETCH_ROW(wk + PREFETCH_K * 2 * PANEL, 2 * PANEL * sizeof(uint16_t));
            for (int c = 0; c < 4; c++)
                a[p][c] = _mm512_dpbf16_ps(a[p][c], xb, (__m512bh)_mm512_loadu_si512(wk + 32 * c));
        }
    }
    for (int p = 0; p < MULTI; p++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + p * PANEL + 16 * c, a[p][c]);
}
#define HAVE_PAIRED_MULTI 1
#endif

#if PAIRED_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* bfloat16 rows against paired panels on AMX tiles (where the CPU has them and Linux lets this process use
 * them). One tile instruction adds a chunk of 16 pairs into each output, in an order the hardware fixes within
 * the chunk (not the pair-by-pair order of the vector kernel, so a process uses AMX for every row count or for
 * none). The chunks run in k order and the last is K2 % 16 pairs for any row count: each output's sum depends
 * on its row, its column and K alone, so blocks of rows and threads never change it. */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* 1 once Linux grants this process the tile state, -1 where it refuses (the vector kernel then runs always). */
static int amx_state;

static int amx_ready(void) {
    if (amx_state == 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    }
    return amx_state > 0;
}

/* Tiles 0-3: the sums of mb rows by 64 columns; 4/5: a chunk of x and of one 16-column slice of the panel;
 * 6/7: the same for the last `tail` pairs. Loaded for every block: other code on this thread (oneDNN) may have
 * set its own. */
static void amx_configure(long mb, long tail) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) {
        c.rows[t] = (uint8_t)mb;
        c.colsb[t] = 64;
    }
    c.rows[4] = (uint8_t)mb;
    c.colsb[4] = 64;
    c.rows[5] = 16;
    c.colsb[5] = 64;
    if (tail) {
        c.rows[6] = (uint8_t)mb;
        c.colsb[6] = (uint16_t)(4 * tail);
        c.rows[7] = (uint8_t)tail;
        c.colsb[7] = 64;
    }
    _tile_loadconfig(&c);
}

/* The configured mb <= AMX_ROWS rows of x (row stride xk) against one paired panel of K2 pairs: out [mb][PANEL]. */
static void amx_block(const uint16_t *x, long xk, const uint16_t *wp, float *out, long K2) {
    long full = K2 / 16 * 16, tail = K2 - full, row = 2 * PANEL; /* a pair row of the panel, in elements */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
/* x's chunk at pair k into tile A, then each 16-column slice of the panel's chunk into tile B, added into
 * sums 0-3 (tile numbers are immediates, hence a macro) */
#define AMX_CHUNK(A, B, k)                                                                       \
    do {                                                                                         \
        const uint16_t *wk = wp + (k) * row;                                                     \
        _tile_loadd(A, x + 2 * (k), xk * 2);                                                     \
        _tile_loadd(B, wk, row * 2);                                                             \
        _tile_dpbf16ps(0, A, B);                                                                 \
        _tile_loadd(B, wk + 32, row * 2);                                                        \
        _tile_dpbf16ps(1, A, B);                                                                 \
        _tile_loadd(B, wk + 64, row * 2);                                                        \
        _tile_dpbf16ps(2, A, B);                                                                 \
        _tile_loadd(B, wk + 96, row * 2);                                                        \
        _tile_dpbf16ps(3, A, B);                                                                 \
    } while (0)
    for (long k = 0; k < full; k += 16) {
        PREFETCH_ROW(wp + (k + 16) * row, 16 * row * sizeof(uint16_t)); /* the next chunk, as the vector kernel's */
        AMX_CHUNK(4, 5, k);
    }
    if (tail) AMX_CHUNK(6, 7, full);
#undef AMX_CHUNK
    _tile_stored(0, out, PANEL * 4);
    _tile_stored(1, out + 16, PANEL * 4);
    _tile_stored(2, out + 32, PANEL * 4);
    _tile_stored(3, out + 48, PANEL * 4);
}
#endif

/* 1 where bfloat16 products run on AMX tiles (asking Linux on the first call), else 0. */
/* Whether bfloat16 products run on the AVX512-BF16 dot product here (paired panels; on AMX tiles or not). */
int ddtree_uses_paired_bf16(void) { return PAIRED_BF16; }

int ddtree_uses_amx(void) {
#ifdef HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

#define DISPATCH(PREFIX, MB, ...)                                                                \
    switch (MB) {                                                                                \
        case 6: PREFIX##_6(__VA_ARGS__); break;                                                  \
        case 5: PREFIX##_5(__VA_ARGS__); break;                                                  \
        case 4: PREFIX##_4(__VA_ARGS__); break;                                                  \
        case 3: PREFIX##_3(__VA_ARGS__); break;                                                  \
        case 2: PREFIX##_2(__VA_ARGS__); break;                                                  \
        default: PREFIX##_1(__VA_ARGS__); break;                                                 \
    }

#define SPLIT_PAST 48 /* rows past which a product's panels are split into row ranges (beyond the k-blocked span) */
#define ROW_SPLIT 96  /* rows per such range: whole blocks of 6 and of 16 */
#define TAIL_SPLIT_ROWS 12 /* rows from which the units left over after an even share are split by rows */

/* One product of a call: a packed weight [N, K], its bias (as float32, or NULL) and its output y [M, N]. */
typedef struct {
    const void *wp;
    float *bias;
    void *y;
    long N, panels;
} product_t;

/* The call's rows, once: float32 (or, paired, bfloat16 padded to an even K). */
typedef struct {
    const float *xf;
    const uint16_t *xp;
    const int64_t *pick; /* the output row of each computed row (NULL: row m is row m) */
    long M, K, K2, xk, panel_elems;
    int dt, paired, amx; /* amx: the paired products run on AMX tiles (HAVE_AMX) */
} rows_t;

#define OUT_ROW(r, m) ((r)->pick ? (r)->pick[m] : (m))

static inline void store8_any(void *p, long i, __m256 v, int dt);

/* Sums out [rows][stride] (+ bias bf[j..]) into y's columns [j, j + width) of output rows m0.., each rounded
 * once to dt: eight at a time, the same add and rounding as store_one (a store per element cost a tile of
 * rows more than its products). */
static TILE_INLINE void store_panel(const rows_t *r, void *y, long N, long m0, long rows, long j, long width,
                                    const float *out, long stride, const float *bf, int dt) {
    for (long rr = 0; rr < rows; rr++) {
        long at = OUT_ROW(r, m0 + rr) * N + j, c = 0;
        const float *o = out + rr * stride;
        for (; c + 8 <= width; c += 8) {
            __m256 v = _mm256_loadu_ps(o + c);
            if (bf) v = _mm256_add_ps(v, _mm256_loadu_ps(bf + j + c));
            store8_any(y, at + c, v, dt);
        }
        for (; c < width; c++) store_one(y, at + c, bf ? o[c] + bf[j + c] : o[c], dt);
    }
}

/* Panels [p0, p0 + np) of one product for rows [m0, m1): np == MULTI only for one row (four panels at once); a
 * row range short of all rows only past SPLIT_PAST rows (row blocks and panels never change a sum). */
static TILE_INLINE void product_unit(const rows_t *r, const product_t *pr, long p0, long np, long m0, long m1) {
    long M = m1, K = r->K, K2 = r->K2, xk = r->xk, panel_elems = r->panel_elems, N = pr->N;
    int dt = r->dt, paired = r->paired;
    const float *xf = r->xf, *bf = pr->bias;
    const uint16_t *xp = r->xp;
    const void *wp = pr->wp;
    void *y = pr->y;
    (void)xp;
    (void)K2;
    (void)xk;
#ifdef HAVE_AMX
    if (r->amx) {
        float out[AMX_ROWS * PANEL];
        for (long m = m0; m < M; m += AMX_ROWS) {
            long mb = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            amx_configure(mb, K2 % 16);
            for (long p = p0; p < p0 + np; p++) {
                long j = p * PANEL, width = N - j < PANEL ? N - j : PANEL;
                amx_block(xp + m * xk, xk, (const uint16_t *)wp + p * panel_elems, out, K2);
                store_panel(r, y, N, m, mb, j, width, out, PANEL, bf, dt);
            }
        }
        return;
    }
#endif
#ifdef HAVE_MULTI
    if (M == 1 && (dt == DT_F32 || paired)) {
        float out[MULTI * PANEL];
        long j = p0 * PANEL;
        if (paired) {
#ifdef HAVE_PAIRED_MULTI
            const uint16_t *w0 = (const uint16_t *)wp + p0 * panel_elems;
            if (np == MULTI) paired_multi(xp, w0, panel_elems, out, K2);
            else
                for (long p = 0; p < np; p++) paired_1(xp, w0 + p * panel_elems, out + p * PANEL, K2);
#endif
        } else {
            const float *w0 = (const float *)wp + p0 * panel_elems;
            if (np == MULTI) packed_multi_f32(xf, w0, panel_elems, out, K);
            else
                for (long p = 0; p < np; p++) packed_f32_1(xf, w0 + p * panel_elems, out + p * PANEL, K);
        }
        long width = N - j < np * PANEL ? N - j : np * PANEL;
        store_panel(r, y, N, 0, 1, j, width, out, np * PANEL, bf, dt);
        return;
    }
#endif
    for (long p = p0; p < p0 + np; p++) {
        long j = p * PANEL, width = N - j < PANEL ? N - j : PANEL;
#ifdef HAVE_SPAN
        /* A few row blocks: each KBLOCK slice of a panel, streamed from memory once, serves every block from L1
         * (one pass per block would stream the whole panel again). */
        if (M - m0 > PACKED_ROWS && M - m0 <= SPAN_ROWS) {
            float acc[SPAN_ROWS * PANEL];
            long span = paired ? K2 : K;
            for (long k0 = 0; k0 < span; k0 += KBLOCK) {
                long k1 = span - k0 < KBLOCK ? span : k0 + KBLOCK;
                for (long m = m0; m < M; m += PACKED_ROWS) {
                    long mb = M - m < PACKED_ROWS ? M - m : PACKED_ROWS;
                    float *at = acc + (m - m0) * PANEL;
                    if (paired) {
#if PAIRED_BF16
                        DISPATCH(pspan, mb, xp + m * xk, (const uint16_t *)wp + p * panel_elems, at, K2, k0, k1)
#endif
                    } else if (dt == DT_F32) {
                        DISPATCH(span_f32, mb, xf + m * K, (const float *)wp + p * panel_elems, at, K, k0, k1)
                    } else if (dt == DT_BF16) {
                        DISPATCH(span_bf16, mb, xf + m * K, (const uint16_t *)wp + p * panel_elems, at, K, k0, k1)
                    } else {
                        DISPATCH(span_f16, mb, xf + m * K, (const uint16_t *)wp + p * panel_elems, at, K, k0, k1)
                    }
                }
            }
            store_panel(r, y, N, m0, M - m0, j, width, acc, PANEL, bf, dt);
            continue;
        }
#endif
        float out[PACKED_ROWS * PANEL];
        for (long m = m0; m < M; m += PACKED_ROWS) {
            long mb = M - m < PACKED_ROWS ? M - m : PACKED_ROWS;
            if (paired) {
#if PAIRED_BF16
                DISPATCH(paired, mb, xp + m * xk, (const uint16_t *)wp + p * panel_elems, out, K2)
#endif
            } else if (dt == DT_F32) {
                DISPATCH(packed_f32, mb, xf + m * K, (const float *)wp + p * panel_elems, out, K)
            } else if (dt == DT_BF16) {
                DISPATCH(packed_bf16, mb, xf + m * K, (const uint16_t *)wp + p * panel_elems, out, K)
            } else {
                DISPATCH(packed_f16, mb, xf + m * K, (const uint16_t *)wp + p * panel_elems, out, K)
            }
            store_panel(r, y, N, m, mb, j, width, out, PANEL, bf, dt);
        }
    }
}

/* ys[i] [M, Ns[i]] = x [M, K] . w_i^T + bias_i for `count` weights packed by ddtree_pack_weight, sharing x: one
 * parallel loop over all their panels (the threads share the work of q, k and v, say, rather than splitting three
 * small products apiece). Each output's sum is the single-product call's. */
static void packed_products(const void *x, int count, const void *const *wps, const void *const *biases,
                            void *const *ys, long M, long K, const long *Ns, int dt, int threads, const int64_t *pick,
                            long picked) {
    rows_t r = {0};
    if (pick) { /* only the picked rows: the rest of each output is zero (the picked ones are written whole) */
        uint8_t *kept = calloc((size_t)(M > 0 ? M : 1), 1);
        for (long m = 0; m < picked; m++) kept[pick[m]] = 1;
        size_t es = dt == DT_F32 ? 4 : 2;
        for (int i = 0; i < count; i++)
            for (long m = 0; m < M; m++)
                if (!kept[m]) memset((char *)ys[i] + (size_t)(m * Ns[i]) * es, 0, (size_t)Ns[i] * es);
        free(kept);
        M = picked;
    }
    r.pick = pick;
    r.M = M;
    r.K = K;
    r.dt = dt;
    r.paired = PAIRED_BF16 && dt == DT_BF16;
#ifdef HAVE_AMX
    r.amx = r.paired && amx_ready();
#endif
    r.K2 = (K + 1) / 2;
    r.xk = r.paired ? 2 * r.K2 : K;
    r.panel_elems = panel_rows(K, dt) * (r.paired ? 2 * PANEL : PANEL);
    float *xf = r.paired ? NULL : (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    uint16_t *xp = r.paired ? (uint16_t *)calloc((size_t)(M * r.xk > 0 ? M * r.xk : 1), 2) : NULL;
    for (long m = 0; m < M; m++) {
        long from = pick ? pick[m] : m;
        for (long k = 0; k < K; k++) {
            if (r.paired) xp[m * r.xk + k] = ((const uint16_t *)x)[from * K + k];
            else xf[m * K + k] = load_one(x, from * K + k, dt);
        }
    }
    r.xf = xf;
    r.xp = xp;
    product_t pr[8];
    long first[9];
    long per_unit = 1;
    /* past SPLIT_PAST rows each panel is split into row ranges, so that two threads share even a product of few
     * panels evenly (a prompt's prefill) */
    long splits = M > SPLIT_PAST ? (M + ROW_SPLIT - 1) / ROW_SPLIT : 1;
#ifdef HAVE_MULTI
    if (M == 1 && (dt == DT_F32 || r.paired)) per_unit = MULTI;
#endif
    if (count > 8) count = 8;
    first[0] = 0;
    for (int i = 0; i < count; i++) {
        pr[i].wp = wps[i];
        pr[i].y = ys[i];
        pr[i].N = Ns[i];
        pr[i].panels = (Ns[i] + PANEL - 1) / PANEL;
        pr[i].bias = NULL;
        if (biases && biases[i]) {
            pr[i].bias = (float *)malloc(sizeof(float) * (size_t)Ns[i]);
            for (long j = 0; j < Ns[i]; j++) pr[i].bias[j] = load_one(biases[i], j, dt);
        }
        first[i + 1] = first[i] + (pr[i].panels + per_unit - 1) / per_unit * splits;
    }
    long units = first[count];
    /* units that do not divide among the threads: the last ones' rows split `threads` ways, so no thread runs
     * the leftover panels while the others wait for it (a decode step's o and down products have 9 panels) */
    long tail = splits == 1 && threads > 1 && M >= TAIL_SPLIT_ROWS ? units % threads : 0;
    long whole = units - tail, part_rows = (M + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long u = 0; u < whole + tail * threads; u++) {
        long w = u < whole ? u : whole + (u - whole) / threads;
        int i = 0;
        while (w >= first[i + 1]) i++;
        long at = w - first[i], s = at % splits, p0 = at / splits * per_unit;
        long np = pr[i].panels - p0 < per_unit ? pr[i].panels - p0 : per_unit;
        long m0 = s * ROW_SPLIT, m1 = splits > 1 && (s + 1) * ROW_SPLIT < M ? (s + 1) * ROW_SPLIT : M;
        if (u >= whole) {
            long part = (u - whole) % threads;
            m0 = part * part_rows;
            m1 = m0 + part_rows < M ? m0 + part_rows : M;
            if (m0 >= m1) continue;
        }
        product_unit(&r, &pr[i], p0, np, m0, m1);
    }
    for (int i = 0; i < count; i++) free(pr[i].bias);
    free(xf);
    free(xp);
}

void ddtree_packed_linears(const void *x, int count, const void *const *wps, const void *const *biases,
                           void *const *ys, long M, long K, const long *Ns, int dt, int threads) {
    packed_products(x, count, wps, biases, ys, M, K, Ns, dt, threads, NULL, 0);
}

/* y [M, N] (dtype dt) = x [M, K] . w^T + bias with w packed by ddtree_pack_weight; with pick, only the picked
 * rows (`picked` row indices, the rest zero: a padded prefill's padding costs nothing). */
void ddtree_packed_linear(const void *x, const void *wp, const void *bias, void *y, long M, long K, long N, int dt,
                          int threads, const int64_t *pick, long picked) {
    const void *b[1] = {bias};
    void *out[1] = {y};
    packed_products(x, 1, &wp, b, out, M, K, &N, dt, threads, pick, picked);
}

/* ------------------------------------------------------------------ float64 linear */

static double dot_f64(const double *x, const double *w, long K) {
    __m256d acc = _mm256_setzero_pd();
    long k = 0;
    for (; k + 4 <= K; k += 4) acc = _mm256_fmadd_pd(_mm256_loadu_pd(x + k), _mm256_loadu_pd(w + k), acc);
    double s = hsum_pd(acc);
    for (; k < K; k++) s = fma(x[k], w[k], s);
    return s;
}

static void linear_f64(const double *x, const double *w, const double *bias, double *y, long M, long K, long N,
                       int transposed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < N; j++) {
        for (long m = 0; m < M; m++) {
            double s;
            if (transposed) {
                s = 0.0;
                for (long k = 0; k < K; k++) s = fma(x[m * K + k], w[k * N + j], s);
            } else {
                s = dot_f64(x + m * K, w + j * K, K);
            }
            y[m * N + j] = bias ? s + bias[j] : s;
        }
    }
}

/* x [M, K] and y [M, N] contiguous, of dtype dt; w [N, K] (or [K, N] when transposed) of dtype dt;
 * bias [N] of dtype dt or NULL. float16/bfloat16 inputs are widened to float32 once (x) or as they are
 * read (w), and every output is rounded once. */
void ddtree_row_linear(const void *x, const void *w, const void *bias, void *y, long M, long K, long N, int dt,
                       int transposed, int threads) {
    if (dt == DT_F64) {
        linear_f64((const double *)x, (const double *)w, (const double *)bias, (double *)y, M, K, N, transposed,
                   threads);
        return;
    }
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    float *bf = bias ? (float *)malloc(sizeof(float) * (size_t)N) : NULL;
    for (long i = 0; i < M * K; i++) xf[i] = load_one(x, i, dt);
    if (bf)
        for (long j = 0; j < N; j++) bf[j] = load_one(bias, j, dt);
    if (transposed) {
        switch (dt) {
            case DT_BF16: linear_kn_bf16(xf, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
            case DT_F16: linear_kn_f16(xf, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
            default: linear_kn_f32(xf, (const float *)w, bf, y, dt, M, K, N, threads);
        }
    } else {
#ifdef WIDE
        switch (dt) {
#ifdef __AVX512BF16__
            case DT_BF16: linear_nk16_dp((const uint16_t *)x, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
#else
            case DT_BF16: linear_nk16_bf16(xf, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
#endif
            case DT_F16: linear_nk16_f16(xf, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
            default: linear_nk16_f32(xf, (const float *)w, bf, y, dt, M, K, N, threads);
        }
#else
        switch (dt) {
            case DT_BF16: linear_nk_bf16(xf, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
            case DT_F16: linear_nk_f16(xf, (const uint16_t *)w, bf, y, dt, M, K, N, threads); break;
            default: linear_nk_f32(xf, (const float *)w, bf, y, dt, M, K, N, threads);
        }
#endif
    }
    free(xf);
    free(bf);
}

/* ------------------------------------------------------------------ attention */

/* exp for 8 lanes: exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (in two parts), e^r by a
 * degree-6 polynomial; below -87 it is 0 (so a masked -inf is 0). One formula for every lane and call. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, p);
}

static inline float exp1(float x) {
    float in[8] = {x, x, x, x, x, x, x, x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

/* Softmax weights in place over one query's T scores (float32): lanes run over the scores in blocks of 8
 * from the first, so the result depends on T and the scores alone. Returns the denominator (the sink's
 * term included); scores past T are left at 0. */
static float softmax_weights(float *sg, long T, const float *sink, float softcap) {
    long TP = (T + 7) / 8 * 8;
    if (softcap > 0.f)
        for (long t = 0; t < T; t++) sg[t] = softcap * tanhf(sg[t] / softcap);
    float m = -INFINITY;
    for (long t = 0; t < T; t++) m = sg[t] > m ? sg[t] : m;
    if (sink && *sink > m) m = *sink;
    for (long t = T; t < TP; t++) sg[t] = -INFINITY;
    __m256 mv = _mm256_set1_ps(m), lv = _mm256_setzero_ps();
    for (long t = 0; t < TP; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
        _mm256_storeu_ps(sg + t, p);
        lv = _mm256_add_ps(lv, p);
    }
    float l = hsum(lv);
    if (sink) l += exp1(*sink - m);
    return l;
}

/* o[D] += p * v[D]: one fused multiply-add per element (lanes over D, so the order is the same anyway) */
static inline void axpy(float *o, float p, const float *v, long D) {
#ifdef WIDE
    __m512 pw = _mm512_set1_ps(p);
    for (long d = 0; d < D; d += 16) {
        __mmask16 m = tail16(D - d);
        _mm512_mask_storeu_ps(o + d, m, _mm512_fmadd_ps(pw, _mm512_maskz_loadu_ps(m, v + d), _mm512_maskz_loadu_ps(m, o + d)));
    }
    return;
#endif
    __m256 pv = _mm256_set1_ps(p);
    long d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
    for (; d < D; d++) o[d] = fmaf(p, v[d], o[d]);
}

static void softmax_values_f64(double *s, long T, long G, const double *sinks, double softcap,
                               const double *const *vrows, long D, double *o) {
    for (long g = 0; g < G; g++) {
        double *sg = s + g * T;
        if (softcap > 0.0)
            for (long t = 0; t < T; t++) sg[t] = softcap * tanh(sg[t] / softcap);
        double m = -INFINITY;
        for (long t = 0; t < T; t++) m = sg[t] > m ? sg[t] : m;
        if (sinks && sinks[g] > m) m = sinks[g];
        double l = 0.0;
        for (long t = 0; t < T; t++) {
            sg[t] = exp(sg[t] - m);
            l += sg[t];
        }
        if (sinks) l += exp(sinks[g] - m);
        double *og = o + g * D;
        for (long d = 0; d < D; d++) {
            double acc = 0.0;
            for (long t = 0; t < T; t++) acc = fma(sg[t], vrows[t][d], acc);
            og[d] = acc / (l > 0.0 ? l : 1.0);
        }
    }
}

/* A cached key or value row as float32: the row itself, or its widened copy in buf. */
static inline const float *as_f32(const char *src, int dt, long D, float *buf) {
    if (dt == DT_F32) return (const float *)src;
    const uint16_t *h = (const uint16_t *)src;
    long d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, dt == DT_BF16 ? load8_bf16(h + d) : load8_f16(h + d));
    for (; d < D; d++) buf[d] = load_one(src, d, dt);
    return buf;
}

#define NODE_CHUNK 8 /* nodes per task: they share one pass over the prefix's keys and values */

#ifdef WIDE
/* The prefix passes with each key and value widened once into registers and the sums held there, for D of 64 or
 * 128: the same operations on every score and output as dot_f32 and axpy, so the same bits, in fewer loads and
 * stores. A "pair" is one query (node i, head g) of the task. */

/* One cached row (D = 16 * DV elements) as float32 lanes. */
#define WIDEN(DV, dst, src, dt)                                                                  \
    for (int c = 0; c < DV; c++)                                                                 \
        dst[c] = dt == DT_BF16 ? load16_bf16((const uint16_t *)(src) + 16 * c, 0xFFFF)           \
                 : dt == DT_F16 ? load16_f16((const uint16_t *)(src) + 16 * c, 0xFFFF)           \
                                : _mm512_loadu_ps((const float *)(src) + 16 * c);

/* 16 keys' lane partials a[t] to their sums, each added as _mm512_reduce_add_ps adds one vector (halves, then
 * quarters, then lanes 0 + 2 and 1 + 3, then those two; float addition commutes, so transposed is the same) */
static inline __m512 reduce16(const __m512 *a) {
    __m512 b[8], c[4], f[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44));
    for (int m = 0; m < 4; m++)
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88));
    for (int n = 0; n < 2; n++)
        f[n] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * n], c[2 * n + 1], 0xEE),
                             _mm512_shuffle_ps(c[2 * n], c[2 * n + 1], 0x44));
    __m512 g = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0xDD), _mm512_shuffle_ps(f[0], f[1], 0x88));
    /* element 4j + l holds key 4l + j */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), g);
}

/* Scores of NP pairs (queries qp[p], each D floats) over the columns [lo, P): key col's score goes to
 * dst[p][col - first[p]] where first[p] <= col < last[p]. */
#define PREFIX_SCORES(NP, DV)                                                                    \
    static void prefix_scores_##NP##_##DV(const float *const *qp, const char *kb, long kstride, int dt,     \
                                          size_t esize, long lo, long P, const long *first, const long *last, \
                                          float *const *dst, float scale) {                     \
        __m512 q[NP][DV], part[NP][16];                                                          \
        for (int p = 0; p < NP; p++)                                                             \
            for (int c = 0; c < DV; c++) q[p][c] = _mm512_loadu_ps(qp[p] + 16 * c);              \
        for (long c0 = lo; c0 < P; c0 += 16) {                                                   \
            long n = P - c0 < 16 ? P - c0 : 16;                                                  \
            for (long t = 0; t < 16; t++) {                                                      \
                if (t >= n) {                                                                    \
                    for (int p = 0; p < NP; p++) part[p][t] = _mm512_setzero_ps();               \
                    continue;                                                                    \
                }                                                                                \
                __m512 kv[DV];                                                                   \
                WIDEN(DV, kv, kb + (size_t)((c0 + t) * kstride) * esize, dt)                     \
                for (int p = 0; p < NP; p++) {                                                   \
                    __m512 acc = _mm512_setzero_ps();                                            \
                    for (int c = 0; c < DV; c++) acc = _mm512_fmadd_ps(q[p][c], kv[c], acc);     \
                    part[p][t] = acc;                                                            \
                }                                                                                \
            }                                                                                    \
            for (int p = 0; p < NP; p++) {                                                       \
                float sums[16];                                                                  \
                _mm512_storeu_ps(sums, _mm512_mul_ps(reduce16(part[p]), _mm512_set1_ps(scale)));  \
                for (long t = 0; t < n; t++)                                                     \
                    if (c0 + t >= first[p] && c0 + t < last[p]) dst[p][c0 + t - first[p]] = sums[t]; \
            }                                                                                    \
        }                                                                                        \
    }
/* o[p] += w[p][col - first[p]] * v[col] over the columns [lo, P) (first[p] <= col < last[p]), in column order. */
#define PREFIX_VALUES(NP, DV)                                                                    \
    static void prefix_values_##NP##_##DV(const char *vb, long vstride, int dt, size_t esize, long lo, long P, \
                                          const long *first, const long *last, const float *const *w,      \
                                          float *const *o) {                                    \
        __m512 acc[NP][DV];                                                                      \
        for (int p = 0; p < NP; p++)                                                             \
            for (int c = 0; c < DV; c++) acc[p][c] = _mm512_loadu_ps(o[p] + 16 * c);             \
        for (long col = lo; col < P; col++) {                                                    \
            __m512 vv[DV];                                                                       \
            WIDEN(DV, vv, vb + (size_t)(col * vstride) * esize, dt)                              \
            for (int p = 0; p < NP; p++) {                                                       \
                if (col < first[p] || col >= last[p]) continue;                                  \
                __m512 pw = _mm512_set1_ps(w[p][col - first[p]]);                                \
                for (int c = 0; c < DV; c++) acc[p][c] = _mm512_fmadd_ps(pw, vv[c], acc[p][c]);  \
            }                                                                                    \
        }                                                                                        \
        for (int p = 0; p < NP; p++)                                                             \
            for (int c = 0; c < DV; c++) _mm512_storeu_ps(o[p] + 16 * c, acc[p][c]);             \
    }
PREFIX_SCORES(1, 4) PREFIX_SCORES(2, 4) PREFIX_SCORES(3, 4) PREFIX_SCORES(4, 4)
PREFIX_SCORES(1, 8) PREFIX_SCORES(2, 8)
PREFIX_VALUES(1, 4) PREFIX_VALUES(2, 4) PREFIX_VALUES(3, 4) PREFIX_VALUES(4, 4)
PREFIX_VALUES(1, 8) PREFIX_VALUES(2, 8)

/* The passes by head size (0: 64, 1: 128) and pairs per call: a group of pairs fits the registers. */
typedef void (*prefix_scores_fn)(const float *const *, const char *, long, int, size_t, long, long, const long *,
                                 const long *, float *const *, float);
typedef void (*prefix_values_fn)(const char *, long, int, size_t, long, long, const long *, const long *,
                                 const float *const *, float *const *);
static const prefix_scores_fn PREFIX_SCORES_BY[2][5] = {
    {NULL, prefix_scores_1_4, prefix_scores_2_4, prefix_scores_3_4, prefix_scores_4_4},
    {NULL, prefix_scores_1_8, prefix_scores_2_8, NULL, NULL}};
static const prefix_values_fn PREFIX_VALUES_BY[2][5] = {
    {NULL, prefix_values_1_4, prefix_values_2_4, prefix_values_3_4, prefix_values_4_4},
    {NULL, prefix_values_1_8, prefix_values_2_8, NULL, NULL}};

/* Whether the register passes take a head of D elements, and how many pairs one call holds. */
static int prefix_fast(long D) { return D == 64 || D == 128; }
static long prefix_group(long D) { return D == 64 ? 4 : 2; }
#endif

/* q [B, Hq, N, D], k and v [B, Hkv, S, D] (element strides qs/ks/vs, last dim contiguous): row b's prefix
 * ends at column P = prefix_end[b] and its N tree nodes follow it, at P .. P + N - 1 (S >= P + N). Node n of
 * row b sees the prefix columns [start[b, n], P), then the tree columns P + m with tree[b, n, m] != 0, in
 * that order. out [B, N, Hq, D]
 * contiguous. sinks [Hq] (float32, or float64 for dt float64) or NULL; softcap <= 0: none.
 * A task is one KV head of one row and up to NODE_CHUNK nodes: each key and value is read once for them all,
 * while every query still reduces over its own keys in its own logical order. */
void ddtree_row_attention(const void *q, const void *k, const void *v, void *out, int dt, long B, long Hq,
                          long Hkv, long N, long D, const long *qs, const long *ks, const long *vs,
                          const int64_t *start, const int64_t *prefix_end, const uint8_t *tree, const void *sinks,
                          double softcap,
                          double scale, int threads) {
    long G = Hq / Hkv;
    long chunks = (N + NODE_CHUNK - 1) / NODE_CHUNK;
    long tasks = B * Hkv * chunks;
    size_t esize = dt == DT_F64 ? 8 : (dt == DT_F32 ? 4 : 2);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long task = 0; task < tasks; task++) {
        long c = task % chunks, hk = (task / chunks) % Hkv, b = task / (chunks * Hkv);
        long n0 = c * NODE_CHUNK, nn = N - n0 < NODE_CHUNK ? N - n0 : NODE_CHUNK, P = prefix_end[b];
        long first[NODE_CHUNK], T[NODE_CHUNK], TP[NODE_CHUNK], lo = P;
        for (long i = 0; i < nn; i++) {
            long f = start[b * N + n0 + i];
            first[i] = f < 0 ? 0 : (f > P ? P : f);
            const uint8_t *vis = tree + (b * N + n0 + i) * N;
            T[i] = P - first[i];
            for (long m = 0; m < N; m++) T[i] += vis[m] != 0;
            TP[i] = (T[i] + 7) / 8 * 8;
            if (first[i] < lo) lo = first[i];
        }
        const char *kb = (const char *)k + (size_t)(b * ks[0] + hk * ks[1]) * esize;
        const char *vb = (const char *)v + (size_t)(b * vs[0] + hk * vs[1]) * esize;
        if (dt == DT_F64) {
            for (long i = 0; i < nn; i++) {
                long n = n0 + i, t = 0;
                const uint8_t *vis = tree + (b * N + n) * N;
                long *cols = (long *)malloc(sizeof(long) * (size_t)(T[i] > 0 ? T[i] : 1));
                for (long col = first[i]; col < P; col++) cols[t++] = col;
                for (long m = 0; m < N; m++)
                    if (vis[m]) cols[t++] = P + m;
                double *sc = (double *)malloc(sizeof(double) * (size_t)(G * (T[i] > 0 ? T[i] : 1)));
                double *o = (double *)malloc(sizeof(double) * (size_t)(G * D));
                const double **vrows = (const double **)malloc(sizeof(double *) * (size_t)(T[i] > 0 ? T[i] : 1));
                for (long g = 0; g < G; g++) {
                    const double *qg = (const double *)q + b * qs[0] + (hk * G + g) * qs[1] + n * qs[2];
                    for (long j = 0; j < T[i]; j++)
                        sc[g * T[i] + j] = dot_f64(qg, (const double *)(kb + (size_t)(cols[j] * ks[2]) * esize), D) * scale;
                }
                for (long j = 0; j < T[i]; j++) vrows[j] = (const double *)(vb + (size_t)(cols[j] * vs[2]) * esize);
                const double *sk = sinks ? (const double *)sinks + hk * G : NULL;
                softmax_values_f64(sc, T[i], G, sk, softcap, vrows, D, o);
                for (long g = 0; g < G; g++)
                    memcpy((double *)out + ((b * N + n) * Hq + hk * G + g) * D, o + g * D, sizeof(double) * (size_t)D);
                free(cols);
                free(sc);
                free(o);
                free(vrows);
            }
            continue;
        }
        /* float32 math: scores s[i][g][0 .. T[i]) in each node's logical order */
        long off[NODE_CHUNK + 1];
        off[0] = 0;
        for (long i = 0; i < nn; i++) off[i + 1] = off[i] + G * TP[i];
        float *sc = (float *)malloc(sizeof(float) * (size_t)(off[nn] > 0 ? off[nn] : 8));
        float *qf = (float *)malloc(sizeof(float) * (size_t)(nn * G * D));
        float *o = (float *)calloc((size_t)(nn * G * D), sizeof(float));
        float *row = (float *)malloc(sizeof(float) * (size_t)D);
        float *ls = (float *)malloc(sizeof(float) * (size_t)(nn * G));
        long *pos = (long *)calloc((size_t)nn, sizeof(long)); /* keys written so far, per node */
        for (long i = 0; i < nn; i++)
            for (long g = 0; g < G; g++) {
                const char *qg = (const char *)q + (size_t)(b * qs[0] + (hk * G + g) * qs[1] + (n0 + i) * qs[2]) * esize;
                for (long d = 0; d < D; d++) qf[(i * G + g) * D + d] = load_one(qg, d, dt);
            }
        /* scores: the shared prefix, one pass over its keys, then each node's own tree keys */
        long after = 0; /* tree columns from which each node's own pass runs (those before: in the register pass) */
#ifdef WIDE
        const float *qp[NODE_CHUNK * 16];
        float *dst[NODE_CHUNK * 16], *op[NODE_CHUNK * 16];
        long pfirst[NODE_CHUNK * 16], plast[NODE_CHUNK * 16], PE = P;
        int fast = prefix_fast(D) && G <= 16;
        if (fast) {
            /* A node whose keys are one run of columns (tree columns [s, e) and no other, after the prefix from
             * its first column or, with s > 0, none of it: a token of a causal prefill, padded or not, a node of
             * a chain) reads them as it reads the prefix, so where every node of the chunk does, they join the
             * register pass with a start and an end per node; otherwise the columns every node sees from the
             * first on do. Each node still reduces over its keys in their logical order with the same
             * operations: the same bits. */
            long starts_at[NODE_CHUNK], ends_at[NODE_CHUNK], common = N, longest = 0;
            int runs = 1;
            for (long i = 0; i < nn; i++) {
                const uint8_t *vis = tree + (b * N + n0 + i) * N;
                long s0 = 0, e, m;
                while (s0 < N && !vis[s0]) s0++;
                for (e = s0; e < N && vis[e]; e++) {}
                for (m = e; m < N && !vis[m]; m++) {}
                runs &= m == N && (s0 == 0 || first[i] == P);
                starts_at[i] = s0;
                ends_at[i] = e;
                if (s0 > 0) common = 0;          /* it does not see the first column */
                else if (e < common) common = e;
                longest = e > longest ? e : longest;
            }
            after = runs ? N : common;
            PE = P + (runs ? longest : common);
            for (long i = 0; i < nn; i++)
                for (long g = 0; g < G; g++) {
                    qp[i * G + g] = qf + (i * G + g) * D;
                    dst[i * G + g] = sc + off[i] + g * TP[i];
                    op[i * G + g] = o + (i * G + g) * D;
                    pfirst[i * G + g] = runs && starts_at[i] ? P + starts_at[i] : first[i];
                    plast[i * G + g] = runs ? P + ends_at[i] : PE;
                }
            for (long p0 = 0, most = prefix_group(D); p0 < nn * G; p0 += most)
                PREFIX_SCORES_BY[D == 128][nn * G - p0 < most ? nn * G - p0 : most](
                    qp + p0, kb, ks[2], dt, esize, lo, PE, pfirst + p0, plast + p0, dst + p0, (float)scale);
            for (long i = 0; i < nn; i++) pos[i] = plast[i * G] - pfirst[i * G];
        } else
#endif
        for (long col = lo; col < P; col++) {
            const float *kf = as_f32(kb + (size_t)(col * ks[2]) * esize, dt, D, row);
            for (long i = 0; i < nn; i++) {
                if (col < first[i]) continue;
                for (long g = 0; g < G; g++)
                    sc[off[i] + g * TP[i] + pos[i]] = dot_f32(qf + (i * G + g) * D, kf, D) * (float)scale;
                pos[i]++;
            }
        }
        for (long i = 0; i < nn; i++) {
            const uint8_t *vis = tree + (b * N + n0 + i) * N;
            for (long m = after; m < N; m++) {
                if (!vis[m]) continue;
                const float *kf = as_f32(kb + (size_t)((P + m) * ks[2]) * esize, dt, D, row);
                for (long g = 0; g < G; g++)
                    sc[off[i] + g * TP[i] + pos[i]] = dot_f32(qf + (i * G + g) * D, kf, D) * (float)scale;
                pos[i]++;
            }
        }
        for (long i = 0; i < nn; i++)
            for (long g = 0; g < G; g++) {
                const float *sk = sinks ? (const float *)sinks + hk * G + g : NULL;
                ls[i * G + g] = softmax_weights(sc + off[i] + g * TP[i], T[i], sk, (float)softcap);
            }
        /* values: the same order, each row of values read once for the chunk */
        for (long i = 0; i < nn; i++) pos[i] = 0;
#ifdef WIDE
        if (fast) {
            for (long p0 = 0, most = prefix_group(D); p0 < nn * G; p0 += most)
                PREFIX_VALUES_BY[D == 128][nn * G - p0 < most ? nn * G - p0 : most](
                    vb, vs[2], dt, esize, lo, PE, pfirst + p0, plast + p0, (const float *const *)dst + p0, op + p0);
            for (long i = 0; i < nn; i++) pos[i] = plast[i * G] - pfirst[i * G];
        } else
#endif
        for (long col = lo; col < P; col++) {
            const float *vf = as_f32(vb + (size_t)(col * vs[2]) * esize, dt, D, row);
            for (long i = 0; i < nn; i++) {
                if (col < first[i]) continue;
                for (long g = 0; g < G; g++) axpy(o + (i * G + g) * D, sc[off[i] + g * TP[i] + pos[i]], vf, D);
                pos[i]++;
            }
        }
        for (long i = 0; i < nn; i++) {
            const uint8_t *vis = tree + (b * N + n0 + i) * N;
            for (long m = after; m < N; m++) {
                if (!vis[m]) continue;
                const float *vf = as_f32(vb + (size_t)((P + m) * vs[2]) * esize, dt, D, row);
                for (long g = 0; g < G; g++) axpy(o + (i * G + g) * D, sc[off[i] + g * TP[i] + pos[i]], vf, D);
                pos[i]++;
            }
            for (long g = 0; g < G; g++) {
                float l = ls[i * G + g] > 0.f ? ls[i * G + g] : 1.f;
                long base = ((b * N + n0 + i) * Hq + hk * G + g) * D, d = 0;
                const float *og = o + (i * G + g) * D;
                for (; d + 8 <= D; d += 8) store8_any(out, base + d, _mm256_div_ps(_mm256_loadu_ps(og + d), _mm256_set1_ps(l)), dt);
                for (; d < D; d++) store_one(out, base + d, og[d] / l, dt);
            }
        }
        free(sc);
        free(qf);
        free(o);
        free(row);
        free(ls);
        free(pos);
    }
}

/* ------------------------------------------------------------------ row-wise layer ops */

/* A decoder layer's per-token work (RMSNorm, rotary embedding, the gated activation), each row computed alone
 * by one thread in one fixed order: the bits of a row never depend on how many rows share the call. Rounding
 * follows the modules they stand in for (transformers' Llama family): the norm in float32, rounded to the
 * dtype, then scaled by the weight in the dtype; the rotation and the product rounded after each operation. */

static inline float round_to(float v, int dt) {
    switch (dt) {
        case DT_BF16: return bf16_to_f32(f32_to_bf16(v));
        case DT_F16: return f16_to_f32(f32_to_f16(v));
        default: return v;
    }
}

/* 8 elements of a float32, bfloat16 or float16 array as float32 lanes, and back (rounded to nearest even) */
static inline __m256 load8_any(const void *p, long i, int dt) {
    switch (dt) {
        case DT_BF16: return load8_bf16((const uint16_t *)p + i);
        case DT_F16: return load8_f16((const uint16_t *)p + i);
        default: return _mm256_loadu_ps((const float *)p + i);
    }
}

static inline __m128i to_bf16x8(__m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    /* One instruction rounds as the integer steps below do for every float32 but the denormals (checked over all
     * 2^32 inputs), which it flushes to zero: a vector holding one takes the integer steps. */
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    if (!(_mm256_cmp_ps_mask(a, _mm256_set1_ps(0x1p-126f), _CMP_LT_OQ) &
          _mm256_cmp_ps_mask(a, _mm256_setzero_ps(), _CMP_GT_OQ)))
        return (__m128i)_mm256_cvtneps_pbh(v);
#endif
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline __m256 round8(__m256 v, int dt) {
    switch (dt) {
        case DT_BF16: return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
        case DT_F16: return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        default: return v;
    }
}

static inline void store8_any(void *p, long i, __m256 v, int dt) {
    switch (dt) {
        case DT_BF16: _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16x8(v)); break;
        case DT_F16:
            _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            break;
        default: _mm256_storeu_ps((float *)p + i, v);
    }
}

#define SUM_LANES 16

/* RMSNorm of rows of H elements at element strides xs / ys: n = x / sqrt(mean(x^2) + eps) in float32, then
 * by mode: NORM_ROUNDED (Llama) round(round(n) * w), NORM_FLOAT (gpt-oss) round(n * w),
 * NORM_FLOAT | NORM_OFFSET (Gemma) round(n * (1 + w)), the scaling in float32 where the mode says so. */
enum { NORM_FLOAT = 1, NORM_OFFSET = 2 };
void ddtree_rms_norm(const void *x, const void *w, void *y, long M, long H, long xs, long ys, double eps, int mode,
                     int dt, int threads) {
    size_t es = dt == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long r = 0; r < M; r++) {
        const char *xr = (const char *)x + (size_t)(r * xs) * es;
        char *yr = (char *)y + (size_t)(r * ys) * es;
        /* the sum of squares: lane j of the two vectors holds elements j, j + 16, ... and 8 + j, 24 + j, ...;
         * then the 16 lane sums in order and the tail in order */
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        long i = 0;
        for (; i + SUM_LANES <= H; i += SUM_LANES) {
            __m256 a = load8_any(xr, i, dt), b = load8_any(xr, i + 8, dt);
            lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
        }
        float acc[SUM_LANES], s = 0.f;
        _mm256_storeu_ps(acc, lo);
        _mm256_storeu_ps(acc + 8, hi);
        for (int j = 0; j < SUM_LANES; j++) s += acc[j];
        for (; i < H; i++) {
            float v = load_one(xr, i, dt);
            s += v * v;
        }
        float inv = 1.0f / sqrtf(s / (float)H + (float)eps);
        __m256 iv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
        for (i = 0; i + 8 <= H; i += 8) {
            __m256 n = _mm256_mul_ps(load8_any(xr, i, dt), iv), wv = load8_any(w, i, dt);
            if (mode & NORM_OFFSET) wv = _mm256_add_ps(one, wv);
            store8_any(yr, i, _mm256_mul_ps(mode & NORM_FLOAT ? n : round8(n, dt), wv), dt);
        }
        for (; i < H; i++) {
            float n = load_one(xr, i, dt) * inv, wi = load_one(w, i, dt);
            if (mode & NORM_OFFSET) wi = 1.0f + wi;
            store_one(yr, i, (mode & NORM_FLOAT ? n : round_to(n, dt)) * wi, dt);
        }
    }
}

/* Rotary embedding in place: x [rows, heads, D] (row stride xs elements, heads contiguous), cos and sin
 * [rows, D]; x[i] <- x[i] * cos[i] + rotate_half(x)[i] * sin[i], each product and the sum rounded to the dtype. */
__attribute__((optimize("fp-contract=off")))
void ddtree_rotary(void *x, const void *cos, const void *sin, long rows, long heads, long D, long xs, int dt,
                   int threads) {
    long half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long r = 0; r < rows; r++) {
        for (long h = 0; h < heads; h++) {
            long o = r * xs + h * D, i = 0;
            /* eight lanes at a time: each element's products, sum and roundings are the scalar loop's */
            const __m256 flip = _mm256_set1_ps(-0.0f);
            for (; i + 8 <= half; i += 8) {
                __m256 a = load8_any(x, o + i, dt), b = load8_any(x, o + i + half, dt);
                __m256 c0 = load8_any(cos, r * D + i, dt), s0 = load8_any(sin, r * D + i, dt);
                __m256 c1 = load8_any(cos, r * D + i + half, dt), s1 = load8_any(sin, r * D + i + half, dt);
                __m256 lo = _mm256_add_ps(round8(_mm256_mul_ps(a, c0), dt),
                                          round8(_mm256_mul_ps(_mm256_xor_ps(b, flip), s0), dt));
                __m256 hi = _mm256_add_ps(round8(_mm256_mul_ps(b, c1), dt), round8(_mm256_mul_ps(a, s1), dt));
                store8_any(x, o + i, lo, dt);
                store8_any(x, o + i + half, hi, dt);
            }
            for (; i < half; i++) {
                float a = load_one(x, o + i, dt), b = load_one(x, o + i + half, dt);
                float c0 = load_one(cos, r * D + i, dt), s0 = load_one(sin, r * D + i, dt);
                float c1 = load_one(cos, r * D + i + half, dt), s1 = load_one(sin, r * D + i + half, dt);
                float lo = round_to(round_to(a * c0, dt) + round_to(-b * s0, dt), dt);
                float hi = round_to(round_to(b * c1, dt) + round_to(a * s1, dt), dt);
                store_one(x, o + i, lo, dt);
                store_one(x, o + i + half, hi, dt);
            }
        }
    }
}

/* y[r, i] = round(round(silu(g[r, i])) * u[r, i]) for rows of I elements (element strides gs, us, ys):
 * silu(v) = v / (1 + exp(-v)) with this file's exp, in blocks of 8 from each row's first element (a row's
 * last partial block through the same vector code, from a zero-padded copy). */
void ddtree_silu_mul(const void *g, const void *u, void *y, long M, long I, long gs, long us, long ys, int dt,
                     int threads) {
    size_t es = dt == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long r = 0; r < M; r++) {
        const char *gr = (const char *)g + (size_t)(r * gs) * es, *ur = (const char *)u + (size_t)(r * us) * es;
        char *yr = (char *)y + (size_t)(r * ys) * es;
        for (long i = 0; i < I; i += 8) {
            long n = I - i < 8 ? I - i : 8;
            char gb[32] = {0}, ub[32] = {0}, yb[32];
            const void *gp = gr + (size_t)i * es, *up = ur + (size_t)i * es;
            void *yp = n == 8 ? (void *)(yr + (size_t)i * es) : (void *)yb;
            if (n < 8) {
                memcpy(gb, gp, (size_t)n * es);
                memcpy(ub, up, (size_t)n * es);
                gp = gb;
                up = ub;
            }
            __m256 gv = load8_any(gp, 0, dt);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 act = round8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), dt);
            store8_any(yp, 0, _mm256_mul_ps(act, load8_any(up, 0, dt)), dt);
            if (n < 8) memcpy(yr + (size_t)i * es, yb, (size_t)n * es);
        }
    }
}

/* ------------------------------------------------------------------ a decoder layer */

/* One pre-norm decoder layer's decode forward (Llama, Mistral, Qwen2, Qwen3) as the sequence of the kernels
 * above, in the order and with the arguments the module-by-module path (ddtree/targets/exact_layers.py) calls
 * them: the same bits, without a Python call between the steps. x [R, H] in (R = B * n rows), y [R, H] out;
 * row b's new keys and values are written into the cache rooms [B, Hkv, cap, D] at columns ends[b] .. ends[b] +
 * n - 1, after its prefix (the same column for every row of a right-aligned cache, each row's own length in a
 * row-packed one), which the attention then reads with the spec's starts, key flags and prefix ends. */
enum {
    L_X, L_Y, L_LN1, L_LN2, L_QN, L_KN, L_PQ, L_PK, L_PV, L_PO, L_PG, L_PU, L_PD, L_BQ, L_BK, L_BV, L_BO, L_BG, L_BU,
    L_BD, L_COS, L_SIN, L_KC, L_VC, L_START, L_VIS, L_ENDS, L_H, L_HQ, L_HKV, L_D, L_I, L_CAP, L_B, L_N,
    L_STYLE1, L_STYLE2, L_STYLEQ, L_STYLEK, L_DT, L_THREADS, L_COUNT
};
enum { F_EPS1, F_EPS2, F_EPSQ, F_EPSK, F_SCALE, F_COUNT };

static int product_threads(long rows, long k, long n, int threads) { return rows * k * n < (1L << 17) ? 1 : threads; }
static int row_threads(long elements, int threads) { return elements < (1L << 15) ? 1 : threads; }
/* the gated activation costs an exp and a division an element: worth a second thread from fewer of them */
static int activation_threads(long elements, int threads) { return elements < (1L << 12) ? 1 : threads; }

/* y = round(x + a), elementwise (torch's add: one rounding) */
static void add_into(void *y, const void *x, const void *a, long count, int dt) {
    long i = 0;
    for (; i + 8 <= count; i += 8) store8_any(y, i, _mm256_add_ps(load8_any(x, i, dt), load8_any(a, i, dt)), dt);
    for (; i < count; i++) store_one(y, i, load_one(x, i, dt) + load_one(a, i, dt), dt);
}

#define PTR(i) ((void *)(intptr_t)a[i])
long ddtree_decoder_layer_slots(void) { return L_COUNT; }

void ddtree_decoder_layer(const int64_t *a, const double *f) {
    int dt = (int)a[L_DT], thr = (int)a[L_THREADS];
    long H = a[L_H], Hq = a[L_HQ], Hkv = a[L_HKV], D = a[L_D], I = a[L_I], cap = a[L_CAP];
    long B = a[L_B], n = a[L_N], R = B * n, QD = Hq * D, KD = Hkv * D;
    size_t es = dt == DT_F32 ? 4 : 2;
    char *h = malloc((size_t)(R * H) * es), *q = malloc((size_t)(R * QD) * es), *k = malloc((size_t)(R * KD) * es);
    char *v = malloc((size_t)(R * KD) * es), *at = malloc((size_t)(R * QD) * es), *o = malloc((size_t)(R * H) * es);
    char *g = malloc((size_t)(R * I) * es), *u = malloc((size_t)(R * I) * es), *ac = malloc((size_t)(R * I) * es);
    void *x = PTR(L_X), *y = PTR(L_Y);
    /* attention block */
    ddtree_rms_norm(x, PTR(L_LN1), h, R, H, H, H, f[F_EPS1], (int)a[L_STYLE1], dt, row_threads(R * H, thr));
    {
        const void *w[3] = {PTR(L_PQ), PTR(L_PK), PTR(L_PV)}, *b[3] = {PTR(L_BQ), PTR(L_BK), PTR(L_BV)};
        void *out[3] = {q, k, v};
        long Ns[3] = {QD, KD, KD};
        ddtree_packed_linears(h, 3, w, b, out, R, H, Ns, dt, product_threads(R, H, QD + 2 * KD, thr));
    }
    if (PTR(L_QN)) {
        ddtree_rms_norm(q, PTR(L_QN), q, R * Hq, D, D, D, f[F_EPSQ], (int)a[L_STYLEQ], dt, row_threads(R * QD, thr));
        ddtree_rms_norm(k, PTR(L_KN), k, R * Hkv, D, D, D, f[F_EPSK], (int)a[L_STYLEK], dt, row_threads(R * KD, thr));
    }
    ddtree_rotary(q, PTR(L_COS), PTR(L_SIN), R, Hq, D, QD, dt, row_threads(R * QD, thr));
    ddtree_rotary(k, PTR(L_COS), PTR(L_SIN), R, Hkv, D, KD, dt, row_threads(R * KD, thr));
    char *kc = PTR(L_KC), *vc = PTR(L_VC);
    const int64_t *ends = (const int64_t *)PTR(L_ENDS);
    for (long b = 0; b < B; b++)
        for (long t = 0; t < n; t++)
            for (long hk = 0; hk < Hkv; hk++) {
                size_t to = (size_t)(((b * Hkv + hk) * cap + ends[b] + t) * D) * es, from = (size_t)(((b * n + t) * Hkv + hk) * D) * es;
                memcpy(kc + to, k + from, (size_t)D * es);
                memcpy(vc + to, v + from, (size_t)D * es);
            }
    long qs[3] = {n * QD, D, QD}, cs[3] = {Hkv * cap * D, cap * D, D};
    ddtree_row_attention(q, kc, vc, at, dt, B, Hq, Hkv, n, D, qs, cs, cs, (const int64_t *)PTR(L_START),
                         ends, (const uint8_t *)PTR(L_VIS), NULL, 0.0, f[F_SCALE], thr);
    ddtree_packed_linear(at, PTR(L_PO), PTR(L_BO), o, R, QD, H, dt, product_threads(R, QD, H, thr), NULL, 0);
    add_into(y, x, o, R * H, dt);
    /* MLP block */
    ddtree_rms_norm(y, PTR(L_LN2), h, R, H, H, H, f[F_EPS2], (int)a[L_STYLE2], dt, row_threads(R * H, thr));
    {
        const void *w[2] = {PTR(L_PG), PTR(L_PU)}, *b[2] = {PTR(L_BG), PTR(L_BU)};
        void *out[2] = {g, u};
        long Ns[2] = {I, I};
        ddtree_packed_linears(h, 2, w, b, out, R, H, Ns, dt, product_threads(R, H, 2 * I, thr));
    }
    ddtree_silu_mul(g, u, ac, R, I, I, I, I, dt, activation_threads(R * I, thr));
    ddtree_packed_linear(ac, PTR(L_PD), PTR(L_BD), o, R, I, H, dt, product_threads(R, I, H, thr), NULL, 0);
    add_into(y, y, o, R * H, dt);
    free(h); free(q); free(k); free(v); free(at); free(o); free(g); free(u); free(ac);
}

/* A forward's decoder layers in turn, in one call: what every layer of the forward takes alike (`s`, in S_*
 * order) is copied into each layer's slots before its call (a layer's key ranges, which follow its window, are
 * its own); layer 0 reads the forward's input, layer i > 0 the output of layer i - 1, and layer i writes its
 * output at S_Y + i * S_YSTEP bytes. Returns 0, or 1 with no layer run where a row's new columns would not
 * fit a layer's cache room (ends[b] + n past its capacity). */
enum { S_X, S_Y, S_YSTEP, S_COS, S_SIN, S_ENDS, S_B, S_N, S_THREADS, S_COUNT };
long ddtree_decoder_stack_slots(void) { return S_COUNT; }

int ddtree_decoder_stack(int64_t *const *as, const double *const *fs, long count, const int64_t *s) {
    static const int to[] = {L_COS, L_SIN, L_ENDS, L_B, L_N, L_THREADS};
    static const int from[] = {S_COS, S_SIN, S_ENDS, S_B, S_N, S_THREADS};
    const int64_t *ends = (const int64_t *)(intptr_t)s[S_ENDS];
    for (long i = 0; i < count; i++)
        for (long b = 0; b < s[S_B]; b++)
            if (ends[b] < 0 || ends[b] + s[S_N] > as[i][L_CAP]) return 1;
    for (long i = 0; i < count; i++) {
        int64_t *a = as[i];
        a[L_X] = i ? s[S_Y] + (i - 1) * s[S_YSTEP] : s[S_X];
        a[L_Y] = s[S_Y] + i * s[S_YSTEP];
        for (int j = 0; j < (int)(sizeof(to) / sizeof(to[0])); j++) a[to[j]] = s[from[j]];
        ddtree_decoder_layer(a, fs[i]);
    }
    return 0;
}

/* ------------------------------------------------------------------ cache compaction */

/* A ragged commit in place: buf [B, H, cap, D] (rows of `row` bytes per column) holds each row's committed
 * columns right-aligned at [prefix - lens[b], prefix) and the tree's nodes from column `prefix`; afterwards row b
 * holds its committed columns and then its accepted nodes (nodes[b, :counts[b]], tree indices) right-aligned at
 * `width`. Columns before a row's first are left as they were (padding: masked). Only rows whose columns move
 * are touched, and only their own columns: no copy of the whole cache. */
void ddtree_compact_rows(void *buf, long B, long H, long cap, long row, long prefix, const int64_t *lens,
                         const int64_t *counts, const int64_t *nodes, long most, long width, int threads) {
#pragma omp parallel num_threads(threads)
    {
        char *saved = malloc((size_t)(most > 0 ? most : 1) * (size_t)row);
#pragma omp for schedule(static)
        for (long bh = 0; bh < B * H; bh++) {
            long b = bh / H;
            char *base = (char *)buf + (size_t)bh * (size_t)cap * (size_t)row;
            long kept = counts[b], src = prefix - lens[b], dst = width - kept - lens[b];
            for (long i = 0; i < kept; i++)
                memcpy(saved + i * row, base + (prefix + nodes[b * most + i]) * row, (size_t)row);
            if (src != dst && lens[b] > 0) memmove(base + dst * row, base + src * row, (size_t)(lens[b] * row));
            memcpy(base + (width - kept) * row, saved, (size_t)(kept * row));
        }
        free(saved);
    }
}
