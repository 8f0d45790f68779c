/* The small per-layer ops of a Llama-family decoder on CPU, each one pass over its rows:
 *   rms_norm   out = weight * x / rms(x); with a residual: residual += x first, then its norm
 *   silu_mul   out = silu(gate) * up, from the gate_up projection's [gate | up] rows
 *   rotary     q and k heads rotated in place by their token's position (rotate-half RoPE)
 *   store_kv   a step's K and V rows written into their slots of the paged pool
 *
 * In PyTorch each of these is several ops, and every op that splits its work wakes OpenMP's
 * sleeping threads, which costs more than the op itself at decode sizes. Here an op over fewer
 * than PARALLEL_MIN elements runs on the calling thread alone; a larger one (prefill) splits
 * its rows over num_threads.
 *
 * Results are rounded where the PyTorch ops Hugging Face uses round them (a 16-bit op rounds
 * its result to 16 bits), and this file is built with -ffp-contract=off so a*b + c*d is not
 * fused: float32 results match PyTorch's up to summation order and exp's last bit.
 * Strides are in elements; every row's elements are contiguous. Built by kernels/cpu_kernels.py.
 */
#include "common.h"
#include "bf16x16.h"
#include "f32x8.h"

#define PARALLEL_MIN 65536

/* Calls BODY with a constant dtype, so each always-inlined copy is one typed loop. */
#define BY_DTYPE(dtype, BODY)           \
    do {                                \
        if ((dtype) == DT_F32) {        \
            const int DT = DT_F32;      \
            BODY;                       \
        } else if ((dtype) == DT_BF16) { \
            const int DT = DT_BF16;     \
            BODY;                       \
        } else {                        \
            const int DT = DT_F16;      \
            BODY;                       \
        }                               \
    } while (0)

static inline __attribute__((always_inline)) void rms_norm_row(const char *x, char *residual, const char *weight,
                                                               char *out, int64_t n, float eps, int dtype) {
    const char *src = x;
    if (residual != NULL) {
        for (int64_t i = 0; i < n; i++)
            store_elem(residual, i, load_elem(residual, i, dtype) + load_elem(x, i, dtype), dtype);
        src = residual;
    }
    float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; i++) {
        const float v = load_elem(src, i, dtype);
        sum_sq += v * v;
    }
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        store_elem(out, i, load_elem(weight, i, dtype) * round_to(load_elem(src, i, dtype) * inv_rms, dtype), dtype);
}

#if HAVE_BF16X16
/* rms_norm_row for bf16, 16 elements at a time (the tail by rms_norm_row's loops): the same
 * roundings; the sum of squares in 16 lanes, so its order (not its rounding) differs. */
static void rms_norm_row_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                              int64_t n, float eps) {
    const int64_t n16 = n & ~(int64_t)15;
    const uint16_t *src = x;
    if (residual != NULL) {
        for (int64_t i = 0; i < n16; i += 16)
            bf16x16_store(residual + i, _mm512_add_ps(bf16x16_load(residual + i), bf16x16_load(x + i)));
        for (int64_t i = n16; i < n; i++) residual[i] = f32_to_bf16(bf16_to_f32(residual[i]) + bf16_to_f32(x[i]));
        src = residual;
    }
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n16; i += 16) {
        const __m512 v = bf16x16_load(src + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    float sum_sq = _mm512_reduce_add_ps(acc);
    for (int64_t i = n16; i < n; i++) sum_sq += bf16_to_f32(src[i]) * bf16_to_f32(src[i]);
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)n + eps);
    const __m512 inv = _mm512_set1_ps(inv_rms);
    for (int64_t i = 0; i < n16; i += 16)
        bf16x16_store(out + i, _mm512_mul_ps(bf16x16_load(weight + i), bf16x16_round(_mm512_mul_ps(bf16x16_load(src + i), inv))));
    for (int64_t i = n16; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_to(bf16_to_f32(src[i]) * inv_rms, DT_BF16));
}
#endif

