/* One core's AMX throughput: independent tdpbf16ps, and 4 KiB weight steps loaded from L1 and from L2.
 *     gcc -O2 -march=native -o /tmp/tile_micro bench/amx/tile_micro.c && taskset -c 1 /tmp/tile_micro
 * (bench/README.md, "bfloat16 on AMX tiles": ~18 ns a product on the benchmark host) */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
struct cfg { uint8_t p, s, r[14]; uint16_t c[16]; uint8_t rows[16]; };
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main() {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no amx\n"); return 1; }
    struct cfg c; memset(&c, 0, sizeof c); c.p = 1;
    for (int t = 0; t < 8; t++) { c.c[t] = 64; c.rows[t] = 16; }
    _tile_loadconfig(&c);
    static uint16_t a[16 * 32] __attribute__((aligned(64)));
    static uint16_t b[16 * 256 * 64] __attribute__((aligned(64)));  /* 512 KiB */
    for (int i = 0; i < 16 * 32; i++) a[i] = 0x3f80;
    for (int i = 0; i < 16 * 256 * 64; i++) b[i] = 0x3f80;
    const long N = 2000000;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a, 64); _tile_loadd(5, b, 256); _tile_loadd(6, b, 256); _tile_loadd(7, b, 256);
    double t0 = now();
    for (long i = 0; i < N; i++) { _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 4, 5); }
    double t1 = now();
    printf("4 dps: %.1f ns per group (%.1f ns per dp)\n", (t1 - t0) / N * 1e9, (t1 - t0) / N / 4 * 1e9);
    /* loads from a 4 KiB L1 block at stride 256 + 4 dps */
    t0 = now();
    for (long i = 0; i < N; i++) {
        const char *p = (const char *)b;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, p, 256); _tile_loadd(6, p + 64, 256); _tile_loadd(7, p + 128, 256);
        _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, p + 192, 256); _tile_dpbf16ps(3, 4, 5);
    }
    t1 = now();
    printf("L1 step (5 loads, 4 dps): %.1f ns\n", (t1 - t0) / N * 1e9);
    /* stream over 512 KiB (L2) */
    t0 = now();
    long steps = 128;  /* 512 KiB / 4 KiB */
    for (long i = 0; i < N; i++) {
        const char *p = (const char *)b + (i % steps) * 4096;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, p, 256); _tile_loadd(6, p + 64, 256); _tile_loadd(7, p + 128, 256);
        _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, p + 192, 256); _tile_dpbf16ps(3, 4, 5);
    }
    t1 = now();
    printf("L2 step (5 loads, 4 dps): %.1f ns (%.1f GB/s of B)\n", (t1 - t0) / N * 1e9, 4096 / ((t1 - t0) / N) / 1e9);
    /* only loads */
    t0 = now();
    for (long i = 0; i < N; i++) {
        const char *p = (const char *)b + (i % steps) * 4096;
        _tile_loadd(5, p, 256); _tile_loadd(6, p + 64, 256); _tile_loadd(7, p + 128, 256); _tile_loadd(5, p + 192, 256);
    }
    t1 = now();
    printf("L2 loads only: %.1f ns per 4 KiB\n", (t1 - t0) / N * 1e9);
    _tile_release();
    return 0;
}
