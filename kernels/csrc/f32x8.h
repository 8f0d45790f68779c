/* Eight float32 elements at a time on AVX2: common.h's fast_exp, the scalar function's operations
 * in the same order (min/max clamp keeping NaN, rint, the polynomial unfused, the exponent added
 * to the bits), so a loop written with it gives the scalar loop's results bit for bit; the file
 * that includes this must be built with -ffp-contract=off (layer_ops.c is).
 *
 * gcc leaves the scalar float32 loops that call fast_exp unvectorized on AVX2 ("control flow in
 * loop"): SiLU-and-mul ran 3-5 ns an element on a 2-core AMD EPYC (Zen 3). */
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
#else
#define HAVE_F32X8 0
#endif

#endif
