/* Paged prefill attention on CPU: each sequence's new query tokens attend causally to its cached
 * prefix and to themselves, K and V read in place from the paged pool through the block table
 * (no gathered copy), flash-attention style (online softmax, nothing of size q_len x ctx kept).
 *
 * A task is (sequence, kv head, tile of new tokens); its rows, at most TILE_ROWS, are the tile's
 * tokens times the group's query heads: every key chunk a task loads serves all of them. Keys go by in chunks of KC = 64 positions, each looked up in
 * the block table on its own (any block size). Per chunk:
 *   1. K's 64 rows are transposed into Kt[d] (4 vectors of 16 lanes) and V's widened to float32;
 *   2. scores = q . Kt as lanes of vectors (no horizontal sums), 4 rows at once: 16 independent
 *      FMA chains; positions past the row's own are masked (causal);
 *   3. online softmax: running max m and sum l per row, the row's accumulator rescaled;
 *   4. acc += p . V for the 4 rows together: each V vector loaded once, 16 independent FMA chains.
 * Chunks past the tile's last position are never read; a row skips chunks past its position.
 * All arithmetic in float32; 16-bit K/V/q widened as read, the output rounded once.
 * Built by kernels/cpu_kernels.py with the host compiler; called through ctypes.
 */
#include <stdlib.h>

#include "common.h"

#define VL 16     /* float32 lanes of one vector */
#define NV 4      /* vectors of keys per chunk */
#define KC (VL * NV) /* keys per chunk */
#define TILE_ROWS 128 /* rows (new tokens x the group's query heads) per task */
#define ROWS 4    /* rows whose scores are computed together */
#define MAX_HEAD_DIM 256

typedef float vf __attribute__((vector_size(VL * sizeof(float))));

/* Keys c0 .. c0 + nk - 1 of the chunk: K transposed into kt[d][NV] (lane j of vector j / VL
 * holds key j), V widened into v_rows[j][head_dim]; lanes past nk zeroed. */
static inline __attribute__((always_inline)) void load_chunk(
    const char *k, const char *v, int64_t block_stride, int64_t token_stride, const int32_t *table, int c0, int nk,
    int kv_head, int head_dim, int block_size, int dtype, int esize, vf *kt, float *v_rows) {
    float *ktf = (float *)kt;
    for (int j = 0; j < KC; j++) {
        if (j >= nk) {
            for (int d = 0; d < head_dim; d++) ktf[(size_t)d * KC + j] = 0.f;
            memset(v_rows + (size_t)j * head_dim, 0, sizeof(float) * head_dim);
            continue;
        }
        const int pos = c0 + j;
        const int64_t at = ((int64_t)table[pos / block_size] * block_stride + (int64_t)(pos % block_size) * token_stride +
                            (int64_t)kv_head * head_dim) * esize;
        const char *kr = k + at, *vr = v + at;
        for (int d = 0; d < head_dim; d++) ktf[(size_t)d * KC + j] = load_elem(kr, d, dtype);
#pragma omp simd
        for (int d = 0; d < head_dim; d++) v_rows[(size_t)j * head_dim + d] = load_elem(vr, d, dtype);
    }
}

/* Online-softmax step of one row with its chunk scores sc[KC] (keys past `valid` masked): sc becomes
 * the chunk's weights p_j = e^(s_j - m_new) (0 past valid), l = l * alpha + sum_j p_j, m = m_new;
 * returns alpha = e^(m_old - m_new), by which the row's accumulator is to be scaled. */
static inline __attribute__((always_inline)) float softmax_row(float *sc, int valid, float *m, float *l) {
    if (valid < KC)
#pragma omp simd
        for (int j = 0; j < KC; j++) sc[j] = j < valid ? sc[j] : -INFINITY;
    float mx = *m;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < KC; j++) mx = sc[j] > mx ? sc[j] : mx;
    const float alpha = *m == -INFINITY ? 0.f : fast_exp(*m - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < KC; j++) {
        sc[j] = j < valid ? fast_exp(sc[j] - mx) : 0.f;
        sum += sc[j];
    }
    *m = mx;
    *l = *l * alpha + sum;
    return alpha;
}

/* acc[x] = acc[x] * alpha[x] + sum_{j < keys} p[x][j] V_j for the ROWS rows x of a score group, the
 * rows' accumulators in registers VG vectors of head_dim at a time: each V vector loaded once serves
 * all ROWS rows, and ROWS x VG independent FMA chains keep the FMA units busy (a row alone had only
 * head_dim / 16 chains, each FMA waiting on the last). A row's terms still add in key order, so its
 * sums are the one-row loop's; weights past a row's own keys are 0 (softmax_row), adding nothing
 * (for finite V: an inf or NaN there, past a row's position, now reaches it as 0 * inf). */
