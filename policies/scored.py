"""Query-agnostic compression: policies that score each row of a turn without a question.

SnapKV rates the prompt's rows by what its last ``window`` tokens attend to; when a document
arrives before any question, that tail is the document's own end. The policies here score
every row the turn added by another signal, which the engine computes while (or right after)
the turn is prefilled and hands to :meth:`ScoredPolicy.keep_scored`:

- ``kvzip`` (:mod:`.kvzip`): KVzip+ (Kim et al., 2025, arXiv 2505.23416; normalisation of
  KVzap, arXiv 2601.07891), the oracle. After the prompt, the engine runs a scratch pass of
  "repeat the previous context" followed by the context again, on a copy of the cache; a row's
  score is the largest attention any repeated token gives it, times the norm of what that row
  adds to the output (``||W_O v_i||``), over the norm of the repeating token's attention input
  (``||h_j||``), per query head, then the largest within each KV group, as a log.
- ``kvzap`` (:mod:`.kvzap`): a per-layer surrogate (linear, or a 2-layer MLP) trained here
  to predict that log score from the row's own attention input (``bench/compression/train_kvzap.py``),
  computed as each prefill chunk passes: a few multiply-adds per token.

Which rows stay: every row kept before this turn (scored and kept when its own turn ran: a
decision per row, made once); of the turn's rows, the last ``window`` always, and of the
others either the ``budget`` best per KV head (``tau`` unset) or those scoring above ``tau``
(a log score). The cache keeps one row count per layer, so above ``tau`` the count is the
mean over the layer's KV heads, and each head keeps its best that many: the share kept
still follows the text, not a fixed ratio.

With a budget (or ratio), "best" is by the highest score within ``kernel`` rows around each
row (max-pooling, as SnapKV pools its votes; 15 by default, 1 = each row's own score): a
fact is a span of tokens (a number is one token per digit in SmolLM2's vocabulary), and a
span loses its meaning with any one of them. Neither paper pools; the measured effect is in
docs/BENCHMARKS.md, "Compressing before the question". With ``tau`` the default is no
pooling (pooling the rows a threshold keeps, the answers' blocks included, made Gemma 3 270M
repeat its first answer in a trial: 1 of 4 answers against 3 of 4 unpooled); a ``kernel``
set explicitly pools there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsnap.errors import InvalidArgument

from .base import Policy, _check_bool, _check_kernel, span_best

DEFAULT_KERNEL = 15  # pooling of a budget's (or ratio's) choice; none with a threshold


@dataclass(frozen=True, slots=True)
class ScoredPolicy(Policy):
    """A policy whose rows are scored by the engine (``scored_by``), not from window queries."""

    name = "scored"
    scored_by = "none"  # "reconstruction" (KVzip+ scratch pass) | "hidden" (a surrogate on the attention input)

    window: int = 128
    tau: float | None = None  # keep the turn's rows whose log score is above this (unset: ``budget`` of them)
    kernel: int | None = None  # odd: rows are chosen by the best score within ``kernel`` rows (None: pool())
    spans: bool = False  # rows are chosen by the best score within their sentence span (engine/spans.py)

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        _check_bool("spans", self.spans)
        if self.kernel is not None:
            _check_kernel(self.kernel)
        if self.tau is not None and (
            isinstance(self.tau, bool) or not isinstance(self.tau, float | int) or not math.isfinite(self.tau)
        ):
            raise InvalidArgument(f"tau must be a finite number (a log score), got {self.tau!r}")

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        raise InvalidArgument(f"policy {self.name!r} scores rows itself (engine: {self.scored_by}), not by a window")

    def pool(self) -> int:
        """The pooling kernel: ``kernel`` if set, else 15 for a budget and 1 (none) with ``tau``."""
        if self.kernel is not None:
            return self.kernel
        return 1 if self.tau is not None else DEFAULT_KERNEL

    @property
    def keeps_spans(self) -> bool:
        return self.spans

    def keep_scored(
        self, scores: torch.Tensor, length: int, window: int | None = None, spans: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of a layer of ``length`` rows to keep, sorted ascending: ``[B, H_kv, k]``.
        ``scores`` ``[B, H_kv, n]`` rate the layer's last ``n`` rows (this turn's); the rows
        before them all stay, and so do the last ``window`` (default: the policy's). ``spans``
        ([n], ascending span ids of those rows): each row is chosen by its span's best score."""
        batch, kv_heads, n = scores.shape
        device = scores.device
        old = length - n
        if old < 0:
            raise InvalidArgument(f"{n} scores for a layer of {length} rows")
        w = min(self.window if window is None else window, n)
        prefix = scores[..., : n - w]  # the turn's rows that may go
        if self.tau is None:
            k = min(self.prefix_budget(n - w), n - w)
        else:  # how many: the rows' own scores (pooling would inflate the count)
            k = int(torch.round((prefix > self.tau).float().sum(dim=-1).mean()).item()) if n > w else 0
            k = min(max(k, self.floor), n - w)
        kernel = self.pool()
        if kernel > 1 and n > w:  # which: each row by its neighbourhood's best
            flat = prefix.reshape(batch * kv_heads, 1, n - w).float()
            prefix = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).view(batch, kv_heads, n - w)
        if spans is not None and n > w:
            prefix = span_best(prefix.float(), spans[: n - w].to(device))
        chosen = prefix.topk(k, dim=-1).indices + old  # [B, H_kv, k]
        always = torch.cat([torch.arange(old, device=device), torch.arange(length - w, length, device=device)])
        kept = torch.cat([always.expand(batch, kv_heads, -1), chosen], dim=-1)
        return kept.sort(dim=-1).values


def reduce_groups(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, n]`` per query head -> ``[B, H_kv, n]``: the largest within each KV group."""
    batch, heads, n = scores.shape
    return scores.view(batch, kv_heads, heads // kv_heads, n).amax(dim=2)


def scored_policy(policy: Policy) -> ScoredPolicy | None:
    """The scored policy a session's policy selects with (also inside a decode-time composition), or None."""
    inner = getattr(policy, "prefill", None) or policy
    return inner if isinstance(inner, ScoredPolicy) else None
