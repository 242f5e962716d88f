"""Tier eviction order: least recently used first.

Pure bookkeeping, no tensors and no I/O: a tier asks ``coldest()`` for the next
victim when it is over its byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class LRU:
    """Keys in use order; ``touch`` on every access, ``coldest`` is the eviction victim."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def coldest(self) -> str | None:
        return next(iter(self._order), None)

    def __contains__(self, key: str) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


EVICTION_POLICIES = {"lru": LRU}
