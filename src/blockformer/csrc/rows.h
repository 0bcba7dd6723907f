/* What the few-row matmul kernels (f32, int8, int4, and the a8 ones) share. Each defines ROWS(R), the product
 * of R = 1..4 rows over output channels [o0, o1), as a function rows_R; this header gives the
 * horizontal sum their AVX2 bodies end with, the software prefetch of the quantized ones, and
 * the walk over a thread's output channels:
 * in chunks whose weights stay in cache while every block of 4 rows reads them, so past 4 rows
 * each weight byte still comes from memory once. blockformer.native hashes this header into
 * each kernel's build key.
 */
#ifndef BLOCKFORMER_ROWS_H
#define BLOCKFORMER_ROWS_H
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* What the a8 kernels' many-row paths share (int8_a8_matmul.c says how they work): 8 output
 * channels to a vector, their weights repacked so that vector t of a block of 32 holds bytes
 * 4t..4t+3 of each channel's block, and a row's 4 inputs broadcast against it. */

/* v[t] lane j = v[j] lane t: the 8 x 8 transpose of 32-bit words */
static inline void transpose8(__m256i v[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            b[i + 2 * h] = _mm256_unpacklo_epi64(a[i + h], a[i + h + 2]);
            b[i + 2 * h + 1] = _mm256_unpackhi_epi64(a[i + h], a[i + h + 2]);
        }
    for (int t = 0; t < 4; t++) {
        v[t] = _mm256_permute2x128_si256(b[t], b[t + 4], 0x20);
        v[t + 4] = _mm256_permute2x128_si256(b[t], b[t + 4], 0x31);
    }
}

/* 4 bytes of a row's inputs in every 32-bit lane */
static inline __m256i broadcast4(const int8_t *x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* y[o + j] = lane j (times scales[o + j] where scales is not NULL) + bias[o + j] (where not
 * NULL), for the n real lanes of 8 channels from o */
static inline void store8(__m256 acc, const float *scales, const float *bias, float *y, int64_t o, int n) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < n; j++) y[o + j] = lanes[j] * (scales ? scales[o + j] : 1.0f) + (bias ? bias[o + j] : 0.0f);
}

/* acc + the 4-byte dot products of unsigned u and signed s in each 32-bit lane, by VNNI's
 * vpdpbusd; without VNNI a stand-in that callers never reach (they test for VNNI first) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { (void)u, (void)s; return acc; }
#endif

/* With AVX512-VNNI's 32 vector registers a pass over a group's repacked weights takes 8 rows
 * (8 independent chains of dot products in flight), with AVX2's 16 it takes 4. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TILE 8
#else
#define TILE 4
#endif

/* For each tile of at most `tile` rows from r0, call fn_n(...) with n its rows (the arguments
 * may use r0); fn_1 .. fn_8 are defined, fn_5 .. fn_8 reached only where the tile is 8. */
#define EACH_TILE_OF(tile, fn, rows, ...)                                           \
    for (int64_t r0 = 0; r0 < (rows); r0 += (tile)) {                               \
        switch ((rows) - r0 < (tile) ? (rows) - r0 : (tile)) {                      \
            case 1: fn##_1(__VA_ARGS__); break;                                     \
            case 2: fn##_2(__VA_ARGS__); break;                                     \
            case 3: fn##_3(__VA_ARGS__); break;                                     \
            case 4: fn##_4(__VA_ARGS__); break;                                     \
            case 5: fn##_5(__VA_ARGS__); break;                                     \
            case 6: fn##_6(__VA_ARGS__); break;                                     \
            case 7: fn##_7(__VA_ARGS__); break;                                     \
            default: fn##_8(__VA_ARGS__); break;                                    \
        }                                                                           \
    }
#define EACH_TILE(rows, ...) EACH_TILE_OF(TILE, many, rows, __VA_ARGS__)

