"""A decode step's products with AVX-512 BF16 vectors: a few rows against a bf16 weight.

Without AMX (cpu_kernels/linear_tiles.py), a decode step's products ran on oneDNN: SmolLM2's 30 layers
of 8-row products took 13-14 ms here (an AMD EPYC, Zen 4), 15-16 GB/s of the 212 MB of weights,
where this machine's two cores read memory at about 30 GB/s.

Here each weight is repacked once (:func:`repack`: ``[N / 16, K / 2, 16, 2]``, each 64-byte line
16 outputs' pair of inputs, the layout ``VDPBF16PS`` multiplies) and a product streams it once:
each thread takes whole units of 32 outputs, holds their sums for up to 8 rows in registers
(16 float32 vectors), and for each pair of inputs adds both weight lines times each row's pair
(broadcast), prefetching the weight 16 lines ahead; rows past 8 take the unit again, from the
cache. Every output is one float32 sum over the inputs in order, pair by pair, rounded to bf16
once at the end, so a row's result depends neither on the rows beside it, nor on how many
there are, nor on the thread count (tests/cpu_kernels/test_linear_vectors.py). 8-row products of SmolLM2's
shapes: 9.4 against oneDNN's 13.5 ms (1.44x), one row 1.75x (docs/BENCHMARKS.md).

They are not oneDNN's bits (its sums are in another order: a bf16 output differs in a few
elements in ten thousand), so engine/models/packed.py gives this kernel a step's single-token rows
only, whatever else the step carries, and oneDNN the prompt chunks: a row's products then
depend on the row alone. The repacked copy is extra memory (one more copy of every weight it
takes: SmolLM2's projections, 212 MB).

C source: cpu_kernels/csrc/linear_vectors.c, run in the avx512bf16 variant (cpu_kernels/build.py); the
amx variant keeps cpu_kernels/linear_tiles.py, which gives oneDNN's bits; elsewhere :func:`available`
is False.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

UNIT = 32  # outputs a unit of work (two vectors of 16)
MAX_WEIGHTS = 8  # weights one call takes


_ARGS = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int] + [ctypes.c_void_p] * 3


def _fn():
    if build.chosen() == "amx":  # the tiles give oneDNN's bits there: cpu_kernels/linear_tiles.py
        return None
    return build.function("few_linear", None, _ARGS)


def available() -> bool:
    return _fn() is not None


def takes(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight ``[N, K]`` of the kernel's shapes (N a multiple of :data:`UNIT`, K even),
    on a CPU where it built."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    out_features, in_features = weight.shape
    return out_features % UNIT == 0 and in_features % 2 == 0 and available()


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
    _fn()(
        x.data_ptr(), x.numel() // in_features, in_features, count,
        pointers(*(w.data_ptr() for w in weights)), (ctypes.c_long * count)(*widths),
        pointers(*(y.data_ptr() for y in outs)),
    )  # fmt: skip
    return outs
