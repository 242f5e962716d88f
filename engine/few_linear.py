"""A decode step's products with AVX-512 BF16 vectors: a few rows against a bf16 weight.

Without AMX (engine/amx_linear.py), a decode step's products ran on oneDNN: SmolLM2's 30 layers
of 8-row products took 13-14 ms here (an AMD EPYC, Zen 4), 15-16 GB/s of the 212 MB of weights,
where this machine's two cores read memory at about 30 GB/s.

Here each weight is repacked once (:func:`repack`: ``[N / 16, K / 2, 16, 2]``, each 64-byte line
16 outputs' pair of inputs, the layout ``VDPBF16PS`` multiplies) and a product streams it once:
each thread takes whole units of 32 outputs, holds their sums for up to 8 rows in registers
(16 float32 vectors), and for each pair of inputs adds both weight lines times each row's pair
(broadcast), prefetching the weight 16 lines ahead; rows past 8 take the unit again, from the
cache. Every output is one float32 sum over the inputs in order, pair by pair, rounded to bf16
once at the end, so a row's result depends neither on the rows beside it, nor on how many
there are, nor on the thread count (tests/test_few_linear.py). 8-row products of SmolLM2's
shapes: 9.4 against oneDNN's 13.5 ms (1.44x), one row 1.75x (docs/BENCHMARKS.md).

They are not oneDNN's bits (its sums are in another order: a bf16 output differs in a few
elements in ten thousand), so engine/packed.py gives this kernel a step's single-token rows
only, whatever else the step carries, and oneDNN the prompt chunks: a row's products then
depend on the row alone. The repacked copy is extra memory (one more copy of every weight it
takes: SmolLM2's projections, 212 MB).

Built on first use (engine/cbuild.py) where the CPU has AVX-512 BF16 and no AMX (AMX machines
keep engine/amx_linear.py, which gives oneDNN's bits); elsewhere :func:`kernel` is None.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import amx_linear, cbuild

UNIT = 32  # outputs a unit of work (two vectors of 16)
MAX_WEIGHTS = 8  # weights one call takes

SOURCE = r"""
#include <stdint.h>
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
"""


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None: no AVX-512 BF16, an AMX CPU (its tiles give oneDNN's bits),
    or no build."""
    flags = cbuild.cpu_flags().split()
    if "avx512_bf16" not in flags or amx_linear.kernel() is not None:
        return None
    lib = cbuild.build("few_linear", SOURCE)
    if lib is not None:
        lib.few_linear.restype = None
        lib.few_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
        lib.few_linear.argtypes += [ctypes.c_void_p] * 3
    return lib


def takes(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight ``[N, K]`` of the kernel's shapes (N a multiple of :data:`UNIT`, K even),
    on a CPU where it built."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    out_features, in_features = weight.shape
    return out_features % UNIT == 0 and in_features % 2 == 0 and kernel() is not None


def repack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as the kernel reads it: ``[N / 16, K / 2, 16, 2]``, contiguous."""
    out_features, in_features = weight.shape
    return weight.detach().reshape(out_features // 16, 16, in_features // 2, 2).transpose(1, 2).contiguous()


def linears(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x @ w.T`` for each of up to :data:`MAX_WEIGHTS` :func:`repack`-ed weights of ``x``'s
    width (``x`` ``[..., K]`` bf16, any number of rows), in one call: ``[..., N]`` each."""
    if not 0 < len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{len(weights)} weights: one call takes 1 to {MAX_WEIGHTS}")
    x = x.contiguous()
    in_features = x.shape[-1]
    widths = [w.shape[0] * 16 for w in weights]
    outs = [torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16) for n in widths]
    count = len(weights)
    pointers = ctypes.c_void_p * count
    kernel().few_linear(
        x.data_ptr(), x.numel() // in_features, in_features, count,
        pointers(*(w.data_ptr() for w in weights)), (ctypes.c_long * count)(*widths),
        pointers(*(y.data_ptr() for y in outs)),
    )  # fmt: skip
    return outs
