"""A decode step's one-token attention over bf16 keys and values, in C (CPU).

``engine/batch.py``'s :func:`~.batch.one_token_attention` converts each row's bf16 keys and
values to float32 and then multiplies: the copies and the second read made it most of a
decode step with 8 sessions on 2K-row caches (docs/BENCHMARKS.md, "The decode step"). The C
function here reads each key and value once, widens it in registers (AVX-512 where the CPU
has it, plain C the compiler vectorizes elsewhere) and accumulates in float32, as that
function and SDPA do, so its output is theirs up to float32 rounding order. One call runs
every one-token row of a layer.

Work is split into units of one row, one KV head and one block of :data:`BLOCK` keys, spread
over torch's own OpenMP threads (the library links ``libgomp.so.1``, which resolves to the
copy torch already loaded, so the model thread's team runs it: no second thread pool). A
head's blocks are joined in their order, so a row's result depends neither on the rows that
share the call nor on the thread count (tests/test_one_token_attention.py).

The source is compiled on first use (engine/cbuild.py). Without a compiler (or with
``KVSNAP_C_KERNELS=0``) :func:`kernel` is None and the torch path runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cbuild

MAX_GROUP = 16  # query heads per KV head (the C code's MAXG)
BLOCK = 256  # keys per unit of work (the C code's BLK)

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLK 256   /* a row's keys are cut into blocks of this many, each a work unit, joined in order */
#define MAXG 16   /* query heads per KV head */

static inline float widen(uint16_t x) { uint32_t u = ((uint32_t)x) << 16; float f; memcpy(&f, &u, 4); return f; }

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
            for (int d = 0; d < D; d++) acc += qg[d] * widen(kr[d]);
            sc[g * BLK + l] = acc * scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *p = sc + g * BLK, mx = -INFINITY, sum = 0.f;
        for (long l = 0; l < n; l++) mx = p[l] > mx ? p[l] : mx;
        #pragma omp simd reduction(+:sum)
        for (long l = 0; l < n; l++) { p[l] = expf(p[l] - mx); sum += p[l]; }
        m[g] = mx; s[g] = sum;
        float *og = o + g * D;
        for (int d = 0; d < D; d++) og[d] = 0.f;
        for (long l = 0; l < n; l++) {
            const uint16_t *vr = V + l * D;
            float w = p[l];
            #pragma omp simd
            for (int d = 0; d < D; d++) og[d] += w * widen(vr[d]);
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
    for (int g = 0; g < G; g++) {
        float *p = sc + g * BLK, mx = -INFINITY, sum = 0.f;
        for (long l = 0; l < n; l++) mx = p[l] > mx ? p[l] : mx;
        #pragma omp simd reduction(+:sum)
        for (long l = 0; l < n; l++) { p[l] = expf(p[l] - mx); sum += p[l]; }
        m[g] = mx; s[g] = sum;
    }
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

/* R rows of one token each. Row r: query q + r*H*D (float32, [H, D]); keys / values [Hkv, L[r], D]
   bf16 with head strides khs[r] / vhs[r] and rows of D contiguous values; out + r*H*D
   (float32). Query head h*G + g reads KV head h (grouped-query attention). Each (row, KV head,
   block of BLK keys) is one unit of work on one thread; the blocks of a head are joined in
   their order, so a row's result depends neither on the other rows nor on the thread count.
   Returns 0, or -1 when out of memory. */
int one_token_rows(int R, const float *q, const uint16_t **k, const uint16_t **v, const long *L,
                   const long *khs, const long *vhs, int H, int Hkv, int D, float scale,
                   float *out, int threads) {
    int G = H / Hkv;
    long *first = malloc(sizeof(long) * (R + 1));  /* the first unit of each row */
    if (!first) return -1;
    first[0] = 0;
    for (int r = 0; r < R; r++) first[r + 1] = first[r] + (long)Hkv * ((L[r] + BLK - 1) / BLK);
    long units = first[R];
    float *part = malloc(sizeof(float) * units * G * (D + 2));  /* per unit: m[G], s[G], o[G][D] */
    if (!part) { free(first); return -1; }
    #pragma omp parallel num_threads(threads)
    {
        float sc[MAXG * BLK];
        int r = 0;
        #pragma omp for schedule(static)
        for (long u = 0; u < units; u++) {
            while (first[r + 1] <= u) r++;
            while (first[r] > u) r--;
            long local = u - first[r], nb = (L[r] + BLK - 1) / BLK;
            int h = (int)(local / nb);
            long b = local % nb, l0 = b * BLK, n = L[r] - l0 < BLK ? L[r] - l0 : BLK;
            float *pu = part + u * G * (D + 2);
            block(q + ((long)r * H + h * G) * D, k[r] + h * khs[r] + l0 * D, v[r] + h * vhs[r] + l0 * D,
                  n, G, D, scale, sc, pu, pu + G, pu + 2 * G);
        }
        #pragma omp for schedule(static)
        for (long rh = 0; rh < (long)R * Hkv; rh++) {
            int rr = (int)(rh / Hkv), h = (int)(rh % Hkv);
            long nb = (L[rr] + BLK - 1) / BLK;
            const float *p0 = part + (first[rr] + h * nb) * G * (D + 2);
            for (int g = 0; g < G; g++) {
                float mx = -INFINITY, sum = 0.f;
                for (long b = 0; b < nb; b++) { float mb = p0[b * G * (D + 2) + g]; mx = mb > mx ? mb : mx; }
                float *o = out + ((long)rr * H + h * G + g) * D;
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
    }
    free(part);
    free(first);
    return 0;
}

/* R one-token rows' new keys and values into their sessions' buffers: row r's KV head h is
   the D values at ks + h*hk + cols[r]*tk (vs + h*hv + cols[r]*tv), written to kd[r] + h*khs[r]
   (vd[r] + h*vhs[r]). Plain copies: a row's bits are the projection's. */
void append_rows(int R, int Hkv, int D, const uint16_t *ks, long hk, long tk, const uint16_t *vs, long hv,
                 long tv, const long *cols, uint16_t **kd, uint16_t **vd, const long *khs, const long *vhs) {
    for (int r = 0; r < R; r++)
        for (int h = 0; h < Hkv; h++) {
            memcpy(kd[r] + h * khs[r], ks + h * hk + cols[r] * tk, sizeof(uint16_t) * D);
            memcpy(vd[r] + h * vhs[r], vs + h * hv + cols[r] * tv, sizeof(uint16_t) * D);
        }
}
"""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (engine/cbuild.py: no compiler, a failed build, or
    ``KVSNAP_C_KERNELS=0``)."""
    lib = cbuild.build("one_token", SOURCE)
    if lib is not None:
        fn = lib.one_token_rows
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.argtypes += [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        lib.append_rows.restype = None
        lib.append_rows.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] * 2
        lib.append_rows.argtypes += [ctypes.c_void_p] * 5
    return lib


def fits(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes this row: bf16 on a CPU, at most :data:`MAX_GROUP` query heads a
    KV head, rows of contiguous values."""
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype == torch.bfloat16
        and query.shape[1] // keys.shape[1] <= MAX_GROUP
        and all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == dim for t in (keys, values))
    )


