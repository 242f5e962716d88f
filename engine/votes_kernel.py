"""SnapKV's votes over bf16 keys, in C: the observation window's attention over a layer's rows,
summed over the window's queries, without the float32 copies and the ``[H, w, L]`` attention
torch's path (``policies/base.py`` ``window_attention``) makes.

A prompt's compression scores every row of every full-attention layer with the queries of its
last ``w`` tokens: for each query head, each window query's softmax over the rows it sees,
summed over the window (SnapKV's votes, before pooling). In torch that is a float32 copy of the
keys, a float32 product and a softmax over ``[H, w, L]``; on SmolLM2's 30 layers and a 2.4K-token
prompt it was ~75 ms of a later chat's compression here, most of the compression. This is the
same sum in one pass per (query head, 16 window queries): the scores by the prompt-chunk
kernel's products (engine/chunk_source.py: bf16 pairs summed in float32, AMX tiles or AVX-512
BF16 vectors), each query's softmax in float32 (to base 2, as that kernel's), added to the
head's votes for the rows before the window. The products of bf16 values are exact in float32
either way; the sums run in another order than torch's, so votes differ from its within float32
rounding (tests/test_votes_kernel.py), and a selection can differ only where two rows' scores
tie to that rounding.

Units run on torch's own OpenMP threads (engine/kernels.py); each unit writes its own votes,
joined in a fixed order after, so the result depends neither on the thread count nor on timing.
Without a compiler or the CPU flags, or with ``KVSNAP_C_KERNELS=0``, :func:`library` is None,
:func:`takes` says no and torch's path runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cbuild, chunk_kernel
from .chunk_source import SOURCE as CHUNK_SOURCE

VOTES = r"""
/* SnapKV's votes: query head h's window query i sits at row L - w + i and sees rows up to it;
   votes[h * (L - w) + j] = sum over i of its softmax weight on row j (j < L - w). q: [H] x [w]
   rows of D bf16 at strides qsh / qst; k: [Hkv] x [L] rows of D, the first `shared` in blocks of bs
   rows (kb: a block's part each), the rest at k with head stride ks (rows_t). */
