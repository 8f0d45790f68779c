/* Paged decode attention on CPU: one query token per sequence, K and V read in place from the
 * paged pool through the block table (no gather into a contiguous copy).
 *
 * One task per sequence, or per segment of its context when there are fewer sequences than
 * threads (flash-decoding), with all kv heads, spread over OpenMP threads. A task:
 *   1. scores[g][t] = scale * q[g] . K[t]   for every query head g, t in the segment
 *   2. softmax per query head (max-subtracted, float32)
 *   3. out[g] = sum_t p[g][t] * V[t]   (segments: partial sums, merged per sequence after)
 * K and V are each read once per task; 16-bit elements are widened to float32 as they are read.
 * float32 and bf16 with head_dim 64 or 128 on AVX-512 CPUs (bf16: AVX512-BF16) take the block
 * functions instead (k_block_* / v_block_*): K dots by FMAs or vdpbf16ps, 16 tokens of a query
 * head at a time, reduced together (the generic loop's one horizontal sum per dot cost 2x at a
 * decode step's sizes); V sums in registers across a block.
 * Built by kernels/cpu_kernels.py with the host compiler; called through ctypes.
 */
#include <omp.h>
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

/* Prefetch token i's row (all kv heads) of the next block while this block's token i is read:
 * blocks lie scattered in the pool, and the hardware prefetchers do not cross into the next one. */
static inline __attribute__((always_inline)) void prefetch_row(const char *next_block, int i, int64_t token_stride,
                                                               int row_bytes, int esize) {
    if (next_block == NULL) return;
    const char *row = next_block + (int64_t)i * token_stride * esize;
    for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

#ifdef __AVX512F__
#include <immintrin.h>
#define F32_BLOCKS 1    /* float32 rows of head_dim 64 or 128 take the block functions below */

/* r[i] = the sum of a[i]'s 16 lanes: a transpose-and-add tree, ~3 instructions per sum where
 * reducing each vector alone takes ~10 (and gcc reduces `omp simd` dots lane by lane, in order). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)     /* per 128-bit lane: [a0 0+2, a1 0+2, a0 1+3, a1 1+3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {   /* per 128-bit lane: the lane's sums of rows 4i .. 4i + 3 */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xdd));
}

/* float32 K pass over tokens [0, n) of one block, as k_block_bf16 below: 16 tokens of one query
 * head at a time, each dot summed in 16 lanes by FMAs, the 16 dots reduced together (sum16).
 * qf: the query heads, pre-scaled. No prefetch of the next block: a float32 row of a head is
 * 4 lines, which the hardware prefetchers follow; prefetching them too measured slower
 * (bench/amx/decode_attention_ab.py). */
static inline __attribute__((always_inline)) void k_block_f32(const float *qf, const float *blk, int n,
                                                              int64_t token_stride, int num_kv_heads, int group, int HD,
                                                              float *scores, int len, int off) {
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int m = n - i0 < 16 ? n - i0 : 16;
        for (int h = 0; h < num_kv_heads; h++) {
            for (int g = 0; g < group; g++) {
                const int j = h * group + g;
                __m512 qv[HD / 16];
                for (int c = 0; c < HD / 16; c++) qv[c] = _mm512_loadu_ps(qf + j * HD + 16 * c);
                __m512 acc[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    const float *kr = blk + (i0 + (i < m ? i : m - 1)) * token_stride + h * HD;
                    acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
#pragma GCC unroll 8
                    for (int c = 1; c < HD / 16; c++) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc[i]);
                }
                _mm512_mask_storeu_ps(scores + (size_t)j * len + off + i0, (__mmask16)((1u << m) - 1), sum16(acc));
            }
        }
    }
}