def one_token_rows(queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """Attention of one token per row over all its rows (no mask): queries ``[1, H, 1, D]``,
    keys / values ``[1, H_kv, L, D]`` (each :func:`fits`) -> per row ``[1, 1, H, D]`` bf16."""
    heads, dim = queries[0].shape[1], queries[0].shape[-1]
    q = torch.cat([x.reshape(heads, dim) for x in queries])  # [R * H, D]
    pairs = zip(keys, values, strict=True)
    rows = [(k.data_ptr(), v.data_ptr(), k.shape[-2], k.stride(1), v.stride(1)) for k, v in pairs]
    out = attend(q, rows, keys[0].shape[1], scale)
    return list(out.view(len(queries), 1, 1, heads, dim).unbind(0))


def attend(queries: torch.Tensor, rows: list[tuple], kv_heads: int, scale: float) -> torch.Tensor:
    """The kernel on raw rows: ``queries`` ``[R * H, D]`` (R rows of H heads); per row its keys'
    and values' addresses, length and head strides (elements), bf16 rows of D contiguous
    values. Returns ``[R * H, D]`` bf16."""
    heads_total, dim = queries.shape
    n = len(rows)
    q = queries.float().contiguous()
    out = torch.empty(heads_total, dim)
    ptrs = ctypes.c_void_p * n
    longs = ctypes.c_long * n
    k_ptr, v_ptr, lengths, k_strides, v_strides = zip(*rows, strict=True)
    failed = kernel().one_token_rows(
        n,
        q.data_ptr(),
        ptrs(*k_ptr),
        ptrs(*v_ptr),
        longs(*lengths),
        longs(*k_strides),
        longs(*v_strides),
        heads_total // n,
        kv_heads,
        dim,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),  # the calling thread's team (the model thread's: engine/threads.py)
    )
    if failed:
        raise MemoryError("the attention kernel could not allocate its work space")
    return out.to(torch.bfloat16)
