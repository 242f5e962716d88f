/* The prompt-chunk kernel's pieces (chunk_attention.c; snapkv_votes.c reuses them): flash attention
   over bf16 keys and values, its two matrix products on AMX tiles (the amx variant) or in AVX-512
   BF16 vector registers (the avx512bf16 variant, for CPUs without tiles such as AMD's Zen 4).

   Both builds share everything but the products: the keys and values are repacked once per call
   into the tiles' pair-interleaved layout (a 64-byte row of a key tile holds one dim pair of 16
   keys; of a value tile, one key pair of 16 dims), and a unit (one query head, 16 queries) walks
   its rows in blocks of 256 keys with a running softmax in float32. The tiles multiply a 16 x 32
   operand at a time; the vector build multiplies one such row by one query's pair broadcast
   (vdpbf16ps: 16 float32 sums of bf16 pairs an instruction), 16 accumulators in registers. The
   repack reads each row where it lies (rows_t): a session's first rows may be a shared prefix's,
   in its blocks, the rest in the session's buffer; the packed rows, and the results, are the same
   either way. Included only where KVSNAP_BF16_VECTORS (kvsnap.h). */
#ifndef KVSNAP_CHUNK_BLOCKS_H
#define KVSNAP_CHUNK_BLOCKS_H

#include <immintrin.h>

#include "kvsnap.h"

#define TILES KVSNAP_TILES

#define QB 16     /* queries a unit: a tile's rows */
#define KB 256    /* keys a block: one running-softmax update per query */
#define MAXD 256
#define NEG (-1e30f)  /* a hidden score (-ffast-math assumes no infinities) */

typedef uint32_t __attribute__((may_alias)) word;   /* two bf16 read as one: a pair */

#if TILES
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

static __attribute__((unused)) void tiles_on(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }   /* every tile 16 x 64 bytes */
    _tile_loadconfig(&c);
}

static __attribute__((unused)) void tiles_off(void) { _tile_release(); }

/* Scores of 16 queries (qbuf: rows of D bf16) against `groups` groups of 16 packed keys (kb:
   the block's first group): s[r * KB + key], two accumulator tiles in turn. */
static __attribute__((unused)) void scores(const uint16_t *qbuf, int D, const uint16_t *kb, int groups, int rows, float *s) {
    const int DC = D / 32;
    (void)rows;
    for (int g = 0; g < groups; g += 2) {
        const uint16_t *k1 = kb + g * DC * 512, *k2 = k1 + DC * 512;
        _tile_zero(0);
        if (g + 1 < groups) _tile_zero(1);
        for (int dc = 0; dc < DC; dc++) {
            _tile_loadd(2, qbuf + dc * 32, 2 * D);
            _tile_loadd(4, k1 + dc * 512, 64);
            _tile_dpbf16ps(0, 2, 4);
            if (g + 1 < groups) { _tile_loadd(5, k2 + dc * 512, 64); _tile_dpbf16ps(1, 2, 5); }
        }
        _tile_stored(0, s + g * 16, 4 * KB);
        if (g + 1 < groups) _tile_stored(1, s + g * 16 + 16, 4 * KB);
    }
}

/* acc[r * D + d] += sum over the block's keys of p[r * KB + key] * value[key][d]: 16 dims a tile,
   two accumulators in turn, added to acc (vb: the block's first pair group of packed values). */
static __attribute__((unused)) void weigh(const uint16_t *p, const uint16_t *vb, int pairs, int D, int rows, float *acc) {
    const int NG = D / 16;
    __attribute__((aligned(64))) float pv[2][QB * 16];
    for (int n = 0; n < NG; n += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int pg = 0; pg < pairs; pg++) {
            const uint16_t *v1 = vb + (pg * NG + n) * 512;
            _tile_loadd(3, p + 32 * pg, 2 * KB);
            _tile_loadd(4, v1, 64);
            _tile_dpbf16ps(0, 3, 4);
            _tile_loadd(5, v1 + 512, 64);
            _tile_dpbf16ps(1, 3, 5);
        }
        _tile_stored(0, pv[0], 64);
        _tile_stored(1, pv[1], 64);
        for (int r = 0; r < rows; r++)
            for (int x = 0; x < 2; x++) {
                float *ar = acc + r * D + (n + x) * 16;
                _mm512_store_ps(ar, _mm512_add_ps(_mm512_load_ps(ar), _mm512_load_ps(pv[x] + r * 16)));
            }
    }
}
#else
static __attribute__((unused)) void tiles_on(void) {}
static __attribute__((unused)) void tiles_off(void) {}

