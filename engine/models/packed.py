"""bfloat16 linear layers on a CPU with their weights packed once for oneDNN.

``F.linear`` on a bf16 CPU tensor hands the weight to oneDNN, which reorders it into its own
blocked layout on every call. A decode step's projections are matrix-vector products (a few
rows against each weight), so that reorder is a large share of their time: packing each
weight once at load (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing
does) and calling ``torch.ops.mkldnn._linear_pointwise`` makes 8-row products 1.5-1.9x faster
here, and 1,024-row ones no slower (docs/BENCHMARKS.md, "Packed linear weights").

The results are bit-equal to ``F.linear``'s for any number of rows
(tests/engine/models/test_packed_linears.py), so no exactness invariant changes; on a CPU with
AMX, at some row counts past the tiles' (333 of SmolLM2's projections), oneDNN's AMX kernels on
the packed layout round otherwise, within a bf16 step. The module keeps its weight (code that
reads it, such as KVzip+'s output-projection norms, sees the same tensor); the packed copy is
extra memory, the bytes :func:`pack_linears` returns. Weights are frozen once packed: this is for
inference. The LM head is left alone (engine/models/head.py reads its weight itself), and so is
every float32, fp16 or CUDA layer.

On a CPU with AMX, a product of at most :data:`AMX_MAX_ROWS` rows (a decode step's) with a
weight of the right shape and no bias runs cpu_kernels/linear_tiles.py's kernel on the module's own
weight instead: oneDNN's bits, at memory speed (a bias added after the kernel would round twice).

Projections of one input that are always called together (a Llama layer's query, key and value
projections in engine/models/lean.py; a gated MLP's gate and up projections in
engine/models/fused.py) are packed as one weight, their rows stacked (:func:`group`; not on a CPU
with AMX, whose tiles take the few-row products): one oneDNN call per layer instead of three (or
two), with each output's bits unchanged (every output is the same sum over the same input;
tests/engine/models/test_packed_linears.py checks each row count). On a CPU without AMX a decode
step's weights stream from memory, and one call streams them faster than three: SmolLM2's 30
layers of 8-row products take about 12 ms grouped and 19 ms apart here (docs/BENCHMARKS.md,
"Grouped projections"). A grouped module keeps no packed copy of its own (no more memory than
before): called alone (transformers' layer, which a capture of the attention input takes) it is
``F.linear``.

On a CPU with AVX-512 BF16 and no AMX, the single-token rows of a packed step (its decoding
sessions, and a prompt's one-token chunk) run cpu_kernels/linear_vectors.py's kernel on a second copy of
each weight, repacked once: 1.4-1.75x oneDNN's speed for 1-8 rows, but not oneDNN's bits. So the
choice is made per row, not per product: :func:`step_rows` (around ``Engine.step``'s forward) says
which rows of the packed sequence have one token, and those always take the kernel, alone or
beside a prompt chunk (which takes oneDNN, the two results put together): a row's products
depend on the row only, as the batching and replay invariants need (tests/cpu_kernels/test_linear_vectors.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
import weakref

import torch
from torch import nn

from kvsnap.cpu_kernels import linear_tiles, linear_vectors

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
# a group's first module -> weak references to the group's modules: every group asked for (see
# group), formed again when pack_linears packs them after unpack_linears (benchmarks compare)
_WANTED: weakref.WeakKeyDictionary[nn.Linear, tuple] = weakref.WeakKeyDictionary()
# a formed group's first module -> (its packed stacked weight, each module's output width, the
# stacked bias or None)
_GROUPS: weakref.WeakKeyDictionary[nn.Linear, tuple] = weakref.WeakKeyDictionary()
_GROUPED: weakref.WeakSet[nn.Linear] = weakref.WeakSet()  # every module of a group
AMX_MAX_ROWS = linear_tiles.MAX_ROWS  # products of more rows run oneDNN (0: every one; benchmarks compare)
_FEW: weakref.WeakKeyDictionary[nn.Linear, torch.Tensor] = weakref.WeakKeyDictionary()  # its linear_vectors repack
FEW_ROWS = True  # single-token rows take linear_vectors where it built (False: oneDNN; benchmarks compare)
# during Engine.step's forward: the packed sequence's length and the positions of its one-token rows
_STEP: contextvars.ContextVar[tuple[int, torch.Tensor] | None] = contextvars.ContextVar("step_rows", default=None)


@contextlib.contextmanager
def step_rows(lengths: list[int]):
    """Within: a packed step's forward, whose rows have ``lengths`` tokens each (engine/batch.py);
    products of its whole packed input give its one-token rows to linear_vectors (see the module)."""
    singles, start = [], 0
    for n in lengths:
        if n == 1:
            singles.append(start)
        start += n
    token = _STEP.set((start, torch.tensor(singles, dtype=torch.long)))
    try:
        yield
    finally:
        _STEP.reset(token)


def _singles(x: torch.Tensor) -> torch.Tensor | None:
    """The positions of the running step's one-token rows when ``x`` is its packed input
    (``[1, T, K]`` bf16), else None."""
    step = _STEP.get()
    if step is None or not FEW_ROWS or x.dim() != 3 or x.shape[:2] != (1, step[0]) or x.dtype != torch.bfloat16:
        return None
    return step[1]


def _with_few_rows(modules: tuple[nn.Linear, ...], x: torch.Tensor, rest) -> list[torch.Tensor]:
    """Each module's product with ``x``: the step's one-token rows on linear_vectors, the other rows
    by ``rest(x)`` (oneDNN), when every module has a repack; else ``rest(x)``."""
    singles = _singles(x)
    if singles is None or not len(singles) or not all(m in _FEW for m in modules):
        return rest(x)
    weights = [_FEW[m] for m in modules]
    if len(singles) == x.shape[1]:  # a decode step: every row
        return _biased(modules, linear_vectors.linears(x, weights))
    outs = rest(x)
    for out, rows in zip(outs, _biased(modules, linear_vectors.linears(x[:, singles], weights)), strict=True):
        out[:, singles] = rows
    return outs


def _biased(modules: tuple[nn.Linear, ...], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The vector kernel's products (which take no bias; their bits are their own anyway) with
    each module's bias added, where it has one (Qwen2's query, key and value projections)."""
    return [out if m.bias is None else out.add_(m.bias) for m, out in zip(modules, outs, strict=True)]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (bf16 ``[N, K]``, one that :func:`can_pack`) reordered once into oneDNN's layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN on the weight :func:`pack` made: ``F.linear``'s bits."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def is_packed(module: nn.Module) -> bool:
    """Packed alone or in a :func:`group`."""
    return module in _PACKED or module in _GROUPED


