"""Decode-time eviction: the contract of policies that drop rows while a turn generates,
and the wrapper that pairs one of them with a prefill policy.

SnapKV compresses the prompt once; every generated token still adds a row to each
full-attention layer. An :class:`Evictor` (H2O, Scissorhands, StreamingLLM) bounds that:
before each decoding step the engine asks it which rows to keep so that the step's new
row still fits in ``capacity()``. Policies that need attention get it one step at a time
(:func:`~kvsnap.policies.base.step_attention`: one query row over the layer's rows), never
a whole attention matrix.

    make_policy("snapkv", budget=512, decode={"policy": "h2o", "budget": 128, "window": 32})

builds ``Compose(prefill=SnapKV(...), decode=H2O(...))``: SnapKV selects at prefill,
H2O evicts while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvsnap.errors import InvalidArgument

from .base import POLICIES, Policy, Wrapper


class Evictor:
    """Mixin for a :class:`Policy` that also evicts while decoding.

    A layer's per-turn eviction state is whatever :meth:`start` returns; the engine hands it
    back to :meth:`observe` after every step and to :meth:`keep` when the layer is full.
    Rows are physical rows of the layer (ascending = older first); the last ``window`` rows
    are the recent ones every evictor keeps.
    """

    __slots__ = ()
    needs_attention = True  # False: observe() is never called and no attention is computed

    def decoder(self) -> Policy:
        return self

    def capacity(self) -> int:
        """Rows per KV head a full-attention layer holds at most while decoding."""
        return self.budget + self.window

    def check_evictor(self) -> None:
        if self.ratio is not None or self.floor:
            raise InvalidArgument(f"{self.name} keeps a fixed number of rows: give budget, not ratio or floor")

    def start(self, window_attn: torch.Tensor | None, length: int):
        """The eviction state of a layer of ``length`` rows after prefill. ``window_attn``:
        [B, H_kv, w, length], the observation window's attention (group mean; window query i
        sees rows j <= length - w + i); None only for evictors that do not need attention."""
        return None

    def observe(self, state, attn: torch.Tensor) -> None:
        """One decoding step's attention over the layer's rows: [B, H_kv, rows] (group mean)."""

    def keep(self, state, length: int, room: int) -> torch.Tensor:
        """Rows to keep ([B, H_kv, k], ascending, k <= capacity - room) of a layer holding
        ``length`` rows so that ``room`` new rows fit; updates ``state`` to the kept rows."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Compose(Wrapper, Policy):
    """``prefill``'s selection when a prompt is prefilled, ``decode``'s eviction while decoding.
    ``window``, ``budget``, ``ratio``, ``floor`` and ``rest`` mirror the prefill policy's."""

    name = "compose"

    window: int = field(init=False, default=0)
    budget: int = field(init=False, default=0)
    ratio: float | None = field(init=False, default=None)
    floor: int = field(init=False, default=0)
    rest: str = field(init=False, default="drop")
    prefill: Policy | None = None
    decode: Policy | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefill, Policy) or isinstance(self.prefill, Compose):
            raise InvalidArgument("compose needs a prefill policy (not itself a composition)")
        if not isinstance(self.decode, Evictor):
            raise InvalidArgument(
                f"decode policy must evict while decoding (one of {', '.join(evictor_names())}), "
                f"got {getattr(self.decode, 'name', self.decode)!r}"
            )
        self._mirror()

    @property
    def wrapped(self) -> Policy:
        return self.prefill

    def decoder(self) -> Policy:
        return self.decode

    def fingerprint(self) -> str:
        return f"{self.prefill.fingerprint()}+decode:{self.decode.fingerprint()}"


def evictor_names() -> list[str]:
    """Registered policies that also evict while decoding (usable as ``decode``)."""
    return sorted(n for n, cls in POLICIES.items() if issubclass(cls, Evictor))
