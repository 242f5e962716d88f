"""The per-session KV cache: a transformers ``DynamicCache`` whose full-attention
layers can be compressed in place.

Two lengths per session: ``logical_len`` is how many tokens the
session has seen (the next RoPE position); ``kept_len`` is how many rows a full
layer physically holds. :class:`CompressedLayer` reports ``logical_len`` as its
sequence length and places its kept rows just before the new tokens in mask
space (a virtual offset), so position ids stay logical for every layer, sliding
window layers keep working, and the library's own mask code builds the right
causal mask.

Rows live in a buffer that grows by blocks (:class:`BlockRows`): a decode step writes one row
per layer in place instead of concatenating the whole cache again (transformers' own
``DynamicLayer`` copies every row on every token). ``keys`` / ``values`` are views of the
rows in use; sliding-window layers move their start forward and compact when the buffer is
full, so a Gemma 3 sliding layer copies its window once per block of tokens, not per token.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvsnap.policies import gather_rows

from . import block_copy
from .prefixes import Block

BLOCK_ROWS = 128  # spare rows a layer's buffer gets when it grows (one copy per this many tokens)


class BlockRows:
    """Keys and values in buffers ``[1, H_kv, capacity, D]`` of which rows ``[_start, _end)`` are
    in use. Appending writes the new rows in place (growing by :data:`BLOCK_ROWS` when full);
    ``keys`` / ``values`` are views of the rows in use, and assigning them replaces the buffers
    (a tensor handed in is never written to: its rows are all in use, so the next append
    reallocates)."""

    def _init_rows(self) -> None:
        self._k = self._v = None
        self._start = self._end = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, self._start : self._end]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k = value if value is None or value.dim() == 4 else None
        self._start, self._end = 0, 0 if self._k is None else self._k.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, self._start : self._end]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = value if value is None or value.dim() == 4 else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)  # sets empty 1-D tensors: no rows yet
        self._init_rows()

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, H_kv, n, D]`` new rows after the rows in use; returns views of all of them."""
        n = key_states.shape[-2]
        if self._k is None or self._end + n > self._k.shape[-2]:
            self._grow(key_states, value_states, n)
        self._k[:, :, self._end : self._end + n] = key_states
        self._v[:, :, self._end : self._end + n] = value_states
        self._end += n
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, start: int, end: int) -> None:
        """Take ``keys`` / ``values`` as the buffers, rows ``[start, end)`` in use and the rows
        after them free for appends (:func:`fill_prefix`)."""
        self._k, self._v, self._start, self._end = keys, values, start, end

    def _claim_row(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        """:meth:`_append` of one row whose values the caller writes (engine/decode_rows.py):
        room for it (``*_states`` give the shape of a row), counted as in use; its index."""
        if self._k is None or self._end + 1 > self._k.shape[-2]:
            self._grow(key_states, value_states, 1)
        self._end += 1
        return self._end - 1

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, n: int) -> None:
        """New buffers with room for ``n`` more rows and a block spare; the rows in use move to the front."""
        used = self._end - self._start
        buffers = []
        for old, new in ((self._k, key_states), (self._v, value_states)):
            b, h, _, d = new.shape
            buf = new.new_empty((b, h, used + n + BLOCK_ROWS, d))
            if used:
                buf[:, :, :used] = old[:, :, self._start : self._end]
            buffers.append(buf)
        self._k, self._v = buffers
        self._start, self._end = 0, used

    def appended(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the last ``n`` rows appended, read right after their append (a sliding
        layer's window may no longer show them all, but its buffer still holds them)."""
        if self._k is None or not 0 < n <= self._end:
            raise ValueError(f"the layer holds {self._end} rows, not the last {n}")
        first = self._end - n
        return self._k[:, :, first : self._end], self._v[:, :, first : self._end]

    def exact(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows in use as tensors of their own (no spare capacity: what a tier stores)."""
        if self._k is None:
            return self.keys, self.values
        if self._start == 0 and self._end == self._k.shape[-2]:
            return self._k, self._v
        return self.keys.clone(), self.values.clone()


class CompressedLayer(BlockRows, DynamicLayer):
    """A full-attention layer whose rows may be a subset of the positions seen."""

    def __init__(self, **kwargs):
        self._init_rows()
        super().__init__()
        self.logical_len = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.logical_len += key_states.shape[-2]
        return self._append(key_states, value_states)

    def claim(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """:meth:`update` with one token whose key and value the caller writes: the buffers, the
        new row's index in them and the first row the token sees (engine/decode_rows.py)."""
        self.logical_len += 1
        row = self._claim_row(key_states, value_states)
        return self._k, self._v, row, self._start

    @property
    def kept_len(self) -> int:
        return 0 if not self.is_initialized or self._k is None else self._end - self._start

    def get_seq_length(self) -> int:
        return self.logical_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv rows: kept + new; kept row i sits at virtual position (logical - kept) + i.
        return self.kept_len + query_length, self.logical_len - self.kept_len

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only ``positions`` ([1, H_kv, k], ascending physical rows)."""
        keys = gather_rows(self.keys, positions).contiguous()
        self.values = gather_rows(self.values, positions).contiguous()
        self.keys = keys

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed layer cannot be cropped")


class SlidingLayer(BlockRows, DynamicSlidingWindowLayer):
    """A sliding-window layer (the last ``sliding_window - 1`` rows kept), appending in place."""

    def __init__(self, sliding_window: int, **kwargs):
        self._init_rows()
        super().__init__(sliding_window=sliding_window)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys, values = self._append(key_states, value_states)  # the window so far plus the new rows
        self._start = max(self._start, self._end - (self.sliding_window - 1))
        return keys, values

    def claim(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """:meth:`update` with one token whose key and value the caller writes (see
        :meth:`CompressedLayer.claim`): the token sees the window before it, then the window moves."""
        self.cumulative_length += 1
        row, start = self._claim_row(key_states, value_states), self._start
        self._start = max(self._start, self._end - (self.sliding_window - 1))
        return self._k, self._v, row, start

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a session's sliding layer cannot be cropped")


def new_session_cache(config) -> DynamicCache:
    """A cache for ``config`` with every full-attention layer a :class:`CompressedLayer`."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = CompressedLayer()
        elif type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = SlidingLayer(layer.sliding_window)
    return cache


def full_layer_indices(cache: DynamicCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, CompressedLayer)]


def cache_bytes(cache: DynamicCache) -> int:
    """Exact bytes of every key and value tensor the cache holds."""
    total = 0
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


def full_cache_bytes(cache: DynamicCache, logical_len: int) -> int:
    """Bytes the same cache would hold with no compression at ``logical_len`` tokens."""
    total = 0
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None:
            continue
        _, heads, _, dim = layer.keys.shape
        rows = logical_len
        if isinstance(layer, DynamicSlidingWindowLayer):
            rows = min(logical_len, layer.sliding_window - 1)
        total += 2 * heads * rows * dim * layer.keys.element_size()
    return total


def kept_len(cache: DynamicCache) -> int:
    """Rows held by the full-attention layers (all equal under one policy)."""
    lengths = [cache.layers[i].kept_len for i in full_layer_indices(cache)]
    return max(lengths, default=0)


# -- moving a session's KV in and out of the model's cache object -------------------------


def export_kv(cache: DynamicCache) -> list[torch.Tensor]:
    """The cache's tensors, ``[k_0, v_0, k_1, v_1, ...]``, each ``[1, H_kv, rows, D]`` (no copy
    unless a layer's buffer has spare rows: a tier holds exactly the bytes it counts)."""
    tensors = []
    for layer in cache.layers:
        tensors += list(layer.exact()) if isinstance(layer, BlockRows) else [layer.keys, layer.values]
    return tensors


def import_kv(config, tensors: list[torch.Tensor], logical_len: int) -> DynamicCache:
    """Rebuild a session cache for ``config`` from :func:`export_kv` tensors at ``logical_len`` tokens."""
    cache = new_session_cache(config)
    fill_kv(cache, tensors, logical_len)
    return cache


def fill_kv(cache: DynamicCache, tensors: list[torch.Tensor], logical_len: int) -> None:
    """Give a new (empty) session cache the rows of :func:`export_kv` tensors at ``logical_len`` tokens."""
    if len(tensors) != 2 * len(cache.layers):
        raise ValueError(f"expected {2 * len(cache.layers)} KV tensors, got {len(tensors)}")
    for i, layer in enumerate(cache.layers):
        keys, values = tensors[2 * i], tensors[2 * i + 1]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        _seen(layer, logical_len)


def _seen(layer, logical_len: int) -> None:
    """A filled layer's count of the tokens it has seen (a compressed layer's logical length, a
    sliding one's cumulative length)."""
    if isinstance(layer, CompressedLayer):
        layer.logical_len = logical_len
    elif isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = logical_len


def fill_prefix(cache: DynamicCache, blocks: list[Block], spare: int = 0) -> None:
    """Give a new (empty) session cache the rows a prefill of consecutive shared prefix
    ``blocks`` leaves: a full layer holds every row, a sliding layer the last
    ``sliding_window - 1`` (of the blocks that hold them). Where the C copy takes them (2-byte
    rows of one shape in host memory), one call copies them all, by the blocks' addresses, into
    buffers with ``spare`` rows free after them (the turn's own tokens then go in place);
    otherwise one concatenation per layer."""
    sample_rows = blocks[0].rows
    sample = sample_rows[0][0]
    block = sample.shape[-2]
    n = block * len(blocks)
    firsts = [  # per layer, the first block holding a row it keeps
        max(0, n - (layer.sliding_window - 1)) // block if isinstance(layer, SlidingLayer) else 0
        for layer in cache.layers
    ]
    if block_copy.takes([t for kv in sample_rows for t in kv]):  # one C call
        _, heads, _, dim = sample.shape
        buffers = [sample.new_empty((1, heads, n - f * block + spare, dim)) for f in firsts for _ in (0, 1)]
        addresses = b"".join(b.addresses for b in blocks)
        block_copy.gather_blocks(addresses, len(blocks), block, buffers, [f for f in firsts for _ in (0, 1)])
    else:
        rows = [b.rows for b in blocks]
        buffers = [torch.cat([b[i][p] for b in rows[f:]], dim=-2) for i, f in enumerate(firsts) for p in (0, 1)]
    for i, (layer, first) in enumerate(zip(cache.layers, firsts, strict=True)):
        keys, values = buffers[2 * i], buffers[2 * i + 1]
        layer.lazy_initialization(keys, values)
        held = n - first * block
        start = max(0, held - (layer.sliding_window - 1)) if isinstance(layer, SlidingLayer) else 0
        layer.adopt(keys, values, start, held)
        _seen(layer, n)


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


def shares_blocks(cache: DynamicCache) -> bool:
    """Whether every layer keeps its rows in :class:`BlockRows` (what sharing a prefix needs)."""
    return all(isinstance(layer, BlockRows) for layer in cache.layers)
