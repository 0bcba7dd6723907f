/* Causal self-attention for training over short sequences, forward and backward, in fp32.
 *
 * For rows b, heads h and positions i of one sequence of T:
 *     out[b, h, i] = sum_{j <= i} p[i, j] v[b, h, j],  p[i, :] = softmax_{j <= i}(scale q[b, h, i] . k[b, h, j])
 * The forward keeps p (T x T a pair, only j <= i written) for the backward, which then needs no
 * second softmax: with dO the output's gradient,
 *     dp[i, j] = dO[i] . v[j],  ds[i, j] = scale p[i, j] (dp[i, j] - sum_j' p[i, j'] dp[i, j'])
 *     dq[i] = sum_{j <= i} ds[i, j] k[j],  dk[j] = sum_{i >= j} ds[i, j] q[i],  dv[j] = sum_{i >= j} p[i, j] dO[i]
 * At nanoGPT's CPU shape (T 64, head size 32) a pair's q, k, v, p and ds take 40 KB, so everything
 * stays in the core's caches; torch's fused kernel, made for long sequences, works in blocks
 * and computes the softmax twice (BENCHMARKS.md). Each product keeps its outputs in registers
 * and reads the other operand in order: a row of scores from keys transposed once per pair
 * (kt, D x ld, zero past T), a row of outputs as a sum of value rows weighed by a row (or, in
 * the backward, a column) of p or ds.
 *
 * Tensors are (B, H, T, D) with D contiguous: element [b, h, t, d] of x at x + b*xb + h*xh + t*xt + d,
 * each with its own three strides (q, k, v, out in the forward; q, k, v, dO, dq, dk, dv in the
 * backward), so q, k and v may be views of one fused projection. p: (B, H, T, T) contiguous.
 * Work is split over (row, head) pairs, one run per thread of torch's OpenMP runtime; `scratch`
 * holds SCRATCH(T, D) floats a thread. AVX2 and FMA where D is a multiple of 8; plain C elsewhere.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif
#include "exp8.h"

static inline int64_t up8(int64_t n) { return (n + 7) & ~(int64_t)7; }


/* The one product of the kernel, for one row of outputs or two (`rows`):
 *     c[r * cr + n] = sum_{m < M} a[r * ar + m * am] b[m * bs + n],  r < rows, n < N
 * a's rows read along am (1: a row of p or ds; T: a column of them), b's rows contiguous. With AVX2
 * and N a multiple of 8: N in blocks of 32 with both rows' sums in eight registers, then blocks of 8;
 * plain C otherwise. Two rows share every load of b: a row of scores against
 * the transposed keys, of outputs against the values, of a key's gradient against the queries. */
static void product(int rows, const float *a, int64_t ar, int64_t am, int64_t M, const float *b, int64_t bs,
                    int64_t N, float *c, int64_t cr) {
#ifdef VECTOR
    const float *a1 = rows == 2 ? a + ar : a; /* one row: the second sums repeat the first, and are dropped */
    int64_t n = 0;
    if (N % 8 == 0) {
    for (; n + 32 <= N; n += 32) {
        __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, y0 = x0, y1 = x0, y2 = x0, y3 = x0;
        for (int64_t m = 0; m < M; m++) {
            const __m256 p = _mm256_set1_ps(a[m * am]), r = _mm256_set1_ps(a1[m * am]);
            const float *x = b + m * bs + n;
            const __m256 b0 = _mm256_loadu_ps(x), b1 = _mm256_loadu_ps(x + 8), b2 = _mm256_loadu_ps(x + 16),
                         b3 = _mm256_loadu_ps(x + 24);
            x0 = _mm256_fmadd_ps(p, b0, x0), x1 = _mm256_fmadd_ps(p, b1, x1);
            x2 = _mm256_fmadd_ps(p, b2, x2), x3 = _mm256_fmadd_ps(p, b3, x3);
            y0 = _mm256_fmadd_ps(r, b0, y0), y1 = _mm256_fmadd_ps(r, b1, y1);
            y2 = _mm256_fmadd_ps(r, b2, y2), y3 = _mm256_fmadd_ps(r, b3, y3);
        }
        float *o = c + n;
        _mm256_storeu_ps(o, x0), _mm256_storeu_ps(o + 8, x1), _mm256_storeu_ps(o + 16, x2),
            _mm256_storeu_ps(o + 24, x3);
        if (rows == 2) {
            o += cr;
            _mm256_storeu_ps(o, y0), _mm256_storeu_ps(o + 8, y1), _mm256_storeu_ps(o + 16, y2),
                _mm256_storeu_ps(o + 24, y3);
        }
    }
    for (; n < N; n += 8) { /* two sums a row, even and odd m, so that the additions overlap */
        __m256 x0 = _mm256_setzero_ps(), x1 = x0, y0 = x0, y1 = x0;
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {
            const __m256 b0 = _mm256_loadu_ps(b + m * bs + n), b1 = _mm256_loadu_ps(b + (m + 1) * bs + n);
            x0 = _mm256_fmadd_ps(_mm256_set1_ps(a[m * am]), b0, x0);
            x1 = _mm256_fmadd_ps(_mm256_set1_ps(a[(m + 1) * am]), b1, x1);
            y0 = _mm256_fmadd_ps(_mm256_set1_ps(a1[m * am]), b0, y0);
            y1 = _mm256_fmadd_ps(_mm256_set1_ps(a1[(m + 1) * am]), b1, y1);
        }
        if (m < M) {
            const __m256 b0 = _mm256_loadu_ps(b + m * bs + n);
            x0 = _mm256_fmadd_ps(_mm256_set1_ps(a[m * am]), b0, x0);
            y0 = _mm256_fmadd_ps(_mm256_set1_ps(a1[m * am]), b0, y0);
        }
        _mm256_storeu_ps(c + n, _mm256_add_ps(x0, x1));
        if (rows == 2) _mm256_storeu_ps(c + cr + n, _mm256_add_ps(y0, y1));
    }
    return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        for (int64_t n = 0; n < N; n++) c[r * cr + n] = 0.0f;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) c[r * cr + n] += a[r * ar + m * am] * b[m * bs + n];
    }
}

