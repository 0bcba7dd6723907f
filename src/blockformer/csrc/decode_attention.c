/* Decode attention over a cache of keys and values laid out by head: one query token per row, and
 * every slot visible (the caller takes this kernel only where the step's mask would be all True:
 * KVCache.sees_every_slot).
 *
 * For rows b and query heads h, with G = H / Hkv query heads per key/value head (GQA):
 *     out[b, h] = sum_s p[s] v[b, h / G, s],  p = softmax_s(scale q[b, h] . k[b, h / G, s]),  s < S
 * k[b, j, s] starts at k + b * kb + j * kh + s * ks (in floats; each slot's D values contiguous),
 * and the same for v. At a decode step the keys and values come from memory: the weights streamed
 * in between have pushed them out of the caches. So each row of keys and then of values is read
 * once, in order, and prefetched AHEAD slots early; torch's SDPA drew 10-19 GB/s there on a 2-core
 * Zen 4 EPYC, this 20-24 (BENCHMARKS.md). Work is split over (row, head) pairs, one run per thread of
 * torch's OpenMP runtime, so a group's query heads share a thread and its keys stay in cache.
 * `scores` holds S floats per thread. AVX2 and FMA where D is a multiple of 32; plain C elsewhere.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef AHEAD
#define AHEAD 16 /* slots: 4 KB ahead for a head of 64 */
#endif

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d, 0, 3);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* q . k for D a multiple of 16: two independent sums */
static inline float dot(const float *q, const float *k, int64_t D) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), b);
    }
    return hsum8(_mm256_add_ps(a, b));
}

/* out[0, 32) = sum_s w[s] v[s][0, 32), the 4 sums in registers */
static void weigh32(const float *w, const float *v, int64_t vs, int64_t S, float *out) {
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
    for (int64_t s = 0; s < S; s++) {
        const float *r = v + s * vs;
        __builtin_prefetch(r + AHEAD * vs, 0, 3);
        const __m256 p = _mm256_set1_ps(w[s]);
        o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(r), o0);
        o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(r + 8), o1);
        o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(r + 16), o2);
        o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(r + 24), o3);
    }
    _mm256_storeu_ps(out, o0), _mm256_storeu_ps(out + 8, o1), _mm256_storeu_ps(out + 16, o2), _mm256_storeu_ps(out + 24, o3);
}
#endif

/* one query head against S slots of its key/value head */
static void head(const float *q, const float *k, const float *v, float *out, float *p, int64_t S, int64_t D, int64_t ks,
                 int64_t vs, float scale) {
    float top = -FLT_MAX;
    for (int64_t s = 0; s < S; s++) {
        const float *r = k + s * ks;
        prefetch_row(r + AHEAD * ks, D);
        float acc;
#if defined(__AVX2__) && defined(__FMA__)
        if (D % 32 == 0) {
            acc = dot(q, r, D);
        } else
#endif
        {
            acc = 0.0f;
            for (int64_t d = 0; d < D; d++) acc += q[d] * r[d];
        }
        p[s] = acc * scale;
        top = p[s] > top ? p[s] : top;
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < S; s++) sum += (p[s] = expf(p[s] - top));
    const float inv = 1.0f / sum;
    for (int64_t s = 0; s < S; s++) p[s] *= inv;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 32 == 0) {
        for (int64_t d = 0; d < D; d += 32) weigh32(p, v + d, vs, S, out + d);
        return;
    }
#endif
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t s = 0; s < S; s++) {
        const float *r = v + s * vs;
        prefetch_row(r + AHEAD * vs, D);
        for (int64_t d = 0; d < D; d++) out[d] += p[s] * r[d];
    }
}

/* q: (B, H, D) contiguous; out: (B, H, D); strides of k and v in floats: (kb, kh, ks), (vb, vh, vs) */
void decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *scores, int64_t B,
                          int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t kb, int64_t kh, int64_t ks, int64_t vb,
                          int64_t vh, int64_t vs, int64_t threads, float scale) {
    const int64_t G = H / Hkv, pairs = B * H;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++)
        for (int64_t i = pairs * t / threads; i < pairs * (t + 1) / threads; i++) {
            const int64_t b = i / H, j = i % H / G;
            head(q + i * D, k + b * kb + j * kh, v + b * vb + j * vh, out + i * D, scores + t * S, S, D, ks, vs, scale);
        }
}