/* The same two products with AVX-512 BF16 (vdpbf16ps: 16 float32 sums of bf16 pairs an
   instruction), for CPUs without tiles. The packed layouts are the tiles' own: a 64-byte row of a
   key tile holds one dim pair of 16 keys, a row of a value tile one key pair of 16 dims; the other
   operand is one query's dim pair (or weight pair) broadcast. */
static __attribute__((unused)) void scores(const uint16_t *qbuf, int D, const uint16_t *kb, int groups, int rows, float *s) {
    const int DC = D / 32;
    const word *qw = (const word *)qbuf;   /* a query's dim pairs */
    for (int g = 0; g < groups; g += 2) {
        const uint16_t *k1 = kb + g * DC * 512, *k2 = k1 + DC * 512;   /* a pair group: both packed */
        for (int r0 = 0; r0 < rows; r0 += 8) {   /* 8 queries x 32 keys: 16 accumulators */
            __m512 a[8][2];
            for (int i = 0; i < 8; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
            for (int dc = 0; dc < DC; dc++)
                for (int pr = 0; pr < 16; pr++) {
                    __m512bh x = (__m512bh)_mm512_load_si512(k1 + dc * 512 + pr * 32);
                    __m512bh y = (__m512bh)_mm512_load_si512(k2 + dc * 512 + pr * 32);
                    const word *w = qw + r0 * (D / 2) + dc * 16 + pr;
                    for (int i = 0; i < 8; i++) {
                        __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[i * (D / 2)]);
                        a[i][0] = _mm512_dpbf16_ps(a[i][0], x, b);
                        a[i][1] = _mm512_dpbf16_ps(a[i][1], y, b);
                    }
                }
            for (int i = 0; i < 8; i++) {
                _mm512_store_ps(s + (r0 + i) * KB + g * 16, a[i][0]);
                if (g + 1 < groups) _mm512_store_ps(s + (r0 + i) * KB + g * 16 + 16, a[i][1]);
            }
        }
    }
}

/* NN (2 or 4) groups of 16 dims of 4 queries: 4 x NN accumulators, kept in registers over the
   block's key pairs, started from and written back to acc. */
static inline __attribute__((always_inline)) void weigh_dims(const word *pw, const uint16_t *vb, int pairs,
                                                             int NG, int n0, int NN, int D, int r0, float *acc) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < NN; j++) a[i][j] = _mm512_load_ps(acc + (r0 + i) * D + (n0 + j) * 16);
    for (int pg = 0; pg < pairs; pg++)
        for (int kp = 0; kp < 16; kp++) {
            __m512bh v[4];
            for (int j = 0; j < NN; j++) v[j] = (__m512bh)_mm512_load_si512(vb + ((pg * NG + n0 + j) * 16 + kp) * 32);
            for (int i = 0; i < 4; i++) {
                __m512bh b = (__m512bh)_mm512_set1_epi32((int)pw[(r0 + i) * (KB / 2) + pg * 16 + kp]);
                for (int j = 0; j < NN; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], v[j], b);
            }
        }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < NN; j++) _mm512_store_ps(acc + (r0 + i) * D + (n0 + j) * 16, a[i][j]);
}

static __attribute__((unused)) void weigh(const uint16_t *p, const uint16_t *vb, int pairs, int D, int rows, float *acc) {
    const int NG = D / 16;   /* even: D is a multiple of 32 */
    const word *pw = (const word *)p;   /* a query's weights, a key pair a word */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        int n0 = 0;
        for (; n0 + 4 <= NG; n0 += 4) weigh_dims(pw, vb, pairs, NG, n0, 4, D, r0, acc);
        if (n0 < NG) weigh_dims(pw, vb, pairs, NG, n0, 2, D, r0, acc);
    }
}
#endif

