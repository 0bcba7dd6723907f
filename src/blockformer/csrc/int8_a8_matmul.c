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

#include <stdlib.h>

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

#if defined(__AVX2__) && defined(__FMA__)
/* Many rows (MANY_ROWS or more: a server's in-flight sequences, a short prompt). One output
 * channel at a time, each block's dot of each row ends in its own 8 lanes, and turning it into
 * a float (a conversion and an FMA by the row's block scale) costs as much as the integer
 * product itself. Here 8 channels share one vector instead, lane j channel j: a thread first
 * repacks their weights so that vector t of block b holds bytes 4t..4t+3 of the block of each
 * of the 8 channels (an 8 x 8 transpose of 32-bit words), and 4 bytes of a row's inputs,
 * broadcast, multiply all 8 at once. After a block's 8 vectors each lane holds its channel's
 * whole dot, and one conversion and one FMA serve 8 channels. As llama.cpp repacks its
 * weights for many rows, but per call, into a thread's scratch, so the layer keeps one copy.
 * With VNNI the inputs are stored unsigned (x + 128, for vpdpbusd's unsigned operand) and each
 * block's lanes start from -128 times its channels' weight sums (repacked with them), so no
 * sign is applied per row; with AVX2 alone the repack keeps |w| beside w, as the few-row body
 * uses it. While the first tile of rows works on one group, it prefetches the next group's
 * weights, a share a block: asked for all at once, before each repack, they came too late and
 * left a pass at 8 rows 1.6x slower than the same pass on weights already in the caches.
 * A pass over a group's repacked weights takes TILE rows (rows.h). MANY_ROWS: from where this
 * path was the faster on GPT-2 small's weights (bench_kernel_ab.py; at 4 rows the few-row
 * bodies already run near the memory's speed). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define UNSIGNED_INPUTS 1
#define MANY_ROWS 5
#else
#define UNSIGNED_INPUTS 0
#define MANY_ROWS 6
#endif

/* Channels [o, o + n) (n <= 8; the rest of the 8 lanes are zero weights) into wt (8 vectors a
 * block) and extra: with VNNI -128 x each block's weight sums (1 vector a block), else |w|
 * (8 a block). */
static void repack(const int8_t *w, int64_t o, int n, int64_t K, __m256i *wt, __m256i *extra) {
    const int8_t *wo = w + o * K;
    for (int64_t b = 0; b < K / BLOCK; b++) {
        __m256i v[8];
        for (int j = 0; j < 8; j++)
            v[j] = j < n ? _mm256_loadu_si256((const __m256i *)(wo + j * K + b * BLOCK)) : _mm256_setzero_si256();
        transpose8(v);
#if UNSIGNED_INPUTS
        __m256i sums = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) sums = _mm256_dpbusd_epi32(sums, _mm256_set1_epi8((char)0x80), v[t]);
        extra[b] = _mm256_sub_epi32(_mm256_setzero_si256(), sums);
#endif
        for (int t = 0; t < 8; t++) {
            wt[b * 8 + t] = v[t];
#if !UNSIGNED_INPUTS
            extra[b * 8 + t] = _mm256_sign_epi8(v[t], v[t]);
#endif
        }
    }
}

/* R rows (xq and d at the first) of the 8 repacked channels at o, n of them real */
#define MANY(R)                                                                                    \
    static void many_##R(Rounded a, const __m256i *wt, const __m256i *extra, const float *scales,   \
                         const float *bias, float *y, int64_t o, int n, int64_t K, int64_t N,      \
                         const int8_t *ahead) {                                                    \
        const int64_t blocks = K / BLOCK;                                                          \
        __m256 acc[R];                                                                             \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            if (ahead) /* the next 8 channels, a 256-byte share a block, as this group's arithmetic runs */ \
                for (int l = 0; l < 8 * BLOCK; l += 64) __builtin_prefetch(ahead + b * 8 * BLOCK + l, 0, 3); \
            __m256i dot[R];                                                                        \
            for (int r = 0; r < R; r++) dot[r] = UNSIGNED_INPUTS ? extra[b] : _mm256_setzero_si256(); \
            for (int t = 0; t < 8; t++) {                                                          \
                const __m256i wv = wt[b * 8 + t];                                                  \
                for (int r = 0; r < R; r++) {                                                      \
                    const __m256i x4 = broadcast4(a.xq + r * K + b * BLOCK + 4 * t);               \
                    dot[r] = UNSIGNED_INPUTS ? dpbusd(dot[r], x4, wv)                              \
                                             : _mm256_add_epi32(dot[r], dot32(extra[b * 8 + t], _mm256_sign_epi8(x4, wv))); \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++)                                                            \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_broadcast_ss(a.d + r * blocks + b), acc[r]); \
        }                                                                                          \
        for (int r = 0; r < R; r++) store8(acc[r], scales, bias, y + r * N, o, n);                 \
    }

MANY(1) MANY(2) MANY(3) MANY(4) MANY(5) MANY(6) MANY(7) MANY(8)

/* vectors of repacked weights a thread holds: 8 a block, and the extra ones */
static int64_t repacked_size(int64_t K) { return (K / BLOCK) * (UNSIGNED_INPUTS ? 9 : 16); }

static void many_span(Rounded a, const int8_t *w, const float *scales, const float *bias, float *y, int64_t rows,
                      int64_t o0, int64_t o1, int64_t K, int64_t N, __m256i *wt) {
    const int64_t blocks = K / BLOCK;
    __m256i *extra = wt + 8 * blocks;
    for (int64_t o = o0; o < o1; o += 8) {
        const int n = o1 - o < 8 ? (int)(o1 - o) : 8;
        repack(w, o, n, K, wt, extra);
        const int8_t *ahead = o + 8 < o1 ? w + (o + 8) * K : NULL;
        EACH_TILE(rows, ((Rounded){a.xq + r0 * K, a.d + r0 * blocks}), wt, extra, scales, bias, y + r0 * N, o, n, K,
                  N, r0 == 0 ? ahead : NULL)
    }
}
#endif

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
#if defined(__AVX2__) && defined(__FMA__)
    /* each thread's repacked weights; where they cannot be had, the few-row bodies do it all */
    __m256i *repacked = rows >= MANY_ROWS ? aligned_alloc(32, (size_t)(threads * repacked_size(K)) * sizeof(__m256i))
                                          : NULL;
    if (repacked) {
        for (int64_t i = 0; UNSIGNED_INPUTS && i < rows * K; i++) a.xq[i] = (int8_t)(a.xq[i] ^ 0x80); /* x + 128 */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int64_t t = 0; t < threads; t++)
            many_span(a, w, scales, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, N,
                      repacked + t * repacked_size(K));
        free(repacked);
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        span(a, w, scales, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, N);
}
