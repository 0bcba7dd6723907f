/* Decode attention over a cache of keys and values laid out by head: one query token per row, over
 * every slot, or over those a per-row key mask keeps (a left-padded batch, a source's padding in
 * cross-attention, the slots a compiled step has not written yet).
 *
 * For rows b and query heads h, with G = H / Hkv query heads per key/value head (GQA):
 *     out[b, h] = sum_s p[s] v[b, h / G, s],  p = softmax_s(scale q[b, h] . k[b, h / G, s]),  s < S, mask[b, s]
 * `mask` is NULL (every slot) or one byte per slot, 0 or 1, row b's at mask + b * mb (mb 0: one row for
 * all). A masked slot is neither read nor weighed, so its keys and values may hold anything; a row with
 * every slot masked gives zeros.
 * k[b, j, s] starts at k + b * kb + j * kh + s * ks (in values; each slot's D values contiguous),
 * and the same for v. The cache holds fp32, bf16, fp16 or int8 (`kv`: 0, 1, 2, 3; a cache kept narrower
 * than the model computes, KVCache's `dtype`): each value is widened to fp32 as it is read, so a narrow
 * cache costs half the bytes (a quarter for int8) and no copy. An int8 slot's D values are codes times
 * one fp32 scale of its own, k_scale[b, j, s] at k_scale + b * ksb + j * ksh + s (v_scale alike): its
 * score is scaled once after the dot product, and its value weight is multiplied by it before the sum.
 * Queries, scores and outputs are fp32.
 * At a decode step the keys and values come from memory: the weights streamed in between have
 * pushed them out of the caches. So each row of keys and then of values is read once, in order,
 * and prefetched AHEAD slots early; torch's SDPA drew 10-19 GB/s there on a 2-core Zen 4 EPYC, this
 * 20-24 (BENCHMARKS.md). Work is split over (row, head) pairs, one run per thread of torch's OpenMP
 * runtime, so a group's query heads share a thread and its keys stay in cache. `scores` holds S
 * floats per thread. AVX2 and FMA where D is a multiple of 32 (F16C for fp16); plain C elsewhere.
 */
#include <stddef.h>
#include <math.h>
#include <stdint.h>

#include "half.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif

#ifndef AHEAD
#define AHEAD 16 /* slots: 4 KB ahead for an fp32 head of 64 */
#endif

static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i, 0, 3);
}

/* one value as fp32 */
static inline float one_f32(const float *p) { return *p; }
static inline float one_bf16(const uint16_t *p) { return bf16_to_float(*p); }
static inline float one_f16(const uint16_t *p) { return f16_to_float(*p); }
static inline float one_i8(const int8_t *p) { return (float)*p; }

#ifdef VECTOR
/* eight values as fp32 */
static inline __m256 eight_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 eight_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 eight_f16(const uint16_t *p) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = one_f16(p + i);
    return _mm256_loadu_ps(f);
#endif
}
static inline __m256 eight_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* head_NAME: one query head against S slots of its key/value head, for a cache of T read by one_NAME
 * (and, vectorised, eight_NAME). With AVX2: q . k in two independent sums, and 32 outputs at a time
 * with their 4 sums in registers. */
