"""The per-session KV cache: a transformers ``DynamicCache`` whose full-attention
layers can be compressed in place.

Two lengths per session: ``logical_len`` is how many tokens the
session has seen (the next RoPE position); ``kept_len`` is how many rows a full
layer physically holds. :class:`CompressedLayer` reports ``logical_len`` as its
sequence length and places its kept rows just before the new tokens in mask
space (a virtual offset), so position ids stay logical for every layer, sliding
window layers keep working, and the library's own mask code builds the right
causal mask.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvsnap.policies import gather_rows


class CompressedLayer(DynamicLayer):
    """A full-attention layer whose rows may be a subset of the positions seen."""

    def __init__(self, **kwargs):
        super().__init__()
        self.logical_len = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.logical_len += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    @property
    def kept_len(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.logical_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv rows: kept + new; kept row i sits at virtual position (logical - kept) + i.
        return self.kept_len + query_length, self.logical_len - self.kept_len

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only ``positions`` ([1, H_kv, k], ascending physical rows)."""
        self.keys = gather_rows(self.keys, positions).contiguous()
        self.values = gather_rows(self.values, positions).contiguous()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed layer cannot be cropped")


def new_session_cache(config) -> DynamicCache:
    """A cache for ``config`` with every full-attention layer a :class:`CompressedLayer`."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = CompressedLayer()
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
    """The cache's tensors, ``[k_0, v_0, k_1, v_1, ...]``, each ``[1, H_kv, rows, D]`` (no copy)."""
    tensors = []
    for layer in cache.layers:
        tensors += [layer.keys, layer.values]
    return tensors


def import_kv(config, tensors: list[torch.Tensor], logical_len: int) -> DynamicCache:
    """Rebuild a session cache for ``config`` from :func:`export_kv` tensors at ``logical_len`` tokens."""
    cache = new_session_cache(config)
    if len(tensors) != 2 * len(cache.layers):
        raise ValueError(f"expected {2 * len(cache.layers)} KV tensors, got {len(tensors)}")
    for i, layer in enumerate(cache.layers):
        keys, values = tensors[2 * i], tensors[2 * i + 1]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if isinstance(layer, CompressedLayer):
            layer.logical_len = logical_len
        elif isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = logical_len
    return cache
