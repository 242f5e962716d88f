"""SnapKV (Li et al., 2024, arXiv 2404.14469): keep what the end of the prompt attends to.

Observation window = the last ``window`` prompt tokens. Their attention over
the prefix, summed over the window queries, is pooled along the sequence with a
1-D ``kernel`` (so neighbours of a hit survive too) and the top ``budget``
prefix positions per KV head are kept, together with the window itself.

With ``spans`` the engine hands the selection each row's sentence span (engine/spans.py) and a
row is rated by its span's best pooled score: a fact is kept whole or not at all.

Grouped-query attention: scores are computed per query head and reduced within
each KV group (mean or max) only after pooling, so the cache keeps one row set
per KV head and the GQA memory saving survives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsnap.errors import InvalidArgument

from .base import Policy, _check_bool, _check_kernel, window_votes


@dataclass(frozen=True, slots=True)
class SnapKV(Policy):
    name = "snapkv"

    kernel: int = 7
    pooling: str = "max"  # "max" | "avg"
    gqa_reduce: str = "mean"  # "mean" | "max"
    spans: bool = False  # rate a row by its sentence span's best score: spans are kept whole

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        _check_kernel(self.kernel)
        _check_bool("spans", self.spans)
        if self.pooling not in ("max", "avg"):
            raise InvalidArgument(f"pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.gqa_reduce not in ("mean", "max"):
            raise InvalidArgument(f"gqa_reduce must be 'mean' or 'max', got {self.gqa_reduce!r}")

    @property
    def keeps_spans(self) -> bool:
        return self.spans

    def scores(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Pooled prefix scores per KV head: [B, H, w, D] x [B, H_kv, L, D] -> [B, H_kv, L - w]."""
        return self.score(window_queries, keys, scale)

    def score(
        self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None, chunk: int | None = None
    ) -> torch.Tensor:
        """``chunk``: move and score ``keys`` that many rows at a time (``keys`` may then live on
        another device, e.g. a full cache kept in host memory); the result is the same."""
        batch, kv_heads, length = keys.shape[0], keys.shape[1], keys.shape[2]
        w = window_queries.shape[-2]
        votes = window_votes(window_queries, keys, scale, chunk)  # [B, H_kv, G, L - w]
        group = votes.shape[2]
        pooled = self._pool(votes.reshape(batch * kv_heads * group, 1, length - w))
        pooled = pooled.view(batch, kv_heads, group, length - w)
        return pooled.mean(dim=2) if self.gqa_reduce == "mean" else pooled.amax(dim=2)

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.kernel // 2
        if self.pooling == "max":
            return F.max_pool1d(x, self.kernel, stride=1, padding=pad)
        return F.avg_pool1d(x, self.kernel, stride=1, padding=pad, count_include_pad=False)
