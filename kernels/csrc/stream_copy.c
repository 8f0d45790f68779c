/* One copy into memory nobody reads soon (a KV block landing in the pool), with streaming stores.
 *
 * A plain memcpy (glibc's, below its multi-MB non-temporal threshold) writes through the cache:
 * every destination line is first read from memory (read for ownership), then written back when
 * evicted, three memory transfers a byte. Streaming (non-temporal) stores write whole lines
 * straight to memory: two. Landing a 0.5 MiB block into a cold pool from a warm buffer took
 * 21 us this way against 30 us through memcpy on the benchmark's Zen 4 (bench/landing_copy.py).
 * The destination is aligned to the store width by a short memcpy first; the tail is memcpy'd.
 * A CPU without SSE2 (not x86-64) gets memcpy throughout.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

/* One vector's load and streaming store, and its width W in bytes, for the widest this build targets. */
#if defined(__AVX512F__)
#define W 64
#define STREAM_ONE(d, s) _mm512_stream_si512((void *)(d), _mm512_loadu_si512((const void *)(s)))
#elif defined(__AVX__)
#define W 32
#define STREAM_ONE(d, s) _mm256_stream_si256((__m256i *)(d), _mm256_loadu_si256((const __m256i *)(s)))
#elif defined(__SSE2__)
#define W 16
#define STREAM_ONE(d, s) _mm_stream_si128((__m128i *)(d), _mm_loadu_si128((const __m128i *)(s)))
#endif

void stream_copy(void *dst, const void *src, int64_t n) {
    char *d = dst;
    const char *s = src;
    int64_t i = 0;
#if defined(W)
    if (n >= 4 * W) {
        i = (int64_t)((W - ((uintptr_t)d & (W - 1))) & (W - 1));   /* bytes until d + i is aligned */
        memcpy(d, s, (size_t)i);
        for (; i + 4 * W <= n; i += 4 * W) {
            STREAM_ONE(d + i, s + i);
            STREAM_ONE(d + i + W, s + i + W);
            STREAM_ONE(d + i + 2 * W, s + i + 2 * W);
            STREAM_ONE(d + i + 3 * W, s + i + 3 * W);
        }
        _mm_sfence();       /* the streamed lines are visible before any later store (and the caller's flag) */
    }
#endif
    memcpy(d + i, s + i, (size_t)(n - i));
}
