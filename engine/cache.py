"""The per-session KV cache: a transformers ``DynamicCache`` whose full-attention layers can be
compressed in place (rows dropped, or kept quantized: ``cold``, engine/cold.py).

Two lengths per session: ``logical_len`` is how many tokens the session has seen (the next
RoPE position); ``kept_len`` is how many rows a full layer holds at the cache's precision.
:class:`CompressedLayer` reports ``logical_len`` as its sequence length and places its rows just
before the new tokens in mask space (a virtual offset), so position ids stay logical for every
layer, sliding window layers keep working, and the library's own mask code builds the right mask.

Rows live in a buffer that grows by blocks (:class:`BlockRows`): a decode step writes one row
per layer in place (transformers' ``DynamicLayer`` copies every row on every token);
``keys`` / ``values`` are views of the rows in use, and a sliding layer compacts its window
once per block of tokens. A full layer of a session started from a shared prefix may refer to
the prefix's rows (``shared``, engine/prefix_rows.py): any use but a prompt chunk's append and
attention copies them in first (:meth:`BlockRows.own`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvsnap.policies import gather_rows
from kvsnap.policies.kivi import KIVI

from .cold import ColdRows, fill_cold

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
        self.shared = None  # rows before the buffers' that a shared prefix holds (engine/prefix_rows.py)

    @property
    def keys(self) -> torch.Tensor | None:
        self.own()
        return None if self._k is None else self._k[:, :, self._start : self._end]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k = value if value is None or value.dim() == 4 else None
        self._start, self._end = 0, 0 if self._k is None else self._k.shape[-2]
        self.shared = None

    @property
    def values(self) -> torch.Tensor | None:
        self.own()
        return None if self._v is None else self._v[:, :, self._start : self._end]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = value if value is None or value.dim() == 4 else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)  # sets empty 1-D tensors: no rows yet
        self._init_rows()

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, H_kv, n, D]`` new rows after the rows in use; returns views of all of them."""
        self.own()
        return self._write(key_states, value_states)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_append` to the buffers alone (shared rows before them stay shared)."""
        n = key_states.shape[-2]
        if self._k is None or self._end + n > self._k.shape[-2]:
            self._grow(key_states, value_states, n)
        self._k[:, :, self._end : self._end + n] = key_states
        self._v[:, :, self._end : self._end + n] = value_states
        self._end += n
        return self.own_rows()

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, start: int, end: int, shared=None) -> None:
        """Take ``keys`` / ``values`` as the buffers, rows ``[start, end)`` in use and the rows
        after them free for appends, after ``shared`` rows a shared prefix holds, if any
        (engine/prefix_rows.py ``fill_prefix``)."""
        self._k, self._v, self._start, self._end, self.shared = keys, values, start, end, shared

    def own(self) -> None:
        """Copy the shared rows in (copy-on-write): every use of the layer but a prompt chunk's
        append and attention (engine/batch.py) reads or changes its rows as one buffer."""
        shared = self.shared
        if shared is None:
            return
        self.shared = None
        used = self._end - self._start
        keys = self._k.new_empty((*self._k.shape[:2], shared.rows + used + BLOCK_ROWS, self._k.shape[-1]))
        values = self._v.new_empty(keys.shape)
        shared.copy_into(keys, values)
        keys[:, :, shared.rows : shared.rows + used] = self._k[:, :, self._start : self._end]
        values[:, :, shared.rows : shared.rows + used] = self._v[:, :, self._start : self._end]
        self._k, self._v, self._start, self._end = keys, values, 0, shared.rows + used

    def own_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the buffers' rows in use (after any shared rows: those are not copied in)."""
        return self._k[:, :, self._start : self._end], self._v[:, :, self._start : self._end]

    def held_bytes(self) -> int:
        """Bytes of the rows this layer holds itself (not the shared ones it refers to)."""
        if self._k is None:
            return 0
        _, heads, _, dim = self._k.shape
        return 2 * heads * (self._end - self._start) * dim * self._k.element_size()

    def _claim_row(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        """:meth:`_append` of one row whose values the caller writes (cpu_kernels/decode_rows.py):
        room for it (``*_states`` give the shape of a row), counted as in use; its index."""
        self.own()
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
        if self.shared is not None and n > self._end - self._start:
            self.own()
        if self._k is None or not 0 < n <= self._end:
            raise ValueError(f"the layer holds {self._end} rows, not the last {n}")
        first = self._end - n
        return self._k[:, :, first : self._end], self._v[:, :, first : self._end]

    def exact(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows in use as tensors of their own (no spare capacity: what a tier stores)."""
        self.own()
        if self._k is None:
            return self.keys, self.values
        if self._start == 0 and self._end == self._k.shape[-2]:
            return self._k, self._v
        return self.keys.clone(), self.values.clone()


class CompressedLayer(BlockRows, DynamicLayer):
    """A full-attention layer whose rows may be a subset of the positions seen, and may also
    hold the rows a selection left out at low precision (``cold``, engine/cold.py): attention
    reads those first, then the kept rows."""

    def __init__(self, **kwargs):
        self._init_rows()
        super().__init__()
        self.logical_len = 0
        self.cold: ColdRows | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self.update_kept(key_states, value_states)
        return (keys, values) if self.cold is None else self.cold.before(keys, values)

    def update_kept(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """:meth:`update` returning the kept rows only (a packed step reads :attr:`cold` itself)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.logical_len += key_states.shape[-2]
        return self._append(key_states, value_states)

    def held_bytes(self) -> int:
        return super().held_bytes() + (0 if self.cold is None else self.cold.nbytes())

    def claim(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """:meth:`update` with one token whose key and value the caller writes: the buffers, the
        new row's index in them and the first row the token sees (cpu_kernels/decode_rows.py)."""
        self.logical_len += 1
        row = self._claim_row(key_states, value_states)
        return self._k, self._v, row, self._start

    def update_shared(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """:meth:`update` of a prompt chunk that keeps the shared rows shared: views of the
        buffers' rows (after :attr:`shared`'s), for the chunk kernel (engine/batch.py)."""
        self.logical_len += key_states.shape[-2]
        return self._write(key_states, value_states)

    @property
    def kept_len(self) -> int:
        if not self.is_initialized or self._k is None:
            return 0
        return self._end - self._start + (0 if self.shared is None else self.shared.rows)

    def get_seq_length(self) -> int:
        return self.logical_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv rows: cold + kept + new; row i of them sits at virtual position (logical - held) + i.
        held = self.kept_len + (0 if self.cold is None else self.cold.rows)
        return held + query_length, self.logical_len - held

    def keep(self, positions: torch.Tensor, rest: KIVI | None = None) -> None:
        """Keep only ``positions`` ([1, H_kv, k], ascending physical rows); of shared rows, only
        those (never copied in whole). ``rest``: the other rows go to :attr:`cold`, quantized
        by it, instead of being dropped."""
        if rest is not None:
            self.own()
            if self.cold is None:
                self.cold = ColdRows()
            self.cold.add_left_out(rest, self.keys, self.values, positions)
        if self.shared is not None:
            keys, values = self.shared.gather(*self.own_rows(), positions)
        else:
            keys = gather_rows(self.keys, positions).contiguous()
            values = gather_rows(self.values, positions).contiguous()
        self.keys, self.values = keys, values

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
    """Exact bytes of every key and value row the cache holds (not shared rows it refers to)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, BlockRows):
            total += layer.held_bytes()
        elif layer.is_initialized and layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


def full_cache_bytes(cache: DynamicCache, logical_len: int) -> int:
    """Bytes the same cache would hold with no compression at ``logical_len`` tokens."""
    total = 0
    for layer in cache.layers:
        some = layer._k if isinstance(layer, BlockRows) else layer.keys  # a tensor of its rows' shape
        if not layer.is_initialized or some is None:
            continue
        _, heads, _, dim = some.shape
        rows = logical_len
        if isinstance(layer, DynamicSlidingWindowLayer):
            rows = min(logical_len, layer.sliding_window - 1)
        total += 2 * heads * rows * dim * some.element_size()
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


def import_kv(config, tensors: list[torch.Tensor], logical_len: int, cold: tuple | None = None) -> DynamicCache:
    """Rebuild a session cache for ``config`` from :func:`export_kv` tensors at ``logical_len``
    tokens, and ``cold`` (engine/cold.py ``export_cold``'s parts and layout) if any."""
    cache = new_session_cache(config)
    fill_kv(cache, tensors, logical_len)
    if cold is not None:
        fill_cold(cache, *cold)
    return cache


def fill_kv(cache: DynamicCache, tensors: list[torch.Tensor], logical_len: int) -> None:
    """Give a new (empty) session cache the rows of :func:`export_kv` tensors at ``logical_len`` tokens."""
    if len(tensors) != 2 * len(cache.layers):
        raise ValueError(f"expected {2 * len(cache.layers)} KV tensors, got {len(tensors)}")
    for i, layer in enumerate(cache.layers):
        keys, values = tensors[2 * i], tensors[2 * i + 1]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        seen(layer, logical_len)


def seen(layer, logical_len: int) -> None:
    """A filled layer's count of the tokens it has seen (a compressed layer's logical length, a
    sliding one's cumulative length)."""
    if isinstance(layer, CompressedLayer):
        layer.logical_len = logical_len
    elif isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = logical_len


def shares_blocks(cache: DynamicCache) -> bool:
    """Whether every layer keeps its rows in :class:`BlockRows` (what sharing a prefix needs)."""
    return all(isinstance(layer, BlockRows) for layer in cache.layers)
