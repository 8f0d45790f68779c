/* The CPU's float32 FMA ceiling: 12 independent chains of 8-lane FMAs per thread (AVX2 and FMA; the
 * ymm width on AVX-512 CPUs too), no memory traffic. bench/gemm_rate.py builds and runs it beside the
 * GEMMs it bounds.
 *
 *    gcc -O2 -march=native -fopenmp -o fma_peak bench/fma_peak.c && ./fma_peak THREADS
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    const long iters = 20000000;        /* rounds of 12 FMAs per thread: ~0.1 s at 3 GHz */
    double best = 0.0;
    for (int rep = 0; rep < 5; rep++) {
        float sink = 0.f;
        const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            __m256 a[12];
            for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i * 1e-3f);
            const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
            for (long it = 0; it < iters; it++)
#pragma GCC unroll 12
                for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
            __m256 s = a[0];
            for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
            float f[8];
            _mm256_storeu_ps(f, s);
            sink += f[0];
        }
        const double gflops = 2.0 * 8 * 12 * (double)iters * threads / (now() - t0) / 1e9;
        if (gflops > best) best = gflops;
        if (sink == 12345.f) printf("%g\n", sink);      /* keeps the chains live */
    }
    printf("%.1f\n", best);
    return 0;
}
