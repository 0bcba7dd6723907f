/* The int4 product of csrc/int4_matmul.c (same codes, scales and zeros) with its activations
 * rounded to int8 first, so that the inner loop multiplies integers: llama.cpp's way on a CPU
 * (4-bit weights against 8-bit activations), and torchao's "8da4w". Each row of x is cut into
 * blocks of 32 inputs, each with its own scale d = max|x| / 127 and int8 values
 * xq = round(x / d). Per group g of G inputs (G a multiple of 32) and output o:
 *     y[r, o] = scale[o, g] * sum_b d[r, b] sum_{k in b} q[o, k] xq[r, k] + (zero[o, g] - 8 scale[o, g]) dq[r, g]
 * with dq[r, g] = sum_b d[r, b] sum_{k in b} xq[r, k], plus bias[o] where given (not NULL): the
 * dequantized weight times the rounded activations, as generate/quantize.py's dense path
 * computes it (round_activations, then F.linear). With AVX2, 32 codes are
 * multiplied by 32 int8 inputs and summed in 8 int32 lanes by two instructions (one with
 * AVX512-VNNI): against the fp32 kernel's 4 conversions and 4 FMAs per 32 codes; at one row two
 * output channels share each load of the inputs. Elsewhere plain C with the same integer sums.
 * Built at first use by blockformer.native.
 */
#include "rows.h"

#include <stdlib.h>

#define BLOCK A8_BLOCK

/* The rows' activations as the kernel reads them: xq[r, k] int8, in the order that code bytes
 * unpack to, d[r, b] per block of 32, and per group dq[r, g], the sum of the rounded inputs.
 * The low nibbles of 16 code bytes hold inputs 0-7 and 16-23 of a block, the high ones 8-15 and
 * 24-31 (pack_int4). With AVX2 and groups of 64 or more, 32 code bytes (two blocks) are read
 * at once as all their low nibbles and all their high ones, so the two blocks' inputs are
 * interleaved in that order too ("paired"), and dv[r, 8 j .. 8 j + 7] holds the scales of run j's
 * two blocks, four times each, as the 8 sums of a pair come out. */
typedef struct {
    int8_t *xq;
    float *d, *dv, *dq;
} Rounded;

/* where input k of a block of 32 is stored: inputs 8-15 and 16-23 swap places */
static inline int64_t position(int64_t k) { return (((k >> 3) ^ (k >> 4)) & 1) ? k ^ 24 : k; }

/* where input k of a run of 64 (two blocks) is stored when paired: the low halves of both
 * blocks' positions, then the high halves */
static inline int64_t paired(int64_t k) {
    const int64_t p = position(k % BLOCK), block = k / BLOCK;
    return (p < 16 ? 0 : 32) + block * 16 + p % 16;
}

#if defined(__AVX2__) && defined(__FMA__)
#define PAIRS(G) ((G) % (2 * BLOCK) == 0)
#else
#define PAIRS(G) 0
#endif

static void round_rows(const float *x, Rounded a, int64_t rows, int64_t K, int64_t G, int pairs) {
    const int64_t blocks = K / BLOCK, per_group = G / BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            int8_t q[BLOCK];
            const float d = round_block(x + r * K + b * BLOCK, q);
            int32_t qsum = 0;
            int8_t *out = a.xq + r * K + (pairs ? b / 2 * 2 * BLOCK : b * BLOCK);
            for (int k = 0; k < BLOCK; k++) {
                out[pairs ? paired(b % 2 * BLOCK + k) : position(k)] = q[k];
                qsum += q[k];
            }
            const int64_t g = r * (K / G) + b / per_group;
            a.d[r * blocks + b] = d;
            for (int i = 0; pairs && i < 4; i++) a.dv[r * (K / 8) + b / 2 * 8 + b % 2 * 4 + i] = d;
            if (b % per_group == 0) a.dq[g] = 0;
            a.dq[g] += d * (float)qsum;
        }
}

/* rows_R: R rows of the product over output channels [o0, o1) */
#define SIGNATURE(R)                                                                              \
    static void rows_##R(Rounded a, const uint8_t *codes, const float *scales, const float *zeros, \
                         const float *bias, float *y, int64_t o0, int64_t o1, int64_t K, int64_t G, int64_t N)

