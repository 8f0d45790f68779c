/* The read ceiling of paged decode attention: every block paged_decode reads (same block table,
 * same pool layout, same OpenMP split: one task a sequence, schedule(dynamic, 1)), read and summed
 * as 32-bit integers, no attention arithmetic. A task reads its sequence's K blocks, then its V
 * blocks, as the kernel does; each block's n tokens are one run of n * row_bytes (a token's kv
 * heads are adjacent). prefetch = 1: each block's next block is prefetched into L1 line by line
 * as it is read (as the kernel's bf16 path does); 0: the hardware prefetchers alone. head_bytes
 * > 0: each block is read head by head, as the kernel reads it; 0: in one contiguous run.
 *
 *    gcc -O3 -march=native -fopenmp -shared -fPIC -std=gnu11 -o ceiling.so bench/amx/kv_read_ceiling.c
 */
#include <stdint.h>
#include <string.h>

/* 64 bytes as 16 int32 lanes (GCC vector extension): one zmm load on AVX-512, two ymm on AVX2. */
typedef int32_t v16 __attribute__((vector_size(64)));

static inline v16 load64(const char *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline v16 read_block(const char *blk, const char *next, int64_t bytes, v16 acc) {
    v16 a1 = (v16){0}, a2 = a1, a3 = a1;
    for (int64_t b = 0; b < bytes; b += 256) {
        if (next != NULL)
            for (int p = 0; p < 256; p += 64) __builtin_prefetch(next + b + p, 0, 3);
        acc = acc + load64(blk + b);
        a1 = a1 + load64(blk + b + 64);
        a2 = a2 + load64(blk + b + 128);
        a3 = a3 + load64(blk + b + 192);
    }
    return acc + a1 + a2 + a3;
}

/* The same block read in the kernel's order: head by head (head_bytes each), 16 tokens of a
 * head at a time, rows row_bytes apart. */
static inline v16 read_block_by_head(const char *blk, const char *next, int n, int row_bytes, int head_bytes, v16 acc) {
    for (int h = 0; h < row_bytes; h += head_bytes)
        for (int i = 0; i < n; i++)
            for (int b = 0; b < head_bytes; b += 64) {
                if (next != NULL) __builtin_prefetch(next + (int64_t)i * row_bytes + h + b, 0, 3);
                acc = acc + load64(blk + (int64_t)i * row_bytes + h + b);
            }
    return acc;
}

/* k, v: byte pointers of one layer's K and V; block_stride in bytes; row_bytes: one token's kv
 * heads (a multiple of 256). sums[s]: the 32-bit sum of sequence s's bytes read (so the reads
 * are not optimized away). */
void kv_read(const char *k, const char *v, int64_t block_stride, const int32_t *tables, int64_t table_stride,
             const int32_t *seq_lens, int num_seqs, int block_size, int row_bytes, int num_threads, int prefetch,
             int head_bytes, int32_t *sums) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        const int32_t *table = tables + (int64_t)s * table_stride;
        const int ctx = seq_lens[s];
        v16 acc = (v16){0};
        for (int pass = 0; pass < 2; pass++) {
            const char *base = pass == 0 ? k : v;
            for (int t0 = 0; t0 < ctx; t0 += block_size) {
                const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
                const char *next = prefetch && t0 + block_size < ctx ? base + table[t0 / block_size + 1] * block_stride : NULL;
                const char *blk = base + table[t0 / block_size] * block_stride;
                acc = head_bytes ? read_block_by_head(blk, next, n, row_bytes, head_bytes, acc)
                                 : read_block(blk, next, (int64_t)n * row_bytes, acc);
            }
        }
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += acc[i];
        sums[s] = sum;
    }
}
