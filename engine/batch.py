"""One forward pass for many sessions at once, each on its own cache: a packed step.

A step packs every row's new tokens into one sequence ``[1, T]``: a decoding session brings
its one pending token, a prefilling session the next chunk of its prompt. Everything but
attention (embeddings, projections, MLPs, norms, and the LM head on each row's last token)
runs once over the packed tokens, which reads the weights once for all rows: that is where a
decode step's time goes, and a small prompt chunk shares that read instead of paying its own. Each token
carries its own RoPE position (its session's ``logical_len`` onwards).

At every layer :class:`BatchCache` writes row b's new keys and values into session b's own cache
layer and hands the attention function a :class:`RaggedKV`: per row, views of that session's
rows (its kept rows plus the new ones; of a layer that still refers to a shared prefix's rows,
only those after them: the chunk kernel reads both) and the row's mask, so no cache is padded,
stacked or copied per step, and a row can only ever attend to its own session's rows. A row of
one token sees every row its layer returns (a full layer returns its kept rows, a sliding layer
its last ``window - 1``): no mask. A row of a prompt chunk gets a causal mask, banded to the
window on sliding-window layers (the same masks transformers builds for one session).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvsnap.cpu_kernels import chunk_attention, cold_attention, decode_attention, decode_rows

from .cache import BlockRows, CompressedLayer, SlidingLayer
from .cold import ColdRows
from .session import Session


class Capture(Protocol):
    """What a row's capture does in a packed step (engine/capture.py has the two kinds: a
    prompt's observation window or a decode step's query, and KVzip+'s scratch pass)."""

    layers: set[int]
    wants_hidden: bool
    reads_keys: bool  # whether :meth:`add` reads the keys it is given (absent: taken as True)

    def add(self, layer_idx: int, query: torch.Tensor, scale: float | None, keys: torch.Tensor | None = None): ...

    def add_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None: ...


# A 4-D mask makes transformers' mask builders return it as it is (they build none); the
# ragged attention ignores it.
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


@dataclass(slots=True)
class Row:
    """One session's part of a packed step: its new tokens, the capture that keeps their
    queries (a prompt's observation window, a decode-time evictor's step) if any, and whether
    only the argmax of its logits is wanted (greedy decoding: engine/models/head.py)."""

    session: Session
    tokens: list[int]
    capture: Capture | None = None
    greedy: bool = False


class RaggedKV(list):
    """One layer's keys (or values) for a packed step: one ``[1, H_kv, rows_b, D]`` view per row,
    with each row's query span in the packed sequence, its capture, and the layer's window (None:
    full attention); :meth:`mask` makes a row's mask where an attention function wants one."""

    def __init__(self, spans, captures=None, window=None, masks=None):
        super().__init__()
        self.spans, self.captures, self.window, self._masks = spans, captures, window, masks
        self.fast: decode_rows.OneTokenRows | None = None  # rows appended in C (their entries here: None)
        self.shared: dict[int, CompressedLayer] = {}  # keys' only: rows whose entry is only the rows after shared ones
        self.cold: dict[int, ColdRows] = {}  # keys' only: rows whose layer also holds quantized rows (engine/cold.py)

    def mask(self, b: int) -> torch.Tensor | None:
        start, end = self.spans[b]
        return self._masks(end - start, self[b].shape[-2], self.window, self[b])