def is_grouped(module: nn.Module) -> bool:
    return module in _GROUPED


def uses_amx(module: nn.Module) -> bool:
    """Whether ``module``'s few-row products run on the AMX tiles (cpu_kernels/linear_tiles.py)."""
    return module in _AMX


def uses_few(module: nn.Module) -> bool:
    """Whether a step's one-token rows take cpu_kernels/linear_vectors.py's kernel in ``module``'s products."""
    return module in _FEW


def _few_rows(x: torch.Tensor) -> bool:
    """Rows the AMX kernel takes (:func:`.linear_tiles.fits`: contiguous bf16), at most
    :data:`AMX_MAX_ROWS` of them."""
    return x.numel() <= AMX_MAX_ROWS * x.shape[-1] and linear_tiles.fits(x)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self in _FEW:
        return _with_few_rows((self,), x, lambda rows: [_product_of(self, rows)])[0]
    return _product_of(self, x)


def _product_of(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = _PACKED.get(self)
    if x.dtype == torch.bfloat16 and self in _AMX and _few_rows(x):
        return linear_tiles.linear(x, self.weight)  # an AMX module has no bias
    if packed is None or x.dtype != torch.bfloat16:  # a copy, a grouped module, another dtype: the plain product
        return nn.Linear.forward(self, x)
    return product(x, packed, self.bias)


def products(modules: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each module's product with the same ``x`` (a layer's query, key and value projections;
    its gate and up projections): one pass on the AMX tiles where every one of them takes it
    (:func:`.linear_tiles.linears`), else one oneDNN call where they were packed as a
    :func:`group` (the outputs are views of its columns), else each module's own; the same bits
    every way."""
    if all(m in _AMX for m in modules) and _few_rows(x):
        return linear_tiles.linears(x, [m.weight for m in modules])
    return _with_few_rows(modules, x, lambda rows: _onednn_products(modules, rows))


def _onednn_products(modules: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    stacked = _GROUPS.get(modules[0])
    if stacked is not None and x.dtype == torch.bfloat16 and _members(modules[0]) == modules:
        weight, widths, bias = stacked
        return list(product(x, weight, bias).split(widths, dim=-1))
    return [_product_of(m, x) for m in modules]


def _members(first: nn.Linear) -> tuple:
    """The modules of the group asked for with ``first`` (None for one collected since)."""
    return tuple(r() for r in _WANTED[first])


def groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """The groups formed among ``model``'s modules (benchmarks take them apart and back)."""
    return [_members(m) for m in model.modules() if m in _GROUPS]


def group(modules: tuple[nn.Linear, ...]) -> bool:
    """Pack ``modules`` (projections of one input, each packed by :func:`pack_linears`; for
    callers that take their products together through :func:`products`) as one stacked weight,
    in place of their own packed copies. False (nothing changes) unless every one is packed
    alone, and all or none of them have a bias; and where they take the AMX tiles, whose few-row
    products are one pass over every weight already: there oneDNN's AMX kernels sum a stacked
    weight in another order at some row counts (SmolLM2's query, key and value at 200-333 rows),
    so a group would not keep each output's bits."""
    if not all(m in _PACKED for m in modules) or len({m.bias is None for m in modules}) != 1:
        return False
    if any(linear_tiles.takes(m.weight) for m in modules):
        return False
    _WANTED[modules[0]] = tuple(weakref.ref(m) for m in modules)
    with torch.no_grad():
        weight = pack(torch.cat([m.weight for m in modules]))
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules]).detach()
    _GROUPS[modules[0]] = (weight, [m.out_features for m in modules], bias)
    for m in modules:
        del _PACKED[m]
        _GROUPED.add(m)
    return True


