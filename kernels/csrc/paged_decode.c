/* Paged decode attention on CPU: one query token per sequence, K and V read in place from the
 * paged pool through the block table (no gather into a contiguous copy).
 *
 * One task per sequence (all its kv heads), spread over OpenMP threads. A task:
 *   1. scores[g][t] = scale * q[g] . K[t]   for the group's G query heads, t < seq_len
 *   2. softmax per query head (max-subtracted, float32)
 *   3. out[g] = sum_t p[g][t] * V[t]
 * K and V are each read once per task; 16-bit elements are widened to float32 as they are read.
 * Built by kernels/cpu_kernels.py with the host compiler; called through ctypes.
 */
#include <stdlib.h>

#include "common.h"

/* q . row and acc += p * row for a K/V row of the given dtype, read as float32. Always inlined
 * with a constant dtype (see the attend_* wrappers): each copy is one typed, vectorized loop. */
static inline __attribute__((always_inline)) float dot_row(const float *q, const void *row, int n, int dtype) {
    float dot = 0.f;
    if (dtype == DT_F32) {
        const float *r = (const float *)row;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < n; d++) dot += q[d] * r[d];
    } else if (dtype == DT_BF16) {
        const uint16_t *r = (const uint16_t *)row;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < n; d++) dot += q[d] * bf16_to_f32(r[d]);
    } else {
        const uint16_t *r = (const uint16_t *)row;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < n; d++) dot += q[d] * f16_to_f32(r[d]);
    }
    return dot;
}

static inline __attribute__((always_inline)) void axpy_row(float *restrict acc, float p, const void *row, int n,
                                                           int dtype) {
    if (dtype == DT_F32) {
        const float *r = (const float *)row;
#pragma omp simd
        for (int d = 0; d < n; d++) acc[d] += p * r[d];
    } else if (dtype == DT_BF16) {
        const uint16_t *r = (const uint16_t *)row;
#pragma omp simd
        for (int d = 0; d < n; d++) acc[d] += p * bf16_to_f32(r[d]);
    } else {
        const uint16_t *r = (const uint16_t *)row;
#pragma omp simd
        for (int d = 0; d < n; d++) acc[d] += p * f16_to_f32(r[d]);
    }
}

static inline void store_row(void *dst, const float *src, float mul, int n, int dtype) {
    if (dtype == DT_F32) {
        float *d = (float *)dst;
        for (int i = 0; i < n; i++) d[i] = src[i] * mul;
    } else if (dtype == DT_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i] * mul);
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (int i = 0; i < n; i++) d[i] = (_Float16)(src[i] * mul);
    }
}

/* Attention of one sequence's query heads [h0 * group, h1 * group) (kv heads [h0, h1)) over its
 * ctx cached tokens. scratch: (h1 - h0) * group * (ctx + 2 * head_dim) floats. */
static inline __attribute__((always_inline)) void attend(
    const char *q_row, const char *k, const char *v, int64_t block_stride, int64_t token_stride, const int32_t *table,
    int ctx, char *out_row, int h0, int h1, int group, int head_dim, int block_size, float scale, int dtype, int esize,
    float *scratch) {
    const int nq = (h1 - h0) * group;                /* query heads of this task */
    float *scores = scratch;                         /* [nq][ctx] */
    float *qf = scores + (size_t)nq * ctx;           /* [nq][head_dim], pre-scaled */
    float *acc = qf + (size_t)nq * head_dim;         /* [nq][head_dim] */
    for (int j = 0; j < nq; j++) {
        const char *row = q_row + (int64_t)(h0 * group + j) * head_dim * esize;
        for (int d = 0; d < head_dim; d++) qf[j * head_dim + d] = load_elem(row, d, dtype) * scale;
    }
    /* K pass: block by block, token by token; a token's kv heads h0..h1 are adjacent in memory */
    for (int t0 = 0; t0 < ctx; t0 += block_size) {
        const char *blk = k + ((int64_t)table[t0 / block_size] * block_stride + (int64_t)h0 * head_dim) * esize;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int i = 0; i < n; i++) {
            for (int h = 0; h < h1 - h0; h++) {
                const char *kr = blk + ((int64_t)i * token_stride + (int64_t)h * head_dim) * esize;
                for (int g = 0; g < group; g++)
                    scores[(size_t)(h * group + g) * ctx + t0 + i] =
                        dot_row(qf + (size_t)(h * group + g) * head_dim, kr, head_dim, dtype);
            }
        }
    }
    float inv_sum[nq];
    for (int j = 0; j < nq; j++) {
        float *sj = scores + (size_t)j * ctx, m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < ctx; t++) m = sj[t] > m ? sj[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < ctx; t++) {
            sj[t] = fast_exp(sj[t] - m);
            sum += sj[t];
        }
        inv_sum[j] = 1.f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)nq * head_dim);
    for (int t0 = 0; t0 < ctx; t0 += block_size) {
        const char *blk = v + ((int64_t)table[t0 / block_size] * block_stride + (int64_t)h0 * head_dim) * esize;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int i = 0; i < n; i++) {
            for (int h = 0; h < h1 - h0; h++) {
                const char *vr = blk + ((int64_t)i * token_stride + (int64_t)h * head_dim) * esize;
                for (int g = 0; g < group; g++)
                    axpy_row(acc + (size_t)(h * group + g) * head_dim, scores[(size_t)(h * group + g) * ctx + t0 + i],
                             vr, head_dim, dtype);
            }
        }
    }
    for (int j = 0; j < nq; j++)
        store_row(out_row + (int64_t)(h0 * group + j) * head_dim * esize, acc + (size_t)j * head_dim, inv_sum[j],
                  head_dim, dtype);
}

