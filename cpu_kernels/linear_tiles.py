"""A decode step's products on AMX tiles: a few rows against a bf16 weight, at memory speed.

A decode step multiplies 1-16 rows by every projection of the model and by the LM head: 212 MB
of SmolLM2 projections and 57 MB of head a step (Gemma 3's head alone is 335 MB), each read
once. oneDNN (engine/models/packed.py; ``F.linear`` for the head, which also reorders the weight on
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
counts (tests/cpu_kernels/test_linear_tiles.py checks every count from 1 to :data:`MAX_ROWS` on both embedded
models' shapes); no exactness invariant moves, and a row's result depends neither on the rows
beside it nor on the thread count. Larger products (a prompt chunk) stay with oneDNN.

C source: cpu_kernels/csrc/linear_tiles.c, in the amx variant (cpu_kernels/build.py: a CPU with AMX whose
Linux grants the tiles' state); elsewhere :func:`available` is False and oneDNN runs every product.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

MAX_ROWS = 16  # the step's rows are one tile's columns (16 x 4 bytes): up to 16 sessions
COLUMNS = 64  # outputs a unit of work (four tiles of 16 weight rows)
DEPTH = 32  # inputs a tile product (16 pairs of bf16)
MAX_WEIGHTS = 8  # weights one call of :func:`linears` takes


_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int] + [ctypes.c_void_p] * 3


def _fn():
    return build.function("amx_linear", ctypes.c_int, _ARGS)


def available() -> bool:
    return _fn() is not None


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
        and available()
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
    done = _fn()(
        x.data_ptr(), x.numel() // in_features, in_features, count,
        pointers(*(w.data_ptr() for w in weights)), (ctypes.c_long * count)(*(w.shape[0] for w in weights)),
        pointers(*(y.data_ptr() for y in outs)),
    )  # fmt: skip
    if done != 0:
        raise MemoryError("the AMX product's scratch could not be allocated")
    return outs
