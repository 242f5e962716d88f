"""Full KV: keep every row. The exactness baseline: a resumed session equals one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True, slots=True)
class FullKV(Policy):
    name = "full"

    @property
    def compresses_anything(self) -> bool:
        return False

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        batch, kv_heads, length, _ = keys.shape
        return keys.new_ones(batch, kv_heads, length - window_queries.shape[-2])
