/* bfloat16 GEMM for a decode step's linears: out[m, n] = x[m, k] . W[n, k] + bias[n], with
 * float32 accumulation, on CPUs with AVX512-BF16 (vdpbf16ps: 32 products per instruction, twice
 * an fp32 FMA's).
 *
 * The weight is packed once, at load (kernels/gemm_bf16.py), into tiles of TILE_N columns,
 * each tile its k pairs in order, each pair the TILE_N columns' two adjacent k elements:
 *
 *   packed[tile][pair][col][2] = W[tile * TILE_N + col][2 * pair + {0, 1}]   (0 past n or k)
 *
 * so one 64-byte load is 16 columns x one k pair, what vdpbf16ps multiplies against a row's k
 * pair broadcast as one 32-bit value (a row of x already holds its k pairs adjacent: no
 * repacking of the activations). A register block is up to MAX_ROWS rows x TILE_N / 16 vectors
 * of 16 float32 accumulators, one pass over the tile's k pairs; output rounded to bf16, round to
 * nearest even. Tasks, register blocks, the next tile's prefetch and the parallel loop (guided,
 * the caller spinning a bounded time at the end) are gemm_tasks.h's, shared with gemm_f32.c;
 * here a task of one register block (<= MAX_ROWS rows) does not prefetch the next tile:
 * streaming one tile once, prefetching the next as well measured 15% slower at 1 row.
 *
 * Built by kernels/cpu_kernels.py with -march=native: where the compiler does not target
 * AVX512-BF16 the file builds without the kernel and gemm_bf16_supported() returns 0.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gemm_tasks.h"

int gemm_bf16_tile_n(void) { return TILE_N; }

#ifdef __AVX512BF16__
int gemm_bf16_supported(void) { return 1; }

static inline __attribute__((always_inline)) __m512 bias_vec(const uint16_t *bias, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* R rows of x (constant after inlining) from row r0 times packed tile t (a gemm_block_fn). */
static inline __attribute__((always_inline)) void block(const int R, const struct gemm_call *g, int64_t r0, int64_t t,
                                                        int cols, const char *pf, int64_t pf_lines) {
    const int64_t k = g->k, x_stride = g->x_stride, out_stride = g->out_stride, pairs = k / 2;
    const uint16_t *x = (const uint16_t *)g->x + r0 * x_stride;
    const uint16_t *tile = (const uint16_t *)g->packed + t * (g->tile_bytes / 2);
    const uint16_t *bias = g->bias == NULL ? NULL : (const uint16_t *)g->bias + t * TILE_N;
    uint16_t *out = (uint16_t *)g->out + r0 * out_stride + t * TILE_N;
    __m512 acc[MAX_ROWS][VECS];
    __mmask16 mask[VECS];
    tile_masks(cols, mask);
    for (int v = 0; v < VECS; v++) {
        const __m512 init = bias == NULL ? opaque_zero() : bias_vec(bias + v * 16, mask[v]);
        for (int r = 0; r < R; r++) acc[r][v] = init;
    }
    const int64_t pf_step = pairs > 0 ? (pf_lines + pairs - 1) / pairs : 0;
    for (int64_t p = 0; p < pairs; p++) {
        for (int64_t j = p * pf_step; j < (p + 1) * pf_step && j < pf_lines; j++) _mm_prefetch(pf + j * 64, _MM_HINT_T1);
        __m512i w[VECS];
        for (int v = 0; v < VECS; v++) w[v] = _mm512_loadu_si512(tile + (p * TILE_N + v * 16) * 2);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < VECS; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, (__m512bh)w[v]);
        }
    }
    if (k & 1) {        /* the last k alone: its pair's other half is 0 in the packed tile */
        __m512i w[VECS];
        for (int v = 0; v < VECS; v++) w[v] = _mm512_loadu_si512(tile + (pairs * TILE_N + v * 16) * 2);
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * x_stride + k - 1]);
            for (int v = 0; v < VECS; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, (__m512bh)w[v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < VECS; v++)
            _mm256_mask_storeu_epi16(out + r * out_stride + v * 16, mask[v],
                                     (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
}

static void rows_block(const struct gemm_call *g, int rows, int64_t r0, int64_t t, int cols, const char *pf,
                       int64_t pf_lines) {
    switch (rows) {
#define CASE(R) case R: block(R, g, r0, t, cols, pf, pf_lines); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
    }
}

/* x: [m, k] rows of stride x_stride; packed: see above, ceil(n / TILE_N) tiles of
 * ceil(k / 2) * TILE_N * 2 elements; bias: [n] or NULL; out: [m, n] rows of stride out_stride. */
void gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
               int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    const struct gemm_call g = {x, packed, bias, out, x_stride, out_stride, m, n, k, (k + 1) / 2 * TILE_N * 2 * 2, 0};
    int64_t done = 0;
#pragma omp parallel num_threads(num_threads)
    gemm_thread(&g, rows_block, &done);
}
#else
int gemm_bf16_supported(void) { return 0; }

void gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
               int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)num_threads;
}
#endif
