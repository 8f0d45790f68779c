/* What the C kernels of kernels/csrc share: dtype codes, 16-bit <-> float32 conversions and a
 * vectorizable exp. Included by each kernel file; kernels/cpu_kernels.py hashes it into every
 * build key, so an edit here rebuilds them all. */
#ifndef PDSERVE_COMMON_H
#define PDSERVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* float16 bits -> float32, exactly (subnormals, inf and NaN included), in integer and float ops
 * that vectorize: gcc 12 converts `(float)` of a _Float16 one element at a time without
 * AVX512-FP16. The exponent and mantissa are shifted into float32 position and the bias fixed
 * by a multiply by 2^112 (which also normalizes subnormals); inf/NaN get the all-ones exponent. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    uint32_t bits = em << 13;
    float f;
    memcpy(&f, &bits, 4);
    f *= 0x1p112f;
    memcpy(&bits, &f, 4);
    bits |= em >= 0x7c00u ? 0x7f800000u : 0u;
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

/* e^x, vectorizable unlike libm's expf (which the softmax and SiLU loops otherwise spend most
 * of their time in). x = (k + f) / log2(e) with k integer and |f| <= 1/2; 2^f by its degree-6
 * Taylor polynomial (relative error < 2e-7 on that range); 2^k added to the exponent bits.
 * x is clamped to [-87, 88]: below, where expf is subnormal or 0, it gives ~1e-38; above,
 * where expf overflows, ~1.6e38. */
static inline float fast_exp(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float t = x * 1.44269504088896341f;
    const float k = rintf(t), f = t - k;
    float p = 1.5403530393381610e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)k << 23;
    memcpy(&p, &bits, 4);
    return p;
}

/* Element i of a row of the given dtype, as float32; and back, rounded to nearest even. */
static inline __attribute__((always_inline)) float load_elem(const void *row, int64_t i, int dtype) {
    if (dtype == DT_F32) return ((const float *)row)[i];
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)row)[i]);
    return f16_to_f32(((const uint16_t *)row)[i]);
}

static inline __attribute__((always_inline)) void store_elem(void *row, int64_t i, float v, int dtype) {
    if (dtype == DT_F32)
        ((float *)row)[i] = v;
    else if (dtype == DT_BF16)
        ((uint16_t *)row)[i] = f32_to_bf16(v);
    else
        ((_Float16 *)row)[i] = (_Float16)v;
}

/* v rounded to the dtype's precision, as a PyTorch op on 16-bit tensors rounds its result. */
static inline __attribute__((always_inline)) float round_to(float v, int dtype) {
    if (dtype == DT_F32) return v;
    if (dtype == DT_BF16) return bf16_to_f32(f32_to_bf16(v));
    return (float)(_Float16)v;
}

#endif