#define ATTEND_ARGS                                                                                     \
    const char *q_row, const char *k, const char *v, int64_t block_stride, int64_t token_stride,          \
        const int32_t *table, int ctx, char *out_row, int h0, int h1, int group, int head_dim, int block_size, \
        float scale, int esize, float *scratch
#define ATTEND_PASS_HD(HD) \
    q_row, k, v, block_stride, token_stride, table, ctx, out_row, h0, h1, group, HD, block_size, scale
/* One copy per dtype, and within it per common head size: constant trip counts unroll fully. */
#define ATTEND_DT(NAME, DT)                                                                           \
    static void NAME(ATTEND_ARGS) {                                                                   \
        if (head_dim == 64)                                                                           \
            attend(ATTEND_PASS_HD(64), DT, esize, scratch);                                           \
        else if (head_dim == 128)                                                                     \
            attend(ATTEND_PASS_HD(128), DT, esize, scratch);                                          \
        else                                                                                          \
            attend(ATTEND_PASS_HD(head_dim), DT, esize, scratch);                                     \
    }
ATTEND_DT(attend_f32, DT_F32)
ATTEND_DT(attend_bf16, DT_BF16)
ATTEND_DT(attend_f16, DT_F16)

/* Strides are in elements. q/out rows: rows[s] is sequence s's row; a row holds num_heads
 * heads of head_dim contiguous elements. Cache token t of sequence s lives in block
 * tables[s * table_stride + t / block_size], at offset (t % block_size) * token_stride,
 * kv head h at h * head_dim. A task is one sequence with all its kv heads: a token's heads are
 * one contiguous row, read in one stream. (Tasks that split a sequence's heads read parts of
 * each row, and ran at a third of the bandwidth: the prefetchers fetch the other parts too.)
 * Returns 0, or -1 if scratch allocation failed. */
int paged_decode(const void *q, int64_t q_row_stride, const void *k, const void *v, int64_t block_stride,
                 int64_t token_stride, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                 const int64_t *rows, void *out, int64_t out_row_stride, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, float scale, int dtype, int num_threads) {
    const int group = num_heads / num_kv_heads, nq = num_heads;
    const int esize = dtype == DT_F32 ? 4 : 2;
    void (*attend_dt)(ATTEND_ARGS) = dtype == DT_F32 ? attend_f32 : dtype == DT_BF16 ? attend_bf16 : attend_f16;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int s = 0; s < num_seqs; s++) {
        const int ctx = seq_lens[s];
        float *scratch = malloc(sizeof(float) * ((size_t)nq * ctx + 2 * (size_t)nq * head_dim));
        if (scratch == NULL) {
            failed = 1;
            continue;
        }
        attend_dt((const char *)q + rows[s] * q_row_stride * esize, k, v, block_stride, token_stride,
                  tables + (int64_t)s * table_stride, ctx, (char *)out + rows[s] * out_row_stride * esize, 0,
                  num_kv_heads, group, head_dim, block_size, scale, esize, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}
