"""A prompt chunk's attention over bf16 keys and values on AMX tiles, in C (Intel CPUs with AMX).

torch's CPU SDPA ran a 2K bf16 prefill's second chunk at 200-360 GFLOP/s on this project's Intel
machine (two cores with AMX), where matrix products on the same cores reach about 420, and
attention was still about 40 % of SmolLM2's prefill and much of a later chat's first token on a
shared document (docs/BENCHMARKS.md, "A prompt chunk's attention on AMX tiles").

The function here is flash attention on AMX: for one query head and 16 of the chunk's queries (a
unit of work), it walks the session's rows in blocks of 256 keys, multiplies queries by keys on
the tiles (bf16 products summed in float32), keeps a running softmax in float32 (each row's
largest score and sum, updated once a block; scores go to base 2 with the scale in one product),
rounds the block's weights to bf16 and multiplies them by the values on the tiles again, as
torch's CPU flash kernel does (its weights go to bf16 for that product too). The mask is
implicit: query ``i`` of a chunk of ``T`` over ``L`` rows is row ``L - T + i`` and sees the rows
at or before it, within ``window`` of it on a sliding layer (:func:`.batch.mask`'s rule); blocks
nobody in a unit can see are skipped. Keys and values are first repacked, once per call, into
the pair-interleaved layout the tiles read.

Units run on torch's own OpenMP threads (see engine/kernels.py), each configuring its tiles and
releasing them when done. A query's result is computed by one unit, over its rows in order:
it depends neither on the other rows of the step nor on the thread count.

The source is compiled on first use (engine/cbuild.py) where the CPU has AMX (``amx_bf16`` in
its flags) and the process gets the kernel's permission for the tiles' state; elsewhere, or with
``KVSNAP_C_KERNELS=0``, :func:`kernel` is None and SDPA runs (engine/batch.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import cbuild

log = logging.getLogger(__name__)

MAX_DIM = 256  # head dims up to this, in multiples of 32 (the C code's MAXD)

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>

#define QB 16     /* queries a unit: a tile's rows */
#define KB 256    /* keys a block: one running-softmax update per query */
#define MAXD 256
#define NEG (-1e30f)  /* a hidden score (-ffast-math assumes no infinities) */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* Ask Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 0 when granted. */
int chunk_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) ? -1 : 0; }

static void tiles_on(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }   /* every tile 16 x 64 bytes */
    _tile_loadconfig(&c);
}

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

static inline uint16_t to_bf16(float f) {   /* round to nearest even, as torch's conversion */
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* Repack one KV head's keys and values (rows of D bf16, L of them) for the tiles, zero past L.
   Keys, per 16 keys (group) and 32 dims: a tile [16 dim pairs][16 keys][2], the keys' transpose
   with pairs of dims kept together (the B operand of queries x keys). Values, per 32 keys and 16
   dims: a tile [16 key pairs][16 dims][2] (the B operand of weights x values). Both 16 x 64 bytes. */
static void repack_keys(const uint16_t *K, long L, int D, long group, uint16_t *kp) {
    for (int dc = 0; dc < D / 32; dc++) {
        __m512i r[16], t[16], u[16];
        for (int key = 0; key < 16; key++) {   /* row key: its 32 dims as 16 words (pairs of dims) */
            long row = group * 16 + key;
            r[key] = row < L ? _mm512_loadu_si512(K + row * D + dc * 32) : _mm512_setzero_si512();
        }
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

static void repack_values(const uint16_t *V, long L, int D, long pair_group, uint16_t *vp) {
    for (int n = 0; n < D / 16; n++) {
        uint16_t *t = vp + (pair_group * (D / 16) + n) * 512;
        for (int kp = 0; kp < 16; kp++) {   /* word d of a key pair: (V[2kp][d], V[2kp + 1][d]) */
            long row = pair_group * 32 + 2 * kp;
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            const uint16_t *src = V + row * D + n * 16;
            if (row < L) a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
            if (row + 1 < L) b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + D)));
            _mm512_store_si512(t + kp * 32, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* One unit: query head h's queries t0 .. t0 + rows - 1 (of T) against the packed rows of its KV head. */
static void unit(const uint16_t *q, long qsh, long qst, int h, long t0, int rows, long T, long L, int D, int window,
                 float scale, const uint16_t *kp, const uint16_t *vp, uint16_t *out, int H) {
    __attribute__((aligned(64))) uint16_t qbuf[QB * MAXD], p[QB * KB];
    __attribute__((aligned(64))) float s[QB * KB], pv[2][QB * 16], acc[QB * MAXD];
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
        /* scores: 16 queries x 16 keys a tile, two accumulators in turn */
        for (int g = 0; g < groups; g += 2) {
            const uint16_t *k1 = kp + ((k0 / 16 + g) * DC) * 512, *k2 = k1 + DC * 512;
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
        /* weights x values: 16 dims a tile, two accumulators in turn, summed over the block's keys */
        for (int n = 0; n < NG; n += 2) {
            _tile_zero(0);
            _tile_zero(1);
            for (int pg = 0; pg < pairs; pg++) {
                const uint16_t *v1 = vp + ((k0 / 32 + pg) * NG + n) * 512;
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
    for (int r = 0; r < rows; r++) {
        float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        uint16_t *o = out + ((t0 + r) * (long)H + h) * D;
        for (int d = 0; d < D; d++) o[d] = to_bf16(acc[r * D + d] * inv);
    }
}

/* q: [H] x [T] rows of D bf16 at strides qsh / qst (elements); k / v: [Hkv] x [L] rows of D at head
   strides ks / vs; out: [T, H, D] bf16. window <= 0: no window. Returns nonzero without memory. */
int chunk_attention(const uint16_t *q, long qsh, long qst, const uint16_t *k, long ks, const uint16_t *v, long vs,
                    long T, long L, int H, int Hkv, int D, int window, float scale, uint16_t *out, int threads) {
    long pair_groups = (L + 31) / 32, per_head = pair_groups * 32 * (long)D;   /* padded to 32 keys */
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * (per_head * Hkv + KB * D));
    uint16_t *vp = aligned_alloc(64, sizeof(uint16_t) * (per_head * Hkv + KB * D));
    if (!kp || !vp) { free(kp); free(vp); return 1; }
    long nq = (T + QB - 1) / QB, units = nq * H;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long b = 0; b < Hkv * pair_groups; b++) {
            long g = b / pair_groups, pg = b % pair_groups;
            repack_keys(k + g * ks, L, D, 2 * pg, kp + g * per_head);
            repack_keys(k + g * ks, L, D, 2 * pg + 1, kp + g * per_head);
            repack_values(v + g * vs, L, D, pg, vp + g * per_head);
        }
        tiles_on();
        #pragma omp for schedule(dynamic)
        for (long u = 0; u < units; u++) {
            int h = (int)(u % H);
            long t0 = (u / H) * QB;
            int rows = T - t0 < QB ? (int)(T - t0) : QB;
            long g = h / (H / Hkv);
            unit(q, qsh, qst, h, t0, rows, T, L, D, window, scale, kp + g * per_head, vp + g * per_head, out, H);
        }
        _tile_release();
    }
    free(kp);
    free(vp);
    return 0;
}
"""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None: no AMX, no permission for its state, or no build
    (engine/cbuild.py)."""
    if "amx_bf16" not in cbuild.cpu_flags().split():
        return None
    lib = cbuild.build("chunk_amx", SOURCE)
    if lib is None:
        return None
    if lib.chunk_init() != 0:
        log.warning("Linux refused the AMX tile state: a prompt chunk's attention runs SDPA")
        return None
    fn = lib.chunk_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def fits(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes this row: bf16 on a CPU, a head dim that is a multiple of 32 up
    to :data:`MAX_DIM`, whole query heads a KV head, rows of contiguous dims."""
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype == torch.bfloat16
        and dim % 32 == 0
        and dim <= MAX_DIM
        and query.shape[1] % keys.shape[1] == 0
        and query.shape[0] == 1
        and query.stride(-1) == 1
        and all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == dim for t in (keys, values))
    )


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None):
    """A chunk's attention: query ``[1, H, T, D]``, the session's rows ``[1, H_kv, L, D]`` (the chunk's
    own last), causal and within ``window`` rows (None: no window) -> ``[1, T, H, D]`` bf16."""
    _, heads, count, dim = query.shape
    kv_heads, rows = keys.shape[1], keys.shape[2]
    out = torch.empty(1, count, heads, dim, dtype=torch.bfloat16)
    failed = kernel().chunk_attention(
        query.data_ptr(),
        query.stride(1),
        query.stride(2),
        keys.data_ptr(),
        keys.stride(1),
        values.data_ptr(),
        values.stride(1),
        count,
        rows,
        heads,
        kv_heads,
        dim,
        window or 0,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the chunk attention kernel could not allocate its work space")
    return out