#ifdef VECTOR
#define VECTOR_BODIES(NAME, T)                                                                                     \
static inline float dot_##NAME(const float *q, const T *k, int64_t D) {                                            \
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();                                                       \
    for (int64_t d = 0; d < D; d += 16) {                                                                          \
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), eight_##NAME(k + d), a);                                       \
        b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), eight_##NAME(k + d + 8), b);                               \
    }                                                                                                              \
    return hsum8(_mm256_add_ps(a, b));                                                                             \
}                                                                                                                  \
static void weigh32_##NAME(const float *w, const T *v, const uint8_t *m, int64_t vs, int64_t S, float *out) {      \
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;                                                    \
    for (int64_t s = 0; s < S; s++) {                                                                              \
        const T *r = v + s * vs;                                                                                   \
        if (!m || s + AHEAD >= S || m[s + AHEAD]) __builtin_prefetch(r + AHEAD * vs, 0, 3);                        \
        if (m && !m[s]) continue;                                                                                  \
        const __m256 p = _mm256_set1_ps(w[s]);                                                                     \
        o0 = _mm256_fmadd_ps(p, eight_##NAME(r), o0);                                                              \
        o1 = _mm256_fmadd_ps(p, eight_##NAME(r + 8), o1);                                                          \
        o2 = _mm256_fmadd_ps(p, eight_##NAME(r + 16), o2);                                                         \
        o3 = _mm256_fmadd_ps(p, eight_##NAME(r + 24), o3);                                                         \
    }                                                                                                              \
    _mm256_storeu_ps(out, o0), _mm256_storeu_ps(out + 8, o1), _mm256_storeu_ps(out + 16, o2),                      \
        _mm256_storeu_ps(out + 24, o3);                                                                            \
}
#define VECTOR_DOT(NAME) if (D % 32 == 0) acc = dot_##NAME(q, r, D); else
#define VECTOR_WEIGH(NAME)                                                                                         \
    if (D % 32 == 0) {                                                                                             \
        for (int64_t d = 0; d < D; d += 32) weigh32_##NAME(p, v + d, m, vs, S, out + d);                           \
        return;                                                                                                    \
    }
#else
#define VECTOR_BODIES(NAME, T)
#define VECTOR_DOT(NAME)
#define VECTOR_WEIGH(NAME)
#endif

#define HEAD(NAME, T)                                                                                              \
VECTOR_BODIES(NAME, T)                                                                                             \
static void head_##NAME(const float *q, const void *k_, const void *v_, const uint8_t *m, const float *kq,         \
                        const float *vq, float *out, float *p, int64_t S, int64_t D, int64_t ks, int64_t vs,       \
                        float scale) {                                                                             \
    const T *k = (const T *)k_, *v = (const T *)v_;                                                                \
    float top = -INFINITY;                                                                                         \
    for (int64_t s = 0; s < S; s++) {                                                                              \
        const T *r = k + s * ks;                                                                                   \
        if (!m || s + AHEAD >= S || m[s + AHEAD]) prefetch_row(r + AHEAD * ks, D * (int64_t)sizeof(T));            \
        if (m && !m[s]) {                                                                                          \
            p[s] = -INFINITY;                                                                                      \
            continue;                                                                                              \
        }                                                                                                          \
        float acc;                                                                                                 \
        VECTOR_DOT(NAME) {                                                                                         \
            acc = 0.0f;                                                                                            \
            for (int64_t d = 0; d < D; d++) acc += q[d] * one_##NAME(r + d);                                       \
        }                                                                                                          \
        p[s] = acc * (kq ? scale * kq[s] : scale);                                                                 \
        top = p[s] > top ? p[s] : top;                                                                             \
    }                                                                                                              \
    float sum = 0.0f;                                                                                              \
    if (top == -INFINITY) top = 0.0f; /* every slot masked: each weight below is 0 */                              \
    for (int64_t s = 0; s < S; s++) sum += (p[s] = expf(p[s] - top));                                              \
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;                                                              \
    for (int64_t s = 0; s < S; s++) p[s] *= vq ? inv * vq[s] : inv;                                                \
    VECTOR_WEIGH(NAME)                                                                                             \
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;                                                                 \
    for (int64_t s = 0; s < S; s++) {                                                                              \
        const T *r = v + s * vs;                                                                                   \
        if (!m || s + AHEAD >= S || m[s + AHEAD]) prefetch_row(r + AHEAD * vs, D * (int64_t)sizeof(T));            \
        if (m && !m[s]) continue;                                                                                  \
        for (int64_t d = 0; d < D; d++) out[d] += p[s] * one_##NAME(r + d);                                        \
    }                                                                                                              \
}

HEAD(f32, float)
HEAD(bf16, uint16_t)
HEAD(f16, uint16_t)
HEAD(i8, int8_t)

typedef void (*head_fn)(const float *, const void *, const void *, const uint8_t *, const float *, const float *, float *,
                        float *, int64_t, int64_t, int64_t, int64_t, float);

/* q: (B, H, D) contiguous fp32; out: (B, H, D); k and v of type `kv` (0 fp32, 1 bf16, 2 fp16, 3 int8), their
 * strides in values: (kb, kh, ks), (vb, vh, vs); mask: NULL, or S bytes a row, mb apart; k_scale, v_scale: NULL,
 * or (int8) one fp32 per slot, strides (ksb, ksh) and (vsb, vsh), each head's slots contiguous */
void decode_attention_f32(const float *q, const void *k, const void *v, const uint8_t *mask, const float *k_scale,
                          const float *v_scale, float *out, float *scores, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                          int64_t D, int64_t kb, int64_t kh, int64_t ks, int64_t vb, int64_t vh, int64_t vs, int64_t mb,
                          int64_t ksb, int64_t ksh, int64_t vsb, int64_t vsh, int64_t threads, int64_t kv, float scale) {
    const head_fn head = kv == 1 ? head_bf16 : kv == 2 ? head_f16 : kv == 3 ? head_i8 : head_f32;
    const int64_t G = H / Hkv, pairs = B * H, size = kv == 0 ? 4 : kv == 3 ? 1 : 2;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        for (int64_t i = pairs * t / threads; i < pairs * (t + 1) / threads; i++) {
            const int64_t b = i / H, j = i % H / G;
            head(q + i * D, (const char *)k + (b * kb + j * kh) * size, (const char *)v + (b * vb + j * vh) * size,
                 mask ? mask + b * mb : NULL, k_scale ? k_scale + b * ksb + j * ksh : NULL,
                 v_scale ? v_scale + b * vsb + j * vsh : NULL, out + i * D, scores + t * S, S, D, ks, vs, scale);
        }
}
