/* A weight-only int8 matmul at a decode step's (or a short prompt's) few rows: y[r, o] = scales[o] * x[r] . w[o]
 * for fp32 activations x (rows, K), int8 weights w (N, K) with one scale per output channel,
 * output channels o in [o0, o1). Each weight byte is read once for all the rows, so at one
 * row the product streams a quarter of the fp32 weight's bytes. With AVX2 and FMA, 16
 * weights at a time are widened to floats in registers; elsewhere plain C. Built at first
 * use by blockformer.native with the machine's C compiler (and OpenMP where it has it).
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 widen(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

#define ROWS(R)                                                                              \
    static void rows_##R(const float *x, const int8_t *w, const float *scales, float *y,   \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                  \
        const int64_t body = K - K % 16;                                                   \
        for (int64_t o = o0; o < o1; o++) {                                                \
            const int8_t *wo = w + o * K;                                                  \
            __m256 a[R], b[R];                                                             \
            for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();                 \
            for (int64_t k = 0; k < body; k += 16) {                                       \
                const __m256 f0 = widen(wo + k), f1 = widen(wo + k + 8);                   \
                for (int r = 0; r < R; r++) {                                              \
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), f0, a[r]);     \
                    b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), f1, b[r]); \
                }                                                                          \
            }                                                                              \
            for (int r = 0; r < R; r++) {                                                  \
                float acc = hsum(_mm256_add_ps(a[r], b[r]));                               \
                for (int64_t k = body; k < K; k++) acc += x[r * K + k] * (float)wo[k];     \
                y[r * N + o] = acc * scales[o];                                            \
            }                                                                              \
        }                                                                                  \
    }
#else
#define ROWS(R)                                                                              \
    static void rows_##R(const float *x, const int8_t *w, const float *scales, float *y,   \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                  \
        for (int64_t o = o0; o < o1; o++) {                                                \
            const int8_t *wo = w + o * K;                                                  \
            float acc[R] = {0};                                                            \
            for (int64_t k = 0; k < K; k++) {                                              \
                const float wk = (float)wo[k];                                             \
                for (int r = 0; r < R; r++) acc[r] += x[r * K + k] * wk;                   \
            }                                                                              \
            for (int r = 0; r < R; r++) y[r * N + o] = acc[r] * scales[o];                 \
        }                                                                                  \
    }
#endif

ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

/* Output channels in chunks whose weights stay in cache while every block of 4 rows reads them:
 * past 4 rows each weight still comes from memory once. */
#define CHUNK 16

static void span(const float *x, const int8_t *w, const float *scales, float *y, int64_t rows, int64_t o0,
                 int64_t o1, int64_t K, int64_t N) {
    for (int64_t c0 = o0; c0 < o1; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < o1 ? c0 + CHUNK : o1;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const float *xr = x + r0 * K;
            float *yr = y + r0 * N;
            switch (rows - r0) {
                case 1: rows_1(xr, w, scales, yr, c0, c1, K, N); break;
                case 2: rows_2(xr, w, scales, yr, c0, c1, K, N); break;
                case 3: rows_3(xr, w, scales, yr, c0, c1, K, N); break;
                default: rows_4(xr, w, scales, yr, c0, c1, K, N); break;
            }
        }
    }
}

/* any rows (the caller takes many as a dense matmul); the N output channels split into
 * `threads` spans, one per thread of the OpenMP runtime torch runs on */
void int8_matmul_f32(const float *x, const int8_t *w, const float *scales, float *y, int64_t rows, int64_t K,
                     int64_t N, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) span(x, w, scales, y, rows, N * t / threads, N * (t + 1) / threads, K, N);
}
