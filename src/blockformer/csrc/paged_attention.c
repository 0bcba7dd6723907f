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

/* out[b, h] = sum_i w_i o_i[h] / sum_i w_i sum_i[h], w_i = exp(top_i[h] - max_i top_i[h]), over row b's parts */
static void merge_parts(const float *partials, float *out, int64_t rows, int64_t parts, int64_t H, int64_t D) {
    const int64_t run = H * D + 2 * H;
    for (int64_t b = 0; b < rows; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *first = partials + b * parts * run;
            float most = -FLT_MAX, total = 0.0f, *ob = out + (b * H + h) * D;
            for (int64_t i = 0; i < parts; i++) most = fmaxf(most, first[i * run + H * D + h]);
            for (int64_t d = 0; d < D; d++) ob[d] = 0.0f;
            for (int64_t i = 0; i < parts; i++) {
                const float *o = first + i * run, w = expf(o[H * D + h] - most);
                total += w * o[H * D + H + h];
                for (int64_t d = 0; d < D; d++) ob[d] += w * o[h * D + d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t d = 0; d < D; d++) ob[d] *= inv;
        }
}

/* part_NAME and paged_decode_attention_NAME for a pool of T, read as floats by LOAD, each slot's
 * keys and values of a head multiplied by SCALE (UNSCALED or ROW_SCALE).
 * part_NAME attends row b over its slots s0..s1 and leaves, for each query head h, the largest score
 * top[h], the sum of the exponentials sum[h] and the values weighed by them, not yet divided, in o[h].
 * With `parts` = 1 the entry point splits the rows into `threads` spans, one per thread of torch's
 * OpenMP runtime, each row's output divided in place. With fewer rows than threads it splits each
 * row's slots, from its first unmasked one to its last, into `parts` instead (split-K, as
 * flash-decoding does on a GPU): each part goes to `partials` (rows * parts runs of H * D + 2 * H
 * floats: o, top, sum) and the parts of a row are merged after. Splitting a row's heads instead made one row slower on two threads: each thread then
 * reads every other stretch of each slot, and the prefetchers fetch the rest too.
 * `scores` holds threads * H * S floats. */
#define PAGED(NAME, T, LOAD, SCALE)                                                                                          \
static void part_##NAME(const float *q, const T *pk, const T *pv, const float *kscale, const float *vscale,                  \
                        const int64_t *read, const uint8_t *mask, float *o, float *top, float *sum, float *scores,          \
                        int64_t b, int64_t s0, int64_t s1, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale) {    \
    const int64_t G = H / Hkv, slot_stride = Hkv * D;                                                                        \
    const float *qb = q + b * H * D;                                                                                         \
    const int64_t *rb = read + b * S;                                                                                        \
    const uint8_t *mb = mask + b * S;                                                                                        \
    for (int64_t h = 0; h < H; h++) top[h] = -FLT_MAX;                                                                       \
    for (int64_t s = s0; s < s1; s++) {                                                                                      \
        if (!mb[s]) continue;                                                                                                \
        const T *ks = pk + rb[s] * slot_stride;                                                                              \
        for (int64_t h = 0; h < H; h++) {                                                                                    \
            const T *kh = ks + (h / G) * D;                                                                                  \
            const float *qh = qb + h * D;                                                                                    \
            float acc = 0.0f;                                                                                                \
            for (int64_t d = 0; d < D; d++) acc += qh[d] * LOAD(kh[d]);                                                      \
            acc *= scale * SCALE(kscale, rb[s], h / G);                                                                      \
            scores[h * S + s] = acc;                                                                                         \
            if (acc > top[h]) top[h] = acc;                                                                                  \
        }                                                                                                                    \
    }                                                                                                                        \
    for (int64_t h = 0; h < H; h++) {                                                                                        \
        float total = 0.0f, *sh = scores + h * S;                                                                            \
        for (int64_t s = s0; s < s1; s++) {                                                                                  \
            if (!mb[s]) continue;                                                                                            \
            sh[s] = expf(sh[s] - top[h]);                                                                                    \
            total += sh[s];                                                                                                  \
        }                                                                                                                    \
        sum[h] = total;                                                                                                      \
    }                                                                                                                        \
    memset(o, 0, (size_t)(H * D) * sizeof(float));                                                                           \
    for (int64_t s = s0; s < s1; s++) {                                                                                      \
        if (!mb[s]) continue;                                                                                                \
        const T *vs = pv + rb[s] * slot_stride;                                                                              \
        for (int64_t h = 0; h < H; h++) {                                                                                    \
            const float p = scores[h * S + s] * SCALE(vscale, rb[s], h / G);                                                 \
            const T *vh = vs + (h / G) * D;                                                                                  \
            float *oh = o + h * D;                                                                                           \
            for (int64_t d = 0; d < D; d++) oh[d] += p * LOAD(vh[d]);                                                        \
        }                                                                                                                    \
    }                                                                                                                        \
}                                                                                                                            \
                                                                                                                             \
void paged_decode_attention_##NAME(const float *q, const T *pk, const T *pv, const float *kscale,                            \
                                const float *vscale, const int64_t *read, const uint8_t *mask, float *out,                   \
                                float *scores, float *partials, int64_t rows, int64_t S, int64_t H, int64_t Hkv,             \
                                int64_t D, int64_t parts, float scale, int64_t threads) {                                    \
    const int64_t units = rows * parts, run = H * D + 2 * H;                                                                 \
    _Pragma("omp parallel for num_threads(threads) schedule(static, 1)")                                                     \
    for (int64_t t = 0; t < threads; t++) {                                                                                  \
        float top[H], sum[H];  /* H is a few dozen at most */                                                                \
        for (int64_t u = units * t / threads; u < units * (t + 1) / threads; u++) {                                          \
            const int64_t b = u / parts, i = u % parts;                                                                      \
            if (parts == 1) {                                                                                                \
                float *ob = out + b * H * D;                                                                                 \
                part_##NAME(q, pk, pv, kscale, vscale, read, mask, ob, top, sum, scores + t * H * S, b, 0, S, S, H, Hkv,     \
                            D, scale);                                                                                       \
                for (int64_t h = 0; h < H; h++) {                                                                            \
                    const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;                                                  \
                    for (int64_t d = 0; d < D; d++) ob[h * D + d] *= inv;                                                    \
                }                                                                                                            \
            } else {  /* the parts share the span from the row's first unmasked slot to its last */                         \
                const uint8_t *mb = mask + b * S;                                                                            \
                int64_t lo = 0, hi = S;                                                                                      \
                while (lo < S && !mb[lo]) lo++;                                                                              \
                while (hi > lo && !mb[hi - 1]) hi--;                                                                         \
                float *o = partials + u * run;                                                                               \
                part_##NAME(q, pk, pv, kscale, vscale, read, mask, o, o + H * D, o + H * D + H, scores + t * H * S, b,       \
                            lo + (hi - lo) * i / parts, lo + (hi - lo) * (i + 1) / parts, S, H, Hkv, D, scale);              \
            }                                                                                                                \
        }                                                                                                                    \
    }                                                                                                                        \
    if (parts > 1) merge_parts(partials, out, rows, parts, H, D);                                                            \
}

PAGED(f32, float, as_float, UNSCALED)
PAGED(bf16, uint16_t, bf16_to_float, UNSCALED)
PAGED(f16, uint16_t, f16_to_float, UNSCALED)
PAGED(i8, int8_t, i8_to_float, ROW_SCALE)
