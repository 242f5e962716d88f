/* One block of a KV head's keys and values against a decode step's queries: the unit of work of
   the one-token kernels (decode_attention.c: bf16 rows; cold_attention.c: quantized rows, which
   it widens into bf16 scratch first). Each block gives its partial softmax (m, s, o), joined
   across the blocks of a head in their order. */
#ifndef DECODE_BLOCKS_H
#define DECODE_BLOCKS_H

#include "kvsnap.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#endif

#define BLK 256   /* a row's keys are cut into blocks of this many, each a work unit, joined in order */
#define MAXG 16   /* query heads per KV head */

/* A block's scores sc[g][n] (rows of BLK) to exp(score - m[g]), with m[g] their largest and
   s[g] the sum of the exps: the block's partial softmax. */
static inline void block_softmax(float *sc, long n, int G, float *m, float *s) {
    for (int g = 0; g < G; g++) {
        float *p = sc + g * BLK, mx = -INFINITY, sum = 0.f;
        for (long l = 0; l < n; l++) mx = p[l] > mx ? p[l] : mx;
        #pragma omp simd reduction(+:sum)
        for (long l = 0; l < n; l++) { p[l] = expf(p[l] - mx); sum += p[l]; }
        m[g] = mx; s[g] = sum;
    }
}


/* One block of one KV head: keys / values [n, D] bf16 (rows of D), queries q [G, D] float32.
   Writes m[g] (the block's largest score), s[g] (sum of exp(score - m[g])) and the unnormalised
   o[g][D] = sum_l exp(score_l - m[g]) * v_l. sc: G * BLK floats of scratch. */
static void block_generic(const float *q, const uint16_t *K, const uint16_t *V, long n, int G, int D,
                          float scale, float *sc, float *m, float *s, float *o) {
    for (long l = 0; l < n; l++) {
        const uint16_t *kr = K + l * D;
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int d = 0; d < D; d++) acc += qg[d] * bf16_to_f32(kr[d]);
            sc[g * BLK + l] = acc * scale;
        }
    }
    block_softmax(sc, n, G, m, s);
    for (int g = 0; g < G; g++) {
        const float *p = sc + g * BLK;
        float *og = o + g * D;
        for (int d = 0; d < D; d++) og[d] = 0.f;
        for (long l = 0; l < n; l++) {
            const uint16_t *vr = V + l * D;
            float w = p[l];
            #pragma omp simd
            for (int d = 0; d < D; d++) og[d] += w * bf16_to_f32(vr[d]);
        }
    }
}

#if defined(__AVX512F__)
static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The lane sums of 16 vectors v[0..15] as one vector (lane j: the sum of v[j]), each added in
   the very pairs _mm512_reduce_add_ps adds (halves folded: 256 bits, 128, 64, then 32), so each
   sum is that function's bit for bit, with a sixth of its shuffles. */
static inline __m512 sum16(float v[16][16]) {
    __m512 w[8], x[4], y[2];
    for (int j = 0; j < 8; j++) {   /* 512 -> 256: keys 2j, 2j+1 (quarters 0-1 and 2-3) */
        __m512 a = _mm512_load_ps(v[2 * j]), b = _mm512_load_ps(v[2 * j + 1]);
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int j = 0; j < 4; j++)     /* 256 -> 128: quarter i holds key 4j + i */
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)     /* 128 -> 64: quarter i holds keys 8j + i, 8j + 4 + i */
        y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
    /* 64 -> 32: lane 4i + j holds key i + 4j; put key k in lane k */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* Key kr's products with the G queries, as 16 lane sums each (acc[g]: lane i sums dims
   i, i + 16, ...): what a score is folded from. */
static inline __attribute__((always_inline)) void lane_sums(const float *q, const uint16_t *kr, const int G, int D,
                                                            __m512 *acc) {
    for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
        __m512 k = load16(kr + c);
        for (int g = 0; g < G; g++) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c), k, acc[g]);
    }
}

/* The same block with AVX-512, for a constant G (inlined per G, so the accumulators stay in
   registers) and D a multiple of 16. */