class BatchCache:
    """The cache object a packed forward sees: row ``b``'s keys and values go to session ``b``'s
    own cache layer, and attention gets each row's layer back."""

    is_compileable = False

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self.layers = rows[0].session.cache.layers  # layer kinds, for code that inspects them
        self._masks: dict[tuple, torch.Tensor | None] = {}  # (q, k, window) -> mask, made once a step
        self.spans, start = [], 0
        for row in rows:
            self.spans.append((start, start + len(row.tokens)))
            start += len(row.tokens)
        self._single = [b for b, row in enumerate(rows) if len(row.tokens) == 1]  # fast-path candidates
        self._usable: bool | None = None  # decode_rows.usable, once a step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]  # every session's layer is of the model's kind
        window = layer.sliding_window if isinstance(layer, SlidingLayer) else None
        keys = RaggedKV(self.spans, [row.capture for row in self.rows], window, self._mask)
        values = RaggedKV(self.spans)
        fast = self._fast_rows(layer_idx, key_states, value_states)
        if fast:
            layers = [self.rows[b].session.cache.layers[layer_idx] for b in fast]
            keys.fast = decode_rows.append(fast, layers, [self.spans[b][0] for b in fast], key_states, value_states)
        skip = set(fast)
        for b, (row, (start, end)) in enumerate(zip(self.rows, self.spans, strict=True)):  # key_states: [1, H_kv, T, D]
            if b in skip:
                keys.append(None)
                values.append(None)
                continue
            session_layer = row.session.cache.layers[layer_idx]
            if getattr(session_layer, "shared", None) is not None and end - start > 1:  # a chunk: kernel
                k, v = session_layer.update_shared(key_states[:, :, start:end], value_states[:, :, start:end])
                keys.shared[b] = session_layer
            elif getattr(session_layer, "cold", None) is not None:  # its quantized rows: read in ragged_attention
                k, v = session_layer.update_kept(key_states[:, :, start:end], value_states[:, :, start:end])
                keys.cold[b] = session_layer.cold
            else:
                k, v = session_layer.update(key_states[:, :, start:end], value_states[:, :, start:end])
            keys.append(k)
            values.append(v)
        return keys, values

    def _fast_rows(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
        """The rows cpu_kernels/decode_rows.py appends and attends at this layer: one token, no capture
        of the layer, an initialized cache layer of ours, bf16 on a CPU with the kernel built."""
        if not self._single or not isinstance(self.layers[layer_idx], BlockRows):
            return []
        if self._usable is None:
            self._usable = decode_rows.takes(key_states, value_states)
        if not self._usable:
            return []
        return [
            b
            for b in self._single
            if (capture := self.rows[b].capture) is None or layer_idx not in capture.layers
            if (layer := self.rows[b].session.cache.layers[layer_idx]).is_initialized
            and getattr(layer, "cold", None) is None  # a layer with quantized rows: torch reads them
        ]

    def _mask(self, q: int, k: int, window: int | None, like: torch.Tensor) -> torch.Tensor | None:
        """:func:`mask` for this step, made once for all the layers that share its shape."""
        key = (q, k, window)
        if key not in self._masks:
            self._masks[key] = mask(q, k, window, like)
        return self._masks[key]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("a packed step has one length per row: pass position_ids")


def mask(q: int, k: int, window: int | None, like: torch.Tensor) -> torch.Tensor | None:
    """``[1, 1, q, k]`` additive mask (0 = attend, -inf = not) in ``like``'s dtype and device for
    ``q`` new tokens that are the last ``q`` of ``k`` rows: causal, and within ``window`` rows on
    a sliding layer (SDPA turns a boolean mask into this one on every call; made once, its calls
    are faster). None where attention needs no mask: one token (it sees every row), or a
    prompt's first chunk on an empty cache (``q == k``) with no window cutting it, plain causal,
    which SDPA runs without one, skipping the blocks above the diagonal (about 60 % of the
    time). Either way the results are the same, bit for bit (tests/engine/test_chunk_mask_and_sdpa.py)."""
    if q == 1 or (q == k and (window is None or window >= q)):
        return None
    i = torch.arange(q, device=like.device).unsqueeze(1) + (k - q)  # each query's row index
    j = torch.arange(k, device=like.device).unsqueeze(0)
    hidden = j > i
    if window is not None:
        hidden |= j <= i - window
    additive = torch.zeros(hidden.shape, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))
    return additive[None, None]