/* x, out: [rows, n]; residual: [rows, n] or NULL; weight: [n]. */
void rms_norm(const void *x, int64_t x_stride, void *residual, int64_t residual_stride, const void *weight, void *out,
              int64_t out_stride, int64_t rows, int64_t n, float eps, int dtype, int num_threads) {
    const int esize = dtype == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * esize;
        char *res = residual == NULL ? NULL : (char *)residual + r * residual_stride * esize;
        char *o = (char *)out + r * out_stride * esize;
#if HAVE_BF16X16
        if (dtype == DT_BF16) {
            rms_norm_row_bf16((const uint16_t *)xr, (uint16_t *)res, (const uint16_t *)weight, (uint16_t *)o, n, eps);
            continue;
        }
#endif
        BY_DTYPE(dtype, rms_norm_row(xr, res, (const char *)weight, o, n, eps, DT));
    }
}

static inline __attribute__((always_inline)) void silu_mul_row(const char *x, char *out, int64_t n, int dtype) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float gate = load_elem(x, i, dtype), up = load_elem(x, n + i, dtype);
        store_elem(out, i, round_to(gate / (1.f + fast_exp(-gate)), dtype) * up, dtype);
    }
}

#if HAVE_BF16X16
/* silu_mul_row for bf16, 16 elements at a time (the tail by silu_mul_row's loop): bit for bit its results. */
static void silu_mul_row_bf16(const uint16_t *x, uint16_t *out, int64_t n) {
    const int64_t n16 = n & ~(int64_t)15;
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t i = 0; i < n16; i += 16) {
        const __m512 gate = bf16x16_load(x + i), up = bf16x16_load(x + n + i);
        const __m512 minus = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gate), sign));
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, fast_exp16(minus)));
        bf16x16_store(out + i, _mm512_mul_ps(bf16x16_round(silu), up));
    }
    for (int64_t i = n16; i < n; i++) {
        const float gate = bf16_to_f32(x[i]), up = bf16_to_f32(x[n + i]);
        out[i] = f32_to_bf16(round_to(gate / (1.f + fast_exp(-gate)), DT_BF16) * up);
    }
}
#endif

#if HAVE_F32X8
/* 8 float32 or bf16 elements (dtype a constant after inlining) from element i of row p, as float32. */
static inline __attribute__((always_inline)) __m256 load8(const char *p, int64_t i, int dtype) {
    return dtype == DT_BF16 ? bf16x8_load((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* silu_mul_row for float32 or bf16, 8 elements at a time on AVX2 (the tail by silu_mul_row's own
 * operations): bit for bit its results. */
static inline __attribute__((always_inline)) void silu_mul_row_x8(const char *x, char *out, int64_t n, int dtype) {
    const int64_t n8 = n & ~(int64_t)7;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < n8; i += 8) {
        const __m256 gate = load8(x, i, dtype), up = load8(x, n + i, dtype);
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, fast_exp8(_mm256_xor_ps(gate, sign))));
        if (dtype == DT_BF16) bf16x8_store((uint16_t *)out + i, _mm256_mul_ps(bf16x8_round(silu), up));
        else _mm256_storeu_ps((float *)out + i, _mm256_mul_ps(silu, up));
    }
    for (int64_t i = n8; i < n; i++) {
        const float gate = load_elem(x, i, dtype), up = load_elem(x, n + i, dtype);
        store_elem(out, i, round_to(gate / (1.f + fast_exp(-gate)), dtype) * up, dtype);
    }
}
#endif

/* x: [rows, 2n] (gate | up); out: [rows, n]. */
void silu_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t rows, int64_t n, int dtype,
              int num_threads) {
    const int esize = dtype == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * esize;
        char *o = (char *)out + r * out_stride * esize;
#if HAVE_BF16X16
        if (dtype == DT_BF16) {
            silu_mul_row_bf16((const uint16_t *)xr, (uint16_t *)o, n);
            continue;
        }
#endif
#if HAVE_F32X8
        if (dtype == DT_F32) {
            silu_mul_row_x8(xr, o, n, DT_F32);
            continue;
        }
        if (dtype == DT_BF16) {
            silu_mul_row_x8(xr, o, n, DT_BF16);
            continue;
        }
#endif
        BY_DTYPE(dtype, silu_mul_row(xr, o, n, DT));
    }
}

