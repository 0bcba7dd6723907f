/* A weight-only int4 matmul at a decode step's few rows. Weights: codes q in 0..15, two per
 * byte (low nibble: even input, high: odd), W[o, k] = (q - 8) * scale[o, g] + zero[o, g] for
 * k in group g of G inputs. Per group the codes are summed against the input first:
 *     y[r, o] = sum_g scale[o, g] * (sum_{k in g} x[r, k] q[o, k] - 8 sx[r, g]) + zero[o, g] sx[r, g]
 * with sx[r, g] the group's sum of x. The caller passes x split into its even and odd inputs
 * (xe, xo: rows x K/2) so the nibbles meet their inputs in order. Each code byte is read
 * once for all the rows: an eighth of the fp32 weight's bytes. Built at first use by
 * blockformer.native with the machine's C compiler; plain C, vectorised by the compiler.
 */
#include <stdint.h>

#define ROWS(R)                                                                                    \
    static void rows_##R(const float *xe, const float *xo, const float *sx, const uint8_t *codes, \
                         const float *scales, const float *zeros, float *y, int64_t o0, int64_t o1, \
                         int64_t K, int64_t G, int64_t N) {                                        \
        const int64_t half = K / 2, groups = K / G;                                               \
        for (int64_t o = o0; o < o1; o++) {                                                        \
            const uint8_t *co = codes + o * half;                                                  \
            float total[R] = {0};                                                                  \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                float acc[R] = {0};                                                                \
                for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j++) {                            \
                    const float lo = (float)(co[j] & 15), hi = (float)(co[j] >> 4);                \
                    for (int r = 0; r < R; r++) acc[r] += xe[r * half + j] * lo + xo[r * half + j] * hi; \
                }                                                                                  \
                const float s = scales[o * groups + g], z = zeros[o * groups + g];                 \
                for (int r = 0; r < R; r++) {                                                      \
                    const float sum = sx[r * groups + g];                                          \
                    total[r] += s * (acc[r] - 8.0f * sum) + z * sum;                               \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) y[r * N + o] = total[r];                                   \
        }                                                                                          \
    }

ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

/* rows 1..4; the caller takes any more as a dense matmul */
void int4_matmul_f32(const float *xe, const float *xo, const float *sx, const uint8_t *codes,
                     const float *scales, const float *zeros, float *y, int64_t rows, int64_t o0,
                     int64_t o1, int64_t K, int64_t G, int64_t N) {
    switch (rows) {
        case 1: rows_1(xe, xo, sx, codes, scales, zeros, y, o0, o1, K, G, N); break;
        case 2: rows_2(xe, xo, sx, codes, scales, zeros, y, o0, o1, K, G, N); break;
        case 3: rows_3(xe, xo, sx, codes, scales, zeros, y, o0, o1, K, G, N); break;
        default: rows_4(xe, xo, sx, codes, scales, zeros, y, o0, o1, K, G, N); break;
    }
}