def ungroup(modules: tuple[nn.Linear, ...]) -> None:
    """Undo :func:`group`: each module packed alone again (benchmarks compare both)."""
    _WANTED.pop(modules[0], None)
    if _GROUPS.pop(modules[0], None) is None:
        return
    with torch.no_grad():
        for m in modules:
            _GROUPED.discard(m)
            _PACKED[m] = pack(m.weight)


def pack_linears(model: nn.Module) -> int:
    """Pack every bf16 CPU ``nn.Linear`` of ``model`` but its LM head; returns the bytes of the
    weights it packed, which their packed copies take again (0: nothing to pack). Idempotent."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    added = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module is head or is_packed(module) or not can_pack(module.weight):
            continue
        with torch.no_grad():
            _PACKED[module] = pack(module.weight)
        module.forward = types.MethodType(_packed_forward, module)
        added += module.weight.numel() * module.weight.element_size()
        if module.bias is None and linear_tiles.takes(module.weight):  # oneDNN's bits: its bias is fused
            _AMX.add(module)
        elif linear_vectors.takes(module.weight):
            _FEW[module] = linear_vectors.repack(module.weight)  # a second copy: counted
            added += module.weight.numel() * module.weight.element_size()
    for first in [m for m in model.modules() if m in _WANTED and m not in _GROUPS]:  # asked for before an unpack
        if None not in (wanted := _members(first)):
            group(wanted)
    return added


def unpack_linears(model: nn.Module) -> None:
    """Undo :func:`pack_linears` (benchmarks compare both in one run)."""
    for module in model.modules():
        _AMX.discard(module)
        _FEW.pop(module, None)
        _GROUPS.pop(module, None)
        if _PACKED.pop(module, None) is not None or module in _GROUPED:
            _GROUPED.discard(module)
            del module.forward
