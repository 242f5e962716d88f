"""Scissorhands (Liu et al., 2023, arXiv 2305.17118): the persistence of importance.

A token that received little attention over the recent steps will receive little later.
Per KV head a layer holds at most ``budget`` + ``window`` rows (``window`` = the paper's r,
the recent rows always kept). When the next row would not fit, ``drop`` x ``budget`` rows
(the paper: half the budget) go at once, so the scoring cost is amortised: the non-recent
rows whose attention was below the step's average (1 / rows attended) most often within the
last ``history`` steps (the paper's w). Ties go to the row with less total attention in the
same steps.

Attention is averaged within each KV group first (the paper's heads are MHA heads). At
prefill the observation window's queries are the history (each one a step), which selects
the ``budget`` prefix rows to keep and seeds the decoding history.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsnap.errors import InvalidArgument

from .base import Policy, _check_int, window_attention
from .decoding import Evictor


def low_attention(window_attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window query i (a step that saw rows j <= L - w + i): which rows got less than the
    average 1 / (L - w + i + 1). window_attn: [B, H_kv, w, L] -> (low bool, attn), both
    [B, H_kv, w, L]; rows a query did not see are neither low nor attended."""
    w, length = window_attn.shape[-2], window_attn.shape[-1]
    seen = torch.arange(length - w + 1, length + 1, device=window_attn.device)  # rows each query saw
    visible = torch.arange(length, device=window_attn.device) < seen.unsqueeze(-1)  # [w, L]
    low = (window_attn < 1.0 / seen.unsqueeze(-1).float()) & visible
    return low, window_attn * visible


class ScissorhandsState:
    __slots__ = ("steps",)

    def __init__(self, history: int):
        # one (low, attn) pair per step, each [B, H_kv, rows the layer had then]
        self.steps: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=history)

    def totals(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Times each of ``length`` rows was below average, and its attention, over the history."""
        low = sum(F.pad(lo.float(), (0, length - lo.shape[-1])) for lo, _ in self.steps)
        attn = sum(F.pad(a, (0, length - a.shape[-1])) for _, a in self.steps)
        return low, attn


@dataclass(frozen=True, slots=True)
class Scissorhands(Evictor, Policy):
    name = "scissorhands"

    window: int = 10  # r: recent rows always kept (and the observation window at prefill)
    budget: int = 256  # rows kept besides the recent ones
    history: int = 400  # w: steps whose attention counts
    drop: float = 0.5  # fraction of the budget evicted at once

    def __post_init__(self) -> None:
        Policy.__post_init__(self)
        self.check_evictor()
        _check_int("history", self.history, minimum=1)
        if isinstance(self.drop, bool) or not isinstance(self.drop, float | int) or not 0.0 < self.drop <= 1.0:
            raise InvalidArgument(f"drop must be a fraction in (0, 1], got {self.drop!r}")

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Higher is kept: minus the low-attention count over the window's steps, ties broken by
        the attention received. [B, H_kv, L - w]."""
        w = window_queries.shape[-2]
        attn = window_attention(window_queries, keys, scale).mean(dim=2)[..., -self.history :, :]
        low, seen = low_attention(attn)
        return _keep_score(low.sum(dim=-2).float(), seen.sum(dim=-2), attn.shape[-2])[..., : keys.shape[-2] - w]

    def start(self, window_attn: torch.Tensor, length: int) -> ScissorhandsState:
        state = ScissorhandsState(self.history)
        low, seen = low_attention(window_attn)
        for i in range(window_attn.shape[-2]):
            state.steps.append((low[:, :, i], seen[:, :, i]))
        return state

    def observe(self, state: ScissorhandsState, attn: torch.Tensor) -> None:
        state.steps.append((attn < 1.0 / attn.shape[-1], attn))

    def keep(self, state: ScissorhandsState, length: int, room: int) -> torch.Tensor:
        recent = min(self.window, length)
        n_drop = max(math.ceil(self.drop * self.budget), length + room - self.capacity())
        n_drop = min(n_drop, length - recent)
        low, attn = state.totals(length)  # [B, H_kv, length]
        score = _keep_score(low, attn, len(state.steps))[..., : length - recent]
        batch, kv_heads = score.shape[0], score.shape[1]
        kept = score.topk(length - recent - n_drop, dim=-1, sorted=False).indices
        tail = torch.arange(length - recent, length, device=score.device).expand(batch, kv_heads, recent)
        positions = torch.cat([kept, tail], dim=-1).sort(dim=-1).values
        state.steps = deque(
            ((_gather(lo, positions, length), _gather(a, positions, length)) for lo, a in state.steps),
            maxlen=self.history,
        )
        return positions


def _keep_score(low: torch.Tensor, attn: torch.Tensor, steps: int) -> torch.Tensor:
    """-count + attention / (steps + 1): the count decides, the attention (< steps) breaks ties."""
    return -low + attn / (steps + 1)


def _gather(x: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(x, (0, length - x.shape[-1])).gather(-1, positions)
