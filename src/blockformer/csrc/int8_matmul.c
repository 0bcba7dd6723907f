/* A weight-only int8 matmul at a decode step's (or a short prompt's) few rows: y[r, o] = scales[o] * x[r] . w[o]
 * + bias[o] (bias may be NULL) for fp32 activations x (rows, K), int8 weights w (N, K) with one scale per output channel,
 * output channels o in [o0, o1). Each weight byte is read once for all the rows, so at one
 * row the product streams a quarter of the fp32 weight's bytes. With AVX2 and FMA, 16
 * weights at a time are widened to floats in registers; elsewhere plain C. Built at first
 * use by blockformer.native with the machine's C compiler (and OpenMP where it has it).
 */
#include "rows.h"
#if defined(__AVX2__) && defined(__FMA__)

static inline __m256 widen(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* At 1 row, 4 independent sums (32 weights a step): with 2, each step waited on the previous
 * one's FMA (4 cycles a step, 4 weights a cycle), where the memory could feed more: 1.29x at one
 * row built for AVX2, 1.1-1.45x natively; from 2 rows, 4 sums a row measured no faster. */
#define ROWS(R)                                                                              \
    static void rows_##R(const float *x, const int8_t *w, const float *scales, const float *bias, float *y, \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                  \
        const int64_t body = K - K % 16, wide = R == 1 ? K - K % 32 : 0;                 \
        for (int64_t o = o0; o < o1; o++) {                                                \
            const int8_t *wo = w + o * K;                                                  \
            prefetch_ahead(wo, K);                                                         \
            __m256 a[R], b[R], c[R], d[R];                                                 \
            for (int r = 0; r < R; r++) a[r] = b[r] = c[r] = d[r] = _mm256_setzero_ps();   \
            int64_t k = 0;                                                                 \
            for (; k < wide; k += 32) {                                                    \
                const __m256 f0 = widen(wo + k), f1 = widen(wo + k + 8);                   \
                const __m256 f2 = widen(wo + k + 16), f3 = widen(wo + k + 24);             \
                for (int r = 0; r < R; r++) {                                              \
                    const float *xr = x + r * K + k;                                       \
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), f0, a[r]);                \
                    b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), f1, b[r]);            \
                    c[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), f2, c[r]);           \
                    d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), f3, d[r]);           \
                }                                                                          \
            }                                                                              \
            for (; k < body; k += 16) {                                                    \
                const __m256 f0 = widen(wo + k), f1 = widen(wo + k + 8);                   \
                for (int r = 0; r < R; r++) {                                              \
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), f0, a[r]);     \
                    b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), f1, b[r]); \
                }                                                                          \
            }                                                                              \
            for (int r = 0; r < R; r++) {                                                  \
                float acc = hsum(_mm256_add_ps(_mm256_add_ps(a[r], b[r]), _mm256_add_ps(c[r], d[r]))); \
                for (int64_t k = body; k < K; k++) acc += x[r * K + k] * (float)wo[k];     \
                y[r * N + o] = acc * scales[o] + (bias ? bias[o] : 0.0f);                 \
            }                                                                              \
        }                                                                                  \
    }
#else
#define ROWS(R)                                                                              \
    static void rows_##R(const float *x, const int8_t *w, const float *scales, const float *bias, float *y, \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                  \
        for (int64_t o = o0; o < o1; o++) {                                                \
            const int8_t *wo = w + o * K;                                                  \
            float acc[R] = {0};                                                            \
            for (int64_t k = 0; k < K; k++) {                                              \
                const float wk = (float)wo[k];                                             \
                for (int r = 0; r < R; r++) acc[r] += x[r * K + k] * wk;                   \
            }                                                                              \
            for (int r = 0; r < R; r++) y[r * N + o] = acc[r] * scales[o] + (bias ? bias[o] : 0.0f); \
        }                                                                                  \
    }
#endif

ALL_ROWS

static void span(const float *x, const int8_t *w, const float *scales, const float *bias, float *y, int64_t rows,
                 int64_t o0, int64_t o1, int64_t K, int64_t N) {
    EACH_BLOCK(rows, o0, o1, x + r0 * K, w, scales, bias, y + r0 * N, c0, c1, K, N)
}

#if defined(__AVX2__) && defined(__FMA__)
/* Many rows (MANY_ROWS or more) go through panels of widened weights (rows.h); the per-channel
 * scale is applied as each output is stored. MANY_ROWS: from where the panels were the faster
 * on GPT-2 small's weights (bench_kernel_ab.py): 1.06x at 5 rows with AVX-512's tiles of 8, but
 * 0.9x at 5 and 6 rows built for AVX2, 1.14x at 8. */
#if PANEL_TILE == 8
#define MANY_ROWS 5
#else
#define MANY_ROWS 8
#endif

/* the panel of the n <= PANEL channels from o (zeros past n): 8 inputs of 8 channels at a time,
 * transposed as bytes, then widened to floats */
static void widen_panel(const int8_t *w, int64_t o, int n, int64_t K, float *panel) {
    const int64_t body = K - K % 8;
    for (int h = 0; h < PANEL; h += 8)
        for (int64_t k = 0; k < body; k += 8) {
            __m128i pairs[4];
            transpose8_bytes((const uint8_t *)(w + (o + h) * K + k), K, n - h, pairs);
            for (int t = 0; t < 8; t++) {
                const __m128i bytes = t % 2 ? _mm_unpackhi_epi64(pairs[t / 2], pairs[t / 2]) : pairs[t / 2];
                _mm256_store_ps(panel + (k + t) * PANEL + h, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
            }
        }
    for (int64_t k = body; k < K; k++)
        for (int j = 0; j < PANEL; j++) panel[k * PANEL + j] = j < n ? (float)w[(o + j) * K + k] : 0.0f;
}

static void many_span(const float *x, const int8_t *w, const float *scales, const float *bias, float *y, int64_t rows,
                      int64_t o0, int64_t o1, int64_t K, int64_t N, float *panel) {
    for (int64_t o = o0; o < o1; o += PANEL) {
        const int n = o1 - o < PANEL ? (int)(o1 - o) : PANEL;
        widen_panel(w, o, n, K, panel);
        const char *ahead = o + PANEL < o1 ? (const char *)(w + (o + PANEL) * K) : NULL;
        panel_product(panel, x, rows, K, scales, bias, y, N, o, n, ahead, PANEL);
    }
}
#endif

/* any rows; the N output channels split into
 * `threads` spans, one per thread of the OpenMP runtime torch runs on */
void int8_matmul_f32(const float *x, const int8_t *w, const float *scales, const float *bias, float *y, int64_t rows,
                     int64_t K, int64_t N, int64_t threads) {
#if defined(__AVX2__) && defined(__FMA__)
    float *scratch = rows >= MANY_ROWS ? panels(threads, K) : NULL; /* NULL: the few-row bodies do it all */
    if (scratch) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int64_t t = 0; t < threads; t++)
            many_span(x, w, scales, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, N,
                      scratch + t * PANEL * K);
        free(scratch);
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        span(x, w, scales, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, N);
}
