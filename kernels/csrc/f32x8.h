/* Eight float32 elements at a time on AVX2: common.h's fast_exp, the scalar function's operations
 * in the same order (min/max clamp keeping NaN, rint, the polynomial unfused, the exponent added
 * to the bits), so a loop written with it gives the scalar loop's results bit for bit; the file
 * that includes this must be built with -ffp-contract=off (layer_ops.c is) for fast_exp8. And
 * eight bfloat16 elements widened to float32 and rounded back (to nearest even, NaN kept a quiet
 * NaN: common.h's f32_to_bf16, lane by lane), bf16x16.h's functions at half the width.
 *
 * gcc leaves the scalar float32 loops that call fast_exp unvectorized on AVX2 ("control flow in
 * loop"): SiLU-and-mul ran 3-5 ns an element on a 2-core AMD EPYC (Zen 3), and in bfloat16 4.2 ms
 * of a 47.5 ms decode step of 32 rows (`python bench/decode_step_profile.py`). */
#ifndef PDSERVE_F32X8_H
#define PDSERVE_F32X8_H

#if defined(__AVX2__)
#include <immintrin.h>
#define HAVE_F32X8 1

static inline __m256 fast_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x)); /* NaN stays NaN */
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, k);
    __m256 p = _mm256_set1_ps(1.5403530393381610e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23));
    return _mm256_castsi256_ps(bits);
}

static inline __attribute__((always_inline)) __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The float32 bits of v rounded to bf16 in their high 16 bits (the low 16 bits are not cleared). */
static inline __attribute__((always_inline)) __m256i bf16x8_round_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
}

/* v rounded to bf16's precision, as float32 (common.h's round_to for DT_BF16). */
static inline __attribute__((always_inline)) __m256 bf16x8_round(__m256 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(bf16x8_round_bits(v), _mm256_set1_epi32((int)0xffff0000u)));
}

/* v rounded to 8 bf16, packed into 16 bytes. */
static inline __attribute__((always_inline)) __m128i bf16x8_bits(__m256 v) {
    const __m256i r = _mm256_srli_epi32(bf16x8_round_bits(v), 16);     /* 32-bit lanes of 16-bit values */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void bf16x8_store(uint16_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, bf16x8_bits(v)); }
#else
#define HAVE_F32X8 0
#endif

#endif