#if defined(__AVX2__) && defined(__FMA__)
/* the 32 codes of 16 bytes as unsigned bytes, in the order round_rows stores the inputs */
static inline __m256i codes32(const uint8_t *c) {
    const __m128i v = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

/* the 8 int32 lanes of sum q * x over 32 codes q and rounded inputs x */
static inline __m256i dot32(__m256i q, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

static inline __m256i load32(const int8_t *xq) { return _mm256_loadu_si256((const __m256i *)xq); }

/* A run of 64 codes (32 bytes, two blocks) as its low nibbles and its high ones */
static inline void codes64(const uint8_t *c, __m256i *low, __m256i *high) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)c), mask = _mm256_set1_epi8(15);
    *low = _mm256_and_si256(v, mask);
    *high = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
}

/* The 8 int32 sums of a paired run against its 64 stored inputs x: lanes 0-3 the first block's,
 * 4-7 the second's. Without VNNI the two maddubs halves add as int16 (at most 2 x 3810) first. */
static inline __m256i dot64(__m256i low, __m256i high, const int8_t *x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), low, load32(x)), high, load32(x + 32));
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, load32(x)), _mm256_maddubs_epi16(high, load32(x + 32)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

#define ROWS(R)                                                                                    \
    SIGNATURE(R) {                                                                                 \
        const int64_t groups = K / G, blocks = K / BLOCK;                                          \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * (K / 2);                                               \
            prefetch_ahead(co, K / 2);                                                             \
            __m256 total[R];                                                                       \
            float offset[R];                                                                       \
            for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps(), offset[r] = 0;             \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                __m256 acc[R];                                                                     \
                for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                          \
                if (PAIRS(G))                                                                      \
                    for (int64_t k = g * G; k < (g + 1) * G; k += 2 * BLOCK) {                     \
                        __m256i low, high;                                                         \
                        codes64(co + k / 2, &low, &high);                                          \
                        for (int r = 0; r < R; r++)                                                \
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot64(low, high, a.xq + r * K + k)), \
                                                     _mm256_loadu_ps(a.dv + r * (K / 8) + k / 8), acc[r]); \
                    }                                                                              \
                else                                                                               \
                    for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {                         \
                        const __m256i q = codes32(co + k / 2);                                     \
                        for (int r = 0; r < R; r++)                                                \
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q, load32(a.xq + r * K + k))), \
                                                     _mm256_broadcast_ss(a.d + r * blocks + k / BLOCK), acc[r]); \
                    }                                                                              \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++) {                                                      \
                    total[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), acc[r], total[r]);               \
                    offset[r] += (z - 8.0f * s) * a.dq[r * groups + g];                            \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = hsum(total[r]) + offset[r] + (bias ? bias[o] : 0.0f); \
        }                                                                                          \
    }
#else
#define ROWS(R)                                                                                    \
    SIGNATURE(R) {                                                                                 \
        const int64_t groups = K / G, blocks = K / BLOCK;                                          \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * (K / 2);                                               \
            float total[R] = {0};                                                                  \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                float acc[R] = {0};                                                                \
                for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {                             \
                    int32_t dot[R] = {0};                                                          \
                    for (int j = 0; j < BLOCK / 2; j++) { /* byte j: positions j (low), j + 16 (high) */ \
                        const int32_t lo = co[k / 2 + j] & 15, hi = co[k / 2 + j] >> 4;            \
                        for (int r = 0; r < R; r++)                                                \
                            dot[r] += lo * a.xq[r * K + k + j] + hi * a.xq[r * K + k + j + 16];    \
                    }                                                                              \
                    for (int r = 0; r < R; r++) acc[r] += a.d[r * blocks + k / BLOCK] * (float)dot[r]; \
                }                                                                                  \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++)                                                        \
                    total[r] += s * acc[r] + (z - 8.0f * s) * a.dq[r * groups + g];                \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = total[r] + (bias ? bias[o] : 0.0f);        \
        }                                                                                          \
    }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define rows_1 rows_1_one /* the generic body, for an odd channel left over */
ROWS(1)
#undef rows_1
ROWS(2) ROWS(3) ROWS(4)
/* One row, paired runs: two output channels at a time share each load of the rounded inputs and
 * their scales. Groups of 32 take the generic body. */
