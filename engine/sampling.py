"""Decoding parameters and next-token sampling (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvsnap.errors import InvalidArgument


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating after an end-of-sequence token (fixed-length load tests)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidArgument(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise InvalidArgument(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidArgument(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidArgument("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)

    def generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first stop string in it (all of it when none occurs)."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from ``logits`` ([V])."""
    if params.temperature == 0:
        return int(logits.argmax())
    scores = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = scores.sort(descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
