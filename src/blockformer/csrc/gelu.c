/* GELU for training, with its derivative from the same pass. The exact form:
 *     y = x Phi(x),  dy = Phi(x) + x phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2,  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
 * erf by Abramowitz and Stegun's 7.1.26, the form torch's own vectorised GELU takes (within 1.5e-7),
 * whose exp(-z^2) is phi's too: one exponential gives both. The tanh form (GPT-2's):
 *     y = x (1 + tanh u) / 2,  u = sqrt(2 / pi) (x + 0.044715 x^3),  dy = (1 + tanh u) / 2 + x (1 - tanh^2 u) u' / 2
 * with e = exp(2u) and r = 1 / (e + 1), (1 + tanh u) / 2 = e r and (1 - tanh^2 u) / 2 = 2 e r^2, so
 *     y = x e r,  dy = e r (1 + 2 x r u'): again one exponential and one division for both, where
 * torch computes tanh twice. The backward is then one product by dy instead of torch's second
 * pass (BENCHMARKS.md). Work is split over `threads` runs of torch's OpenMP runtime in blocks of 8.
 * AVX2 and FMA; plain C (libm's erff and tanhf) elsewhere.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif
#include "exp8.h"

static void gelu_range(const float *x, float *y, float *dy, int64_t n) {
    int64_t i = 0;
#ifdef VECTOR
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), z = _mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f));
        const __m256 a = _mm256_andnot_ps(sign, z);
        const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
        __m256 r = _mm256_set1_ps(1.061405429f);
        r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-1.453152027f));
        r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
        r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
        r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
        r = _mm256_mul_ps(r, t);
        const __m256 e = exp8(_mm256_xor_ps(sign, _mm256_mul_ps(z, z)));  /* exp(-z^2) */
        const __m256 erf = _mm256_or_ps(_mm256_and_ps(sign, z), _mm256_fnmadd_ps(r, e, one));  /* erf(|z|), z's sign */
        const __m256 cdf = _mm256_fmadd_ps(half, erf, half);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(v, cdf));
        _mm256_storeu_ps(dy + i, _mm256_fmadd_ps(_mm256_mul_ps(v, e), _mm256_set1_ps(0.39894228040143268f), cdf));
    }
#endif
    for (; i < n; i++) {
        const float cdf = 0.5f + 0.5f * erff(x[i] * 0.70710678118654752f);
        y[i] = x[i] * cdf;
        dy[i] = cdf + x[i] * expf(-0.5f * x[i] * x[i]) * 0.39894228040143268f;
    }
}

static void gelu_tanh_range(const float *x, float *y, float *dy, int64_t n) {
    int64_t i = 0;
#ifdef VECTOR
    const __m256 one = _mm256_set1_ps(1.0f), k = _mm256_set1_ps(0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), v2 = _mm256_mul_ps(v, v);
        const __m256 u = _mm256_mul_ps(_mm256_mul_ps(k, v), _mm256_fmadd_ps(c, v2, one));
        const __m256 du = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_set1_ps(3.0f * 0.044715f), v2, one));
        /* 2u within +-80: e r stays 1 or 0 to a float and r normal; NaN passes (the constant comes first) */
        const __m256 two_u = _mm256_min_ps(_mm256_set1_ps(80.0f), _mm256_max_ps(_mm256_set1_ps(-80.0f), _mm256_add_ps(u, u)));
        const __m256 e = exp8(two_u), r = _mm256_div_ps(one, _mm256_add_ps(e, one)), er = _mm256_mul_ps(e, r);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(v, er));
        const __m256 xr = _mm256_mul_ps(_mm256_add_ps(v, v), r);
        _mm256_storeu_ps(dy + i, _mm256_mul_ps(er, _mm256_fmadd_ps(xr, du, one)));
    }
#endif
    for (; i < n; i++) {
        const float v = x[i], t = tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v));
        y[i] = 0.5f * v * (1.0f + t);
        dy[i] = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
    }
}

static void split(void (*range)(const float *, float *, float *, int64_t), const float *x, float *y, float *dy,
                  int64_t n, int64_t threads) {
    const int64_t blocks = (n + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) {
        const int64_t lo = blocks * t / threads * 8, hi = blocks * (t + 1) / threads * 8;
        if (lo < n) range(x + lo, y + lo, dy + lo, (hi < n ? hi : n) - lo);
    }
}

/* y = GELU(x) and dy = GELU'(x), n floats each, contiguous: the exact form, then the tanh form */
void gelu_f32(const float *x, float *y, float *dy, int64_t n, int64_t threads) {
    split(gelu_range, x, y, dy, n, threads);
}

void gelu_tanh_f32(const float *x, float *y, float *dy, int64_t n, int64_t threads) {
    split(gelu_tanh_range, x, y, dy, n, threads);
}