/* float32 V pass over tokens [0, n) of one block: acc[j] += sum_i p[j * len + off + i] * V[i],
 * each query head's head_dim sums in registers across the block, in two sets (even and odd
 * tokens) so the FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void v_block_f32(const float *p, const float *blk, int n,
                                                              int64_t token_stride, int num_kv_heads, int group, int HD,
                                                              float *acc, int len, int off) {
    for (int h = 0; h < num_kv_heads; h++) {
        for (int g = 0; g < group; g++) {
            const int j = h * group + g;
            __m512 a0[HD / 16], a1[HD / 16];
            for (int c = 0; c < HD / 16; c++) a0[c] = a1[c] = _mm512_setzero_ps();
            const float *pj = p + (size_t)j * len + off;
            int i = 0;
            for (; i + 1 < n; i += 2) {
                const float *r0 = blk + i * token_stride + h * HD, *r1 = r0 + token_stride;
                const __m512 w0 = _mm512_set1_ps(pj[i]), w1 = _mm512_set1_ps(pj[i + 1]);
                for (int c = 0; c < HD / 16; c++) {
                    a0[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(r0 + 16 * c), a0[c]);
                    a1[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(r1 + 16 * c), a1[c]);
                }
            }
            if (i < n) {
                const float *r0 = blk + i * token_stride + h * HD;
                for (int c = 0; c < HD / 16; c++) a0[c] = _mm512_fmadd_ps(_mm512_set1_ps(pj[i]), _mm512_loadu_ps(r0 + 16 * c), a0[c]);
            }
            for (int c = 0; c < HD / 16; c++) {
                float *dst = acc + (size_t)j * HD + 16 * c;
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_add_ps(a0[c], a1[c])));
            }
        }
    }
}

#ifdef __AVX512BF16__
#define BF16_BLOCKS 1   /* bf16 rows of head_dim 64 or 128 take the block functions below */

/* Prefetch one head's row (HD bf16 elements) of the next block into L1. The K and V passes
 * prefetch the next block's row of the head they read, token by token as they read this block's:
 * the same lines as prefetching a head's 16 rows at once (the previous form), spread between the
 * loads, so the prefetches do not queue up for the line fill buffers together (faster from L3 and
 * from memory: bench/README.md, session 20). */
static inline __attribute__((always_inline)) void prefetch_head(const uint16_t *row, int HD) {
    for (int b = 0; b < HD * 2; b += 64) __builtin_prefetch((const char *)row + b, 0, 3);
}

/* The same row into L2 only: the K pass fetches the V rows of the block it reads, so that the V pass,
 * run after the softmax over the whole segment, finds them there (the V pass's own L1 prefetch of its
 * next block then comes from L2); only for a segment whose V takes V_IN_L2 bytes at most (8 heads x 64
 * in bf16: 512 tokens), so that the prefetched rows are not evicted before the V pass reads them. From
 * memory a bf16 decode batch's attention read its KV at ~15 GB/s of the 29 two threads read; with this,
 * 9 of 10 paired runs were faster, by 20% at the median (bench/README.md, session 28). The V pass
 * likewise fetches the K of the task its thread runs next into L2 (when that task's K is V_IN_L2 bytes at
 * most; as many of its blocks as this task has V blocks), so that memory is read during both passes: every
 * paired run faster again, by 18-25% at the median (bench/README.md, session 29). */
#define V_IN_L2 (512 * 1024)   /* half a Zen 4 core's L2 */
static inline __attribute__((always_inline)) void prefetch_head_l2(const uint16_t *row, int HD) {
    for (int b = 0; b < HD * 2; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T1);
}

/* scores[j * len + off + i0 + i] = scale * q_j . K[i0 + i] for i < m, 16 tokens of one kv head's
 * query heads: vdpbf16ps products (exact in float32) summed in float32, the 16 dots reduced
 * together. q: the query row, unscaled bf16. Tokens past m read token m - 1's row again (their
 * dots are not stored): the loop over 16 tokens has no branch, so gcc keeps the 16 sums in
 * registers; k_block_bf16 calls it with m = 16 for every full run of 16, so those runs have no
 * selects either. next: the block whose rows i0 .. i0 + 15 of head h to prefetch into L1 (NULL: none);
 * vblk: the block whose same rows to prefetch into L2 (this block's V; NULL: none). */
