/* bfloat16 GEMM on AMX tiles: out[m, n] = x[m, k] . W[n, k] + bias[n], float32 accumulation, on
 * CPUs with AMX-BF16 (Intel Xeon since Sapphire Rapids). One tdpbf16ps multiplies 16 rows x 32 k
 * by 32 k x 16 columns: 16x the products of a vdpbf16ps, so a decode step's few rows cost what
 * streaming the weight costs, and a prefill chunk's many rows are no longer compute-bound.
 *
 * The weight is gemm_bf16.c's packed layout (kernels/gemm_packed.py), with k padded to a multiple
 * of 32 (KSTEP) so that every tile is whole:
 *
 *   packed[tile][pair][col][2] = W[tile * TILE_N + col][2 * pair + {0, 1}]   (0 past n or k)
 *
 * A row of a tile is TILE_N columns x one k pair (256 bytes), which is what tdpbf16ps wants of its
 * B operand: a B tile is 16 pairs (32 k) of 16 columns, rows 256 bytes apart. A register block is
 * up to 16 rows of x against one packed tile of 64 columns: four C tiles (16 x 16 float32 each),
 * one A tile (the rows' 32 k), three B tiles (the fourth reuses the first's register):
 *
 *   tiles 0-3  C: rows x 16 columns each        tile 4  A: rows x 32 k        tiles 5-7  B
 *
 * A task's first block prefetches each next step's 4 KiB of weight into L1 while it multiplies the
 * current one: without it the tile loads wait on memory (the prefetchers stop at each 4 KiB page).
 * On the benchmark host (Intel Xeon, 2 cores, AMX) a decode pass over the 58.5M model's linears at
 * 32 rows (84 MB) took 11.3 ms without it, 8.5 ms with it (scratch timings, 07:15 UTC 2026-12-03);
 * a tdpbf16ps there took ~18 ns, so at 32 rows the tiles' own work is ~40% of a step's weight read.
 *
 * Tasks are (a chunk of up to ROW_CHUNK rows, a tile), handed out guided with the caller's bounded
 * spin at the end (gemm_tasks.h: the other thread's wake-up under OMP_WAIT_POLICY=PASSIVE); a
 * task's row blocks re-read its tile from L2. x is read in place when k is a multiple of 32, else
 * copied once into a zero-padded buffer (a tile past k must multiply zeros, never a row's tail).
 * Each thread configures its tiles (LDTILECFG) at the start of its part, again for a last block of
 * fewer than 16 rows, and releases them at the end.
 *
 * Linux hands out AMX's tile state only to a process that asked for it (arch_prctl
 * ARCH_REQ_XCOMP_PERM): gemm_amx_supported() asks once and returns 1 only if the compiler
 * targeted AMX-BF16 and the kernel granted it. Built by kernels/cpu_kernels.py with -march=native.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_tasks.h"

#define KSTEP 32            /* k per tile step: an A tile's 64 bytes a row */
#define TILE_ROWS 16        /* rows per register block */

