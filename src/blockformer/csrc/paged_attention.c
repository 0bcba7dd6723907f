/* Decode attention read straight from a paged key/value pool: one query token per row.
 *
 * For rows b in [b0, b1) and query heads h:
 *     out[b, h] = sum_s p[s] * v[read[b, s], h / G],
 *     p = softmax over the slots s with mask[b, s] of scale * q[b, h] . k[read[b, s], h / G]
 * with G = H / Hkv query heads per key/value head (GQA). The pool is (slots, Hkv, D), so a
 * slot's keys for every head are one contiguous run: each key and value is read once, with
 * no gathered copy (the copy and a second pass over it are what this replaces).
 * `scores` is scratch of H * S floats per thread. The pool holds fp32, bf16 or fp16 (half.h widens
 * each value as it is read), or int8 codes with one fp32 scale per slot and key/value head
 * (`kscale`, `vscale`, (slots, Hkv); NULL for a float pool): a score is scaled once after its dot product
 * and a value's scale is folded into its softmax weight, so the inner loops only widen int8 to
 * fp32. Queries, scores and outputs are fp32.
 * Built at first use by blockformer.native with the machine's C compiler (and OpenMP where it
 * has it); plain C, vectorised by the compiler.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

static inline float as_float(float x) { return x; }
static inline float i8_to_float(int8_t x) { return (float)x; }

/* The scale of slot `slot`, key/value head `hk`: 1 in a float pool, `scales[slot * Hkv + hk]` in an int8 one. */
#define UNSCALED(scales, slot, hk) 1.0f
#define ROW_SCALE(scales, slot, hk) (scales)[(slot) * Hkv + (hk)]

/* span_NAME and paged_decode_attention_NAME for a pool of T, read as floats by LOAD, each slot's
 * keys and values of a head multiplied by SCALE (UNSCALED or ROW_SCALE). The
 * entry point splits the rows into `threads` spans, one per thread of torch's OpenMP runtime;
 * `scores` holds threads * H * S floats. */
#define PAGED(NAME, T, LOAD, SCALE)                                                                                          \
static void span_##NAME(const float *q, const T *pk, const T *pv, const float *kscale, const float *vscale,                  \
                 const int64_t *read, const uint8_t *mask, float *out, float *scores, int64_t b0, int64_t b1,                \
                 int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale) {                                                \
    const int64_t G = H / Hkv, slot_stride = Hkv * D;                                                                        \
    float top[H], inv[H];  /* H is a few dozen at most */                                                                    \
    for (int64_t b = b0; b < b1; b++) {                                                                                      \
        const float *qb = q + b * H * D;                                                                                     \
        const int64_t *rb = read + b * S;                                                                                    \
        const uint8_t *mb = mask + b * S;                                                                                    \
        float *ob = out + b * H * D;                                                                                         \
        for (int64_t h = 0; h < H; h++) top[h] = -FLT_MAX;                                                                   \
        for (int64_t s = 0; s < S; s++) {                                                                                    \
            if (!mb[s]) continue;                                                                                            \
            const T *ks = pk + rb[s] * slot_stride;                                                                          \
            for (int64_t h = 0; h < H; h++) {                                                                                \
                const T *kh = ks + (h / G) * D;                                                                              \
                const float *qh = qb + h * D;                                                                                \
                float acc = 0.0f;                                                                                            \
                for (int64_t d = 0; d < D; d++) acc += qh[d] * LOAD(kh[d]);                                                  \
                acc *= scale * SCALE(kscale, rb[s], h / G);                                                                  \
                scores[h * S + s] = acc;                                                                                     \
                if (acc > top[h]) top[h] = acc;                                                                              \
            }                                                                                                                \
        }                                                                                                                    \
        for (int64_t h = 0; h < H; h++) {                                                                                    \
            float sum = 0.0f, *sh = scores + h * S;                                                                          \
            for (int64_t s = 0; s < S; s++) {                                                                                \
                if (!mb[s]) continue;                                                                                        \
                sh[s] = expf(sh[s] - top[h]);                                                                                \
                sum += sh[s];                                                                                                \
            }                                                                                                                \
            inv[h] = sum > 0.0f ? 1.0f / sum : 0.0f;                                                                         \
        }                                                                                                                    \
        memset(ob, 0, (size_t)(H * D) * sizeof(float));                                                                      \
        for (int64_t s = 0; s < S; s++) {                                                                                    \
            if (!mb[s]) continue;                                                                                            \
            const T *vs = pv + rb[s] * slot_stride;                                                                          \
            for (int64_t h = 0; h < H; h++) {                                                                                \
                const float p = scores[h * S + s] * inv[h] * SCALE(vscale, rb[s], h / G);                                    \
                const T *vh = vs + (h / G) * D;                                                                              \
                float *oh = ob + h * D;                                                                                      \
                for (int64_t d = 0; d < D; d++) oh[d] += p * LOAD(vh[d]);                                                    \
            }                                                                                                                \
        }                                                                                                                    \
    }                                                                                                                        \
}                                                                                                                            \
                                                                                                                             \
void paged_decode_attention_##NAME(const float *q, const T *pk, const T *pv, const float *kscale,                            \
                                const float *vscale, const int64_t *read, const uint8_t *mask, float *out,                   \
                                float *scores, int64_t rows, int64_t S, int64_t H, int64_t Hkv, int64_t D,                   \
                                float scale, int64_t threads) {                                                              \
    _Pragma("omp parallel for num_threads(threads) schedule(static, 1)")                                                     \
    for (int64_t t = 0; t < threads; t++)                                                                                    \
        span_##NAME(q, pk, pv, kscale, vscale, read, mask, out, scores + t * H * S, rows * t / threads,                      \
                    rows * (t + 1) / threads, S, H, Hkv, D, scale);                                                          \
}

PAGED(f32, float, as_float, UNSCALED)
PAGED(bf16, uint16_t, bf16_to_float, UNSCALED)
PAGED(f16, uint16_t, f16_to_float, UNSCALED)
PAGED(i8, int8_t, i8_to_float, ROW_SCALE)