static inline __attribute__((always_inline)) void k_tokens_bf16(const uint16_t *q, const uint16_t *blk, const uint16_t *next,
                                                                const uint16_t *vblk, int i0, int m, int h,
                                                                int64_t token_stride, int group,
                                                                int HD, float scale, float *scores, int len, int off) {
    for (int g = 0; g < group; g++) {
        const int j = h * group + g;
        __m512i qv[4];  /* HD / 32 of them: a fixed size, or gcc makes it a stack array */
        for (int c = 0; c < HD / 32; c++) qv[c] = _mm512_loadu_si512(q + j * HD + 32 * c);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const uint16_t *kr = blk + (i0 + (i < m ? i : m - 1)) * token_stride + h * HD;
            if (g == 0 && next != NULL) prefetch_head(next + (i0 + i) * token_stride + h * HD, HD);
            if (g == 0 && vblk != NULL) prefetch_head_l2(vblk + (i0 + i) * token_stride + h * HD, HD);
            acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qv[0], (__m512bh)_mm512_loadu_si512(kr));
#pragma GCC unroll 4
            for (int c = 1; c < HD / 32; c++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
        }
        _mm512_mask_storeu_ps(scores + (size_t)j * len + off + i0, (__mmask16)((1u << m) - 1),
                              _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
}

/* K pass over tokens [0, n) of one bf16 block (k_tokens_bf16, 16 tokens at a time), prefetching
 * `next` (the sequence's next K block, or its first V block after the last K block) into L1 and `vblk`
 * (this block's V, or NULL: none) into L2. */
static inline __attribute__((always_inline)) void k_block_bf16(const uint16_t *q, const uint16_t *blk, const uint16_t *next,
                                                               const uint16_t *vblk, int n, int64_t token_stride,
                                                               int num_kv_heads, int group,
                                                               int HD, float scale, float *scores, int len, int off) {
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int m = n - i0 < 16 ? n - i0 : 16;
        for (int h = 0; h < num_kv_heads; h++) {
            if (m == 16)
                k_tokens_bf16(q, blk, next, vblk, i0, 16, h, token_stride, group, HD, scale, scores, len, off);
            else
                k_tokens_bf16(q, blk, next, vblk, i0, m, h, token_stride, group, HD, scale, scores, len, off);
        }
    }
}

/* a += w * row, row: HD bf16 elements widened to float32, in pairs: 32 elements a load, the even
 * ones (low halves of its 32-bit lanes) into e[c], the odd ones (high halves) into o[c]. A shift
 * and an AND widen them, where widening 16 elements into 16 lanes takes a shuffle each
 * (vpmovzxwd), which the FMAs' port also serves. */
static inline __attribute__((always_inline)) void v_row_bf16(__m512 *e, __m512 *o, float w, const uint16_t *row, int HD) {
    const __m512 wv = _mm512_set1_ps(w);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int c = 0; c < HD / 32; c++) {
        const __m512i x = _mm512_loadu_si512(row + 32 * c);
        e[c] = _mm512_fmadd_ps(wv, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), e[c]);
        o[c] = _mm512_fmadd_ps(wv, _mm512_castsi512_ps(_mm512_and_si512(x, high)), o[c]);
    }
}

/* V pass over tokens [0, n) of one bf16 block: acc[j] += sum_i p[j * len + off + i] * V[i],
 * each query head's head_dim sums in registers across the block, as even / odd element pairs
 * (v_row_bf16), in two sets, even and odd tokens, so the adds do not wait on each other; the
 * pairs are put back in element order once a block. */
