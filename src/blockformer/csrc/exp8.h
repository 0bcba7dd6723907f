/* e^x on eight floats with AVX2 and FMA (causal_attention.c, gelu.c); include after defining VECTOR. */
#ifndef BLOCKFORMER_EXP8_H
#define BLOCKFORMER_EXP8_H
#ifdef VECTOR
#include <immintrin.h>

/* e^x for eight floats: x = n ln2 + r, e^r by its degree-6 Taylor-like polynomial (Cephes' expf
 * coefficients, within 2 ulp), 2^n into the exponent. Below -87.3 gives the smallest normal float
 * rather than 0 (a weight under 1e-38 of the row's largest); NaN stays NaN. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-87.3365447505531f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
#endif
