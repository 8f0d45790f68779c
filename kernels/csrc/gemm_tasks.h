/* What pdserve's packed GEMMs (gemm_f32.c, gemm_bf16.c, gemm_avx2.c) share: how a call is cut into tasks
 * and the parallel loop that runs them. Each file supplies its register block (a gemm_block_fn,
 * typed by its dtype and instruction set); this header does the rest:
 *
 * - A task is one tile of TILE_N columns x one chunk of up to ROW_CHUNK rows (prefill: a chunk of
 *   x stays in L2 across tiles). It walks its rows in register blocks of near-equal size, never a
 *   block of 1 or 2 left over (32 rows: 6,6,5,5,5,5), each block one pass over the tile's k (the
 *   tile stays in L2 while the blocks re-read it), each prefetching its share of the next tile
 *   into L2: tiles are contiguous, but the hardware prefetchers stop at each page's end.
 * - Tasks are handed out guided (a thread takes half of what is left per thread, then less), not
 *   static: with OMP_WAIT_POLICY=PASSIVE (pdserve's default) the other thread takes ~16-70 us to
 *   wake, and under a static split the calling thread then waits for it; guided, the caller
 *   starts on the first tiles and the late thread takes a smaller share. A guided chunk is
 *   consecutive tiles, so the next tile is this thread's next task but at a chunk's end.
 * - At the end the caller spins up to SPIN_NS for the other threads' last tasks instead of
 *   sleeping in the closing barrier and waiting to be woken; unbounded, that spin cost more than
 *   it saved when other processes wanted the core (bench/README.md, "float32 GEMM"). The bound
 *   is read off CLOCK_MONOTONIC (vDSO, ~20 ns a read), not TSC ticks, whose rate differs by
 *   machine.
 */
#ifndef PDSERVE_GEMM_TASKS_H
#define PDSERVE_GEMM_TASKS_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <time.h>

#ifndef TILE_N              /* a file may set its own before including this (gemm_avx2.c: 16 columns) */
#define TILE_N 64           /* columns per packed tile */
#endif
#define VECS (TILE_N / 16)  /* accumulator vectors per row (AVX-512's 16 lanes) */
#define MAX_ROWS 6          /* rows per register block: MAX_ROWS x VECS accumulators (24 zmm) */
#define ROW_CHUNK 96        /* rows per task */
#define SPIN_NS 20000       /* the caller's wait for the other threads' last tasks, at most (20 us) */

/* One call's operands. x, out: rows of x_stride / out_stride elements; packed: tiles of
 * tile_bytes; bias: [n] or NULL. */
struct gemm_call {
    const void *x, *packed, *bias;
    void *out;
    int64_t x_stride, out_stride, m, n, k, tile_bytes;
    int prefetch_single;    /* prefetch the next tile also when a task is one register block */
};

/* rows (1..MAX_ROWS) rows of x from row r0 times tile t into out; cols: the tile's valid columns;
 * meanwhile prefetch pf_lines cache lines from pf into L2, spread over the k loop. */
typedef void (*gemm_block_fn)(const struct gemm_call *g, int rows, int64_t r0, int64_t t, int cols, const char *pf,
                              int64_t pf_lines);

/* The store masks of a tile's VECS vectors of 16 columns when only cols are valid. */
static inline __attribute__((always_inline)) void tile_masks(int cols, __mmask16 mask[VECS]) {
    for (int v = 0; v < VECS; v++) {
        const int left = cols - v * 16;
        mask[v] = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
}

/* One task: rows [c0, c0 + rows) times tile t, in register blocks, each block prefetching its
 * share of tile t + 1. */
static inline __attribute__((always_inline)) void gemm_task(const struct gemm_call *g, gemm_block_fn block, int64_t c0, int64_t rows, int64_t t) {
    const int64_t tiles = (g->n + TILE_N - 1) / TILE_N;
    const int cols = (int)(g->n - t * TILE_N < TILE_N ? g->n - t * TILE_N : TILE_N);
    const int64_t blocks = (rows + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t lines = t + 1 < tiles && (blocks > 1 || g->prefetch_single) ? g->tile_bytes / 64 : 0;
    const int64_t share = (lines + blocks - 1) / blocks;
    const char *next = (const char *)g->packed + (t + 1) * g->tile_bytes;
    int64_t r0 = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int size = (int)((rows - r0 + (blocks - b) - 1) / (blocks - b));
        const int64_t pf0 = b * share < lines ? b * share : lines;
        block(g, size, c0 + r0, t, cols, next + pf0 * 64, lines - pf0 < share ? lines - pf0 : share);
        r0 += size;
    }
}

#ifdef __AVX512F__
/* Zero, in a register gcc cannot see is zero. Register blocks start their accumulators from it:
 * from a plain zero gcc turns that loop into a memset of the accumulator array on the stack, a
 * call per block that took 6% of a bf16 prefill step (bench/README.md, session 29). */
static inline __attribute__((always_inline)) __m512 opaque_zero(void) {
    __m512 z = _mm512_setzero_ps();
    __asm__("" : "+v"(z));
    return z;
}
#endif

/* CLOCK_MONOTONIC in ns. */
static inline uint64_t gemm_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* A thread's last act in a call's parallel region: count its `mine` finished tasks into the shared
 * `done`; the caller (thread 0) then spins, up to SPIN_NS, until all `tasks` are done. */
static inline __attribute__((always_inline)) void gemm_finish(int64_t *done, int64_t mine, int64_t tasks) {
    __atomic_fetch_add(done, mine, __ATOMIC_RELEASE);
    if (omp_get_thread_num() == 0)
        for (const uint64_t until = gemm_now_ns() + SPIN_NS;
             __atomic_load_n(done, __ATOMIC_ACQUIRE) < tasks && gemm_now_ns() < until;)
            _mm_pause();
}

/* One thread's part of a call's tasks: call it inside `#pragma omp parallel` in each GEMM, with
 * its block function (a constant there, so the call is direct once inlined into the region's
 * outlined body) and a shared count of finished tasks starting at 0. The tasks go out guided
 * (an orphaned `omp for`, bound to the caller's region); then the caller spins, bounded, for
 * the others' last tasks. */
static inline __attribute__((always_inline)) void gemm_thread(const struct gemm_call *g, gemm_block_fn block,
                                                              int64_t *done) {
    const int64_t m = g->m, tiles = (g->n + TILE_N - 1) / TILE_N, chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
    int64_t mine = 0;
#pragma omp for collapse(2) schedule(guided) nowait
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t c0 = m * c / chunks;      /* near-equal row chunks */
            gemm_task(g, block, c0, m * (c + 1) / chunks - c0, t);
            mine++;
        }
    }
    gemm_finish(done, mine, chunks * tiles);
}

#endif