/* mt[d * ld + j] = x[j * xt + d] for j < T, 0 for T <= j < ld */
static void transpose(const float *x, int64_t xt, int64_t T, int64_t D, int64_t ld, float *mt) {
    for (int64_t j = 0; j < T; j++)
        for (int64_t d = 0; d < D; d++) mt[d * ld + j] = x[j * xt + d];
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = T; j < ld; j++) mt[d * ld + j] = 0.0f;
}

/* p[j] = softmax of scale * s[j] over j < n, and 0 for n <= j < T; s holds up8(n) floats and is overwritten */
static void softmax(float *s, int64_t n, int64_t T, float scale, float *p) {
    float top = -INFINITY, sum = 0.0f;
#ifdef VECTOR
    const int64_t m = up8(n);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), none = _mm256_set1_ps(-INFINITY);
    __m256 most = none, total = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; j += 8) {  /* lanes past n take no part */
        const __m256 kept = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - j)), _CMP_LT_OQ);
        most = _mm256_max_ps(most, _mm256_blendv_ps(none, _mm256_loadu_ps(s + j), kept));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, most);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    if (top == -INFINITY) top = 0.0f;  /* NaN scores are passed by and give NaN weights below */
    const __m256 shift = _mm256_set1_ps(top * scale), times = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < m; j += 8) {
        const __m256 kept = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - j)), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(kept, exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), times, shift)));
        _mm256_storeu_ps(s + j, e);
        total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(lanes, total);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#else
    for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    if (top == -INFINITY) top = 0.0f;
    for (int64_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] * scale - top * scale));
#endif
    const float inv = 1.0f / sum;
    int64_t j = 0;
    for (; j < n; j++) p[j] = s[j] * inv;
    for (; j < T; j++) p[j] = 0.0f;
}

/* ds[j] = scale p[j] (dp[j] - sum_j' p[j'] dp[j']) over j < n, and 0 for n <= j < T */
static void softmax_backward(const float *p, const float *dp, int64_t n, int64_t T, float scale, float *ds) {
    float r = 0.0f;
    for (int64_t j = 0; j < n; j++) r += p[j] * dp[j];
    for (int64_t j = 0; j < n; j++) ds[j] = scale * p[j] * (dp[j] - r);
    for (int64_t j = n; j < T; j++) ds[j] = 0.0f;
}

/* a pair's scores, then outputs, two query rows at a time; p's rows are written whole, zero past the diagonal */
#define SCRATCH(T, D) ((D) * up8(T) + 2 * up8(T) + (T) * (T))

static void forward_pair(const float *q, const float *k, const float *v, float *out, float *p, int64_t T, int64_t D,
                         int64_t qt, int64_t kt, int64_t vt, int64_t ot, float scale, float *scratch) {
    const int64_t ld = up8(T);
    float *keys = scratch, *s = scratch + D * ld;
    transpose(k, kt, T, D, ld, keys);
    for (int64_t i = 0; i < T; i += 2) {
        const int rows = i + 1 < T ? 2 : 1;
        product(rows, q + i * qt, qt, 1, D, keys, ld, up8(i + rows), s, ld);
        for (int r = 0; r < rows; r++) softmax(s + r * ld, i + r + 1, T, scale, p + (i + r) * T);
        product(rows, p + i * T, T, 1, i + rows, v, vt, D, out + i * ot, ot);
    }
}

