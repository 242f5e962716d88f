/* A decode step's one-token attention over a mixed-precision layer: KIVI-quantized rows (the
   rows a selection left out, engine/cold.py) and bf16 rows (the kept ones), read where they lie
   (cpu_kernels/cold_attention.py). Quantized rows are read as codes (cold_block: scales folded
   into the queries and the weights, never dequantized to memory), bf16 rows by the one-token
   kernel's block code (decode_blocks.h); the blocks' partial softmaxes are joined in order. A
   row's result is the torch path's (every row dequantized, then one attention) within the
   rounding of the dequantized values to bf16, which this kernel skips. */
#include "decode_blocks.h"

/* One segment of a row's quantized rows (one compression's), every KV head's:
   keys: codes of [Hkv][rows / 32][32][D] packed (bits a code, the first in the low bits), scale
   and zero point float16 [Hkv][rows / 32][D] (per channel, per group of 32 rows);
   values: codes of [Hkv][rows][D], scale and zero float16 [Hkv][rows][D / vg] (per row, per
   group of vg channels), bits a code (2 or 4); then res rows left unquantized, bf16
   [Hkv][res][D] (keys rk, values rv). */
typedef struct {
    const uint8_t *kc;
    const uint16_t *ks, *kz;
    const uint8_t *vc;
    const uint16_t *vs, *vz;
    long rows;
    const uint16_t *rk, *rv;
    long res;
    long vg;
    long bits;
} cold_seg;

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {   /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A key group's scales and zero points folded into the queries (qs: [G][PER][J], stream order)
   and their zero-point products (bias[G]); vf, zf: D floats of scratch. */
static void fold_group(const float *q, const cold_seg *s, int h, long l, int G, int D, int PER,
                       float *qs, float *bias, float *vf, float *zf) {
    long groups = s->rows / 32, J = D / PER;
    const uint16_t *ks = s->ks + (h * groups + l / 32) * D, *kz = s->kz + (h * groups + l / 32) * D;
    for (int d = 0; d < D; d++) vf[d] = f16_to_f32(ks[d]), zf[d] = f16_to_f32(kz[d]);
    for (int g = 0; g < G; g++) {
        float b = 0.f;
        for (int d = 0; d < D; d++) {
            qs[(long)g * D + (d % PER) * J + d / PER] = q[(long)g * D + d] * vf[d];
            b += q[(long)g * D + d] * zf[d];
        }
        bias[g] = b;
    }
}

/* One block of quantized rows [l0, l0 + n) of KV head h (n <= BLK, l0 a multiple of 32), as
   block() (decode_blocks.h) computes a block of bf16 rows: m[g], s[g] and the unnormalised o[g][D].
   Read from the codes: a key group's scales fold into the queries once per 32 rows
   (q . (c * scale + zero) = (q * scale) . c + q . zero), a value row's into its weight. A byte
   holds PER = 8 / BITS codes, channel d = PER * j + k at bits k * BITS of byte j; the queries and
   the output are kept in that order (stream k, index j), so no code is moved. BITS is a constant
   (inlined per value), so the loops unpack with shifts and vectorize. f: scratch of
   (2 * G + 1) * D + G floats. */
static inline __attribute__((always_inline)) void cold_block_bits(
        const float *q, const cold_seg *s, int h, long l0, long n, int G, int D, float scale,
        float *sc, float *m, float *sm, float *o, float *f, const int BITS) {
    const int PER = 8 / BITS, J = D / PER;
    const unsigned MASK = (1u << BITS) - 1u;
    long vg = s->vg;
    float *qs = f, *bias = f + (long)G * D, *vf = bias + G, *acc = vf + D;   /* qs, acc: [G][PER][J] */
    for (long i = 0; i < n; i++) {
        long l = l0 + i;
        if (i % 32 == 0) fold_group(q, s, h, l, G, D, PER, qs, bias, vf, acc);   /* a new key group */
        const uint8_t *kc = s->kc + (h * s->rows + l) * J;   /* row l of head h: J bytes */
        for (int g = 0; g < G; g++) {
            float dot = 0.f;
            for (int k = 0; k < PER; k++) {
                const float *qk = qs + (long)g * D + k * J;
                #pragma omp simd reduction(+:dot)
                for (int j = 0; j < J; j++) dot += qk[j] * (float)((kc[j] >> (k * BITS)) & MASK);
            }
            sc[g * BLK + i] = (dot + bias[g]) * scale;
        }
    }
    block_softmax(sc, n, G, m, sm);
    for (long x = 0; x < (long)G * D; x++) acc[x] = 0.f;
    for (long i = 0; i < n; i++) {
        long l = l0 + i;
        const uint8_t *vc = s->vc + (h * s->rows + l) * J;
        const uint16_t *vs = s->vs + (h * s->rows + l) * (D / vg), *vz = s->vz + (h * s->rows + l) * (D / vg);
        for (int k = 0; k < PER; k++)   /* the row's values, in stream order: channel PER * j + k */
            for (long c = 0; c < D / vg; c++) {
                float a = f16_to_f32(vs[c]), b = f16_to_f32(vz[c]);
                long j0 = c * vg / PER, j1 = (c + 1) * vg / PER;
                #pragma omp simd
                for (long j = j0; j < j1; j++) vf[k * J + j] = (float)((vc[j] >> (k * BITS)) & MASK) * a + b;
            }
        for (int g = 0; g < G; g++) {
            float w = sc[g * BLK + i], *ag = acc + (long)g * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ag[d] += w * vf[d];
        }
    }
    for (int g = 0; g < G; g++)   /* stream order back to channel order */
        for (int d = 0; d < D; d++) o[(long)g * D + d] = acc[(long)g * D + (d % PER) * J + d / PER];
}

#if defined(__AVX512F__)
/* fold_group with AVX-512 for 4-bit codes (PER 2) and D a multiple of 32: products in vectors,
   the even and odd channels split by two permutes. */
static inline void fold_group_avx4(const float *q, const cold_seg *s, int h, long l, int G, int D,
                                   float *qs, float *bias) {
    long groups = s->rows / 32, J = D / 2;
    const uint16_t *ks = s->ks + (h * groups + l / 32) * D, *kz = s->kz + (h * groups + l / 32) * D;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int g = 0; g < G; g++) {
        const float *qg = q + (long)g * D;
        __m512 b = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + d)));
            __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + d + 16)));
            __m512 q0 = _mm512_loadu_ps(qg + d), q1 = _mm512_loadu_ps(qg + d + 16);
            __m512 p0 = _mm512_mul_ps(q0, s0), p1 = _mm512_mul_ps(q1, s1);
            _mm512_storeu_ps(qs + (long)g * D + d / 2, _mm512_permutex2var_ps(p0, even, p1));
            _mm512_storeu_ps(qs + (long)g * D + J + d / 2, _mm512_permutex2var_ps(p0, odd, p1));
            b = _mm512_fmadd_ps(q0, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kz + d))), b);
            b = _mm512_fmadd_ps(q1, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kz + d + 16))), b);
        }
        bias[g] = _mm512_reduce_add_ps(b);
    }
}