def ragged_attention(attend, module, query: torch.Tensor, keys: RaggedKV, values: RaggedKV, **kwargs):
    """``attend`` (an attention function) row by row; query ``[1, H, T, D]`` -> ``[1, T, H, D]``.
    In bf16 / fp16 on a CPU, a one-token row takes :func:`one_token_attention` or the decode
    kernel (cpu_kernels/decode_attention.py) instead, and a prompt chunk in bf16 the AMX kernel where the CPU
    has one (cpu_kernels/chunk_attention.py), which also reads a session's shared prefix rows where its
    blocks hold them (engine/prefix_rows.py); elsewhere those are copied in first."""
    outputs, fused = [], []  # fused: the one-token rows the kernel takes, in one call (cpu_kernels/decode_attention.py)
    layer_idx = getattr(module, "layer_idx", None)
    own = _one_token_pays(query) and kwargs.get("softcap") is None
    fast = own and decode_attention.available()
    chunks = own and chunk_attention.available()
    cold_kernel = own and cold_attention.available()
    fused_cold = []  # the one-token rows with quantized rows the kernel takes (cpu_kernels/cold_attention.py)
    scale = kwargs.get("scaling")  # None: the function's own default (a capture records only a given one)
    kernel_scale = query.shape[-1] ** -0.5 if scale is None else scale  # what the C kernels are handed
    appended = keys.fast  # rows cpu_kernels/decode_rows.py appended: the kernel takes them, or they become views
    if appended is not None and not (fast and query.shape[1] // appended.kv_heads <= decode_attention.MAX_GROUP):
        for i, b in enumerate(appended.index):
            keys[b], values[b] = appended.views(i)
        appended = None
    for b, (start, end) in enumerate(keys.spans):
        if keys[b] is None:  # appended: below
            outputs.append(None)
            continue
        q = query[:, :, start:end]
        capture = keys.captures[b]
        referring = keys.shared.get(b)  # its layer: rows after a shared prefix's, the kernel reads both
        if referring is not None and (
            reads_keys(capture, layer_idx) or not (chunks and chunk_attention.takes(q, keys[b], values[b]))
        ):
            keys[b], values[b] = referring.keys, referring.values  # copied in: one buffer, as any other row's
            referring = None
        if capture is not None and layer_idx in capture.layers:
            capture.add(layer_idx, q, scale, keys[b])  # a layer's kept rows (an evictor scores those)
        if (cold := keys.cold.get(b)) is not None:
            view = None
            if own and end - start == 1 and cold_kernel and cold_attention.takes(q, keys[b], values[b]):
                view = cold_attention.segments(cold)  # None: the kernel cannot read these rows
            if view is not None:
                fused_cold.append((b, q, view))
                outputs.append(None)
                continue
            keys[b], values[b] = cold.before(keys[b], values[b])
        if own and end - start == 1:
            if fast and decode_attention.takes(q, keys[b], values[b]):
                fused.append((b, q))
                outputs.append(None)
            else:
                outputs.append(one_token_attention(q, keys[b], values[b], scale))
        elif chunks and chunk_attention.takes(q, keys[b], values[b]):
            shared = None if referring is None else referring.shared
            outputs.append(chunk_attention.attention(q, keys[b], values[b], kernel_scale, keys.window, shared=shared))
        else:
            outputs.append(attend(module, q, keys[b], values[b], keys.mask(b), **kwargs)[0])
    if fused:
        rows = [b for b, _ in fused]
        queries = [q for _, q in fused]
        done = decode_attention.one_token_rows(
            queries, [keys[b] for b in rows], [values[b] for b in rows], kernel_scale
        )
        for b, out in zip(rows, done, strict=True):
            outputs[b] = out
    if fused_cold:
        rows = [b for b, _, _ in fused_cold]
        queries, views = [q for _, q, _ in fused_cold], [view for _, _, view in fused_cold]
        rows_k, rows_v = [keys[b] for b in rows], [values[b] for b in rows]
        done = cold_attention.one_token_rows(queries, rows_k, rows_v, views, kernel_scale)
        for b, out in zip(rows, done, strict=True):
            outputs[b] = out
    if appended is not None:
        columns = [keys.spans[b][0] for b in appended.index]
        done = appended.attend(query, columns, kernel_scale)  # [R, H, D]
        if len(columns) == len(outputs):  # every row (a decode step): the outputs in packed order
            return done[None], None
        for i, b in enumerate(appended.index):
            outputs[b] = done[i][None, None]
    return torch.cat(outputs, dim=1), None


def reads_keys(capture: Capture | None, layer_idx: int | None) -> bool:
    """Whether ``capture`` reads this layer's keys (one that does not say is taken to)."""
    return capture is not None and layer_idx in capture.layers and getattr(capture, "reads_keys", True)


def sdpa_chunk_attention(
    module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scaling=None, **kwargs
):
    """A prompt chunk's rows on a CPU: SDPA with the row's mask, each KV head shared by its query
    heads (transformers' SDPA wrapper copies keys and values once per query head when a mask
    is given; the results are the same, bit for bit). No mask on several rows is causal (as
    transformers reads it, :func:`mask`). Query ``[1, H, T, D]`` -> ``[1, T, H, D]``."""
    causal = mask is None and query.shape[2] > 1
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=query.shape[1] != keys.shape[1]
    )
    return out.transpose(1, 2), None


def _one_token_pays(query: torch.Tensor) -> bool:
    """torch's CPU flash kernel takes 2-3 ms for one bf16 query against 1-2K rows; two float32
    matrix products take about a seventh of that (docs/BENCHMARKS.md, "The decode step").
    float32 and CUDA keep SDPA."""
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def one_token_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None):
    """Attention of one token over every row (no mask): query ``[1, H, 1, D]``, keys / values
    ``[1, H_kv, L, D]`` -> ``[1, 1, H, D]``. All in float32, as SDPA's kernels accumulate, so the
    result equals SDPA's up to the output's own rounding: a prompt chunk of one token (which a
    batched step may cut where a session alone would not) answers as SDPA would. Each KV head's
    query heads (grouped-query attention) share one product with its keys."""
    _, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    scale = dim**-0.5 if scale is None else scale
    q = query.float().view(1, kv_heads, heads // kv_heads, dim)  # [1, H_kv, G, D]
    weights = torch.softmax(torch.matmul(q, keys.float().transpose(-1, -2)) * scale, dim=-1)  # [1, H_kv, G, L]
    out = torch.matmul(weights, values.float()).to(values.dtype)  # [1, H_kv, G, D]
    return out.view(1, 1, heads, dim)


def packed_inputs(rows: list[Row], device) -> dict:
    """The forward's inputs for one packed step: every row's tokens at its own positions."""
    ids, positions = [], []
    for row in rows:
        ids += row.tokens
        positions += range(row.session.logical_len, row.session.logical_len + len(row.tokens))
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long, device=device),  # [1, T]
        "position_ids": torch.tensor([positions], dtype=torch.long, device=device),  # [1, T]
        "cache": BatchCache(rows),
        "attention_mask": _NO_MASK.to(device),
        "use_cache": True,
    }
