/* A weight-only int4 matmul at a decode step's (or a short prompt's) few rows. Weights: codes q
 * in 0..15, two per byte: in each run of 16 inputs, byte j holds input j in its low nibble and
 * input 8 + j in its high one (generate/quantize.py pack_int4), so 8 bytes widen to two vectors
 * of 8 floats in input order with one shuffle, a mask and a shift. W[o, k] = (q - 8) *
 * scale[o, g] + zero[o, g] for k in group g of G inputs. Per group the codes are summed against
 * the input first:
 *     y[r, o] = sum_g scale[o, g] * (sum_{k in g} x[r, k] q[o, k]) + (zero[o, g] - 8 scale[o, g]) sx[r, g]
 * with sx[r, g] the group's sum of x, plus bias[o] where a bias is given (not NULL). Each code byte is read once for all the rows: an eighth
 * of the fp32 weight's bytes. With AVX2 and FMA, 16 code bytes become 32 floats in registers;
 * elsewhere plain C. Built at first use by blockformer.native with the machine's C compiler
 * (and OpenMP where it has it).
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
/* the 16 inputs whose codes are the 8 bytes at c: the low nibbles (inputs 0..7), the high ones (8..15) */
static inline void widen(const uint8_t *c, __m256 *low, __m256 *high) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    *low = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *high = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

/* G is a multiple of 32: a group is a whole number of 16-byte loads */
#define ROWS(R)                                                                                    \
    static void rows_##R(const float *x, const float *sx, const uint8_t *codes, const float *scales, \
                         const float *zeros, const float *bias, float *y, int64_t o0, int64_t o1,  \
                         int64_t K, int64_t G, int64_t N) {                                        \
        const int64_t groups = K / G;                                                              \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * (K / 2);                                               \
            prefetch_ahead(co, K / 2);                                                             \
            __m256 total[R];                                                                       \
            float offset[R];                                                                       \
            for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps(), offset[r] = 0;             \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                __m256 a[R], b[R], c[R], d[R];                                                     \
                for (int r = 0; r < R; r++) a[r] = b[r] = c[r] = d[r] = _mm256_setzero_ps();       \
                for (int64_t k = g * G; k < (g + 1) * G; k += 32) {                                \
                    __m256 f0, f1, f2, f3;                                                         \
                    widen(co + k / 2, &f0, &f1);                                                   \
                    widen(co + k / 2 + 8, &f2, &f3);                                               \
                    for (int r = 0; r < R; r++) {                                                  \
                        const float *xr = x + r * K + k;                                           \
                        a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), f0, a[r]);                    \
                        b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), f1, b[r]);                \
                        if (R == 1) { /* 4 independent sums: 2 waited on the FMA's latency */       \
                            c[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), f2, c[r]);           \
                            d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), f3, d[r]);           \
                        } else { /* from 2 rows 4 sums a row measured no faster */                  \
                            a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), f2, a[r]);           \
                            b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), f3, b[r]);           \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++) {                                                      \
                    const __m256 sum = _mm256_add_ps(_mm256_add_ps(a[r], b[r]), _mm256_add_ps(c[r], d[r])); \
                    total[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), sum, total[r]);                  \
                    offset[r] += (z - 8.0f * s) * sx[r * groups + g];                              \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = hsum(total[r]) + offset[r] + (bias ? bias[o] : 0.0f); \
        }                                                                                          \
    }
#else
#define ROWS(R)                                                                                    \
    static void rows_##R(const float *x, const float *sx, const uint8_t *codes, const float *scales, \
                         const float *zeros, const float *bias, float *y, int64_t o0, int64_t o1,  \
                         int64_t K, int64_t G, int64_t N) {                                        \
        const int64_t groups = K / G;                                                              \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * (K / 2);                                               \
            float total[R] = {0};                                                                  \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                float acc[R] = {0};                                                                \
                for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j++) {                            \
                    const float lo = (float)(co[j] & 15), hi = (float)(co[j] >> 4);                \
                    const int64_t k = j / 8 * 16 + j % 8; /* the low nibble's input; the high's is k + 8 */ \
                    for (int r = 0; r < R; r++) acc[r] += x[r * K + k] * lo + x[r * K + k + 8] * hi; \
                }                                                                                  \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++) total[r] += s * acc[r] + (z - 8.0f * s) * sx[r * groups + g]; \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = total[r] + (bias ? bias[o] : 0.0f);        \
        }                                                                                          \
    }