#define VG 4
static inline __attribute__((always_inline)) void pv_rows(vf *const acc[ROWS], const float alpha[ROWS],
                                                          const float p[ROWS][KC], int keys, const float *v_rows,
                                                          int head_dim) {
    const int nvec = head_dim / VL;
    for (int c0 = 0; c0 < nvec; c0 += VG) {
        const int nc = nvec - c0 < VG ? nvec - c0 : VG;
        vf a[ROWS][VG];
        for (int x = 0; x < ROWS; x++)
            for (int c = 0; c < VG; c++) a[x][c] = c < nc ? acc[x][c0 + c] * alpha[x] : (vf){0};
        for (int j = 0; j < keys; j++) {
            const vf *vr = (const vf *)(v_rows + (size_t)j * head_dim) + c0;
            for (int c = 0; c < VG; c++) {
                if (c >= nc) break;
                const vf vv = vr[c];
                for (int x = 0; x < ROWS; x++) a[x][c] += vv * p[x][j];
            }
        }
        for (int x = 0; x < ROWS; x++)
            for (int c = 0; c < nc; c++) acc[x][c0 + c] = a[x][c];
    }
}

/* One task. q/out rows of token i, query head qh: (row0 + i) * row_stride + qh * head_dim.
 * first_pos: position of the sequence's first new token; tokens [t0, t1) of its new ones. */
