/* An fp32 matmul at a decode step's few rows: y[r, o] = x[r] . w[o] (+ bias[o]) for x (rows, K)
 * and a plain row-major weight w (N, K). At one row a step reads each weight once and does one
 * multiply-add with it, so the product is bound by memory, not arithmetic; this streams each
 * thread's share of w once, in order, for all the rows, where torch's kernels at one row drew
 * under half the machine's bandwidth on an AVX2 CPU (BENCHMARKS.md). With AVX2 and FMA, four
 * weight rows side by side, 8 inputs a step; elsewhere plain C. Built at first use by
 * blockformer.native with the machine's C compiler (and OpenMP where it has it).
 */
#include <stddef.h>
#include "rows.h"
#if defined(__AVX2__) && defined(__FMA__)

/* G output channels from o, for R rows: one accumulator per (row, channel), 8 inputs a step.
 * The G weight rows are G streams read side by side: one row at a time kept too few loads in
 * flight, and drew 10-15% less of the bandwidth at one row (BENCHMARKS.md). */
static inline __attribute__((always_inline)) void channels(const float *x, const float *w, const float *bias,
                                                           float *y, int64_t o, int64_t K, int64_t N, const int R,
                                                           const int G) {
    const int64_t body = K - K % 8;
    const float *wo = w + o * K;
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < G; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < body; k += 8) {
        __m256 xs[4];
        for (int r = 0; r < R; r++) xs[r] = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < G; c++) {
            const __m256 wc = _mm256_loadu_ps(wo + c * K + k);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(xs[r], wc, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < G; c++) {
            float sum = hsum(acc[r][c]);
            for (int64_t k = body; k < K; k++) sum += x[r * K + k] * wo[c * K + k];
            y[r * N + o + c] = bias ? sum + bias[o + c] : sum;
        }
}

/* 4 channels at a time, at every row count: at 3 and 4 rows too, where the accumulators no
 * longer all fit the 16 AVX2 registers, it was faster than 2 (BENCHMARKS.md). */
#define ROWS(R)                                                                                  \
    static void rows_##R(const float *x, const float *w, const float *bias, float *y, int64_t o0, \
                         int64_t o1, int64_t K, int64_t N) {                                    \
        int64_t o = o0;                                                                        \
        for (; o + 4 <= o1; o += 4) channels(x, w, bias, y, o, K, N, R, 4);                    \
        for (; o < o1; o++) channels(x, w, bias, y, o, K, N, R, 1);                            \
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