static inline __attribute__((always_inline)) void v_block_bf16(const float *p, const uint16_t *blk, const uint16_t *next,
                                                               const uint16_t *ahead, int n, int64_t token_stride,
                                                               int num_kv_heads, int group, int HD, float *acc, int len,
                                                               int off) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int h = 0; h < num_kv_heads; h++) {
        for (int g = 0; g < group; g++) {
            const int j = h * group + g;
            __m512 e0[4], o0[4], e1[4], o1[4];  /* HD / 32 of each, as k_tokens_bf16's qv */
            for (int c = 0; c < HD / 32; c++) e0[c] = o0[c] = e1[c] = o1[c] = _mm512_setzero_ps();
            const float *pj = p + (size_t)j * len + off;
            int i = 0;
            for (; i + 1 < n; i += 2) {
                if (g == 0 && next != NULL) {
                    prefetch_head(next + i * token_stride + h * HD, HD);
                    prefetch_head(next + (i + 1) * token_stride + h * HD, HD);
                }
                if (g == 0 && ahead != NULL) {
                    prefetch_head_l2(ahead + i * token_stride + h * HD, HD);
                    prefetch_head_l2(ahead + (i + 1) * token_stride + h * HD, HD);
                }
                v_row_bf16(e0, o0, pj[i], blk + i * token_stride + h * HD, HD);
                v_row_bf16(e1, o1, pj[i + 1], blk + (i + 1) * token_stride + h * HD, HD);
            }
            if (i < n) v_row_bf16(e0, o0, pj[i], blk + i * token_stride + h * HD, HD);
            for (int c = 0; c < HD / 32; c++) {
                const __m512 e = _mm512_add_ps(e0[c], e1[c]), o = _mm512_add_ps(o0[c], o1[c]);
                float *dst = acc + (size_t)j * HD + 32 * c;
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_permutex2var_ps(e, lo, o)));
                _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_loadu_ps(dst + 16), _mm512_permutex2var_ps(e, hi, o)));
            }
        }
    }
}
#else
#define BF16_BLOCKS 0
#endif
#else
#define F32_BLOCKS 0
#define BF16_BLOCKS 0
#endif

/* Attention of one sequence's query heads over its cached tokens [c0, c1) (c0 a multiple of
 * block_size). partial == NULL: the normalized output row goes to out_row. Otherwise, per query
 * head j, partial[j * (head_dim + 2) ...] gets the unnormalized sum_t e^(s_t - m) V_t, then m and
 * l = sum_t e^(s_t - m): merge_partials combines the segments. scratch: nq * (c1 - c0 + 2 *
 * head_dim) floats. ahead_table, [a0, a1): the block table and tokens of the task this thread runs
 * next (NULL: none), whose K a bf16 V pass fetches into L2. */
static inline __attribute__((always_inline)) void attend(
    const char *q_row, const char *k, const char *v, int64_t block_stride, int64_t token_stride, const int32_t *table,
    int c0, int c1, char *out_row, float *partial, int num_kv_heads, int group, int head_dim, int block_size,
    float scale, int dtype, int esize, float *scratch, const int32_t *ahead_table, int a0, int a1) {
    const int nq = num_kv_heads * group, len = c1 - c0, row_bytes = num_kv_heads * head_dim * esize;
    float *scores = scratch;                         /* [nq][len] */
    float *qf = scores + (size_t)nq * len;           /* [nq][head_dim], pre-scaled */
    float *acc = qf + (size_t)nq * head_dim;         /* [nq][head_dim] */
    const int blocks16 = ((BF16_BLOCKS && dtype == DT_BF16) || (F32_BLOCKS && dtype == DT_F32)) &&
                         (head_dim == 64 || head_dim == 128);
    for (int j = 0; j < nq && !(blocks16 && dtype == DT_BF16); j++) { /* the bf16 blocks read q_row */
        const char *row = q_row + (int64_t)j * head_dim * esize;
        for (int d = 0; d < head_dim; d++) qf[j * head_dim + d] = load_elem(row, d, dtype) * scale;
    }
#if BF16_BLOCKS
    if (blocks16 && dtype == DT_BF16)
        for (int t0 = c0; t0 < c1; t0 += block_size) {
            const int64_t b = table[t0 / block_size], nb = t0 + block_size < c1 ? table[t0 / block_size + 1] : -1;
            /* the last K block prefetches the first V block */
            const uint16_t *next = nb < 0 ? (const uint16_t *)v + (int64_t)table[c0 / block_size] * block_stride
                                          : (const uint16_t *)k + nb * block_stride;
            k_block_bf16((const uint16_t *)q_row, (const uint16_t *)k + b * block_stride, next,
                         (int64_t)len * row_bytes <= V_IN_L2 ? (const uint16_t *)v + b * block_stride : NULL,
                         c1 - t0 < block_size ? c1 - t0 : block_size, token_stride, num_kv_heads, group, head_dim, scale,
                         scores, len, t0 - c0);
        }
#endif
#if F32_BLOCKS
    if (blocks16 && dtype == DT_F32)
        for (int t0 = c0; t0 < c1; t0 += block_size) {
            k_block_f32(qf, (const float *)k + (int64_t)table[t0 / block_size] * block_stride,
                        c1 - t0 < block_size ? c1 - t0 : block_size, token_stride, num_kv_heads, group, head_dim, scores,
                        len, t0 - c0);
        }
#endif
    /* K pass: block by block, token by token; a token's kv heads are adjacent in memory */
    for (int t0 = c0; t0 < c1 && !blocks16; t0 += block_size) {
        const char *blk = k + (int64_t)table[t0 / block_size] * block_stride * esize;
        const char *next = t0 + block_size < c1 ? k + (int64_t)table[t0 / block_size + 1] * block_stride * esize : NULL;
        const int n = c1 - t0 < block_size ? c1 - t0 : block_size;
        for (int i = 0; i < n; i++) {
            prefetch_row(next, i, token_stride, row_bytes, esize);
            for (int h = 0; h < num_kv_heads; h++) {
                const char *kr = blk + ((int64_t)i * token_stride + (int64_t)h * head_dim) * esize;
                for (int g = 0; g < group; g++)
                    scores[(size_t)(h * group + g) * len + t0 - c0 + i] =
                        dot_row(qf + (size_t)(h * group + g) * head_dim, kr, head_dim, dtype);
            }
        }
    }
    float m_of[nq], l_of[nq];
    for (int j = 0; j < nq; j++) {
        float *sj = scores + (size_t)j * len, m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < len; t++) m = sj[t] > m ? sj[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            sj[t] = fast_exp(sj[t] - m);
            sum += sj[t];
        }
        m_of[j] = m;
        l_of[j] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)nq * head_dim);