static inline __attribute__((always_inline)) void prefill_task(
    const char *q, int64_t q_stride, const char *k, const char *v, int64_t block_stride, int64_t token_stride,
    const int32_t *table, int64_t row0, int first_pos, int t0, int t1, char *out, int64_t out_stride, int kv_head,
    int group, int head_dim, int block_size, float scale, int dtype, int esize, char *scratch) {
    const int nrows = (t1 - t0) * group, nvec = head_dim / VL;
    vf *kt = (vf *)scratch;                                    /* [head_dim][NV] */
    vf *acc = kt + (size_t)head_dim * NV;                      /* [nrows][nvec] */
    float *v_rows = (float *)(acc + (size_t)nrows * nvec);     /* [KC][head_dim] */
    float *qf = v_rows + (size_t)KC * head_dim;                /* [nrows][head_dim], pre-scaled */
    float *m = qf + (size_t)nrows * head_dim, *l = m + nrows;  /* [nrows] each */
    vf *spare = (vf *)(l + nrows + (16 - (nrows * 2) % 16) % 16);   /* [nvec]: rows that skip a chunk write here */
    for (int r = 0; r < nrows; r++) {
        const int i = t0 + r / group, qh = kv_head * group + r % group;
        const char *row = q + ((row0 + i) * q_stride + (int64_t)qh * head_dim) * esize;
        for (int d = 0; d < head_dim; d++) qf[(size_t)r * head_dim + d] = load_elem(row, d, dtype) * scale;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(acc, 0, sizeof(vf) * (size_t)nrows * nvec);
    memset(spare, 0, sizeof(vf) * (size_t)nvec);
    const int last = first_pos + t1 - 1; /* the tile's last position: no key past it is read */
    for (int c0 = 0; c0 <= last; c0 += KC) {
        const int nk = last + 1 - c0 < KC ? last + 1 - c0 : KC;
        load_chunk(k, v, block_stride, token_stride, table, c0, nk, kv_head, head_dim, block_size, dtype, esize, kt,
                   v_rows);
        /* rows before r_start end before this chunk: their position < c0 */
        int r_start = (c0 - first_pos - t0) * group;
        r_start = r_start < 0 ? 0 : r_start;
        for (int r0 = r_start - r_start % ROWS; r0 < nrows; r0 += ROWS) {
            const int nr = nrows - r0 < ROWS ? nrows - r0 : ROWS;
            vf s[ROWS][NV] = {{{0}}};
            const float *qx[ROWS];
            for (int x = 0; x < ROWS; x++) qx[x] = qf + (size_t)(r0 + (x < nr ? x : 0)) * head_dim;
            for (int d = 0; d < head_dim; d++)
                for (int c = 0; c < NV; c++)
                    for (int x = 0; x < ROWS; x++) s[x][c] += kt[(size_t)d * NV + c] * qx[x][d];
            float p[ROWS][KC] __attribute__((aligned(64)));
            float alpha[ROWS];
            vf *rows_acc[ROWS];
            int keys = 0;
            for (int x = 0; x < ROWS; x++) {
                const int r = r0 + x, pos = first_pos + t0 + r / group;
                const int valid = x >= nr ? 0 : pos - c0 + 1 < nk ? pos - c0 + 1 : nk; /* keys c0 .. pos */
                rows_acc[x] = valid > 0 ? acc + (size_t)r * nvec : spare;
                alpha[x] = 1.f;
                if (valid <= 0) {   /* a tail row, or one whose position is before this chunk: untouched */
                    memset(p[x], 0, sizeof p[x]);
                    continue;
                }
                memcpy(p[x], s[x], sizeof p[x]);
                alpha[x] = softmax_row(p[x], valid, m + r, l + r);
                keys = valid > keys ? valid : keys;
            }
            pv_rows(rows_acc, alpha, (const float(*)[KC])p, keys, v_rows, head_dim);
        }
    }
    for (int r = 0; r < nrows; r++) {
        const int i = t0 + r / group, qh = kv_head * group + r % group;
        char *row = out + ((row0 + i) * out_stride + (int64_t)qh * head_dim) * esize;
        const float inv = 1.f / l[r];
        const float *a = (const float *)(acc + (size_t)r * nvec);
        for (int d = 0; d < head_dim; d++) store_elem(row, d, a[d] * inv, dtype);
    }
}

#define TASK_ARGS                                                                                               \
    const char *q, int64_t q_stride, const char *k, const char *v, int64_t block_stride, int64_t token_stride,    \
        const int32_t *table, int64_t row0, int first_pos, int t0, int t1, char *out, int64_t out_stride,          \
        int kv_head, int group, int head_dim, int block_size, float scale, int esize, char *scratch
#define TASK_PASS(HD, DT)                                                                                        \
    prefill_task(q, q_stride, k, v, block_stride, token_stride, table, row0, first_pos, t0, t1, out, out_stride, \
                 kv_head, group, HD, block_size, scale, DT, esize, scratch)
/* One copy per dtype, and within it per common head size: constant trip counts unroll fully. */
#define TASK_DT(NAME, DT)                   \
    static void NAME(TASK_ARGS) {           \
        if (head_dim == 64)                 \
            TASK_PASS(64, DT);              \
        else if (head_dim == 128)           \
            TASK_PASS(128, DT);             \
        else                                \
            TASK_PASS(head_dim, DT);        \
    }
TASK_DT(task_f32, DT_F32)
TASK_DT(task_bf16, DT_BF16)
TASK_DT(task_f16, DT_F16)

/* Strides are in elements. Sequence n (of num_seqs) has q_lens[n] new tokens in q/out rows
 * row0s[n] .. + q_lens[n], seq_lens[n] tokens in all (the new ones last), and its block table
 * at tables + table_rows[n] * table_stride. head_dim must be a multiple of 16. Returns 0, or
 * -1 if scratch allocation failed. */
int paged_prefill(const void *q, int64_t q_stride, const void *k, const void *v, int64_t block_stride,
                  int64_t token_stride, const int32_t *tables, int64_t table_stride, const int64_t *table_rows,
                  const int64_t *row0s, const int32_t *q_lens, const int32_t *seq_lens, void *out, int64_t out_stride,
                  int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtype,
                  int num_threads) {
    const int group = num_heads / num_kv_heads, esize = dtype == DT_F32 ? 4 : 2;
    void (*task_dt)(TASK_ARGS) = dtype == DT_F32 ? task_f32 : dtype == DT_BF16 ? task_bf16 : task_f16;
    const int tile_q = TILE_ROWS / group > 0 ? TILE_ROWS / group : 1; /* new tokens per task */
    /* tasks of sequence n start at first[n]: tiles x kv heads */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int n = 0; n < num_seqs; n++)
        first[n + 1] = first[n] + (int64_t)((q_lens[n] + tile_q - 1) / tile_q) * num_kv_heads;
    const size_t max_rows = (size_t)tile_q * group;
    const size_t scratch_bytes = sizeof(vf) * ((size_t)head_dim * NV + max_rows * (head_dim / VL) + 1 + head_dim / VL) +
                                 sizeof(float) * ((size_t)KC * head_dim + max_rows * head_dim + 2 * max_rows);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        char *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < first[num_seqs]; task++) {
            if (scratch == NULL) continue;
            int n = 0;
            while (first[n + 1] <= task) n++;
            const int64_t local = task - first[n];
            /* the longest tiles (last tiles: most keys) are handed out first within a sequence */
            const int tiles = (q_lens[n] + tile_q - 1) / tile_q;
            const int tile = tiles - 1 - (int)(local / num_kv_heads), kv_head = (int)(local % num_kv_heads);
            const int t0 = tile * tile_q, t1 = t0 + tile_q < q_lens[n] ? t0 + tile_q : q_lens[n];
            task_dt((const char *)q, q_stride, (const char *)k, (const char *)v, block_stride, token_stride,
                    tables + table_rows[n] * table_stride, row0s[n], seq_lens[n] - q_lens[n], t0, t1, (char *)out,
                    out_stride, kv_head, group, head_dim, block_size, scale, esize, scratch);
        }
        free(scratch);
    }
    free(first);
    return failed ? -1 : 0;
}