/* The weight-only kernels' many-row path (int8_matmul.c, int4_matmul.c). Their few-row bodies
 * take one output channel at a time: every block of 4 rows widens each weight to a float
 * again, and every channel's row ends in a horizontal sum. Here a thread first widens PANEL
 * channels' weights to floats once, input by input (panel[k * PANEL + j] is W[o + j, k]), into
 * its own scratch, which stays in the caches; each tile of rows then runs an fp32 product
 * against it, a row's input broadcast against 2 vectors of 8 channels, one FMA per 8 products
 * and 2 x tile independent sums, as the inner kernel of an fp32 GEMM does. While the first
 * tile runs, it prefetches the next panel's weights, `ahead_per_k` bytes an input. */
#define PANEL 16
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define PANEL_TILE 8 /* 16 sums, 2 weight vectors and a broadcast in AVX-512's 32 vector registers */
#else
#define PANEL_TILE 4 /* 8 + 2 + 1 of AVX2's 16 */
#endif

/* R rows of x against the n <= PANEL real channels of a panel, into y[r, o + j] (times scales
 * where given) + bias. The sums are named variables, not arrays: GCC kept arrays of them in
 * memory too and stored each one at every input. */
#define EACH_OF_8(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
static inline __attribute__((always_inline)) void panel_tile(int R, const float *panel, const float *x, int64_t K,
                                                             const float *scales, const float *bias, float *y,
                                                             int64_t N, int64_t o, int n, const char *ahead,
                                                             int64_t ahead_per_k) {
#define PANEL_SUMS(r) __m256 a##r = _mm256_setzero_ps(), b##r = _mm256_setzero_ps();
    EACH_OF_8(PANEL_SUMS)
    for (int64_t k = 0; k < K; k++) {
        if (ahead && (k * ahead_per_k) % 64 < ahead_per_k) __builtin_prefetch(ahead + k * ahead_per_k, 0, 3);
        const __m256 w0 = _mm256_load_ps(panel + k * PANEL), w1 = _mm256_load_ps(panel + k * PANEL + 8);
#define PANEL_FMA(r)                                                                               \
    if (R > r) {                                                                                   \
        const __m256 xr = _mm256_broadcast_ss(x + r * K + k);                                      \
        a##r = _mm256_fmadd_ps(xr, w0, a##r);                                                      \
        b##r = _mm256_fmadd_ps(xr, w1, b##r);                                                      \
    }
        EACH_OF_8(PANEL_FMA)
    }
    float out[8][PANEL];
#define PANEL_OUT(r)                                                                               \
    if (R > r) _mm256_storeu_ps(out[r], a##r), _mm256_storeu_ps(out[r] + 8, b##r);
    EACH_OF_8(PANEL_OUT)
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++)
            y[r * N + o + j] = out[r][j] * (scales ? scales[o + j] : 1.0f) + (bias ? bias[o + j] : 0.0f);
}
#define PANEL_ROWS(R)                                                                              \
    static void panel_##R(const float *panel, const float *x, int64_t K, const float *scales,      \
                          const float *bias, float *y, int64_t N, int64_t o, int n, const char *ahead, \
                          int64_t ahead_per_k) {                                                   \
        panel_tile(R, panel, x, K, scales, bias, y, N, o, n, ahead, ahead_per_k);                  \
    }
PANEL_ROWS(1) PANEL_ROWS(2) PANEL_ROWS(3) PANEL_ROWS(4) PANEL_ROWS(5) PANEL_ROWS(6) PANEL_ROWS(7) PANEL_ROWS(8)

/* every one of x's rows against a panel (panel_R's arguments) */
static inline void panel_product(const float *panel, const float *x, int64_t rows, int64_t K, const float *scales,
                                 const float *bias, float *y, int64_t N, int64_t o, int n, const char *ahead,
                                 int64_t ahead_per_k) {
    EACH_TILE_OF(PANEL_TILE, panel, rows, panel, x + r0 * K, K, scales, bias, y + r0 * N, N, o, n,
                 r0 == 0 ? ahead : NULL, ahead_per_k)
}

/* Bytes t of 8 rows (row j at p + j * stride; only rows j < n are read, the rest are zeros), as
 * one 8 x 8 byte transpose: pairs[i] holds bytes 2i of the rows in its low 8 bytes, 2i + 1 in
 * its high ones. A third of the shuffles of widening first and transposing 32-bit words. */