/* ds row by row with dq, then dk and dv column by column (p and ds are zero past the diagonal) */
static void backward_pair(const float *q, const float *k, const float *v, const float *p, const float *dout,
                          float *dq, float *dk, float *dv, int64_t T, int64_t D, const int64_t *t, float scale,
                          float *scratch) {
    /* t: token strides of q, k, v, dout, dq, dk, dv */
    const int64_t ld = up8(T);
    float *values = scratch, *dp = scratch + D * ld, *ds = dp + 2 * ld;
    transpose(v, t[2], T, D, ld, values);
    for (int64_t i = 0; i < T; i += 2) {
        const int rows = i + 1 < T ? 2 : 1;
        product(rows, dout + i * t[3], t[3], 1, D, values, ld, up8(i + rows), dp, ld);
        for (int r = 0; r < rows; r++)
            softmax_backward(p + (i + r) * T, dp + r * ld, i + r + 1, T, scale, ds + (i + r) * T);
        product(rows, ds + i * T, T, 1, i + rows, k, t[1], D, dq + i * t[4], t[4]);
    }
    for (int64_t j = 0; j < T; j += 2) {
        const int rows = j + 1 < T ? 2 : 1;
        product(rows, ds + j * T + j, 1, T, T - j, q + j * t[0], t[0], D, dk + j * t[5], t[5]);
        product(rows, p + j * T + j, 1, T, T - j, dout + j * t[3], t[3], D, dv + j * t[6], t[6]);
    }
}

/* Bring the next pair's rows towards the cache while this pair computes.
 * In a training step they come from memory (the step's other layers have been through the caches since),
 * and a pair's arithmetic takes a few microseconds; without this the kernel ran a third slower there. */
static void prefetch_pair(const float *const *x, int n, const int64_t *s, int64_t i, int64_t H, int64_t T, int64_t D) {
    /* pair i's T rows of D floats of each of x[0..n), whose (b, h, t) strides are s[3j..3j+2] */
    for (int j = 0; j < n; j++) {
        const float *r = x[j] + i / H * s[3 * j] + i % H * s[3 * j + 1];
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(r + t * s[3 * j + 2] + d, 0, 3);
    }
}

/* s: the (b, h, t) strides of q, k, v, out, 12 values; p: (B, H, T, T); scratch: threads * SCRATCH(T, D) floats */
void causal_attention_forward_f32(const float *q, const float *k, const float *v, float *out, float *p, float *scratch,
                                  int64_t B, int64_t H, int64_t T, int64_t D, const int64_t *s, int64_t threads,
                                  float scale) {
    const int64_t pairs = B * H, size = SCRATCH(T, D);
    const float *const inputs[3] = {q, k, v};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t n = 0; n < threads; n++)
        for (int64_t i = pairs * n / threads; i < pairs * (n + 1) / threads; i++) {
            const int64_t b = i / H, h = i % H;
            if (i + 1 < pairs * (n + 1) / threads) prefetch_pair(inputs, 3, s, i + 1, H, T, D);
            forward_pair(q + b * s[0] + h * s[1], k + b * s[3] + h * s[4], v + b * s[6] + h * s[7],
                         out + b * s[9] + h * s[10], p + i * T * T, T, D, s[2], s[5], s[8], s[11], scale,
                         scratch + n * size);
        }
}

/* s: the (b, h, t) strides of q, k, v, dout, dq, dk, dv, 21 values */
void causal_attention_backward_f32(const float *q, const float *k, const float *v, const float *p, const float *dout,
                                   float *dq, float *dk, float *dv, float *scratch, int64_t B, int64_t H, int64_t T,
                                   int64_t D, const int64_t *s, int64_t threads, float scale) {
    const int64_t pairs = B * H, size = SCRATCH(T, D);
    const int64_t t[7] = {s[2], s[5], s[8], s[11], s[14], s[17], s[20]}, ps[3] = {H * T * T, T * T, T};
    const float *const inputs[4] = {q, k, v, dout};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t n = 0; n < threads; n++)
        for (int64_t i = pairs * n / threads; i < pairs * (n + 1) / threads; i++) {
            const int64_t b = i / H, h = i % H;
            if (i + 1 < pairs * (n + 1) / threads)
                prefetch_pair(inputs, 4, s, i + 1, H, T, D), prefetch_pair(&p, 1, ps, i + 1, H, T, T);
            backward_pair(q + b * s[0] + h * s[1], k + b * s[3] + h * s[4], v + b * s[6] + h * s[7], p + i * T * T,
                          dout + b * s[9] + h * s[10], dq + b * s[12] + h * s[13], dk + b * s[15] + h * s[16],
                          dv + b * s[18] + h * s[19], T, D, t, scale, scratch + n * size);
        }
}
