"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks + a recent window.

Keeps the first ``sinks`` rows and the last ``window`` rows; no attention needed.
Expressed through the base class: the sinks score 1, everything else 0, and the
prefix budget is the number of sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, _check_int


@dataclass(frozen=True, slots=True)
class StreamingLLM(Policy):
    name = "streaming"

    window: int = 512
    sinks: int = 4

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        _check_int("sinks", self.sinks, minimum=1)

    def prefix_budget(self, prefix_len: int) -> int:
        return self.sinks

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        batch, kv_heads, length, _ = keys.shape
        prefix = length - window_queries.shape[-2]
        scores = keys.new_zeros(batch, kv_heads, prefix, dtype=torch.float32)
        scores[..., : self.sinks] = 1.0
        return scores
