/* A step's few one-token rows times a bf16 weight on AVX-512 BF16 vectors (cpu_kernels/linear_vectors.py). */
#include "kvsnap.h"

#if KVSNAP_BF16_VECTORS
#include <immintrin.h>

#define AHEAD 16  /* weight lines prefetched ahead, per stream */

/* MR rows x[m * K2 + p] (bf16 pairs) against one unit: 32 outputs, two streams of K2 lines. */
#define UNIT_FN(MR) \
static void unit_##MR(const uint32_t* x, long K2, const uint16_t* w0, uint16_t* y, long N) { \
    const uint16_t* w1 = w0 + K2 * 32; \
    __m512 a0[MR], a1[MR]; \
    for (int m = 0; m < MR; m++) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); } \
    for (long p = 0; p < K2; p++) { \
        _mm_prefetch((const char*)(w0 + (p + AHEAD) * 32), _MM_HINT_T0); \
        _mm_prefetch((const char*)(w1 + (p + AHEAD) * 32), _MM_HINT_T0); \
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32); \
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + p * 32); \
        for (int m = 0; m < MR; m++) { \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[m * K2 + p]); \
            a0[m] = _mm512_dpbf16_ps(a0[m], b0, xb); \
            a1[m] = _mm512_dpbf16_ps(a1[m], b1, xb); \
        } \
    } \
    for (int m = 0; m < MR; m++) { \
        _mm256_storeu_si256((__m256i*)(y + m * N), (__m256i)_mm512_cvtneps_pbh(a0[m])); \
        _mm256_storeu_si256((__m256i*)(y + m * N + 16), (__m256i)_mm512_cvtneps_pbh(a1[m])); \
    } \
}
UNIT_FN(1) UNIT_FN(2) UNIT_FN(3) UNIT_FN(4) UNIT_FN(5) UNIT_FN(6) UNIT_FN(7) UNIT_FN(8)
typedef void (*unit_fn)(const uint32_t*, long, const uint16_t*, uint16_t*, long);
static const unit_fn UNITS[9] = {0, unit_1, unit_2, unit_3, unit_4, unit_5, unit_6, unit_7, unit_8};

/* ys[i] [M][Ns[i]] = x [M][K] . w_i^T for count weights, each repacked [Ns[i] / 16][K / 2][16][2];
   one parallel pass over all their units. Ns[i] % 32 == 0, K % 2 == 0. */
void few_linear(const uint16_t* x, long M, long K, int count, const uint16_t* const* ws, const long* Ns,
                uint16_t* const* ys) {
    long first[9] = {0}, K2 = K / 2;
    for (int i = 0; i < count; i++) first[i + 1] = first[i] + Ns[i] / 32;
    const uint32_t* x32 = (const uint32_t*)x;
    #pragma omp parallel for schedule(static)
    for (long u = 0; u < first[count]; u++) {
        int i = 0;
        while (u >= first[i + 1]) i++;
        long g = u - first[i], N = Ns[i];
        for (long m0 = 0; m0 < M; m0 += 8)
            UNITS[M - m0 < 8 ? M - m0 : 8](x32 + m0 * K2, K2, ws[i] + g * 32 * K, ys[i] + m0 * N + g * 32, N);
    }
}

#endif