#endif

ALL_ROWS

static void span(const float *x, const float *sx, const uint8_t *codes, const float *scales, const float *zeros,
                 const float *bias, float *y, int64_t rows, int64_t o0, int64_t o1, int64_t K, int64_t G, int64_t N) {
    EACH_BLOCK(rows, o0, o1, x + r0 * K, sx + r0 * (K / G), codes, scales, zeros, bias, y + r0 * N, c0, c1, K, G, N)
}

#if defined(__AVX2__) && defined(__FMA__)
/* Many rows (MANY_ROWS or more) go through panels of the dequantized weights (rows.h): each
 * weight q * scale + (zero - 8 scale), within a rounding of (q - 8) * scale + zero, which
 * generate/quantize.py's dequantize_int4 computes. MANY_ROWS: from where the panels were the
 * faster on GPT-2 small's weights, natively and built for AVX2 (bench_kernel_ab.py; at 5 rows
 * 0.9-1.1x, at 8 rows 0.99-1.04x, at 16 1.23-1.3x). */
#define MANY_ROWS 8

/* the panel of the n <= PANEL channels from o (zeros past n): a run of 16 inputs of 8 channels
 * at a time, its 8 code bytes transposed, then each nibble widened and dequantized as
 * q * scale + (zero - 8 scale), in one FMA */
static void dequantize_panel(const uint8_t *codes, const float *scales, const float *zeros, int64_t o, int n,
                             int64_t K, int64_t G, float *panel) {
    const int64_t groups = K / G;
    for (int h = 0; h < PANEL; h += 8)
        for (int64_t g = 0; g < groups; g++) {
            float s[8], z[8];
            for (int j = 0; j < 8; j++) {
                s[j] = h + j < n ? scales[(o + h + j) * groups + g] : 0.0f;
                z[j] = h + j < n ? zeros[(o + h + j) * groups + g] - 8.0f * s[j] : 0.0f;
            }
            const __m256 scale = _mm256_loadu_ps(s), offset = _mm256_loadu_ps(z);
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                __m128i pairs[4];
                transpose8_bytes(codes + (o + h) * (K / 2) + k / 2, K / 2, n - h, pairs);
                for (int t = 0; t < 8; t++) {
                    const __m128i bytes = t % 2 ? _mm_unpackhi_epi64(pairs[t / 2], pairs[t / 2]) : pairs[t / 2];
                    const __m256i v = _mm256_cvtepu8_epi32(bytes);
                    const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
                    const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                    _mm256_store_ps(panel + (k + t) * PANEL + h, _mm256_fmadd_ps(low, scale, offset));
                    _mm256_store_ps(panel + (k + 8 + t) * PANEL + h, _mm256_fmadd_ps(high, scale, offset));
                }
            }
        }
}

static void many_span(const float *x, const uint8_t *codes, const float *scales, const float *zeros,
                      const float *bias, float *y, int64_t rows, int64_t o0, int64_t o1, int64_t K, int64_t G,
                      int64_t N, float *panel) {
    for (int64_t o = o0; o < o1; o += PANEL) {
        const int n = o1 - o < PANEL ? (int)(o1 - o) : PANEL;
        dequantize_panel(codes, scales, zeros, o, n, K, G, panel);
        const char *ahead = o + PANEL < o1 ? (const char *)(codes + (o + PANEL) * (K / 2)) : NULL;
        panel_product(panel, x, rows, K, NULL, bias, y, N, o, n, ahead, PANEL / 2);
    }
}
#endif

/* x: rows of K contiguous floats; the N output
 * channels split into `threads` spans, one per thread of torch's OpenMP runtime. sx: scratch
 * of rows * K / G floats for the group sums. */
void int4_matmul_f32(const float *x, const uint8_t *codes, const float *scales, const float *zeros,
                     const float *bias, float *y, float *sx, int64_t rows, int64_t K, int64_t G, int64_t N,
                     int64_t threads) {
#if defined(__AVX2__) && defined(__FMA__)
    float *scratch = rows >= MANY_ROWS ? panels(threads, K) : NULL; /* NULL: the few-row bodies do it all */
    if (scratch) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int64_t t = 0; t < threads; t++)
            many_span(x, codes, scales, zeros, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, G, N,
                      scratch + t * PANEL * K);
        free(scratch);
        return;
    }
#endif
    group_sums(x, sx, rows, K, G);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        span(x, sx, codes, scales, zeros, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, G, N);
}