static void rows_1(Rounded a, const uint8_t *codes, const float *scales, const float *zeros, const float *bias,
                   float *y, int64_t o0, int64_t o1, int64_t K, int64_t G, int64_t N) {
    const int64_t groups = K / G;
    int64_t o = o0;
    for (; PAIRS(G) && o + 2 <= o1; o += 2) {
        const uint8_t *c0 = codes + o * (K / 2), *c1 = c0 + K / 2;
        prefetch_ahead(c0, K);
        __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
        float f0 = 0, f1 = 0;
        for (int64_t g = 0; g < groups; g++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 2 * BLOCK) {
                __m256i low0, high0, low1, high1;
                codes64(c0 + k / 2, &low0, &high0);
                codes64(c1 + k / 2, &low1, &high1);
                const __m256 d = _mm256_loadu_ps(a.dv + k / 8);
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot64(low0, high0, a.xq + k)), d, a0); /* the same x loads */
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot64(low1, high1, a.xq + k)), d, a1);
            }
            const float s0 = scales[o * groups + g], z0 = zeros[o * groups + g];
            const float s1 = scales[(o + 1) * groups + g], z1 = zeros[(o + 1) * groups + g];
            t0 = _mm256_fmadd_ps(_mm256_set1_ps(s0), a0, t0);
            t1 = _mm256_fmadd_ps(_mm256_set1_ps(s1), a1, t1);
            f0 += (z0 - 8.0f * s0) * a.dq[g];
            f1 += (z1 - 8.0f * s1) * a.dq[g];
        }
        y[o] = hsum(t0) + f0 + (bias ? bias[o] : 0.0f);
        y[o + 1] = hsum(t1) + f1 + (bias ? bias[o + 1] : 0.0f);
    }
    if (o < o1) rows_1_one(a, codes, scales, zeros, bias, y, o, o1, K, G, N);
}
#else
ALL_ROWS
#endif

static Rounded offset_rows(Rounded a, int64_t r0, int64_t K, int64_t G) {
    return (Rounded){a.xq + r0 * K, a.d + r0 * (K / BLOCK), a.dv + r0 * (K / 8), a.dq + r0 * (K / G)};
}

#if defined(__AVX2__) && defined(__FMA__)
/* Many rows (MANY_ROWS or more), as int8_a8_matmul.c's many-row path: a thread repacks 8 output
 * channels' codes at a time, unpacked to bytes (0..15) in codes32's order, so that vector t of
 * block b holds codes 4t..4t+3 of each channel's block, and the rows' rounded inputs, stored
 * unpaired, are broadcast 4 at a time against them. The codes are the unsigned operand, so
 * neither VNNI nor AVX2 needs a sign trick; without VNNI a block's 8 maddubs add as int16 (at
 * most 16 x 15 x 127 = 30,480) before one madd. A group's lanes then take its 8 channels'
 * scales and zero offsets as vectors (2 a group, repacked with the codes). MANY_ROWS: from
 * where this path was the faster (bench_kernel_ab.py): the few-row bodies' paired runs already
 * share a conversion and an FMA between two blocks, so the gain is smaller than int8-a8's. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#define MANY_ROWS 6
#else
#define VNNI 0
#define MANY_ROWS 8
#endif

/* Channels [o, o + n) (n <= 8; the other lanes zero) into wt: 8 vectors a block, then per group
 * the channels' scales and their zero - 8 x scale (2 vectors a group). */
static void repack(const uint8_t *codes, const float *scales, const float *zeros, int64_t o, int n, int64_t K,
                   int64_t G, __m256i *wt) {
    const int64_t blocks = K / BLOCK, groups = K / G;
    const uint8_t *co = codes + o * (K / 2);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i v[8];
        for (int j = 0; j < 8; j++) v[j] = j < n ? codes32(co + j * (K / 2) + b * (BLOCK / 2)) : _mm256_setzero_si256();
        transpose8(v);
        for (int t = 0; t < 8; t++) wt[b * 8 + t] = v[t];
    }
    __m256 *sz = (__m256 *)(wt + 8 * blocks);
    for (int64_t g = 0; g < groups; g++) {
        float s[8] = {0}, z[8] = {0};
        for (int j = 0; j < n; j++) {
            s[j] = scales[(o + j) * groups + g];
            z[j] = zeros[(o + j) * groups + g] - 8.0f * s[j];
        }
        sz[2 * g] = _mm256_loadu_ps(s);
        sz[2 * g + 1] = _mm256_loadu_ps(z);
    }
}