#if F32_BLOCKS
    if (blocks16 && dtype == DT_F32)
        for (int t0 = c0; t0 < c1; t0 += block_size) {
            v_block_f32(scores, (const float *)v + (int64_t)table[t0 / block_size] * block_stride,
                        c1 - t0 < block_size ? c1 - t0 : block_size, token_stride, num_kv_heads, group, head_dim, acc,
                        len, t0 - c0);
        }
#endif
#if BF16_BLOCKS
    if (blocks16 && dtype == DT_BF16) {
        /* the next task's K blocks into L2, one beside each of this task's V blocks (more: its K pass's own) */
        const int ahead_ok = ahead_table != NULL && (int64_t)(a1 - a0) * row_bytes <= V_IN_L2;
        for (int t0 = c0, ta = a0; t0 < c1; t0 += block_size, ta += block_size) {
            const int64_t b = table[t0 / block_size], nb = t0 + block_size < c1 ? table[t0 / block_size + 1] : -1;
            const uint16_t *ahead =
                ahead_ok && ta < a1 ? (const uint16_t *)k + (int64_t)ahead_table[ta / block_size] * block_stride : NULL;
            v_block_bf16(scores, (const uint16_t *)v + b * block_stride,
                         nb < 0 ? NULL : (const uint16_t *)v + nb * block_stride, ahead,
                         c1 - t0 < block_size ? c1 - t0 : block_size, token_stride, num_kv_heads, group, head_dim, acc,
                         len, t0 - c0);
        }
    }
