"""bfloat16 linear layers on a CPU with their weights packed once for oneDNN.

``F.linear`` on a bf16 CPU tensor hands the weight to oneDNN, which reorders it into its own
blocked layout on every call. A decode step's projections are matrix-vector products (a few
rows against each weight), so that reorder is a large share of their time: packing each
weight once at load (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing
does) and calling ``torch.ops.mkldnn._linear_pointwise`` makes 8-row products 1.5-1.9x faster
here, and 1,024-row ones no slower (docs/BENCHMARKS.md, "Packed linear weights").

The results are bit-equal to ``F.linear``'s for any number of rows (tests/test_packed.py), so
no exactness invariant changes. The module keeps its weight (code that reads it, such as
KVzip+'s output-projection norms, sees the same tensor); the packed copy is extra memory, the
bytes :func:`pack_linears` returns. Weights are frozen once packed: this is for inference.
The LM head is left alone (engine/head.py reads its weight itself), and so is every float32,
fp16 or CUDA layer.

On a CPU with AMX, a product of at most :data:`AMX_MAX_ROWS` rows (a decode step's) with a
weight of the right shape runs engine/amx_linear.py's kernel on the module's own weight instead:
oneDNN's bits, at memory speed.
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn

from . import amx_linear

ROWS_HINT = 8  # the rows oneDNN is told to expect (a decode step's); any count works


def can_pack(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight, on a torch whose oneDNN has bf16 kernels on this CPU."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    return ops._is_mkldnn_bf16_supported()


# module -> its packed weight. Kept beside the module, not in it: the packed tensor is opaque
# (no storage), so a module holding it could not be deep-copied; a copy (tests build reference
# models so) finds no entry here and takes the plain product, with the same results.
_PACKED: weakref.WeakKeyDictionary[nn.Linear, torch.Tensor] = weakref.WeakKeyDictionary()
_AMX: weakref.WeakSet[nn.Linear] = weakref.WeakSet()  # modules whose few-row products take the tiles
AMX_MAX_ROWS = amx_linear.MAX_ROWS  # products of more rows run oneDNN (0: every one; benchmarks compare)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (bf16 ``[N, K]``, one that :func:`can_pack`) reordered once into oneDNN's layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN on the weight :func:`pack` made: ``F.linear``'s bits."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def is_packed(module: nn.Module) -> bool:
    return module in _PACKED


def uses_amx(module: nn.Module) -> bool:
    """Whether ``module``'s few-row products run on the AMX tiles (engine/amx_linear.py)."""
    return module in _AMX


def _few_rows(x: torch.Tensor) -> bool:
    """Rows the AMX kernel takes (:func:`.amx_linear.fits`: contiguous bf16), at most
    :data:`AMX_MAX_ROWS` of them."""
    return x.numel() <= AMX_MAX_ROWS * x.shape[-1] and amx_linear.fits(x)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = _PACKED.get(self)
    if packed is None or x.dtype != torch.bfloat16:  # a copy, or another dtype: the plain product
        return nn.Linear.forward(self, x)
    if self in _AMX and _few_rows(x):
        return amx_linear.linear(x, self.weight)
    return product(x, packed, self.bias)


def products(modules: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each module's product with the same ``x`` (a layer's query, key and value projections;
    its gate and up projections): one pass on the AMX tiles where every one of them takes it
    (:func:`.amx_linear.linears`), else each module's own, with the same bits either way."""
    if all(m in _AMX for m in modules) and _few_rows(x):
        return amx_linear.linears(x, [m.weight for m in modules])
    return [_packed_forward(m, x) for m in modules]


def pack_linears(model: nn.Module) -> int:
    """Pack every bf16 CPU ``nn.Linear`` of ``model`` but its LM head; returns the bytes of the
    weights it packed, which their packed copies take again (0: nothing to pack). Idempotent."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    added = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module is head or module in _PACKED or not can_pack(module.weight):
            continue
        with torch.no_grad():
            _PACKED[module] = pack(module.weight)
        module.forward = types.MethodType(_packed_forward, module)
        added += module.weight.numel() * module.weight.element_size()
        if module.bias is None and amx_linear.takes(module.weight):
            _AMX.add(module)
    return added


def unpack_linears(model: nn.Module) -> None:
    """Undo :func:`pack_linears` (benchmarks compare both in one run)."""
    for module in model.modules():
        _AMX.discard(module)
        if _PACKED.pop(module, None) is not None:
            del module.forward
