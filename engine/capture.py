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

from kvsnap.policies.scored import reduce_groups

from .batch import BatchCache, RaggedKV, ragged_attention, sdpa_chunk_attention

ATTN_IMPLEMENTATION = "kvsnap"


class WindowCapture:
    """The last ``window`` queries ([1, H, w, D]) of ``layers``, as a packed step's row feeds them.
    With a ``scorer`` (KVzap's surrogate: layer, attention input ``[t, D]`` -> ``[H_kv, t]``) it
    also scores every row the row's tokens add, from their attention input, as they pass."""

    __slots__ = ("window", "layers", "queries", "scales", "scorer", "scores")
    reads_keys = False  # its add() keeps queries only

    def __init__(self, window: int, layers: set[int], scorer=None):
        self.window = window
        self.layers = layers
        self.queries: dict[int, torch.Tensor] = {}
        self.scales: dict[int, float] = {}
        self.scorer = scorer
        self.scores: dict[int, list[torch.Tensor]] = {}

    @property
    def wants_hidden(self) -> bool:
        return self.scorer is not None

    def add_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The attention input of this row's tokens at a layer ``[t, D]`` (KVzap's features)."""
        if layer_idx in self.layers:
            self.scores.setdefault(layer_idx, []).append(self.scorer(layer_idx, hidden))

    def add(self, layer_idx: int, query: torch.Tensor, scale: float | None, keys: torch.Tensor | None = None) -> None:
        tail = query[:, :, -self.window :, :].detach()
        previous = self.queries.get(layer_idx)
        if previous is not None and tail.shape[-2] < self.window:
            tail = torch.cat([previous, tail], dim=-2)[:, :, -self.window :, :]
        self.queries[layer_idx] = tail
        if scale is not None:
            self.scales[layer_idx] = float(scale)


class ReconstructionCapture:
    """KVzip+ scores of a context's rows, gathered while a scratch pass repeats that context.

    For each full-attention layer in ``starts`` (layer -> the context's first row in it, ``n``
    rows), every repeating query's attention over the layer's rows is computed as sdpa computes
    it (causal within the chunk, softmax over every row), divided by the norm of that token's
    attention input, and the largest value each context row receives is kept per query head.
    :meth:`scores` multiplies in ``||W_O v_i||`` and reduces each KV group (KVzap's KVzip+)."""

    __slots__ = ("starts", "n", "skip", "layers", "norms", "best", "seen")
    reads_keys = True  # its add() scores the layer's rows

    def __init__(self, starts: dict[int, int], n: int, skip: int = 0):
        self.starts, self.n, self.skip, self.layers = starts, n, skip, set(starts)
        self.norms: dict[int, torch.Tensor] = {}
        self.best: dict[int, torch.Tensor] = {}
        self.seen: dict[int, int] = {}  # per layer, the pass's tokens so far (the first ``skip`` only ask)

    wants_hidden = True

    def add_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        if layer_idx in self.layers:
            self.norms[layer_idx] = hidden.float().norm(dim=-1)  # [t]: read by the attention call that follows

    def add(self, layer_idx: int, query: torch.Tensor, scale: float | None, keys: torch.Tensor | None = None) -> None:
        _, heads, t, dim = query.shape
        offset = self.seen.get(layer_idx, 0)
        self.seen[layer_idx] = offset + t
        first = max(0, self.skip - offset)  # the instruction's own queries do not count
        if first >= t:
            return
        kv_heads, length = keys.shape[1], keys.shape[2]
        scale = dim**-0.5 if scale is None else scale
        q = query[:, :, first:].float().view(1, kv_heads, heads // kv_heads, t - first, dim)
        logits = torch.matmul(q, keys.float().unsqueeze(2).transpose(-1, -2)) * scale  # [1, H_kv, G, t', L]
        rows = torch.arange(length - t + first, length, device=q.device)[:, None]  # each query's own row
        later = torch.arange(length, device=q.device)[None, :] > rows  # causal: a query sees rows up to its own
        attn = logits.masked_fill(later, float("-inf")).softmax(dim=-1)
        start = self.starts[layer_idx]
        attn = attn[..., start : start + self.n] / self.norms[layer_idx][first:].clamp_min(1e-6)[:, None]
        best = attn.amax(dim=3).reshape(1, heads, self.n)  # [1, H, n]
        old = self.best.get(layer_idx)
        self.best[layer_idx] = best if old is None else torch.maximum(old, best)

    def scores(self, layer_idx: int, values: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
        """Log KVzip+ scores ``[1, H_kv, n]`` of a layer whose context rows hold ``values``
        ``[1, H_kv, n, D]``; ``o_proj``: the layer's output projection weight ``[hidden, H * D]``."""
        best = self.best[layer_idx]  # [1, H, n]
        heads, kv_heads, dim = best.shape[1], values.shape[1], values.shape[-1]
        w_o = o_proj.float().t().reshape(heads, dim, -1)  # per query head: [D, hidden]
        v = values.float()[0].repeat_interleave(heads // kv_heads, dim=0)  # [H, n, D]
        out_norm = torch.stack([(v[h] @ w_o[h]).norm(dim=-1) for h in range(heads)])  # [H, n]
        return reduce_groups(best * out_norm, kv_heads).clamp_min(1e-30).log()


def hidden_hook(module, args, kwargs) -> None:
    """A forward pre-hook on a full-attention layer's attention module: hands each packed row's
    attention input to its capture when the capture wants it (KVzap, KVzip+)."""
    cache = kwargs.get("cache")
    if not isinstance(cache, BatchCache):
        return
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    for row, (start, end) in zip(cache.rows, cache.spans, strict=True):
        capture = row.capture
        if capture is not None and capture.wants_hidden:
            capture.add_hidden(module.layer_idx, hidden[0, start:end])


def _capturing_sdpa(module, query, key, value, attention_mask, **kwargs):
    if isinstance(key, RaggedKV):  # a packed step: each row on its own session's rows, its own capture
        cpu = query.device.type == "cpu" and kwargs.get("softcap") is None  # CUDA's kernels want no mask with GQA
        return ragged_attention(
            sdpa_chunk_attention if cpu else sdpa_attention_forward, module, query, key, value, **kwargs
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the capturing attention (idempotent); returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _capturing_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
