/* An fp32 matmul at a decode step's few rows: y[r, o] = x[r] . w[o] (+ bias[o]) for x (rows, K)
 * and a plain row-major weight w (N, K). At one row a step reads each weight once and does one
 * multiply-add with it, so the product is bound by memory, not arithmetic; this streams each
 * thread's share of w once, in order, for all the rows, where torch's kernels at one row drew
 * under half the machine's bandwidth on an AVX2 CPU (BENCHMARKS.md). With AVX2 and FMA, 16
 * inputs at a time in registers; elsewhere plain C. Built at first use by blockformer.native
 * with the machine's C compiler (and OpenMP where it has it).
 */
#include <stddef.h>
#include "rows.h"
#if defined(__AVX2__) && defined(__FMA__)

#define ROWS(R)                                                                                  \
    static void rows_##R(const float *x, const float *w, const float *bias, float *y, int64_t o0, \
                         int64_t o1, int64_t K, int64_t N) {                                    \
        const int64_t body = K - K % 16;                                                       \
        for (int64_t o = o0; o < o1; o++) {                                                    \
            const float *wo = w + o * K;                                                       \
            __m256 a[R], b[R];                                                                 \
            for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();                     \
            for (int64_t k = 0; k < body; k += 16) {                                           \
                const __m256 w0 = _mm256_loadu_ps(wo + k), w1 = _mm256_loadu_ps(wo + k + 8);   \
                for (int r = 0; r < R; r++) {                                                  \
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, a[r]);         \
                    b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, b[r]);     \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < R; r++) {                                                      \
                float acc = hsum(_mm256_add_ps(a[r], b[r]));                                   \
                for (int64_t k = body; k < K; k++) acc += x[r * K + k] * wo[k];                \
                y[r * N + o] = bias ? acc + bias[o] : acc;                                     \
            }                                                                                  \
        }                                                                                      \
    }
#else
#define ROWS(R)                                                                                  \
    static void rows_##R(const float *x, const float *w, const float *bias, float *y, int64_t o0, \
                         int64_t o1, int64_t K, int64_t N) {                                    \
        for (int64_t o = o0; o < o1; o++) {                                                    \
            const float *wo = w + o * K;                                                       \
            float acc[R] = {0};                                                                \
            for (int64_t k = 0; k < K; k++)                                                    \
                for (int r = 0; r < R; r++) acc[r] += x[r * K + k] * wo[k];                    \
            for (int r = 0; r < R; r++) y[r * N + o] = bias ? acc[r] + bias[o] : acc[r];       \
        }                                                                                      \
    }
#endif

ALL_ROWS

static void span(const float *x, const float *w, const float *bias, float *y, int64_t rows, int64_t o0,
                 int64_t o1, int64_t K, int64_t N) {
    EACH_BLOCK(rows, o0, o1, x + r0 * K, w, bias, y + r0 * N, c0, c1, K, N)
}

/* any rows (the caller takes more than a few as torch's matmul); bias may be NULL; the N
 * output channels split into `threads` spans, one per thread of torch's OpenMP runtime */
void f32_matmul_f32(const float *x, const float *w, const float *bias, float *y, int64_t rows, int64_t K,
                    int64_t N, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) span(x, w, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, N);
}