/* One head: x[d] and x[d + half] rotated together, as x * cos + rotate_half(x) * sin. */
static inline __attribute__((always_inline)) void rotary_head(char *x, const char *cos, const char *sin, int64_t half,
                                                              int dtype) {
#pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        const float a = load_elem(x, d, dtype), b = load_elem(x, d + half, dtype);
        const float lo = round_to(a * load_elem(cos, d, dtype), dtype) +
                         round_to(-b * load_elem(sin, d, dtype), dtype);
        const float hi = round_to(b * load_elem(cos, d + half, dtype), dtype) +
                         round_to(a * load_elem(sin, d + half, dtype), dtype);
        store_elem(x, d, lo, dtype);
        store_elem(x, d + half, hi, dtype);
    }
}

#if HAVE_BF16X16
/* rotary_head for bf16 heads whose half is a multiple of 16, 16 element pairs at a time: bit for
 * bit its results (-b by flipping the sign bit, as the scalar negation). */
static void rotary_head_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t d = 0; d < half; d += 16) {
        const __m512 a = bf16x16_load(x + d), b = bf16x16_load(x + d + half);
        const __m512 minus_b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), sign));
        const __m512 lo = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(a, bf16x16_load(cos + d))),
                                        bf16x16_round(_mm512_mul_ps(minus_b, bf16x16_load(sin + d))));
        const __m512 hi = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(b, bf16x16_load(cos + d + half))),
                                        bf16x16_round(_mm512_mul_ps(a, bf16x16_load(sin + d + half))));
        bf16x16_store(x + d, lo);
        bf16x16_store(x + d + half, hi);
    }
}
#endif

/* qk: [rows, heads, head_dim], rotated in place; cos, sin: [num_positions, head_dim].
 * Returns 0, or -1 (nothing written past the bad row) if a position is out of the table. */
int rotary(void *qk, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const int64_t *positions,
           const void *cos, const void *sin, int64_t num_positions, int dtype, int num_threads) {
    const int esize = dtype == DT_F32 ? 4 : 2;
    int bad = 0;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = positions[r];
        if (p < 0 || p >= num_positions) {
            bad = 1;
            continue;
        }
        const char *c = (const char *)cos + p * head_dim * esize, *s = (const char *)sin + p * head_dim * esize;
        char *row = (char *)qk + r * row_stride * esize;
#if HAVE_BF16X16
        if (dtype == DT_BF16 && head_dim % 32 == 0) {
            for (int64_t h = 0; h < heads; h++)
                rotary_head_bf16((uint16_t *)row + h * head_dim, (const uint16_t *)c, (const uint16_t *)s, head_dim / 2);
            continue;
        }
#endif
        for (int64_t h = 0; h < heads; h++)
            BY_DTYPE(dtype, rotary_head(row + h * head_dim * esize, c, s, head_dim / 2, DT));
    }
    return bad ? -1 : 0;
}

/* key, value: [rows, row_elems] (a token's kv heads); slot s >= 0 goes to block s / block_size,
 * row s % block_size of k_cache / v_cache; slot < 0 is skipped. Returns 0, or -1 if a slot is
 * >= num_slots (that row is skipped). */
int store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
             void *v_cache, int64_t block_stride, int64_t token_stride, const int64_t *slots, int64_t rows,
             int64_t row_elems, int64_t block_size, int64_t num_slots, int esize, int num_threads) {
    int bad = 0;
#pragma omp parallel for num_threads(num_threads) if (rows * row_elems >= PARALLEL_MIN) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t s = slots[r];
        if (s < 0) continue;
        if (s >= num_slots) {
            bad = 1;
            continue;
        }
        const int64_t at = ((s / block_size) * block_stride + (s % block_size) * token_stride) * esize;
        memcpy((char *)k_cache + at, (const char *)key + r * key_stride * esize, (size_t)(row_elems * esize));
        memcpy((char *)v_cache + at, (const char *)value + r * value_stride * esize, (size_t)(row_elems * esize));
    }
    return bad ? -1 : 0;
}
