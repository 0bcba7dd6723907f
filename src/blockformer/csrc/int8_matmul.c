/* A weight-only int8 matmul at a decode step's few rows: y[r, o] = scales[o] * x[r] . w[o]
 * for fp32 activations x (rows, K), int8 weights w (N, K) with one scale per output channel,
 * output channels o in [o0, o1). Each weight byte is read once for all the rows, so at one
 * row the product streams a quarter of the fp32 weight's bytes. Built at first use by
 * blockformer.native with the machine's C compiler; plain C, vectorised by the compiler.
 */
#include <stdint.h>

#define ROWS(R)                                                                              \
    static void rows_##R(const float *x, const int8_t *w, const float *scales, float *y,   \
                         int64_t o0, int64_t o1, int64_t K, int64_t N) {                  \
        for (int64_t o = o0; o < o1; o++) {                                                \
            const int8_t *wo = w + o * K;                                                  \
            float acc[R] = {0};                                                            \
            for (int64_t k = 0; k < K; k++) {                                              \
                const float wk = (float)wo[k];                                             \
                for (int r = 0; r < R; r++) acc[r] += x[r * K + k] * wk;                   \
            }                                                                              \
            for (int r = 0; r < R; r++) y[r * N + o] = acc[r] * scales[o];                 \
        }                                                                                  \
    }

ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

/* rows 1..4; the caller takes any more as a dense matmul */
void int8_matmul_f32(const float *x, const int8_t *w, const float *scales, float *y, int64_t rows,
                     int64_t o0, int64_t o1, int64_t K, int64_t N) {
    switch (rows) {
        case 1: rows_1(x, w, scales, y, o0, o1, K, N); break;
        case 2: rows_2(x, w, scales, y, o0, o1, K, N); break;
        case 3: rows_3(x, w, scales, y, o0, o1, K, N); break;
        default: rows_4(x, w, scales, y, o0, o1, K, N); break;
    }
}
