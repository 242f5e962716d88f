"""Per-turn re-selection: a wrapper that keeps every row, and selects each turn's rows afresh.

SnapKV chooses what to keep by looking at the first question, so a follow-up that needs
another part of the document finds it dropped. ``Reselect(inner=SnapKV(...))`` keeps the
full KV of the full-attention layers in host memory as well (the engine's full copy), and
every turn its ``inner`` policy scores all of it with that turn's observation window; the
device cache holds just the selection. It wraps a policy as :class:`Compose` does, so the
engine asks the policy (``reselects``) rather than a session mode string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsnap.errors import InvalidArgument

from .base import Policy, Wrapper


@dataclass(frozen=True, slots=True)
class Reselect(Wrapper, Policy):
    name = "reselect"
    reselects = True

    window: int = field(init=False, default=0)
    budget: int = field(init=False, default=0)
    ratio: float | None = field(init=False, default=None)
    floor: int = field(init=False, default=0)
    rest: str = field(init=False, default="drop")
    inner: Policy | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Policy) or self.inner.reselects:
            raise InvalidArgument("reselect wraps a policy that selects rows (not itself a re-selection)")
        if self.inner.rest != "drop":  # the full copy keeps every row at full precision already
            raise InvalidArgument("recompress='reselect' keeps every row in its full copy: rest must be drop")
        if self.inner.decoder() is not None:
            # re-selection appends every row generated since the last turn to the full copy; a
            # decode-time evictor has dropped some of them from the device cache already
            raise InvalidArgument(
                f"recompress='reselect' does not combine with decode-time eviction ({self.inner.name})"
            )
        self._mirror()

    @property
    def wrapped(self) -> Policy:
        return self.inner

    def fingerprint(self) -> str:
        return f"{self.inner.fingerprint()}+reselect"
