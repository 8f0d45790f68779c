/* Sixteen bf16 elements at a time on AVX-512: widening to float32, rounding back (to nearest
 * even, NaN kept a quiet NaN, subnormals kept: common.h's f32_to_bf16, lane by lane) and
 * common.h's fast_exp. Each is the scalar function's operations in the same order, so a loop
 * written with them gives the scalar loop's results bit for bit; the file that includes this
 * must be built with -ffp-contract=off (layer_ops.c is) for fast_exp16's polynomial to stay
 * unfused, like fast_exp's.
 *
 * gcc vectorizes the scalar loops over bf16 rows into 8-lane loops that widen and narrow one
 * element pair at a time: 2.4x a float32 row's time for SiLU-and-mul. */
#ifndef PDSERVE_BF16X16_H
#define PDSERVE_BF16X16_H

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16X16 1

static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The float32 bits of v rounded to bf16 in their high 16 bits (the low 16 bits are not cleared). */
static inline __m512i bf16x16_round_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
}

/* v rounded to bf16's precision, as float32 (common.h's round_to for DT_BF16). */
static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16x16_round_bits(v), _mm512_set1_epi32((int)0xffff0000u)));
}

static inline void bf16x16_store(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16x16_round_bits(v), 16)));
}

static inline __m512 fast_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-87.f), x)); /* NaN stays NaN */
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.5403530393381610e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(k), 23));
    return _mm512_castsi512_ps(bits);
}
#else
#define HAVE_BF16X16 0
#endif

#endif
