/* float32 and bfloat16 GEMMs for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel
 * before Skylake-SP): out[m, n] = x[m, k] . W[n, k] + bias[n], summed in float32.
 *
 * Such a CPU has no bfloat16 arithmetic, and oneDNN reports no bf16 support there, so PyTorch
 * multiplies bf16 linears through its generic path: at a decode step's 32 rows, 5x the time of
 * the same linear in float32 on a 2-core AMD EPYC (Zen 3). Here a bf16 weight is widened to
 * float32 in registers (a bf16 is a float32's top 16 bits) and multiplied by FMA: the arithmetic
 * of the float32 kernel, half its weight bytes.
 *
 * The weight is packed once, at load (kernels/gemm_avx2.py), into tiles of TILE_N = 16 columns,
 * each tile its k rows in order, in the weight's dtype:
 *
 *   packed[tile][kk][col] = W[tile * TILE_N + col][kk]   (0 past n)
 *
 * A register block is up to MAX_ROWS = 6 rows x 2 vectors of 8 float32 accumulators (12 of the 16
 * ymm registers; the two weight vectors and a broadcast row element take three more), one pass
 * over the tile's k. bfloat16 rows of x are widened to float32 once per call, into a scratch
 * buffer, not once per tile; results are rounded to bfloat16 to nearest even. Tasks, register
 * blocks, the next tile's prefetch and the parallel loop are gemm_tasks.h's, shared with
 * gemm_f32.c and gemm_bf16.c.
 *
 * Built by kernels/cpu_kernels.py with -march=native: where the compiler does not target AVX2 and
 * FMA the file builds without the kernels and both *_supported() return 0.
 */
#define TILE_N 16
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f32x8.h"
#include "gemm_tasks.h"

int gemm_avx2_f32_tile_n(void) { return TILE_N; }
int gemm_avx2_bf16_tile_n(void) { return TILE_N; }

#if defined(__AVX2__) && defined(__FMA__)
int gemm_avx2_f32_supported(void) { return 1; }
int gemm_avx2_bf16_supported(void) { return 1; }

/* R rows (constant after inlining) of float32 x from row r0 times packed tile t, the weight and
 * bias in float32 (BF16 = 0) or bfloat16 (BF16 = 1), the output in the same dtype. */
