/* Exact GELU for training, with its derivative from the same pass:
 *     y = x Phi(x),  dy = Phi(x) + x phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2,  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
 * erf by Abramowitz and Stegun's 7.1.26, the form torch's own vectorised GELU takes (within 1.5e-7),
 * whose exp(-z^2) is phi's too: one exponential gives both. The backward is then one product by dy
 * instead of torch's second pass through erf and exp (BENCHMARKS.md). Work is split over `threads`
 * runs of torch's OpenMP runtime in blocks of 8. AVX2 and FMA; plain C (libm's erff) elsewhere.
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

/* y = GELU(x) and dy = GELU'(x), n floats each, contiguous */
void gelu_f32(const float *x, float *y, float *dy, int64_t n, int64_t threads) {
    const int64_t blocks = (n + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) {
        const int64_t lo = blocks * t / threads * 8, hi = blocks * (t + 1) / threads * 8;
        if (lo < n) gelu_range(x + lo, y + lo, dy + lo, (hi < n ? hi : n) - lo);
    }
}