static inline void transpose8_bytes(const uint8_t *p, int64_t stride, int n, __m128i pairs[4]) {
    __m128i r[8], a[4], b[4];
    for (int j = 0; j < 8; j++) r[j] = j < n ? _mm_loadl_epi64((const __m128i *)(p + j * stride)) : _mm_setzero_si128();
    for (int i = 0; i < 4; i++) a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 2; i++) {
        b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    pairs[0] = _mm_unpacklo_epi32(b[0], b[2]);
    pairs[1] = _mm_unpackhi_epi32(b[0], b[2]);
    pairs[2] = _mm_unpacklo_epi32(b[1], b[3]);
    pairs[3] = _mm_unpackhi_epi32(b[1], b[3]);
}

/* each thread's panel: PANEL x K floats, aligned for _mm256_load_ps, or NULL where it cannot be had */
static inline float *panels(int64_t threads, int64_t K) {
    return aligned_alloc(32, (size_t)(threads * PANEL * K) * sizeof(float));
}
#endif

/* Software prefetch: as a kernel starts a row of weights it asks for the same number of bytes
 * PREFETCH_AHEAD further on, so the loads run that far ahead of the arithmetic. At one row the
 * hardware prefetcher alone kept too few loads in flight for the int8 and int4 kernels, which
 * do more arithmetic per byte than an fp32 product: on a 2-core Xeon they drew 8.4 and 5.3 GB/s
 * where torch's fp32 matmul drew 27, and 19 and 14 with it (BENCHMARKS.md). The fp32 kernel
 * streamed as fast without it. A prefetch past the weight's end does not fault. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif
static inline void prefetch_ahead(const void *row, int64_t bytes) {
    const char *p = (const char *)row + PREFETCH_AHEAD;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* The a8 kernels' activations (int4_a8_matmul.c, int8_a8_matmul.c): 32 inputs x rounded to
 * int8 q against their own scale d = max|x| / 127, q = round(x / d), as generate/quantize.py's
 * round_activations computes them. Returns d: NaN where the inputs hold an infinity or a NaN,
 * so that every output they reach is NaN, as in torch. */
#define A8_BLOCK 32
static inline float round_block(const float *x, int8_t *q) {
    float amax = 0;
    int finite = 1;
    for (int k = 0; k < A8_BLOCK; k++) {
        const float v = x[k] < 0 ? -x[k] : x[k];
        amax = v > amax ? v : amax;
        finite &= v <= 3.4028235e38f; /* false for an infinity or a NaN */
    }
    if (!finite) amax = __builtin_nanf("");
    const float inv = amax > 0 ? 127.0f / amax : 0.0f; /* 0 for NaN: no undefined conversion */
    for (int k = 0; k < A8_BLOCK; k++) q[k] = (int8_t)(int32_t)__builtin_nearbyintf(x[k] * inv);
    return amax / 127.0f;
}

#define ALL_ROWS ROWS(1) ROWS(2) ROWS(3) ROWS(4)

#define CHUNK 16

/* For each chunk [c0, c1) of [o0, o1) and each block of rows starting at r0, call rows_n(...)
 * with n the block's rows (at most 4); the arguments may use r0, c0 and c1. */
#define EACH_BLOCK(rows, o0, o1, ...)                                               \
    for (int64_t c0 = (o0); c0 < (o1); c0 += CHUNK) {                               \
        const int64_t c1 = c0 + CHUNK < (o1) ? c0 + CHUNK : (o1);                   \
        for (int64_t r0 = 0; r0 < (rows); r0 += 4) {                                \
            switch ((rows) - r0) {                                                  \
                case 1: rows_1(__VA_ARGS__); break;                                 \
                case 2: rows_2(__VA_ARGS__); break;                                 \
                case 3: rows_3(__VA_ARGS__); break;                                 \
                default: rows_4(__VA_ARGS__); break;                                \
            }                                                                       \
        }                                                                           \
    }

#endif
