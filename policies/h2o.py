"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023, arXiv 2306.14048): keep the rows with the
highest accumulated attention plus the most recent ones, evicting while decoding.

Per KV head a layer holds at most ``budget`` heavy hitters + ``window`` recent rows. Each
decoding step adds its query's attention (averaged within the KV group) to every row's
running sum; when the next row would not fit, the non-recent rows with the lowest sums go.

At prefill the paper sums the attention of every prompt query; kvsnap sums that of the
observation window (the last ``window`` prompt tokens), which needs a w x L attention slice
instead of L x L, and starts the decoding sums from the same slice over the kept rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Policy, window_attention
from .decoding import Evictor


class H2OState:
    __slots__ = ("acc",)

    def __init__(self, acc: torch.Tensor):
        self.acc = acc  # [B, H_kv, rows]: attention each row has received this turn


@dataclass(frozen=True, slots=True)
class H2O(Evictor, Policy):
    name = "h2o"

    window: int = 32  # recent rows always kept (and the observation window at prefill)
    budget: int = 256  # heavy hitters kept besides the recent rows

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        self.check_evictor()

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Accumulated window attention over the prefix: [B, H_kv, L - w]."""
        w = window_queries.shape[-2]
        attn = window_attention(window_queries, keys, scale).mean(dim=2)  # [B, H_kv, w, L]
        return attn.sum(dim=-2)[..., : keys.shape[-2] - w]

    def start(self, window_attn: torch.Tensor, length: int) -> H2OState:
        return H2OState(window_attn.sum(dim=-2))

    def observe(self, state: H2OState, attn: torch.Tensor) -> None:
        state.acc = F.pad(state.acc, (0, attn.shape[-1] - state.acc.shape[-1])) + attn  # new rows start at 0

    def keep(self, state: H2OState, length: int, room: int) -> torch.Tensor:
        recent = min(self.window, length)
        heavy = max(0, min(self.capacity() - room - recent, length - recent))
        acc = F.pad(state.acc, (0, length - state.acc.shape[-1]))  # [B, H_kv, length]
        batch, kv_heads = acc.shape[0], acc.shape[1]
        top = acc[..., : length - recent].topk(heavy, dim=-1, sorted=False).indices
        tail = torch.arange(length - recent, length, device=acc.device).expand(batch, kv_heads, recent)
        positions = torch.cat([top, tail], dim=-1).sort(dim=-1).values
        state.acc = acc.gather(-1, positions)
        return positions
