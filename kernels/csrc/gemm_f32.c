/* float32 GEMM for a decode step's linears: out[m, n] = x[m, k] . W[n, k] + bias[n], on CPUs with
 * AVX-512 (vfmadd231ps with x broadcast from memory: 16 products per instruction).
 *
 * The weight is packed once, at load (kernels/gemm_f32.py), into tiles of TILE_N columns, each
 * tile its k rows in order:
 *
 *   packed[tile][kk][col] = W[tile * TILE_N + col][kk]   (0 past n)
 *
 * so one 64-byte load is 16 columns at one k. A task is one tile x up to ROW_CHUNK rows; it walks
 * its rows in register blocks of up to MAX_ROWS rows x TILE_N / 16 vectors of 16 float32
 * accumulators (24 zmm registers), each block one pass over the tile's k (the tile, 64 columns x
 * k, stays in L2 while the blocks re-read it). Rows are split into blocks of near-equal size (32
 * rows: 6,6,5,5,5,5). Each block prefetches its share of the next tile into L2: tiles are
 * contiguous, but the hardware prefetchers stop at each page's end (as gemm_bf16.c does).
 *
 * Tasks are handed out guided (a thread takes half of what is left per thread, then less), not
 * static: with OMP_WAIT_POLICY=PASSIVE (pdserve's default) the other thread takes ~40 us to wake,
 * and under a static split the calling thread then waits for it; guided, the caller starts on
 * the first tiles and the late thread takes a smaller share (32 rows, cache-warm: o_proj
 * 85 -> 66 us, qkv 154 -> 142 us). A guided chunk is consecutive tiles, so the next tile is
 * this thread's next task except at a chunk's end. At the end the caller spins up to ~20 us for
 * the other thread's last task instead of sleeping in the closing barrier and waiting to be woken
 * (load ~2.7: qkv 0.17-0.21 -> 0.15-0.17 ms, o_proj 81-91 -> 67 us); unbounded, that spin cost
 * more than it saved when other processes wanted the core.
 *
 * Built by kernels/cpu_kernels.py with -march=native: where the compiler does not target AVX-512F
 * the file builds without the kernel and gemm_f32_supported() returns 0.
 */
#include <immintrin.h>
#include <omp.h>
#include <x86intrin.h>
#include <stdint.h>

#define TILE_N 64           /* columns per packed tile */
#define VECS (TILE_N / 16)  /* accumulator vectors per row */
#define MAX_ROWS 6          /* rows per register block: MAX_ROWS x VECS accumulators */
#define ROW_CHUNK 96        /* rows per task (prefill: a chunk of x stays in L2 across tiles) */
#define SPIN_TICKS 50000    /* the caller's wait for the other threads' last tasks, at most (~20 us) */

int gemm_f32_tile_n(void) { return TILE_N; }

#ifdef __AVX512F__
int gemm_f32_supported(void) { return 1; }

/* R rows of x (constant after inlining) times one packed tile; cols: the tile's valid columns.
 * Meanwhile it prefetches pf_lines cache lines from pf (its share of the next tile) into L2,
 * spread over its k. */
static inline __attribute__((always_inline)) void block(const int R, const float *x, int64_t x_stride,
                                                        const float *tile, int64_t k, const float *bias,
                                                        float *out, int64_t out_stride, int cols, const char *pf,
                                                        int64_t pf_lines) {
    __m512 acc[MAX_ROWS][VECS];
    __mmask16 mask[VECS];
    for (int v = 0; v < VECS; v++) {
        const int left = cols - v * 16;
        mask[v] = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        const __m512 init = bias == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], bias + v * 16);
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

static void rows_block(int rows, const float *x, int64_t x_stride, const float *tile, int64_t k, const float *bias,
                       float *out, int64_t out_stride, int cols, const char *pf, int64_t pf_lines) {
    switch (rows) {
#define CASE(R) case R: block(R, x, x_stride, tile, k, bias, out, out_stride, cols, pf, pf_lines); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
    }
}

/* One task: rows [c0, c0 + rows) of x times tile t, in register blocks, each block prefetching
 * its share of tile t + 1 (this thread's next task but at a guided chunk's end). */
static void task(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                 int64_t out_stride, int64_t c0, int64_t rows, int64_t t, int64_t n, int64_t k) {
    const int64_t tiles = (n + TILE_N - 1) / TILE_N, tile_size = k * TILE_N;
    const int cols = (int)(n - t * TILE_N < TILE_N ? n - t * TILE_N : TILE_N);
    const int64_t blocks = (rows + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t lines = t + 1 < tiles ? tile_size * 4 / 64 : 0, share = (lines + blocks - 1) / blocks;
    const char *next = (const char *)(packed + (t + 1) * tile_size);
    int64_t r0 = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int size = (int)((rows - r0 + (blocks - b) - 1) / (blocks - b));
        const int64_t pf0 = b * share < lines ? b * share : lines;
        rows_block(size, x + (c0 + r0) * x_stride, x_stride, packed + t * tile_size, k,
                   bias == NULL ? NULL : bias + t * TILE_N, out + (c0 + r0) * out_stride + t * TILE_N,
                   out_stride, cols, next + pf0 * 64, (lines - pf0 < share ? lines - pf0 : share));
        r0 += size;
    }
}

/* x: [m, k] rows of stride x_stride; packed: see above, ceil(n / TILE_N) tiles of k * TILE_N
 * floats; bias: [n] or NULL; out: [m, n] rows of stride out_stride. */
void gemm_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
              int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t tiles = (n + TILE_N - 1) / TILE_N, chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
    int64_t done = 0;       /* tasks finished */
#pragma omp parallel num_threads(num_threads)
    {
        int64_t mine = 0;
#pragma omp for collapse(2) schedule(guided) nowait
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t c0 = m * c / chunks;      /* near-equal row chunks */
                task(x, x_stride, packed, bias, out, out_stride, c0, m * (c + 1) / chunks - c0, t, n, k);
                mine++;
            }
        }
        __atomic_fetch_add(&done, mine, __ATOMIC_RELEASE);
        /* the calling thread waits for the others' last tasks spinning, for a bounded time, rather
         * than asleep in the closing barrier (PASSIVE: a sleeping thread takes tens of us to wake) */
        if (omp_get_thread_num() == 0)
            for (const uint64_t until = __rdtsc() + SPIN_TICKS;
                 __atomic_load_n(&done, __ATOMIC_ACQUIRE) < chunks * tiles && __rdtsc() < until;)
                _mm_pause();
    }
}
#else
int gemm_f32_supported(void) { return 0; }

void gemm_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
              int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)num_threads;
}
#endif
