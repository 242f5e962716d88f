"""A new session's rows from a shared prompt prefix (engine/prefixes.py): referenced or copied.

A session that opens with a prefix the replica has seen starts from its blocks instead of
prefilling it. Where the blocks are bf16 in host memory, with the C copy and the prompt-chunk
kernel built (cpu_kernels/block_copy.py, cpu_kernels/chunk_attention.py), a full-attention layer does not
copy them: it refers to them (:class:`SharedRows`, the layer's ``shared``) and its own buffer
holds only the rows after them. The turn's prompt chunks append to that buffer and the chunk
kernel reads the shared rows where the blocks keep them (engine/batch.py); SnapKV's selection
votes over them there too (:class:`LayerKeys`) and the compression gathers the rows it keeps
from the blocks and the buffer (``CompressedLayer.keep``), so a compressing session never holds
a whole copy. The first other use of the layer (a decode step of a session that did not
compress, an export to a tier, another policy's selection) copies them in (``BlockRows.own``:
copy-on-write), so every other path sees one buffer as before; a turn's end copies in what is
still referred to (:func:`own_all`). A session's reference keeps the blocks' memory alive if the
prefix cache evicts them meanwhile. Sliding layers (Gemma 3's) copy the window they keep, as do
all layers elsewhere (one C call, or a concatenation per layer without the C copy). Either way
the session's rows and results are the same, bit for bit (tests/engine/test_prefix_rows.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from kvsnap.cpu_kernels import block_copy, chunk_attention, snapkv_votes
from kvsnap.policies.base import window_votes
from kvsnap.policies.snapkv import SnapKV

from .cache import CompressedLayer, SlidingLayer, seen
from .prefixes import Block

REFER = True  # full layers refer to the shared rows where they can (False: always copy; tests, benchmarks)


class SharedRows:
    """One full layer's rows of a run of shared prefix blocks, by address: ``keys`` / ``values``
    hold each block's part (``[1, H_kv, block, D]`` contiguous) as int64 addresses; ``blocks``
    keeps them alive. ``rows``: how many rows they are."""

    __slots__ = ("blocks", "block", "rows", "keys", "values", "_pairs")

    def __init__(self, blocks: list[Block], block: int, pairs: torch.Tensor):
        self.blocks, self.block, self.rows = blocks, block, block * len(blocks)
        self._pairs = pairs  # [blocks, 2] int64: per block, the layer's keys' and values' addresses
        self.keys, self.values = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()

    def copy_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the rows to the first :attr:`rows` rows of ``keys`` / ``values`` ``[1, H_kv, cap, D]``."""
        block_copy.gather_blocks(self._pairs.numpy().tobytes(), len(self.blocks), self.block, [keys, values], [0, 0])

    def gather(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """Rows ``positions`` (``[1, H_kv, k]``, ascending) of these rows followed by ``keys`` /
        ``values`` (the layer's own) as new ``[1, H_kv, k, D]`` tensors (a compression's kept rows)."""
        positions = positions.to(torch.int64).contiguous()  # what the C reads
        return tuple(
            block_copy.gather_rows(table, self.rows, self.block, own, positions)
            for table, own in ((self.keys, keys), (self.values, values))
        )


class LayerKeys:
    """A referring layer's keys as SnapKV's selection reads them (policies/base.py ``select``):
    their shape, and the window's votes over the rows in the blocks and in the layer's buffer
    (cpu_kernels/snapkv_votes.py), without copying the shared ones in. Where the votes kernel does not
    take them, the layer's rows are copied in and torch's path votes."""

    def __init__(self, layer: CompressedLayer):
        self.layer = layer
        own = layer.own_rows()[0]
        self.shape = torch.Size((own.shape[0], own.shape[1], layer.kept_len, own.shape[3]))
        self.device, self.dtype = own.device, own.dtype

    def window_votes(self, window_queries: torch.Tensor, scale: float | None) -> torch.Tensor:
        own, shared = self.layer.own_rows()[0], self.layer.shared
        scale = self.shape[-1] ** -0.5 if scale is None else scale
        if shared is not None and snapkv_votes.takes(window_queries, own, shared.rows):
            return snapkv_votes.votes(window_queries, own, scale, shared=shared)
        return window_votes(window_queries, self.layer.keys, scale)


def own_all(cache: DynamicCache) -> None:
    """Copy in any shared rows a session's layers still refer to (a turn that ends without a
    compression that dropped rows): between turns a session holds its rows, as its byte counts,
    its export to a tier and a rewind expect."""
    for layer in cache.layers:
        if getattr(layer, "shared", None) is not None:
            layer.own()


def keys_for(layer, policy) -> torch.Tensor | LayerKeys:
    """What a compression hands ``policy`` as ``layer``'s keys: a referring full layer's
    :class:`LayerKeys` for SnapKV's own selection (its votes read the blocks), else its keys
    (any shared rows copied in first)."""
    if getattr(layer, "shared", None) is not None and type(policy) is SnapKV:
        return LayerKeys(layer)
    return layer.keys


def fill_prefix(cache: DynamicCache, blocks: list[Block], spare: int = 0) -> None:
    """Give a new (empty) session cache the rows a prefill of consecutive shared prefix
    ``blocks`` leaves: a full layer holds every row (referred to, or copied), a sliding layer
    the last ``sliding_window - 1`` (of the blocks that hold them). Each layer's buffers keep
    ``spare`` rows free after its rows (the turn's own tokens then go in place). Where the C
    copy takes them (2-byte rows of one shape in host memory), one call copies them all, by the
    blocks' addresses; otherwise one concatenation per layer."""
    sample_rows = blocks[0].rows
    sample = sample_rows[0][0]
    block = sample.shape[-2]
    n = block * len(blocks)
    c_copy = block_copy.takes([t for kv in sample_rows for t in kv])
    refer = REFER and c_copy and sample.dtype == torch.bfloat16 and chunk_attention.available()
    firsts = [  # per layer, the first block holding a row it keeps (all of them: none)
        max(0, n - (layer.sliding_window - 1)) // block
        if isinstance(layer, SlidingLayer)
        else len(blocks)
        if refer and isinstance(layer, CompressedLayer)
        else 0
        for layer in cache.layers
    ]
    if c_copy:  # one C call
        _, heads, _, dim = sample.shape
        buffers = [sample.new_empty((1, heads, n - f * block + spare, dim)) for f in firsts for _ in (0, 1)]
        addresses = b"".join(b.addresses for b in blocks)
        block_copy.gather_blocks(addresses, len(blocks), block, buffers, [f for f in firsts for _ in (0, 1)])
    else:
        rows = [b.rows for b in blocks]
        buffers = [torch.cat([b[i][p] for b in rows[f:]], dim=-2) for i, f in enumerate(firsts) for p in (0, 1)]
    table = None
    if refer:  # per block, every part's address
        table = torch.frombuffer(bytearray(addresses), dtype=torch.int64)  # refer: the C copy's (c_copy)
        table = table.view(len(blocks), -1)
    for i, (layer, first) in enumerate(zip(cache.layers, firsts, strict=True)):
        keys, values = buffers[2 * i], buffers[2 * i + 1]
        layer.lazy_initialization(keys, values)
        held = n - first * block
        start = max(0, held - (layer.sliding_window - 1)) if isinstance(layer, SlidingLayer) else 0
        referred = refer and isinstance(layer, CompressedLayer)
        shared = SharedRows(blocks, block, table[:, 2 * i : 2 * i + 2]) if referred else None
        layer.adopt(keys, values, start, held, shared)
        seen(layer, n)


def blocks_written(cache: DynamicCache, n: int, block: int) -> list:
    """Copies of the whole blocks of ``block`` rows that open the last ``n`` rows appended to
    every layer (a prompt chunk's, read right after it ran), each as a shared prefix block's
    data (:class:`~.prefixes.Block`). Where the C copy takes them (2-byte rows of one shape in
    host memory): one call, and per block one tensor ``[2 * layers, 1, H_kv, block, D]`` (its
    own allocation, so a block evicted alone frees its memory). Otherwise a copy per layer and
    block: per block, every layer's ``(keys, values)``."""
    whole = n // block * block
    views = [tuple(t[:, :, :whole] for t in layer.appended(n)) for layer in cache.layers]
    parts = [t for kv in views for t in kv]
    if block_copy.takes(parts):
        return block_copy.scatter_blocks(parts, block)
    cut = [(j * block, (j + 1) * block) for j in range(whole // block)]
    return [[(k[:, :, a:b].clone(), v[:, :, a:b].clone()) for k, v in views] for a, b in cut]