/* R rows (xq, d and dq at the first) of the 8 repacked channels at o, n of them real */
#define MANY(R)                                                                                    \
    static void many_##R(Rounded a, const __m256i *wt, const float *bias, float *y, int64_t o, int n, int64_t K, \
                         int64_t G, int64_t N, const uint8_t *ahead) {                             \
        const int64_t blocks = K / BLOCK, groups = K / G, per_group = G / BLOCK;                   \
        const __m256 *sz = (const __m256 *)(wt + 8 * blocks);                                      \
        __m256 total[R];                                                                           \
        for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps();                                \
        for (int64_t g = 0; g < groups; g++) {                                                     \
            __m256 acc[R];                                                                         \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                              \
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {                        \
                if (ahead) /* the next 8 channels' codes, 128 bytes a block */                     \
                    for (int l = 0; l < 8 * BLOCK / 2; l += 64) __builtin_prefetch(ahead + b * 4 * BLOCK + l, 0, 3); \
                __m256i dot[R];                                                                    \
                for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();                       \
                for (int t = 0; t < 8; t++) {                                                      \
                    const __m256i wv = wt[b * 8 + t];                                              \
                    for (int r = 0; r < R; r++) {                                                  \
                        const __m256i x4 = broadcast4(a.xq + r * K + b * BLOCK + 4 * t);           \
                        dot[r] = VNNI ? dpbusd(dot[r], wv, x4) : _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(wv, x4)); \
                    }                                                                              \
                }                                                                                  \
                for (int r = 0; r < R; r++) {                                                      \
                    const __m256i d32 = VNNI ? dot[r] : _mm256_madd_epi16(dot[r], _mm256_set1_epi16(1)); \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32), _mm256_broadcast_ss(a.d + r * blocks + b), acc[r]); \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) {                                                          \
                total[r] = _mm256_fmadd_ps(acc[r], sz[2 * g], total[r]);                           \
                total[r] = _mm256_fmadd_ps(sz[2 * g + 1], _mm256_broadcast_ss(a.dq + r * groups + g), total[r]); \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++) store8(total[r], NULL, bias, y + r * N, o, n);                 \
    }

MANY(1) MANY(2) MANY(3) MANY(4) MANY(5) MANY(6) MANY(7) MANY(8)

/* vectors a thread's repacked channels take: 8 a block, 2 a group */
static int64_t repacked_size(int64_t K, int64_t G) { return (K / BLOCK) * 8 + (K / G) * 2; }

static void many_span(Rounded a, const uint8_t *codes, const float *scales, const float *zeros, const float *bias,
                      float *y, int64_t rows, int64_t o0, int64_t o1, int64_t K, int64_t G, int64_t N, __m256i *wt) {
    for (int64_t o = o0; o < o1; o += 8) {
        const int n = o1 - o < 8 ? (int)(o1 - o) : 8;
        repack(codes, scales, zeros, o, n, K, G, wt);
        const uint8_t *ahead = o + 8 < o1 ? codes + (o + 8) * (K / 2) : NULL;
        EACH_TILE(rows, offset_rows(a, r0, K, G), wt, bias, y + r0 * N, o, n, K, G, N, r0 == 0 ? ahead : NULL)
    }
}
#endif

static void span(Rounded a, const uint8_t *codes, const float *scales, const float *zeros, const float *bias,
                 float *y, int64_t rows, int64_t o0, int64_t o1, int64_t K, int64_t G, int64_t N) {
    EACH_BLOCK(rows, o0, o1, offset_rows(a, r0, K, G), codes, scales, zeros, bias, y + r0 * N, c0, c1, K, G, N)
}

/* x: rows of K contiguous floats; K and G multiples of 32, G dividing K. The rows are rounded
 * once, on the calling thread, into `scratch` (the caller's) of rows * (K / 4 + K / 8 + K / 32 + K / G)
 * floats; then the N output channels split into `threads`
 * spans, one per thread of torch's OpenMP runtime. */
void int4_a8_matmul_f32(const float *x, const uint8_t *codes, const float *scales, const float *zeros,
                        const float *bias, float *y, float *scratch, int64_t rows, int64_t K, int64_t G,
                        int64_t N, int64_t threads) {
    Rounded a;
    a.d = scratch;
    a.dv = a.d + rows * (K / BLOCK);
    a.dq = a.dv + rows * (K / 8);
    a.xq = (int8_t *)(a.dq + rows * (K / G));
#if defined(__AVX2__) && defined(__FMA__)
    /* each thread's repacked channels; where they cannot be had, the few-row bodies do it all */
    __m256i *repacked = rows >= MANY_ROWS
                            ? aligned_alloc(32, (size_t)(threads * repacked_size(K, G)) * sizeof(__m256i))
                            : NULL;
    if (repacked) {
        round_rows(x, a, rows, K, G, 0);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int64_t t = 0; t < threads; t++)
            many_span(a, codes, scales, zeros, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, G, N,
                      repacked + t * repacked_size(K, G));
        free(repacked);
        return;
    }
#endif
    round_rows(x, a, rows, K, G, PAIRS(G));
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        span(a, codes, scales, zeros, bias, y, rows, N * t / threads, N * (t + 1) / threads, K, G, N);
}
