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

/* IEEE half: 1 sign, 5 exponent and 10 mantissa bits; exponent 0 is zero or subnormal (man * 2^-24),
 * 31 infinity or NaN */
static inline float f16_to_float(uint16_t x) {
    const uint32_t sign = (uint32_t)(x & 0x8000u) << 16, exp = (x >> 10) & 0x1f, man = x & 0x3ff;
    if (exp == 0) {
        const float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    union { uint32_t u; float f; } v = {sign | (exp == 0x1f ? 0x7f800000u | man << 13 : (exp + 112) << 23 | man << 13)};
    return v.f;
}
#endif
