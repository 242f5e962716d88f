"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks + a recent window.

Keeps the first ``sinks`` rows and the last ``window`` rows; no attention needed. At
prefill this is the base class's selection with the sinks scoring 1 and everything else
0 (prefix budget = the sinks); while decoding it evicts the oldest non-sink row before each
new one, so a layer never holds more than ``sinks + window`` rows: unbounded generation in
bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, _check_int
from .decoding import Evictor


@dataclass(frozen=True, slots=True)
class StreamingLLM(Evictor, Policy):
    name = "streaming"
    needs_attention = False

    window: int = 512
    sinks: int = 4

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        self.check_evictor()
        _check_int("sinks", self.sinks, minimum=1)

    def prefix_budget(self, prefix_len: int) -> int:
        return self.sinks

    def capacity(self) -> int:
        return self.sinks + self.window

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        batch, kv_heads, length, _ = keys.shape
        prefix = length - window_queries.shape[-2]
        scores = keys.new_zeros(batch, kv_heads, prefix, dtype=torch.float32)
        scores[..., : self.sinks] = 1.0
        return scores

    def keep(self, state, length: int, room: int) -> torch.Tensor:
        sinks = min(self.sinks, length)
        recent = max(0, min(self.capacity() - room - sinks, length - sinks))
        rows = list(range(sinks)) + list(range(length - recent, length))
        return torch.tensor(rows).view(1, 1, -1)
