"""Observation-window query capture, architecture-agnostic.

SnapKV needs the post-RoPE queries of the last ``window`` prompt tokens at every
full-attention layer. Rather than re-deriving them per architecture, kvsnap
registers its own attention implementation with transformers ("kvsnap"): plain
SDPA, except in a packed step (:mod:`.batch`), where it runs row by row on each row's own
session and a row that brings a :class:`WindowCapture` has it keep the last ``window`` query
rows of the layers it was asked for. Prefill may run in chunks; the capture keeps a rolling
tail across them. Eager attention for the whole prompt is never needed.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .batch import RaggedKV, ragged_attention

ATTN_IMPLEMENTATION = "kvsnap"


class WindowCapture:
    """The last ``window`` queries ([1, H, w, D]) of ``layers``, as a packed step's row feeds them."""

    __slots__ = ("window", "layers", "queries", "scales")

    def __init__(self, window: int, layers: set[int]):
        self.window = window
        self.layers = layers
        self.queries: dict[int, torch.Tensor] = {}
        self.scales: dict[int, float] = {}

    def add(self, layer_idx: int, query: torch.Tensor, scale: float | None) -> None:
        tail = query[:, :, -self.window :, :].detach()
        previous = self.queries.get(layer_idx)
        if previous is not None and tail.shape[-2] < self.window:
            tail = torch.cat([previous, tail], dim=-2)[:, :, -self.window :, :]
        self.queries[layer_idx] = tail
        if scale is not None:
            self.scales[layer_idx] = float(scale)


def _capturing_sdpa(module, query, key, value, attention_mask, **kwargs):
    if isinstance(key, RaggedKV):  # a packed step: each row on its own session's rows, its own capture
        return ragged_attention(sdpa_attention_forward, module, query, key, value, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the capturing attention (idempotent); returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _capturing_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
