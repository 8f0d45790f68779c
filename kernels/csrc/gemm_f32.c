/* float32 GEMM for a decode step's linears: out[m, n] = x[m, k] . W[n, k] + bias[n], on CPUs with
 * AVX-512 (vfmadd231ps with x broadcast from memory: 16 products per instruction).
 *
 * The weight is packed once, at load (kernels/gemm_f32.py), into tiles of TILE_N columns, each
 * tile its k rows in order:
 *
 *   packed[tile][kk][col] = W[tile * TILE_N + col][kk]   (0 past n)
 *
 * so one 64-byte load is 16 columns at one k. A register block is up to MAX_ROWS rows x TILE_N /
 * 16 vectors of 16 float32 accumulators; tasks, register blocks, the next tile's prefetch and the
 * parallel loop (guided, the caller spinning a bounded time at the end: 32 rows, cache-warm, o_proj
 * 85 -> 66 us, qkv 154 -> 142 us guided; then at load ~2.7 qkv 0.17-0.21 -> 0.15-0.17 ms, o_proj
 * 81-91 -> 67 us with the spin) are gemm_tasks.h's, shared with gemm_bf16.c.
 *
 * Built by kernels/cpu_kernels.py with -march=native: where the compiler does not target AVX-512F
 * the file builds without the kernel and gemm_f32_supported() returns 0.
 */
#include <immintrin.h>
#include <stdint.h>

#include "gemm_tasks.h"

int gemm_f32_tile_n(void) { return TILE_N; }

#ifdef __AVX512F__
int gemm_f32_supported(void) { return 1; }

/* R rows of x (constant after inlining) from row r0 times packed tile t (a gemm_block_fn). */
static inline __attribute__((always_inline)) void block(const int R, const struct gemm_call *g, int64_t r0, int64_t t,
                                                        int cols, const char *pf, int64_t pf_lines) {
    const int64_t k = g->k, x_stride = g->x_stride, out_stride = g->out_stride;
    const float *x = (const float *)g->x + r0 * x_stride, *tile = (const float *)g->packed + t * k * TILE_N;
    const float *bias = g->bias == NULL ? NULL : (const float *)g->bias + t * TILE_N;
    float *out = (float *)g->out + r0 * out_stride + t * TILE_N;
    __m512 acc[MAX_ROWS][VECS];
    __mmask16 mask[VECS];
    tile_masks(cols, mask);
    for (int v = 0; v < VECS; v++) {
        const __m512 init = bias == NULL ? opaque_zero() : _mm512_maskz_loadu_ps(mask[v], bias + v * 16);
        for (int r = 0; r < R; r++) acc[r][v] = init;
    }
    const int64_t pf_step = (pf_lines + k - 1) / k;
    for (int64_t kk = 0; kk < k; kk++) {
        for (int64_t j = kk * pf_step; j < (kk + 1) * pf_step && j < pf_lines; j++) _mm_prefetch(pf + j * 64, _MM_HINT_T1);
        __m512 w[VECS];
        for (int v = 0; v < VECS; v++) w[v] = _mm512_loadu_ps(tile + kk * TILE_N + v * 16);
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * x_stride + kk]);
            for (int v = 0; v < VECS; v++) acc[r][v] = _mm512_fmadd_ps(xb, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < VECS; v++) _mm512_mask_storeu_ps(out + r * out_stride + v * 16, mask[v], acc[r][v]);
}

static void rows_block(const struct gemm_call *g, int rows, int64_t r0, int64_t t, int cols, const char *pf,
                       int64_t pf_lines) {
    switch (rows) {
#define CASE(R) case R: block(R, g, r0, t, cols, pf, pf_lines); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
    }
}

/* x: [m, k] rows of stride x_stride; packed: see above, ceil(n / TILE_N) tiles of k * TILE_N
 * floats; bias: [n] or NULL; out: [m, n] rows of stride out_stride. */
void gemm_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
              int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    const struct gemm_call g = {x, packed, bias, out, x_stride, out_stride, m, n, k, k * TILE_N * 4, 1};
    int64_t done = 0;
#pragma omp parallel num_threads(num_threads)
    gemm_thread(&g, rows_block, &done);
}
#else
int gemm_f32_supported(void) { return 0; }

void gemm_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
              int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)num_threads;
}
#endif