#endif
    for (int t0 = c0; t0 < c1 && !blocks16; t0 += block_size) {
        const char *blk = v + (int64_t)table[t0 / block_size] * block_stride * esize;
        const char *next = t0 + block_size < c1 ? v + (int64_t)table[t0 / block_size + 1] * block_stride * esize : NULL;
        const int n = c1 - t0 < block_size ? c1 - t0 : block_size;
        for (int i = 0; i < n; i++) {
            prefetch_row(next, i, token_stride, row_bytes, esize);
            for (int h = 0; h < num_kv_heads; h++) {
                const char *vr = blk + ((int64_t)i * token_stride + (int64_t)h * head_dim) * esize;
                for (int g = 0; g < group; g++)
                    axpy_row(acc + (size_t)(h * group + g) * head_dim, scores[(size_t)(h * group + g) * len + t0 - c0 + i],
                             vr, head_dim, dtype);
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        if (partial == NULL) {
            store_row(out_row + (int64_t)j * head_dim * esize, acc + (size_t)j * head_dim, 1.f / l_of[j], head_dim,
                      dtype);
            continue;
        }
        float *p = partial + (size_t)j * (head_dim + 2);
        memcpy(p, acc + (size_t)j * head_dim, sizeof(float) * head_dim);
        p[head_dim] = m_of[j];
        p[head_dim + 1] = l_of[j];
    }
}

/* One sequence's output from its `splits` segments' partials (attend's layout): each segment's
 * sums rescaled by e^(m_i - M), M the largest m, and divided by the rescaled sum of the l_i.
 * An empty segment has m = -inf, l = 0 and weighs nothing. */
static void merge_partials(const float *parts, int splits, int nq, int head_dim, char *out_row, int dtype,
                           int esize) {
    float acc[head_dim];
    for (int j = 0; j < nq; j++) {
        float m = -INFINITY, l = 0.f;
        for (int i = 0; i < splits; i++) {
            const float mi = parts[((size_t)i * nq + j) * (head_dim + 2) + head_dim];
            m = mi > m ? mi : m;
        }
        memset(acc, 0, sizeof acc);
        for (int i = 0; i < splits; i++) {
            const float *p = parts + ((size_t)i * nq + j) * (head_dim + 2);
            if (p[head_dim + 1] == 0.f) continue; /* empty segment */
            const float w = fast_exp(p[head_dim] - m);
            l += w * p[head_dim + 1];
            for (int d = 0; d < head_dim; d++) acc[d] += w * p[d];
        }
        store_row(out_row + (int64_t)j * head_dim * esize, acc, 1.f / l, head_dim, dtype);
    }
}

/* Task `task`'s tokens [*c0, *c1): its sequence's context cut into equal block-aligned segments. */
static void task_range(int task, const int *task_seq, const int *first, const int32_t *seq_lens, int block_size, int *c0,
                       int *c1) {
    const int s = task_seq[task], splits = first[s + 1] - first[s], i = task - first[s], ctx = seq_lens[s];
    const int seg = ((ctx + splits - 1) / splits + block_size - 1) / block_size * block_size;
    *c0 = i * seg < ctx ? i * seg : ctx;
    *c1 = *c0 + seg < ctx ? *c0 + seg : ctx;
}

#define ATTEND_ARGS                                                                                         \
    const char *q_row, const char *k, const char *v, int64_t block_stride, int64_t token_stride,              \
        const int32_t *table, int c0, int c1, char *out_row, float *partial, int num_kv_heads, int group,       \
        int head_dim, int block_size, float scale, int esize, float *scratch, const int32_t *ahead_table, int a0, \
        int a1
#define ATTEND_PASS_HD(HD)                                                                                    \
    q_row, k, v, block_stride, token_stride, table, c0, c1, out_row, partial, num_kv_heads, group, HD,        \
        block_size, scale
/* One copy per dtype, and within it per common head size: constant trip counts unroll fully. */
#define ATTEND_DT(NAME, DT)                                                                                   \
    static void NAME(ATTEND_ARGS) {                                                                           \
        if (head_dim == 64)                                                                                   \
            attend(ATTEND_PASS_HD(64), DT, esize, scratch, ahead_table, a0, a1);                              \
        else if (head_dim == 128)                                                                             \
            attend(ATTEND_PASS_HD(128), DT, esize, scratch, ahead_table, a0, a1);                             \
        else                                                                                                  \
            attend(ATTEND_PASS_HD(head_dim), DT, esize, scratch, ahead_table, a0, a1);                        \
    }
ATTEND_DT(attend_f32, DT_F32)
ATTEND_DT(attend_bf16, DT_BF16)
ATTEND_DT(attend_f16, DT_F16)

/* Strides are in elements. q/out rows: rows[s] is sequence s's row; a row holds num_heads
 * heads of head_dim contiguous elements. Cache token t of sequence s lives in block
 * tables[s * table_stride + t / block_size], at offset (t % block_size) * token_stride,
 * kv head h at h * head_dim. A task is one segment of a sequence's context (block-aligned) with
 * all its kv heads: a token's heads are one contiguous row, read in one stream. (Tasks that split
 * a sequence's heads instead read parts of each row, and ran at a third of the bandwidth: the
 * prefetchers fetch the other parts too.) A sequence of ctx tokens has ctx / min_segment segments,
 * at least 1 and at most max_splits, their partial results merged (flash-decoding), so a batch
 * smaller than the thread count still keeps every thread reading. The cut depends on the
 * sequence's own length only, not on the batch or the thread count: a sequence's output has the
 * same bits in any batch, on any number of threads. Returns 0, or -1 if scratch allocation
 * failed. */
int paged_decode(const void *q, int64_t q_row_stride, const void *k, const void *v, int64_t block_stride,
                 int64_t token_stride, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                 const int64_t *rows, void *out, int64_t out_row_stride, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, float scale, int dtype, int num_threads,
                 int max_splits, int min_segment) {
    const int group = num_heads / num_kv_heads, nq = num_heads;
    const int esize = dtype == DT_F32 ? 4 : 2;
    const size_t part_floats = (size_t)nq * (head_dim + 2);
    void (*attend_dt)(ATTEND_ARGS) = dtype == DT_F32 ? attend_f32 : dtype == DT_BF16 ? attend_bf16 : attend_f16;
    /* first[s]: sequence s's first task; task_seq[task]: its sequence */
    int *first = malloc(sizeof(int) * ((size_t)num_seqs + 1));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int n = seq_lens[s] / min_segment;
        first[s + 1] = first[s] + (n < 1 ? 1 : n > max_splits ? max_splits : n);
    }
    const int tasks = first[num_seqs];
    int *task_seq = malloc(sizeof(int) * (size_t)(tasks > 0 ? tasks : 1));
    float *parts = NULL; /* [tasks][nq][head_dim + 2], a split sequence's segments' partials */
    if (task_seq != NULL && tasks > num_seqs) parts = malloc(sizeof(float) * (size_t)tasks * part_floats);
    if (task_seq == NULL || (tasks > num_seqs && parts == NULL)) {
        free(first), free(task_seq), free(parts);
        return -1;
    }
    for (int s = 0; s < num_seqs; s++)
        for (int t = first[s]; t < first[s + 1]; t++) task_seq[t] = s;
    int failed = 0, claimed = 0;
    /* Dynamic scheduling by hand, claiming one task ahead while more than a task a thread is still
     * unclaimed: a thread then knows the task it runs next, and a bf16 V pass fetches that task's K
     * into L2, so memory is read during both passes. Past that point a thread claims its next task
     * when it is done with one, as schedule(dynamic, 1) does, so the last tasks go to whichever
     * threads free up first. */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int team = omp_get_num_threads();
        int task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (task < tasks) {
            const int next = __atomic_load_n(&claimed, __ATOMIC_RELAXED) + team < tasks
                                 ? __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED)
                                 : tasks;
            int c0, c1, a0 = 0, a1 = 0;
            task_range(task, task_seq, first, seq_lens, block_size, &c0, &c1);
            if (next < tasks) task_range(next, task_seq, first, seq_lens, block_size, &a0, &a1);
            const int s = task_seq[task], splits = first[s + 1] - first[s];
            float *scratch = malloc(sizeof(float) * ((size_t)nq * (c1 - c0) + 2 * (size_t)nq * head_dim));
            if (scratch == NULL) {
                failed = 1;
            } else {
                attend_dt((const char *)q + rows[s] * q_row_stride * esize, k, v, block_stride, token_stride,
                          tables + (int64_t)s * table_stride, c0, c1, (char *)out + rows[s] * out_row_stride * esize,
                          splits == 1 ? NULL : parts + (size_t)task * part_floats, num_kv_heads, group, head_dim,
                          block_size, scale, esize, scratch,
                          next < tasks ? tables + (int64_t)task_seq[next] * table_stride : NULL, a0, a1);
                free(scratch);
            }
            task = next < tasks ? next : __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        }
    }
    if (parts != NULL && !failed) {
#pragma omp parallel for num_threads(num_threads) if (num_seqs > 1)
        for (int s = 0; s < num_seqs; s++)
            if (first[s + 1] - first[s] > 1)
                merge_partials(parts + (size_t)first[s] * part_floats, first[s + 1] - first[s], nq, head_dim,
                               (char *)out + rows[s] * out_row_stride * esize, dtype, esize);
    }
    free(first), free(task_seq), free(parts);
    return failed ? -1 : 0;
}