static inline __attribute__((always_inline)) void block(const int R, const int BF16, const struct gemm_call *g,
                                                        int64_t r0, int64_t t, int cols, const char *pf,
                                                        int64_t pf_lines) {
    const int64_t k = g->k, x_stride = g->x_stride, out_stride = g->out_stride;
    const float *x = (const float *)g->x + r0 * x_stride;
    const char *tile = (const char *)g->packed + t * g->tile_bytes;
    const int esize = BF16 ? 2 : 4;
    __m256 acc[MAX_ROWS][2];
#pragma GCC unroll 2
    for (int v = 0; v < 2; v++) {
        __m256 init = _mm256_setzero_ps();
        if (g->bias != NULL) {
            const char *bias = (const char *)g->bias + (t * TILE_N + v * 8) * esize;
            const int valid = cols - v * 8 >= 8 ? 8 : cols - v * 8 <= 0 ? 0 : cols - v * 8;
            if (valid == 8) {
                init = BF16 ? bf16x8_load((const uint16_t *)bias) : _mm256_loadu_ps((const float *)bias);
            } else if (valid > 0) {
                char part[32] = {0};
                memcpy(part, bias, (size_t)valid * esize);
                init = BF16 ? bf16x8_load((const uint16_t *)part) : _mm256_loadu_ps((const float *)part);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) acc[r][v] = init;
    }
    const int64_t pf_step = (pf_lines + k - 1) / k;
    for (int64_t kk = 0; kk < k; kk++) {
        for (int64_t j = kk * pf_step; j < (kk + 1) * pf_step && j < pf_lines; j++) _mm_prefetch(pf + j * 64, _MM_HINT_T1);
        const char *row = tile + kk * TILE_N * esize;
        const __m256 w0 = BF16 ? bf16x8_load((const uint16_t *)row) : _mm256_loadu_ps((const float *)row);
        const __m256 w1 = BF16 ? bf16x8_load((const uint16_t *)row + 8) : _mm256_loadu_ps((const float *)row + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + kk);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        char *out = (char *)g->out + ((r0 + r) * out_stride + t * TILE_N) * esize;
        if (cols == TILE_N) {
            for (int v = 0; v < 2; v++) {
                if (BF16) _mm_storeu_si128((__m128i *)(out + v * 16), bf16x8_bits(acc[r][v]));
                else _mm256_storeu_ps((float *)out + v * 8, acc[r][v]);
            }
        } else {       /* the last tile's valid columns only */
            char part[TILE_N * 4];
            for (int v = 0; v < 2; v++) {
                if (BF16) _mm_storeu_si128((__m128i *)(part + v * 16), bf16x8_bits(acc[r][v]));
                else _mm256_storeu_ps((float *)part + v * 8, acc[r][v]);
            }
            memcpy(out, part, (size_t)cols * esize);
        }
    }
}

#define ROWS_BLOCK(NAME, BF16)                                                                                   \
    static void NAME(const struct gemm_call *g, int rows, int64_t r0, int64_t t, int cols, const char *pf,       \
                     int64_t pf_lines) {                                                                         \
        switch (rows) {                                                                                          \
            case 1: block(1, BF16, g, r0, t, cols, pf, pf_lines); break;                                         \
            case 2: block(2, BF16, g, r0, t, cols, pf, pf_lines); break;                                         \
            case 3: block(3, BF16, g, r0, t, cols, pf, pf_lines); break;                                         \
            case 4: block(4, BF16, g, r0, t, cols, pf, pf_lines); break;                                         \
            case 5: block(5, BF16, g, r0, t, cols, pf, pf_lines); break;                                         \
            case 6: block(6, BF16, g, r0, t, cols, pf, pf_lines); break;                                         \
        }                                                                                                        \
    }
ROWS_BLOCK(rows_block_f32, 0)
ROWS_BLOCK(rows_block_bf16, 1)
#undef ROWS_BLOCK

/* x: [m, k] float32 rows of stride x_stride; packed: see above, ceil(n / TILE_N) tiles of
 * k * TILE_N floats; bias: [n] or NULL; out: [m, n] rows of stride out_stride. */
void gemm_avx2_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                   int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    const struct gemm_call g = {x, packed, bias, out, x_stride, out_stride, m, n, k, k * TILE_N * 4, 1};
    int64_t done = 0;
#pragma omp parallel num_threads(num_threads)
    gemm_thread(&g, rows_block_f32, &done);
}

/* The same in bfloat16 (x, packed of k * TILE_N bf16 a tile, bias, out). Returns 0, or -1 if the
 * float32 copy of x could not be allocated. */
int gemm_avx2_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                   int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m == 0) return 0;
    float *wide = malloc((size_t)(m * k) * sizeof(float));
    if (wide == NULL) return -1;
    const struct gemm_call g = {wide, packed, bias, out, k, out_stride, m, n, k, k * TILE_N * 2, 1};
    int64_t done = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            const uint16_t *src = x + r * x_stride;
            float *dst = wide + r * k;
            int64_t j = 0;
            for (; j + 8 <= k; j += 8) _mm256_storeu_ps(dst + j, bf16x8_load(src + j));
            for (; j < k; j++) {
                const uint32_t bits = (uint32_t)src[j] << 16;
                memcpy(dst + j, &bits, 4);
            }
        }       /* the loop's closing barrier: every row widened before any task reads one */
        gemm_thread(&g, rows_block_bf16, &done);
    }
    free(wide);
    return 0;
}
#else
int gemm_avx2_f32_supported(void) { return 0; }
int gemm_avx2_bf16_supported(void) { return 0; }

void gemm_avx2_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                   int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)num_threads;
}

int gemm_avx2_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                   int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)num_threads;
    return -1;
}
#endif