/* cold_block for 4-bit codes with AVX-512, for a constant G, D a multiple of 32 and value groups
   of a multiple of 32 channels: 16 bytes of a row's codes are 16 low and 16 high nibbles (two
   vectors of streams 0 and 1), and 16 keys' lane sums fold into one vector of scores (sum16). */
static inline __attribute__((always_inline)) void cold_block_avx4(
        const float *q, const cold_seg *s, int h, long l0, long n, const int G, int D, float scale,
        float *sc, float *m, float *sm, float *o, float *f) {
    const long J = D / 2, vg = s->vg;
    float *qs = f, *bias = f + (long)G * D, *vf = bias + G, *acc = vf + D;
    const __m512i low = _mm512_set1_epi32(15);
    __attribute__((aligned(64))) float part[G][16][16];
    for (long i0 = 0; i0 < n; i0 += 16) {
        if (i0 % 32 == 0) fold_group_avx4(q, s, h, l0 + i0, G, D, qs, bias);
        for (int r = 0; r < 16; r++) {
            const uint8_t *kc = s->kc + (h * s->rows + l0 + i0 + r) * J;
            __m512 a[MAXG];
            for (int g = 0; g < G; g++) a[g] = _mm512_setzero_ps();
            for (long j = 0; j < J; j += 16) {
                __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(kc + j)));
                __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low)), hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                for (int g = 0; g < G; g++)
                    a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + g * D + j), lo,
                                           _mm512_fmadd_ps(_mm512_loadu_ps(qs + g * D + J + j), hi, a[g]));
            }
            for (int g = 0; g < G; g++) _mm512_store_ps(part[g][r], a[g]);
        }
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(sc + g * BLK + i0,
                             _mm512_mul_ps(_mm512_add_ps(sum16(part[g]), _mm512_set1_ps(bias[g])), _mm512_set1_ps(scale)));
    }
    block_softmax(sc, n, G, m, sm);
    for (long j = 0; j < J; j += 16) {   /* channels 2j .. 2j + 31 (one value group), every row, in registers */
        __m512 alo[MAXG], ahi[MAXG];
        for (int g = 0; g < G; g++) alo[g] = ahi[g] = _mm512_setzero_ps();
        for (long i = 0; i < n; i++) {
            long row = h * s->rows + l0 + i, c = row * (D / vg) + 2 * j / vg;
            __m512 a = _mm512_set1_ps(_cvtsh_ss(s->vs[c])), z = _mm512_set1_ps(_cvtsh_ss(s->vz[c]));
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s->vc + row * J + j)));
            __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), a, z);
            __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), a, z);
            for (int g = 0; g < G; g++) {
                __m512 w = _mm512_set1_ps(sc[g * BLK + i]);
                alo[g] = _mm512_fmadd_ps(w, lo, alo[g]);
                ahi[g] = _mm512_fmadd_ps(w, hi, ahi[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm512_storeu_ps(acc + (long)g * D + j, alo[g]);
            _mm512_storeu_ps(acc + (long)g * D + J + j, ahi[g]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) o[(long)g * D + d] = acc[(long)g * D + (d % 2) * J + d / 2];
}
#endif

static void cold_block(const float *q, const cold_seg *s, int h, long l0, long n, int G, int D, float scale,
                       float *sc, float *m, float *sm, float *o, float *f) {
#if defined(__AVX512F__)
    if (s->bits == 4 && D % 32 == 0 && s->vg % 32 == 0) {
        switch (G) {
            case 1: cold_block_avx4(q, s, h, l0, n, 1, D, scale, sc, m, sm, o, f); return;
            case 2: cold_block_avx4(q, s, h, l0, n, 2, D, scale, sc, m, sm, o, f); return;
            case 3: cold_block_avx4(q, s, h, l0, n, 3, D, scale, sc, m, sm, o, f); return;
            case 4: cold_block_avx4(q, s, h, l0, n, 4, D, scale, sc, m, sm, o, f); return;
            case 5: cold_block_avx4(q, s, h, l0, n, 5, D, scale, sc, m, sm, o, f); return;
            case 6: cold_block_avx4(q, s, h, l0, n, 6, D, scale, sc, m, sm, o, f); return;
            case 7: cold_block_avx4(q, s, h, l0, n, 7, D, scale, sc, m, sm, o, f); return;
            case 8: cold_block_avx4(q, s, h, l0, n, 8, D, scale, sc, m, sm, o, f); return;
            default: break;
        }
    }
#endif
    if (s->bits == 4) cold_block_bits(q, s, h, l0, n, G, D, scale, sc, m, sm, o, f, 4);
    else cold_block_bits(q, s, h, l0, n, G, D, scale, sc, m, sm, o, f, 2);
}

/* A unit of work: blocks of one (row, KV head) in the order they are joined: the segments'
   quantized rows, their unquantized rows, then the bf16 rows (kind 2, 1, 0). */
typedef struct { int r, h, kind, seg; long l0, n; } unit;

static long blocks(long n) { return (n + BLK - 1) / BLK; }

/* R rows of one token each, as one_token_rows (decode_attention.c) takes them, and before each
   row's bf16 rows its nseg[r] segments of quantized rows (segs: every row's, in row order).
   Returns 0, or -1 when out of memory. */
int one_token_cold_rows(int R, const float *q, const uint16_t **k, const uint16_t **v, const long *L,
                        const long *khs, const long *vhs, const int *nseg, const cold_seg *segs, int H, int Hkv, int D, float scale, float *out, int threads) {
    int G = H / Hkv;
    long count = 0, *firstseg = malloc(sizeof(long) * (R + 1));
    if (!firstseg) return -1;
    firstseg[0] = 0;
    for (int r = 0; r < R; r++) {
        firstseg[r + 1] = firstseg[r] + nseg[r];
        long per_head = blocks(L[r]);
        for (long s = firstseg[r]; s < firstseg[r + 1]; s++) per_head += blocks(segs[s].rows) + blocks(segs[s].res);
        count += per_head * Hkv;
    }
    unit *units = malloc(sizeof(unit) * (count ? count : 1));
    long *head_first = malloc(sizeof(long) * ((long)R * Hkv + 1));   /* each (row, head)'s first unit */
    float *part = malloc(sizeof(float) * (count ? count : 1) * G * (D + 2));
    if (!units || !head_first || !part) { free(units); free(head_first); free(part); free(firstseg); return -1; }
    long u = 0;
    for (int r = 0; r < R; r++)
        for (int h = 0; h < Hkv; h++) {
            head_first[(long)r * Hkv + h] = u;
            for (long s = firstseg[r]; s < firstseg[r + 1]; s++) {
                for (long l0 = 0; l0 < segs[s].rows; l0 += BLK)
                    units[u++] = (unit){r, h, 2, (int)s, l0, segs[s].rows - l0 < BLK ? segs[s].rows - l0 : BLK};
                for (long l0 = 0; l0 < segs[s].res; l0 += BLK)
                    units[u++] = (unit){r, h, 1, (int)s, l0, segs[s].res - l0 < BLK ? segs[s].res - l0 : BLK};
            }
            for (long l0 = 0; l0 < L[r]; l0 += BLK)
                units[u++] = (unit){r, h, 0, -1, l0, L[r] - l0 < BLK ? L[r] - l0 : BLK};
        }
    head_first[(long)R * Hkv] = u;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float sc[MAXG * BLK];
        float *scratch = malloc(sizeof(float) * ((2L * G + 1) * D + G));   /* cold_block's */
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < count; i++) {
            if (!scratch) continue;
            const unit *w = &units[i];
            const float *qh = q + ((long)w->r * H + w->h * G) * D;
            float *pu = part + i * G * (D + 2);
            if (w->kind == 2) {
                cold_block(qh, &segs[w->seg], w->h, w->l0, w->n, G, D, scale, sc, pu, pu + G, pu + 2 * G, scratch);
                continue;
            }
            const uint16_t *K, *V;
            if (w->kind == 1) {
                const cold_seg *s = &segs[w->seg];
                K = s->rk + (w->h * s->res + w->l0) * D, V = s->rv + (w->h * s->res + w->l0) * D;
            } else {
                K = k[w->r] + w->h * khs[w->r] + w->l0 * D, V = v[w->r] + w->h * vhs[w->r] + w->l0 * D;
            }
            block(qh, K, V, w->n, G, D, scale, sc, pu, pu + G, pu + 2 * G);
        }
        free(scratch);
        #pragma omp for schedule(static)
        for (long rh = 0; rh < (long)R * Hkv; rh++) {
            long nb = head_first[rh + 1] - head_first[rh];
            if (!failed) join_blocks(part + head_first[rh] * G * (D + 2), nb, G, D, out + rh * G * D);
        }
    }
    free(units); free(head_first); free(part); free(firstseg);
    return failed ? -1 : 0;
}
