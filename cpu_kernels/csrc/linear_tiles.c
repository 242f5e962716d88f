/* A step's rows times a bf16 weight on AMX tiles (cpu_kernels/linear_tiles.py). */
#include "kvsnap.h"

#if KVSNAP_TILES
#include <immintrin.h>

#define AHEAD 2  /* weight blocks prefetched ahead (1.3-1.5x here); a prefetch past the end is harmless */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;


/* ys[i] [M][Ns[i]] = x [M][K] . ws[i]^T for count (<= 8) weights [Ns[i]][K] as they are, one
   parallel pass over all their groups of 64 outputs; M <= 16, Ns[i] % 64 == 0, K % 32 == 0 */
int amx_linear(const uint16_t* x, int M, long K, int count, const uint16_t* const* ws, const long* Ns,
               uint16_t* const* ys) {
    long depth = K / 32, first[9] = {0};
    if (count < 1 || count > 8) return -2;
    for (int i = 0; i < count; i++) first[i + 1] = first[i] + Ns[i] / 64;  /* weight i's first group */
    uint32_t* xp = aligned_alloc(64, (size_t)K * 32);  /* [K / 2 pairs][M][2]: the tile's columns */
    if (xp == NULL) return -1;
    const uint32_t* x32 = (const uint32_t*)x;
    for (long p = 0; p < K / 2; p++)
        for (int m = 0; m < M; m++) xp[p * M + m] = x32[m * (K / 2) + p];
    #pragma omp parallel
    {
        tilecfg c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int t = 0; t < 5; t++) { c.rows[t] = 16; c.colsb[t] = (uint16_t)(4 * M); }  /* 4 sums, the rows */
        for (int t = 5; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }               /* weight blocks */
        _tile_loadconfig(&c);
        float acc[16 * 16] __attribute__((aligned(64)));
        __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(M));
        #pragma omp for schedule(static)
        for (long u = 0; u < first[count]; u++) {
            int i = 0;
            while (u >= first[i + 1]) i++;
            long g = u - first[i], N = Ns[i];
            const uint16_t* a = ws[i] + g * 64 * K;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (long d = 0; d < depth; d++) {
                const uint16_t* ad = a + d * 32;
                for (int r = 0; r < 64; r++) _mm_prefetch((const char*)(ad + r * K + AHEAD * 32), _MM_HINT_T0);
                _tile_loadd(4, xp + d * 16 * M, 4 * M);
                _tile_loadd(5, ad, K * 2);
                _tile_dpbf16ps(0, 5, 4);
                _tile_loadd(6, ad + 16 * K, K * 2);
                _tile_dpbf16ps(1, 6, 4);
                _tile_loadd(7, ad + 32 * K, K * 2);
                _tile_dpbf16ps(2, 7, 4);
                _tile_loadd(5, ad + 48 * K, K * 2);
                _tile_dpbf16ps(3, 5, 4);
            }
            uint16_t* out = ys[i] + g * 64;
            /* a sum tile is [16 outputs][M rows]: each row's 16 outputs are a column of it */
#define STORE(t) \
            _tile_stored(t, acc, 4 * M); \
            for (int m = 0; m < M; m++) { \
                __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(m)), acc, 4); \
                _mm256_storeu_si256((__m256i*)(out + m * N + t * 16), (__m256i)_mm512_cvtneps_pbh(col)); \
            }
            STORE(0) STORE(1) STORE(2) STORE(3)
        }
        _tile_release();
    }
    free(xp);
    return 0;
}

#endif