/* 2^x for 16 floats: 2^n * p(r), x = n + r, |r| <= 1/2, p the degree-5 Taylor polynomial of
   2^r = e^(r ln 2) (relative error under 3e-6, far below a bf16 weight's rounding); 0 below -126
   (where 2^x leaves the normal floats), so a hidden score (NEG) weighs exactly 0. Scores are
   taken to base 2 with the softmax's scale in one product, so no exp needs its own. */
static inline __m512 exp2_512(__m512 x) {
    __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);                     /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));     /* ln2^4 / 4! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));     /* ln2^3 / 3! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));     /* ln2^2 / 2! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));     /* ln2 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(normal, p, n);
}


/* Where a part's rows lie (a layer's keys or values, [Hkv] heads of rows of D): the first `shared`
   in a shared prefix's blocks of `bs` rows (block b's part at blocks[b], its heads bs * D values
   apart), the rest in the session's own buffer `own` (heads `hs` values apart). shared 0: all own. */
typedef struct { const uint16_t *own; long hs; const long *blocks; long shared, bs; } rows_t;

static inline const uint16_t *row_at(const rows_t *s, long h, long row, int D) {
    if (row < s->shared) return (const uint16_t *)s->blocks[row / s->bs] + (h * s->bs + row % s->bs) * D;
    return s->own + h * s->hs + (row - s->shared) * D;
}

/* Repack one KV head's keys and values (rows of D bf16, L of them) for the tiles, zero past L.
   Keys, per 16 keys (group) and 32 dims: a tile [16 dim pairs][16 keys][2], the keys' transpose
   with pairs of dims kept together (the B operand of queries x keys). Values, per 32 keys and 16
   dims: a tile [16 key pairs][16 dims][2] (the B operand of weights x values). Both 16 x 64 bytes. */
static __attribute__((unused)) void repack_keys(const rows_t *K, long h, long L, int D, long group, uint16_t *kp) {
    const uint16_t *src[16];
    for (int key = 0; key < 16; key++) src[key] = group * 16 + key < L ? row_at(K, h, group * 16 + key, D) : 0;
    for (int dc = 0; dc < D / 32; dc++) {
        __m512i r[16], t[16], u[16];
        for (int key = 0; key < 16; key++)   /* row key: its 32 dims as 16 words (pairs of dims) */
            r[key] = src[key] ? _mm512_loadu_si512(src[key] + dc * 32) : _mm512_setzero_si512();
        /* a 16 x 16 transpose of the words: word pr of every key, in a row per pr */
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {
            u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        for (int i = 0; i < 16; i += 8)
            for (int j = 0; j < 4; j++) {
                t[i + j] = _mm512_shuffle_i32x4(u[i + j], u[i + j + 4], 0x88);
                t[i + j + 4] = _mm512_shuffle_i32x4(u[i + j], u[i + j + 4], 0xdd);
            }
        uint16_t *dst = kp + (group * (D / 32) + dc) * 512;
        for (int j = 0; j < 8; j++) {
            _mm512_store_si512(dst + j * 32, _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88));
            _mm512_store_si512(dst + (j + 8) * 32, _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd));
        }
    }
}

