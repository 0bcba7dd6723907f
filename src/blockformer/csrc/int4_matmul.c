/* A weight-only int4 matmul at a decode step's (or a short prompt's) few rows. Weights: codes q in 0..15, two per
 * byte (low nibble: even input, high: odd), W[o, k] = (q - 8) * scale[o, g] + zero[o, g] for
 * k in group g of G inputs. Per group the codes are summed against the input first:
 *     y[r, o] = sum_g scale[o, g] * (sum_{k in g} x[r, k] q[o, k]) + (zero[o, g] - 8 scale[o, g]) sx[r, g]
 * with sx[r, g] the group's sum of x. Each code byte is read once for all the rows: an eighth
 * of the fp32 weight's bytes. With AVX2 and FMA, 16 code bytes become 32 floats in registers
 * (nibbles split, interleaved back into input order, widened); elsewhere plain C. Built at
 * first use by blockformer.native with the machine's C compiler (and OpenMP where it has it).
 */
#include "rows.h"

/* sx[r, g] for rows r and groups g of x (rows, K) */
static void group_sums(const float *x, float *sx, int64_t rows, int64_t K, int64_t G) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < K / G; g++) {
            float s = 0;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += x[r * K + k];
            sx[r * (K / G) + g] = s;
        }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

/* G is a multiple of 32: a group is a whole number of 16-byte loads */
#define ROWS(R)                                                                                    \
    static void rows_##R(const float *x, const float *sx, const uint8_t *codes, const float *scales, \
                         const float *zeros, float *y, int64_t o0, int64_t o1, int64_t K, int64_t G, \
                         int64_t N) {                                                              \
        const int64_t groups = K / G;                                                              \
        const __m128i low4 = _mm_set1_epi8(15);                                                    \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * (K / 2);                                               \
            __m256 total[R];                                                                       \
            float offset[R];                                                                       \
            for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps(), offset[r] = 0;             \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                __m256 a[R], b[R];                                                                 \
                for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();                     \
                for (int64_t k = g * G; k < (g + 1) * G; k += 32) {                                \
                    const __m128i q = _mm_loadu_si128((const __m128i *)(co + k / 2));             \
                    const __m128i lo = _mm_and_si128(q, low4);                                     \
                    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);                  \
                    const __m128i w0 = _mm_unpacklo_epi8(lo, hi), w1 = _mm_unpackhi_epi8(lo, hi);  \
                    const __m256 f0 = widen(w0), f1 = widen(_mm_srli_si128(w0, 8));                \
                    const __m256 f2 = widen(w1), f3 = widen(_mm_srli_si128(w1, 8));                \
                    for (int r = 0; r < R; r++) {                                                  \
                        const float *xr = x + r * K + k;                                           \
                        a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), f0, a[r]);                    \
                        b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), f1, b[r]);                \
                        a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), f2, a[r]);               \
                        b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), f3, b[r]);               \
                    }                                                                              \
                }                                                                                  \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++) {                                                      \
                    total[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_add_ps(a[r], b[r]), total[r]); \
                    offset[r] += (z - 8.0f * s) * sx[r * groups + g];                              \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = hsum(total[r]) + offset[r];                 \
        }                                                                                          \
    }
#else
#define ROWS(R)                                                                                    \
    static void rows_##R(const float *x, const float *sx, const uint8_t *codes, const float *scales, \
                         const float *zeros, float *y, int64_t o0, int64_t o1, int64_t K, int64_t G, \
                         int64_t N) {                                                              \
        const int64_t groups = K / G;                                                              \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * (K / 2);                                               \
            float total[R] = {0};                                                                  \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                float acc[R] = {0};                                                                \
                for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j++) {                            \
                    const float lo = (float)(co[j] & 15), hi = (float)(co[j] >> 4);                \
                    for (int r = 0; r < R; r++) acc[r] += x[r * K + 2 * j] * lo + x[r * K + 2 * j + 1] * hi; \
                }                                                                                  \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++) total[r] += s * acc[r] + (z - 8.0f * s) * sx[r * groups + g]; \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = total[r];                                   \
        }                                                                                          \
    }
#endif

ALL_ROWS

static void span(const float *x, const float *sx, const uint8_t *codes, const float *scales, const float *zeros,
                 float *y, int64_t rows, int64_t o0, int64_t o1, int64_t K, int64_t G, int64_t N) {
    EACH_BLOCK(rows, o0, o1, x + r0 * K, sx + r0 * (K / G), codes, scales, zeros, y + r0 * N, c0, c1, K, G, N)
}

/* x: rows of K contiguous floats (the caller takes many rows as a dense matmul); the N output
 * channels split into `threads` spans, one per thread of torch's OpenMP runtime. sx: scratch
 * of rows * K / G floats for the group sums. */
void int4_matmul_f32(const float *x, const uint8_t *codes, const float *scales, const float *zeros, float *y,
                     float *sx, int64_t rows, int64_t K, int64_t G, int64_t N, int64_t threads) {
    group_sums(x, sx, rows, K, G);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        span(x, sx, codes, scales, zeros, y, rows, N * t / threads, N * (t + 1) / threads, K, G, N);
}