int window_votes(const uint16_t *q, long qsh, long qst, const uint16_t *k, long ks, const long *kb, long shared,
                 long bs, long L, int H, int Hkv, int D, int w, float scale, float *votes, int threads) {
    const rows_t K = {k, ks, kb, shared, bs};
    const long pair_groups = (L + 31) / 32, per_head = pair_groups * 32 * (long)D, Lp = pair_groups * 32;
    const long P = L - w, nqb = (w + QB - 1) / QB, units = nqb * H;
    const int DC = D / 32;
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * (per_head * Hkv + KB * D));
    float *part = aligned_alloc(64, sizeof(float) * (units * P + 16));
    if (!kp || !part) { free(kp); free(part); return 1; }
    const float base2 = scale * 1.44269504f;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long b = 0; b < Hkv * pair_groups; b++) {
            long g = b / pair_groups, pg = b % pair_groups;
            repack_keys(&K, g, L, D, 2 * pg, kp + g * per_head);
            repack_keys(&K, g, L, D, 2 * pg + 1, kp + g * per_head);
        }
        tiles_on();
        __attribute__((aligned(64))) uint16_t qbuf[QB * MAXD];
        __attribute__((aligned(64))) float s[QB * KB];
        float *x = aligned_alloc(64, sizeof(float) * QB * (Lp + KB));   /* a unit's queries' scores, per thread */
        if (!x) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic)
        for (long u = 0; u < units; u++) {
            if (!x) continue;   /* every thread takes part in the loop; this one has no room to work */
            const int h = (int)(u % H);
            const long i0 = (u / H) * QB;
            const int rows = w - i0 < QB ? (int)(w - i0) : QB;
            const uint16_t *kh = kp + (h / (H / Hkv)) * per_head;
            memset(qbuf, 0, sizeof(uint16_t) * QB * D);
            for (int r = 0; r < rows; r++) memcpy(qbuf + r * D, q + h * qsh + (i0 + r) * qst, 2 * D);
            const long last = L - w + i0 + rows - 1;   /* the unit's last query's row: no key past it */
            long seen = 0;
            for (long k0 = 0; k0 <= last; k0 += KB) {
                long end = last + 1 < k0 + KB ? last + 1 : k0 + KB;
                int groups = (int)((end - k0 + 15) / 16);
                scores(qbuf, D, kh + (k0 / 16) * DC * 512, groups, rows, s);
                for (int r = 0; r < rows; r++)
                    memcpy(x + r * (Lp + KB) + k0, s + r * KB, sizeof(float) * 16 * groups);
                seen = k0 + 16 * groups;
            }
            float *mine = part + u * P;
            memset(mine, 0, sizeof(float) * P);
            for (int r = 0; r < rows; r++) {
                float *xr = x + r * (Lp + KB);
                const long pos = L - w + i0 + r;   /* this query's row: it sees 0 .. pos */
                for (long j = pos + 1; j < seen; j++) xr[j] = NEG;
                __m512 best = _mm512_set1_ps(NEG);
                for (long j = 0; j < seen; j += 16) best = _mm512_max_ps(best, _mm512_load_ps(xr + j));
                const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(best) * base2), b2 = _mm512_set1_ps(base2);
                __m512 sum = _mm512_setzero_ps();
                for (long j = 0; j < seen; j += 16) {
                    __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(xr + j), b2, shift));
                    _mm512_store_ps(xr + j, e);
                    sum = _mm512_add_ps(sum, e);
                }
                const float inv = 1.f / _mm512_reduce_add_ps(sum);
                for (long j = 0; j < P; j++) mine[j] += xr[j] * inv;
            }
        }
        free(x);
        tiles_off();
    }
    for (int h = 0; h < H; h++) {   /* each head's units in order: the same sums on any thread count */
        float *out = votes + (long)h * P;
        memcpy(out, part + (long)h * P, sizeof(float) * P);
        for (long b = 1; b < nqb; b++) {
            const float *add = part + (b * H + h) * P;
            for (long j = 0; j < P; j++) out[j] += add[j];
        }
    }
    free(kp);
    free(part);
    return failed;
}
"""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The build for this CPU (the prompt-chunk kernel's: tiles, else vectors), or None."""
    build = chunk_kernel.build()
    if build is None:
        return None
    source = f"#define TILES {int(build == 'tiles')}\n{CHUNK_SOURCE}\n{VOTES}"
    lib = cbuild.build(f"votes_{build}", source)
    if lib is None or lib.chunk_init() != 0:
        return None
    fn = lib.window_votes
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_long, ctypes.c_long, ctypes.c_long]
    fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int]
    return lib


def takes(window_queries: torch.Tensor, keys: torch.Tensor, shared: int = 0) -> bool:
    """Whether :func:`votes` takes these: bf16 on a CPU, one sequence, the chunk kernel's head dims,
    whole query heads a KV head, rows of contiguous dims, a window shorter than the rows (with
    ``shared`` rows before ``keys``)."""
    return (
        chunk_kernel.fits(window_queries, keys, keys)
        and keys.shape[2] + shared > window_queries.shape[2]
        and library() is not None
    )


def votes(window_queries: torch.Tensor, keys: torch.Tensor, scale: float, shared=None) -> torch.Tensor:
    """SnapKV's votes: ``[1, H, w, D]`` window queries over ``[1, H_kv, L, D]`` rows (the window
    the last ``w``) -> ``[1, H_kv, G, L - w]`` float32, each window query's causal softmax summed
    over the window, for the rows before it (:func:`takes` them). ``shared``: rows before ``keys``
    that a shared prefix's blocks hold (engine/prefix_rows.py ``SharedRows``), counted in L."""
    _, heads, w, dim = window_queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    paged = (None, 0, 1)  # no shared rows: every row at keys
    if shared is not None:
        paged, length = (shared.keys.data_ptr(), shared.rows, shared.block), length + shared.rows
    out = torch.empty(heads, length - w, dtype=torch.float32)
    failed = library().window_votes(
        window_queries.data_ptr(),
        window_queries.stride(1),
        window_queries.stride(2),
        keys.data_ptr(),
        keys.stride(1),
        *paged,
        length,
        heads,
        kv_heads,
        dim,
        w,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the votes kernel could not allocate its work space")
    return out.view(1, kv_heads, heads // kv_heads, length - w)