static inline __attribute__((always_inline)) void block_avx(const float *q, const uint16_t *K, const uint16_t *V,
        long n, const int G, int D, float scale, float *sc, float *m, float *s, float *o) {
    __attribute__((aligned(64))) float part[G][16][16];   /* per query head, 16 keys' lane sums */
    long l = 0;
    __m512 acc[MAXG];
    for (; l + 16 <= n; l += 16) {   /* 16 keys at a time: their sums come out as one vector */
        for (int j = 0; j < 16; j++) {
            lane_sums(q, K + (l + j) * D, G, D, acc);
            for (int g = 0; g < G; g++) _mm512_store_ps(part[g][j], acc[g]);
        }
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(sc + g * BLK + l, _mm512_mul_ps(sum16(part[g]), _mm512_set1_ps(scale)));
    }
    for (; l < n; l++) {   /* the last n % 16 keys one by one */
        lane_sums(q, K + l * D, G, D, acc);
        for (int g = 0; g < G; g++) sc[g * BLK + l] = _mm512_reduce_add_ps(acc[g]) * scale;
    }
    block_softmax(sc, n, G, m, s);
    /* o = p @ V, 64 (G <= 4) or 32 / 16 dims of every query head at a time */
    const int W = G <= 4 ? 4 : (G <= 8 ? 2 : 1);
    for (int c = 0; c < D; c += 16 * W) {
        int w = (D - c) / 16 < W ? (D - c) / 16 : W;
        __m512 acc[MAXG][4];
        for (int g = 0; g < G; g++) for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        for (long l = 0; l < n; l++) {
            const uint16_t *vr = V + l * D + c;
            __m512 v[4];
            for (int j = 0; j < w; j++) v[j] = load16(vr + 16 * j);
            for (int g = 0; g < G; g++) {
                __m512 p = _mm512_set1_ps(sc[g * BLK + l]);
                for (int j = 0; j < w; j++) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++) for (int j = 0; j < w; j++) _mm512_storeu_ps(o + g * D + c + 16 * j, acc[g][j]);
    }
}

#endif

static void block(const float *q, const uint16_t *K, const uint16_t *V, long n, int G, int D,
                  float scale, float *sc, float *m, float *s, float *o) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        switch (G) {
            case 1: block_avx(q, K, V, n, 1, D, scale, sc, m, s, o); return;
            case 2: block_avx(q, K, V, n, 2, D, scale, sc, m, s, o); return;
            case 3: block_avx(q, K, V, n, 3, D, scale, sc, m, s, o); return;
            case 4: block_avx(q, K, V, n, 4, D, scale, sc, m, s, o); return;
            case 5: block_avx(q, K, V, n, 5, D, scale, sc, m, s, o); return;
            case 6: block_avx(q, K, V, n, 6, D, scale, sc, m, s, o); return;
            case 7: block_avx(q, K, V, n, 7, D, scale, sc, m, s, o); return;
            case 8: block_avx(q, K, V, n, 8, D, scale, sc, m, s, o); return;
            default: break;
        }
    }

#endif
    block_generic(q, K, V, n, G, D, scale, sc, m, s, o);
}

/* A KV head's nb blocks' partials (each m[G], s[G], o[G][D], one after another) joined in their
   order: out[g] = the softmax-weighted sum over every block's keys (G rows of D, float32). */
static inline void join_blocks(const float *p0, long nb, int G, int D, float *out) {
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY, sum = 0.f;
        for (long b = 0; b < nb; b++) { float mb = p0[b * G * (D + 2) + g]; mx = mb > mx ? mb : mx; }
        float *o = out + (long)g * D;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        for (long b = 0; b < nb; b++) {
            const float *pb = p0 + b * G * (D + 2);
            float f = expf(pb[g] - mx);
            sum += pb[G + g] * f;
            const float *ob = pb + 2 * G + g * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) o[d] += f * ob[d];
        }
        float inv = 1.f / sum;
        #pragma omp simd
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

#endif  /* DECODE_BLOCKS_H */
