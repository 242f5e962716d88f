"""The base class every KV compression policy derives from.

A policy is a small frozen dataclass with one method, ``score``: given the
observation-window queries and the keys of one layer, rate every prefix position
per KV head. The base class owns everything else: when to compress at all, how
many rows to keep, top-k, always keeping the window, and gathering the rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvsnap.cpu_kernels import snapkv_votes
from kvsnap.errors import InvalidArgument

# Every policy by name (filled by ``register_policy`` in policies/__init__.py). A policy's
# parameters are its dataclass fields, declared once: the HTTP schema, the gRPC ``params`` map,
# the CLI flags and ``kvsnap eval`` specs all read them there.
POLICIES: dict[str, type[Policy]] = {}

# What happens to the rows a selection does not keep: dropped (eviction), or kept at 2 or 4
# bits (KIVI groups) beside the selected rows, which stay at the cache's precision (engine/cold.py)
RESTS = ("drop", "kivi2", "kivi4")


@dataclass(frozen=True, slots=True)
class Policy:
    """Keep ``budget`` prefix rows (or ``ratio`` of the prefix) plus the last ``window`` rows.

    ``floor`` (with a ratio, or a scored policy's ``tau``): the fewest prefix rows a selection
    keeps, so a prefix of ``floor`` rows or fewer is kept whole (a ratio alone halves a
    two-sentence document too). 0: none.

    ``rest``: the rows the selection leaves out are dropped (``drop``) or kept KIVI-quantized
    at 4 or 2 bits (``kivi4`` / ``kivi2``: mixed precision; attention reads both).

    Subclasses implement :meth:`score`. ``window`` is also how many trailing
    prompt tokens the engine records queries for (the observation window).
    """

    name = "base"
    reselects = False  # True for a wrapper that selects each turn from a full copy (reselect.py)

    window: int = 32
    budget: int = 512
    ratio: float | None = None
    floor: int = 0
    rest: str = "drop"

    def __post_init__(self) -> None:
        _check_int("window", self.window, minimum=1)
        if self.rest not in RESTS:
            raise InvalidArgument(f"rest must be one of {', '.join(RESTS)}, got {self.rest!r}")
        _check_int("budget", self.budget, minimum=1)
        if self.ratio is not None and not (isinstance(self.ratio, float | int) and 0.0 < self.ratio < 1.0):
            raise InvalidArgument(f"ratio must be a number in (0, 1), got {self.ratio!r}")
        _check_int("floor", self.floor, minimum=0)
        if self.floor and self.ratio is None and getattr(self, "tau", None) is None:
            raise InvalidArgument(
                "floor is the fewest rows a ratio (or tau) keeps: give a ratio with it, or a budget alone"
            )

    # -- what subclasses provide -------------------------------------------------------
    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Rate prefix positions. window_queries: [B, H, w, D]; keys: [B, H_kv, L, D] -> [B, H_kv, L - w]."""
        raise NotImplementedError

    # -- shared machinery --------------------------------------------------------------
    @property
    def compresses_anything(self) -> bool:
        """False for policies that never drop a row (``full``): the engine skips query capture."""
        return True

    @property
    def keeps_spans(self) -> bool:
        """True when the engine should hand :meth:`select` the rows' sentence spans (see
        :func:`span_best`); policies with a ``spans`` parameter say so by it."""
        return False

    def prefix_budget(self, prefix_len: int) -> int:
        """How many prefix rows to keep out of ``prefix_len`` (a ratio's share, at least ``floor``)."""
        if self.ratio is not None:
            return max(1, math.ceil(self.ratio * prefix_len), self.floor)
        return self.budget

    def compresses(self, length: int, window: int | None = None) -> bool:
        """True when a layer of ``length`` rows would lose rows (prompts <= budget + window are left alone)."""
        w = self.window if window is None else window
        return self.compresses_anything and length - w > self.prefix_budget(length - w)

    def select(
        self,
        window_queries: torch.Tensor,
        keys: torch.Tensor,
        scale: float | None = None,
        logical_len: int | None = None,
        chunk: int | None = None,
        spans: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows to keep, sorted ascending, window included: [B, H_kv, k], on the queries' device.

        The window is the last ``window_queries.shape[-2]`` rows of ``keys``. ``logical_len``
        (tokens seen, when ``keys`` is already a compressed subset) sizes a ``ratio`` budget.
        ``chunk`` (policies that read keys, e.g. SnapKV): score ``keys`` that many rows at a
        time, so that ``keys`` may stay on another device (a full cache in host memory).
        ``spans`` ([L], ascending span ids of the rows of ``keys``): a row is rated by the best
        score of its span, so a span is kept whole or not at all (but for the last one chosen).
        """
        batch, kv_heads, length, _ = keys.shape
        w = window_queries.shape[-2]
        device = window_queries.device
        if w > length:
            raise InvalidArgument(f"observation window ({w}) is longer than the sequence ({length})")
        k = min(self.prefix_budget((logical_len or length) - w), length - w)
        if not self.compresses_anything or k >= length - w:
            return torch.arange(length, device=device).expand(batch, kv_heads, length)
        if chunk is None:
            scores = self.score(window_queries, keys, scale)  # [B, H_kv, L - w]
        else:
            scores = self.score(window_queries, keys, scale, chunk=chunk)
        if spans is not None:
            scores = span_best(scores, spans[: length - w].to(device))
        # unsorted: the same rows (a top-k picks its set before it sorts it), and both ways below
        # put them in order; sorting 2K of them took 0.4 ms a layer, 8x the pick, on every turn
        prefix = scores.topk(k, dim=-1, sorted=False).indices
        if device.type == "cpu":  # the chosen rows in order, by a mask (a sort cost 10x more here)
            keep = torch.zeros(batch, kv_heads, length, dtype=torch.bool)
            keep.scatter_(-1, prefix, True)
            keep[..., length - w :] = True
            return keep.nonzero()[:, -1].view(batch, kv_heads, k + w)
        tail = torch.arange(length - w, length, device=device).expand(batch, kv_heads, w)
        return torch.cat([prefix, tail], dim=-1).sort(dim=-1).values  # no host sync (nonzero's)

    def fingerprint(self) -> str:
        """A stable string naming the policy and every parameter (stored with a session)."""
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}({params})"

    def decoder(self) -> Policy | None:
        """The policy that evicts rows while decoding (an :class:`~kvsnap.policies.decoding.Evictor`),
        or None: a turn's generated rows then stay until the next turn compresses."""
        return None


class Wrapper:
    """Mixin for a policy that selects rows as the policy it wraps does (``wrapped``): Compose
    and Reselect. Its ``window``, ``budget``, ``ratio``, ``floor`` and ``rest`` mirror the wrapped policy's (the
    window is the observation window the engine captures); call :meth:`_mirror` after checks."""

    __slots__ = ()

    @property
    def wrapped(self) -> Policy:
        raise NotImplementedError

    def _mirror(self) -> None:
        for name in ("window", "budget", "ratio", "floor", "rest"):
            object.__setattr__(self, name, getattr(self.wrapped, name))

    @property
    def compresses_anything(self) -> bool:
        return self.wrapped.compresses_anything

    def prefix_budget(self, prefix_len: int) -> int:
        return self.wrapped.prefix_budget(prefix_len)

    @property
    def keeps_spans(self) -> bool:
        return self.wrapped.keeps_spans

    def select(self, window_queries, keys, scale=None, logical_len=None, chunk=None, spans=None) -> torch.Tensor:
        return self.wrapped.select(window_queries, keys, scale, logical_len, chunk, spans)

    def score(self, window_queries, keys, scale=None) -> torch.Tensor:
        return self.wrapped.score(window_queries, keys, scale)


def window_attention(
    window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None, chunk: int | None = None
) -> torch.Tensor:
    """Attention of the observation-window queries over ``keys``, per query head, causal:
    [B, H, w, D] x [B, H_kv, L, D] -> [B, H_kv, G, w, L] (G = H / H_kv; float32).

    The window is the last w rows of ``keys``: window query i sits at position L - w + i and
    sees keys j <= L - w + i. ``chunk``: move ``keys`` to the queries' device that many rows at
    a time (the logits are w x L, small; only the keys are big).
    """
    batch, heads, w, dim = window_queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if heads % kv_heads:
        raise InvalidArgument(f"{heads} query heads do not split into {kv_heads} KV groups")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    groups = heads // kv_heads
    # a KV head's G x w queries as the rows of one product with its keys (a [.., G, w, D] query
    # against [.., 1, L, D] keys would copy the keys G times to broadcast them)
    q = window_queries.float().reshape(batch, kv_heads, groups * w, dim)  # [B, H_kv, G * w, D]
    # a power of two (1 / sqrt(64), Gemma 3's 1 / 16) scales every product and sum exactly: on the
    # queries it is the same logits bit for bit, without a pass over all of them
    folded = math.frexp(scale)[0] == 0.5
    if folded:
        q = q * scale
    step = chunk or length
    parts = []
    for start in range(0, length, step):
        k = keys[:, :, start : start + step].to(q.device, non_blocking=True).float()
        parts.append(torch.matmul(q, k.transpose(-1, -2)))  # [B, H_kv, G * w, step]
    logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    logits = logits.view(batch, kv_heads, groups, w, length)  # [B, H_kv, G, w, L]
    if not folded:
        logits = logits * scale
    causal = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)
    logits[..., length - w :].masked_fill_(causal, float("-inf"))
    return logits.softmax(dim=-1)


def window_votes(
    window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None, chunk: int | None = None
) -> torch.Tensor:
    """SnapKV's votes: each window query's causal attention (:func:`window_attention`) summed over
    the window, for the rows before it: [B, H, w, D] x [B, H_kv, L, D] -> [B, H_kv, G, L - w]
    (float32). bf16 on a CPU with the prompt-chunk kernel's flags: one C pass
    (cpu_kernels/snapkv_votes.py, the same sums within float32 rounding, ~4x faster); else torch's.
    Keys that lie in more than one place vote their own way (engine/prefix_rows.py ``LayerKeys``)."""
    if (own_way := getattr(keys, "window_votes", None)) is not None and chunk is None:
        return own_way(window_queries, scale)
    w, length = window_queries.shape[-2], keys.shape[2]
    cpu_bf16 = keys.device.type == "cpu" and keys.dtype == torch.bfloat16
    if chunk is None and cpu_bf16 and snapkv_votes.takes(window_queries, keys):
        scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else scale
        return snapkv_votes.votes(window_queries, keys, scale)
    return window_attention(window_queries, keys, scale, chunk)[..., : length - w].sum(dim=-2)


def step_attention(query: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of one decoding query over every row of a layer, averaged within each KV group:
    [B, H, 1, D] x [B, H_kv, L, D] -> [B, H_kv, L] (float32). One step sees every row."""
    return window_attention(query[:, :, -1:], keys, scale).mean(dim=2)[:, :, 0]


def span_best(scores: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Every row rated by the best score within its span: [B, H_kv, n] with spans [n] (ascending
    ids, a span's rows contiguous) -> [B, H_kv, n]. A fact is a span of tokens (a 5-digit number
    is five rows for a tokenizer that writes digits one by one); rows that share a rating are
    kept together by a top-k."""
    batch, heads, n = scores.shape
    index = spans.view(1, 1, n).expand(batch, heads, n)
    best = scores.new_full((batch, heads, int(spans[-1]) + 1 if n else 0), float("-inf"))
    best.scatter_reduce_(-1, index, scores, reduce="amax")
    return best.gather(-1, index)


def gather_rows(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """states: [B, H_kv, L, D], positions: [B, H_kv, k] -> [B, H_kv, k, D]: whole rows copied by
    one index over the rows of every (batch, head) (a gather's index per value is D times
    larger). ``states`` may be a view of a larger buffer (a cache layer's rows in use): its rows
    are read in place, where its strides are whole rows."""
    batch, heads, length, dim = states.shape
    if states.stride(-1) != 1 or states.stride(-2) != dim or any(s % dim for s in states.stride()[:2]):
        states = states.contiguous()
    per_batch, per_head = states.stride(0) // dim, states.stride(1) // dim  # in rows
    span = (batch - 1) * per_batch + (heads - 1) * per_head + length  # rows from the first to the last
    rows = states.as_strided((span, dim), (dim, 1))  # every row of the buffer in between, in place
    first = torch.arange(batch, device=positions.device).view(batch, 1, 1) * per_batch
    first = first + torch.arange(heads, device=positions.device).view(1, heads, 1) * per_head
    picked = rows.index_select(0, (positions + first).flatten())
    return picked.view(batch, heads, positions.shape[-1], dim)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false, got {value!r}")


def _check_kernel(kernel: object) -> None:
    """A pooling kernel over rows: a positive odd integer (so pooling keeps the length)."""
    _check_int("kernel", kernel, minimum=1)
    if kernel % 2 == 0:
        raise InvalidArgument(f"kernel must be odd (so pooling keeps the length), got {kernel}")
