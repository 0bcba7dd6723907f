/* The int8 product of csrc/int8_matmul.c (the same weights and per-channel scales) with its
 * activations rounded to int8 first, so that the inner loop multiplies integers: llama.cpp's
 * 8-bit-by-8-bit product on a CPU, and the int8 half of torchao's "8da" schemes. Each row of x
 * is cut into blocks of 32 inputs, each with its own scale d = max|x| / 127 and int8 values
 * xq = round(x / d) (rows.h, round_block). For output o:
 *     y[r, o] = scale[o] * sum_b d[r, b] sum_{k in b} w[o, k] xq[r, k]  (+ bias[o] where given, not NULL)
 * the dequantized weight times the rounded activations, as generate/quantize.py's dense path
 * computes it (round_activations, then F.linear). Both factors are signed, and AVX2's byte
 * product (maddubs) takes one unsigned: as in llama.cpp, |w| is multiplied by xq with w's sign,
 * so that a pair of products sums to at most 2 x 127 x 127 and cannot saturate 16 bits. Then 32
 * weights against 32 inputs are two instructions (one, vpdpbusd, with AVX512-VNNI) where the fp32
 * kernel converts and multiplies 4 vectors. Elsewhere plain C with the same integer sums.
 * Built at first use by blockformer.native.
 */
#include "rows.h"

#define BLOCK A8_BLOCK

/* The rows' activations as the kernel reads them: xq[r, k] int8 in x's order, d[r, b] per block. */
typedef struct {
    int8_t *xq;
    float *d;
} Rounded;

static void round_rows(const float *x, Rounded a, int64_t rows, int64_t K) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < K / BLOCK; b++)
            a.d[r * (K / BLOCK) + b] = round_block(x + r * K + b * BLOCK, a.xq + r * K + b * BLOCK);
}

#if defined(__AVX2__) && defined(__FMA__)
/* the 8 int32 lanes of sum w * x over 32 weights, given |w| (unsigned) and x with w's sign */
static inline __m256i dot32(__m256i magnitude, __m256i signed_x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
#endif
}

#define ROWS(R)                                                                                    \
    static void rows_##R(Rounded a, const int8_t *w, const float *scales, const float *bias, float *y, \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                          \
        const int64_t blocks = K / BLOCK;                                                          \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const int8_t *wo = w + o * K;                                                          \
            prefetch_ahead(wo, K);                                                                 \
            __m256 acc[R];                                                                         \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                              \
            for (int64_t b = 0; b < blocks; b++) {                                                 \
                const __m256i wb = _mm256_loadu_si256((const __m256i *)(wo + b * BLOCK));          \
                const __m256i magnitude = _mm256_sign_epi8(wb, wb);                                \
                for (int r = 0; r < R; r++) {                                                      \
                    const __m256i xb = _mm256_loadu_si256((const __m256i *)(a.xq + r * K + b * BLOCK)); \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(magnitude, _mm256_sign_epi8(xb, wb))), \
                                             _mm256_broadcast_ss(a.d + r * blocks + b), acc[r]);  \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = hsum(acc[r]) * scales[o] + (bias ? bias[o] : 0.0f); \
        }                                                                                          \
    }
#else
#define ROWS(R)                                                                                    \
    static void rows_##R(Rounded a, const int8_t *w, const float *scales, const float *bias, float *y, \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                          \
        const int64_t blocks = K / BLOCK;                                                          \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const int8_t *wo = w + o * K;                                                          \
            float acc[R] = {0};                                                                    \
            for (int64_t b = 0; b < blocks; b++) {                                                 \
                int32_t dot[R] = {0};                                                              \
                for (int k = 0; k < BLOCK; k++)                                                    \
                    for (int r = 0; r < R; r++) dot[r] += wo[b * BLOCK + k] * a.xq[r * K + b * BLOCK + k]; \
                for (int r = 0; r < R; r++) acc[r] += a.d[r * blocks + b] * (float)dot[r];         \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = acc[r] * scales[o] + (bias ? bias[o] : 0.0f); \
        }                                                                                          \
    }
#endif

ALL_ROWS

static void span(Rounded a, const int8_t *w, const float *scales, const float *bias, float *y, int64_t rows,
                 int64_t o0, int64_t o1, int64_t K, int64_t N) {
    EACH_BLOCK(rows, o0, o1, ((Rounded){a.xq + r0 * K, a.d + r0 * (K / BLOCK)}), w, scales, bias, y + r0 * N, c0, c1,
               K, N)
}

/* x: rows of K contiguous floats, K a multiple of 32. The rows are rounded once, on the calling
 * thread, into `scratch` (the caller's) of rows * (K / 32 + K / 4) floats; then the N output
 * channels split into `threads` spans, one per thread of torch's OpenMP runtime. */
void int8_a8_matmul_f32(const float *x, const int8_t *w, const float *scales, const float *bias, float *y,
                        float *scratch, int64_t rows, int64_t K, int64_t N, int64_t threads) {
    const Rounded a = {(int8_t *)(scratch + rows * (K / BLOCK)), scratch};
    round_rows(x, a, rows, K);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        span(a, w, scales, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, N);
}
