/* 16-bit floats widened to fp32, in plain C: the caches that hold keys and values in bf16 or fp16
 * (decode_attention.c, paged_attention.c). Exact: every bf16 and fp16 value is an fp32 value. */
#ifndef BLOCKFORMER_HALF_H
#define BLOCKFORMER_HALF_H
#include <stdint.h>

/* a bf16 is the top half of an fp32 */
static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v = {(uint32_t)x << 16};
    return v.f;
}

/* IEEE half: 1 sign, 5 exponent and 10 mantissa bits. Its exponent and mantissa, moved into an fp32's
 * places, read as 2^-112 times the value (normal or subnormal: the fp32 is then subnormal too), so one
 * product by 2^112 rebiases them; exponent 31 (infinity, NaN) sets every exponent bit. No branch, so the
 * compiler vectorises loops over it. */
static inline float f16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v = {(uint32_t)(x & 0x7fff) << 13};
    v.f *= 0x1p112f;
    v.u |= ((x & 0x7c00) == 0x7c00 ? 0x7f800000u : 0) | (uint32_t)(x & 0x8000) << 16;
    return v.f;
}
#endif