int gemm_amx_tile_n(void) { return TILE_N; }
int gemm_amx_k_step(void) { return KSTEP; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int gemm_amx_supported(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

struct tile_config {        /* LDTILECFG's 64-byte operand, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-4 (C and A) of `rows` rows, tiles 5-7 (B) of 16 pairs; every row 64 bytes. */
static void configure(int rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t < 5 ? rows : 16;
    }
    _tile_loadconfig(&c);
}

/* Rows [r0, r0 + rows) of x (rows <= 16, tiles configured for them) times packed tile t; steps:
 * k / KSTEP. The four C tiles go through c_buf [16][TILE_N] float32, then to out with the bias,
 * rounded to bf16. */
static void block(const uint16_t *x, int64_t x_stride, const char *tile, int64_t steps, const uint16_t *bias,
                  uint16_t *out, int64_t out_stride, int rows, int cols, float *c_buf, int prefetch) {
    const int64_t x_bytes = x_stride * 2, step_bytes = KSTEP / 2 * TILE_N * 4;   /* a step's 16 pairs */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const char *b = tile + s * step_bytes;
        if (prefetch && s + 1 < steps)      /* the next step's weight, while this step multiplies */
            for (int line = 0; line < step_bytes; line += 64) _mm_prefetch(b + step_bytes + line, _MM_HINT_T0);
        _tile_loadd(4, x + s * KSTEP, x_bytes);
        _tile_loadd(5, b, TILE_N * 4);
        _tile_loadd(6, b + 64, TILE_N * 4);
        _tile_loadd(7, b + 128, TILE_N * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 192, TILE_N * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c_buf, TILE_N * 4);
    _tile_stored(1, c_buf + 16, TILE_N * 4);
    _tile_stored(2, c_buf + 32, TILE_N * 4);
    _tile_stored(3, c_buf + 48, TILE_N * 4);
    __mmask16 mask[VECS];
    tile_masks(cols, mask);
    __m512 b[VECS];
    for (int v = 0; v < VECS; v++) {
        b[v] = _mm512_setzero_ps();
        if (bias != NULL) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask[v], bias + v * 16));
            b[v] = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < VECS; v++)
            _mm256_mask_storeu_epi16(out + r * out_stride + v * 16, mask[v],
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c_buf + r * TILE_N + v * 16), b[v])));
}

/* x: [m, k] rows of stride x_stride; packed: ceil(n / TILE_N) tiles of ceil(k / KSTEP) * KSTEP / 2
 * pairs of TILE_N columns; bias: [n] or NULL; out: [m, n] rows of stride out_stride. Returns 0, or
 * -1 if k is not a multiple of KSTEP and the padded copy of x could not be allocated. */
int gemm_amx(const uint16_t *x, int64_t x_stride, const char *packed, const uint16_t *bias, uint16_t *out,
             int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t steps = (k + KSTEP - 1) / KSTEP, kp = steps * KSTEP;
    const int64_t tile_bytes = kp / 2 * TILE_N * 4, tiles = (n + TILE_N - 1) / TILE_N;
    const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
    uint16_t *padded = NULL;
    if (kp != k && m > 0) {
        padded = calloc((size_t)(m * kp), 2);
        if (padded == NULL) return -1;
        for (int64_t r = 0; r < m; r++) memcpy(padded + r * kp, x + r * x_stride, (size_t)k * 2);
        x = padded;
        x_stride = kp;
    }
    int64_t done = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float c_buf[TILE_ROWS * TILE_N] __attribute__((aligned(64)));
        int configured = 0;
        int64_t mine = 0;
#pragma omp for collapse(2) schedule(guided) nowait
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t c0 = m * c / chunks, c1 = m * (c + 1) / chunks;
                const int cols = (int)(n - t * TILE_N < TILE_N ? n - t * TILE_N : TILE_N);
                for (int64_t r0 = c0; r0 < c1; r0 += TILE_ROWS) {
                    const int rows = (int)(c1 - r0 < TILE_ROWS ? c1 - r0 : TILE_ROWS);
                    if (rows != configured) {
                        configure(rows);
                        configured = rows;
                    }
                    block(x + r0 * x_stride, x_stride, packed + t * tile_bytes, steps,
                          bias == NULL ? NULL : bias + t * TILE_N, out + r0 * out_stride + t * TILE_N, out_stride,
                          rows, cols, c_buf, r0 == c0);
                }
                mine++;
            }
        }
        if (configured) _tile_release();
        gemm_finish(&done, mine, chunks * tiles);
    }
    free(padded);
    return 0;
}
#else
int gemm_amx_supported(void) { return 0; }

int gemm_amx(const uint16_t *x, int64_t x_stride, const char *packed, const uint16_t *bias, uint16_t *out,
             int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)num_threads;
    return -1;
}
#endif