static __attribute__((unused)) void repack_values(const rows_t *V, long h, long L, int D, long pair_group, uint16_t *vp) {
    const uint16_t *src[32];
    for (int key = 0; key < 32; key++)
        src[key] = pair_group * 32 + key < L ? row_at(V, h, pair_group * 32 + key, D) : 0;
    for (int n = 0; n < D / 16; n++) {
        uint16_t *t = vp + (pair_group * (D / 16) + n) * 512;
        for (int kp = 0; kp < 16; kp++) {   /* word d of a key pair: (V[2kp][d], V[2kp + 1][d]) */
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            if (src[2 * kp]) a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src[2 * kp] + n * 16)));
            if (src[2 * kp + 1])
                b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src[2 * kp + 1] + n * 16)));
            _mm512_store_si512(t + kp * 32, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* One unit: query head h's queries t0 .. t0 + rows - 1 (of T) against the packed rows of its KV head. */
static __attribute__((unused)) void unit(const uint16_t *q, long qsh, long qst, int h, long t0, int rows, long T, long L, int D, int window,
                 float scale, const uint16_t *kp, const uint16_t *vp, uint16_t *out, int H) {
    __attribute__((aligned(64))) uint16_t qbuf[QB * MAXD], p[QB * KB];
    __attribute__((aligned(64))) float s[QB * KB], acc[QB * MAXD];
    float m[QB], l[QB];
    const int DC = D / 32, NG = D / 16;
    memset(qbuf, 0, sizeof(uint16_t) * QB * D);
    for (int r = 0; r < rows; r++) memcpy(qbuf + r * D, q + h * qsh + (t0 + r) * qst, 2 * D);
    memset(acc, 0, sizeof(float) * QB * D);
    for (int r = 0; r < QB; r++) { m[r] = NEG; l[r] = 0.f; }
    const long first = L - T + t0, last = first + rows - 1;   /* the unit's first and last query's row */
    const long lo = window > 0 && first - window + 1 > 0 ? (first - window + 1) / KB : 0;
    for (long k0 = lo * KB; k0 <= last; k0 += KB) {
        long end = last + 1 < k0 + KB ? last + 1 : k0 + KB;   /* keys past the last query's row: unseen */
        int groups = (int)((end - k0 + 15) / 16), pairs = (groups + 1) / 2;
        scores(qbuf, D, kp + (k0 / 16) * DC * 512, groups, rows, s);
        /* running softmax: a hidden key (past the query's row, the padding past L in the last
           group, or before its window) weighs 0; a block needs the per-key test where any key its
           groups score lies past the unit's first query or before the last query's window */
        int edge = k0 + 16 * groups - 1 > first || (window > 0 && k0 <= last - window);
        const __m512 base2 = _mm512_set1_ps(scale * 1.44269504f);   /* a score to base 2, scaled */
        for (int r = 0; r < QB; r++) {
            float *sr = s + r * KB;
            uint16_t *pr = p + r * KB;
            if (r >= rows) { memset(pr, 0, 2 * 32 * pairs); continue; }
            int pos = (int)(first + r), from = window > 0 ? pos - window : -1;
            __m512 best = _mm512_set1_ps(NEG);
            const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int c = 0; c < groups; c++) {
                __m512 x = _mm512_load_ps(sr + 16 * c);
                if (edge) {
                    __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int)k0 + 16 * c), iota);
                    __mmask16 seen = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos)) &
                                     _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(from));
                    x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(NEG), x);
                    _mm512_store_ps(sr + 16 * c, x);
                }
                best = _mm512_max_ps(best, x);
            }
            float top = _mm512_reduce_max_ps(best);
            if (top == NEG) { memset(pr, 0, 2 * 32 * pairs); continue; }
            float top2 = top * scale * 1.44269504f, mx = m[r] > top2 ? m[r] : top2;   /* base 2 */
            float alpha = _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(m[r] - mx)));
            __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(mx);
            for (int c = 0; c < 2 * pairs; c += 2) {
                __m512 e0 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(sr + 16 * c), base2, shift));
                __m512 e1 = _mm512_setzero_ps();   /* an odd last group: its pair's second half weighs 0 */
                if (c + 1 < groups) e1 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(sr + 16 * c + 16), base2, shift));
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                _mm512_storeu_si512(pr + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
            m[r] = mx;
            if (alpha != 1.f) {
                float *ar = acc + r * D;
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(ar + d, _mm512_mul_ps(_mm512_load_ps(ar + d), _mm512_set1_ps(alpha)));
            }
        }
        weigh(p, vp + (k0 / 32) * NG * 512, pairs, D, rows, acc);
    }
    for (int r = 0; r < rows; r++) {
        float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        uint16_t *o = out + ((t0 + r) * (long)H + h) * D;
        for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[r * D + d] * inv);
    }
}

#endif
