"""A decode step's products on AMX tiles: a few rows against a bf16 weight, at memory speed.

A decode step multiplies 1-16 rows by every projection of the model and by the LM head: 212 MB
of SmolLM2 projections and 57 MB of head a step (Gemma 3's head alone is 335 MB), each read
once. oneDNN (engine/packed.py; ``F.linear`` for the head, which also reorders the weight on
every call) ran those products at 8-12 GB/s on this project's machine, where the weights stream
from memory at up to about 18 GB/s.

Here a product reads the weight as it is (``[N, K]``, row-major: no second copy) with the roles
of the tile product swapped: 16 of the weight's rows are one tile, the step's rows (at most
16, packed once per call into bf16 pairs) the other, and each thread takes whole groups of 64
outputs, adding, for every 32 inputs, four tile products into four float32 accumulators,
prefetching the weight rows two steps ahead. The accumulators are rounded to bf16 once at the
end (``TDPBF16PS``, then ``VCVTNEPS2BF16``).

Every output is summed over the inputs in order, in one accumulator, by the instruction oneDNN's
AMX kernels use for the same products, so the results are oneDNN's bit for bit at these row
counts (tests/test_amx_linear.py checks every count from 1 to :data:`MAX_ROWS` on both embedded
models' shapes); no exactness invariant moves, and a row's result depends neither on the rows
beside it nor on the thread count. Larger products (a prompt chunk) stay with oneDNN.

Built on first use (engine/cbuild.py) where the CPU has AMX and Linux grants the tiles' state
(as engine/chunk_kernel.py); elsewhere :func:`kernel` is None and oneDNN runs every product.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cbuild

MAX_ROWS = 16  # the step's rows are one tile's columns (16 x 4 bytes): up to 16 sessions
COLUMNS = 64  # outputs a unit of work (four tiles of 16 weight rows)
DEPTH = 32  # inputs a tile product (16 pairs of bf16)
MAX_WEIGHTS = 8  # weights one call of :func:`linears` takes

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>

#define AHEAD 2  /* weight blocks prefetched ahead (1.3-1.5x here); a prefetch past the end is harmless */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

int amx_linear_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) ? -1 : 0; }

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
"""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None: no AMX, no permission for its state, or no build."""
    if "amx_bf16" not in cbuild.cpu_flags().split():
        return None
    lib = cbuild.build("amx_linear", SOURCE)
    if lib is None or lib.amx_linear_init() != 0:
        return None
    lib.amx_linear.restype = ctypes.c_int
    lib.amx_linear.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int]
    lib.amx_linear.argtypes += [ctypes.c_void_p] * 3
    return lib


def takes(weight: torch.Tensor) -> bool:
    """A contiguous bf16 CPU weight ``[N, K]`` of the kernel's shapes, on a CPU where it built.

    Not rows a multiple of 4 KiB long: a tile's 16 rows, 4 KiB apart, fall in one set of the L1
    cache, and the 64 rows a unit reads evict each other's prefetched lines (Gemma 3's down
    projection, 2,048 inputs: 0.78x oneDNN's speed, where every other shape gains 1.05-1.6x)."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and out_features % COLUMNS == 0
        and in_features % DEPTH == 0
        and (in_features * 2) % 4096 != 0
        and kernel() is not None
    )


def fits(x: torch.Tensor) -> bool:
    """Rows the kernel takes: 1 to :data:`MAX_ROWS` of them, contiguous bf16."""
    return x.dtype == torch.bfloat16 and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and x.is_contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[..., K]`` that :func:`fits`, ``weight`` that the kernel
    :func:`takes`."""
    return linears(x, [weight])[0]


def linears(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x @ w.T`` for each of up to :data:`MAX_WEIGHTS` weights of ``x``'s width (a layer's
    query, key and value projections; its gate and up projections), in one pass: one call, one
    parallel region over all their groups of outputs (the small ones no longer leave a thread
    idle), each output the bits :func:`linear` gives it alone."""
    if not 0 < len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{len(weights)} weights: one pass takes 1 to {MAX_WEIGHTS}")
    in_features = x.shape[-1]
    outs = [torch.empty(*x.shape[:-1], w.shape[0], dtype=torch.bfloat16) for w in weights]
    count = len(weights)
    pointers = ctypes.c_void_p * count
    done = kernel().amx_linear(
        x.data_ptr(), x.numel() // in_features, in_features, count,
        pointers(*(w.data_ptr() for w in weights)), (ctypes.c_long * count)(*(w.shape[0] for w in weights)),
        pointers(*(y.data_ptr() for y in outs)),
    )  # fmt: skip
    if done != 0:
        raise MemoryError("the AMX product's scratch could not be allocated")
    return outs
