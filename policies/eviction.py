"""Tier eviction order: the session whose next turn is due last leaves first.

Pure bookkeeping, no tensors and no I/O: a tier store asks for the next victim when a tier
is over its byte budget.

Least recently used is the classic order, and the wrong one for conversations. Sessions'
turns come round in cycles: each user reads an answer, then asks again. When a cycle holds
a few more sessions than the tiers do, the least recently used session is always the one
asked next, so LRU drops every session just before its turn (the peer bench's pressure
workload: 21 of 24 follow-ups rebuilt from the token log). :class:`NextUse` instead
predicts each session's next turn from its last two (the gap between them; for a session
seen once, the median gap of its tenant's other sessions, or :data:`PRIOR_GAP_S`) and evicts
the one due last: on a cycle, the one asked most recently (Belady's choice). A session idle
for more than twice its gap plus :data:`SLACK_S` is taken for abandoned and goes first, least
recently used first, so idle sessions do not hold the tiers. Not before any session of its
tenant has come back, though: until then nothing says how long its users take between turns.
With the prior alone, a first round of turns longer than twice the prior plus the slack (48
chats of 3K tokens on 2 cores took 218 s) made its oldest sessions look abandoned; each was
dropped just before its follow-up, and each rebuild pushed out the next (the peer bench's
pressure workload at 48 chats: every follow-up rebuilt). The median is the tenant's own
(keys are ``tenant/...``): another tenant's quick turns do not make a tenant's sessions look
abandoned sooner.

The tier store (store/tiers.py) also shares the tiers between tenants: it passes each key's
bytes, and a live victim is then the one due last of the tenant holding the most bytes.

:class:`LRU` stays as each tier's use order: the order :meth:`NextUse.victim` reads keys in,
so that ties, and keys with no recorded use, go least recently used first.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping

PRIOR_GAP_S = 60.0  # a user's time between turns, before any session has shown its own
SLACK_S = 30.0  # idle this much past twice its gap: abandoned, not just slow to reply


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


class NextUse:
    """Each key's last use and the gap before it; :meth:`victim` is the key needed last."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last: dict[str, float] = {}
        self.gap: dict[str, float] = {}

    def used(self, key: str) -> None:
        """A use of ``key`` (a session's turn committed)."""
        now = self.clock()
        if (prev := self.last.get(key)) is not None:
            self.gap[key] = now - prev
        self.last[key] = now

    def forget(self, key: str) -> None:
        self.last.pop(key, None)
        self.gap.pop(key, None)

    def typical_gaps(self) -> dict[str, float]:
        """Each tenant's median gap (tenants whose sessions have come back)."""
        by_tenant: defaultdict[str, list[float]] = defaultdict(list)
        for key, gap in self.gap.items():
            by_tenant[tenant_of(key)].append(gap)
        return {tenant: statistics.median(gaps) for tenant, gaps in by_tenant.items()}

    def victim(self, keys: Iterable[str], sizes: Mapping[str, int] | None = None) -> str | None:
        """The key of ``keys`` (least recently used first) to evict: a key with no recorded use,
        else the most overdue abandoned one, else the one whose next use is due last. With
        ``sizes`` (each key's bytes in the tier) that last one is the heaviest tenant's: the
        tenant holding the most bytes, over its share whenever the tier is over budget."""
        ranked = list(self._ranks(keys))
        if sizes is not None and _best(ranked, at_least=1) is None:
            held: Counter[str] = Counter()
            for key, _ in ranked:
                held[tenant_of(key)] += sizes.get(key, 0)
            heaviest = max(held, key=held.__getitem__, default=None)  # the first of equals, in use order
            ranked = [(key, rank) for key, rank in ranked if tenant_of(key) == heaviest]
        return _best(ranked, at_least=0)

    def _ranks(self, keys: Iterable[str]) -> Iterator[tuple[str, tuple]]:
        """Each key with its rank, higher leaving sooner: (2,) no recorded use; (1, idle)
        abandoned; (0, when its next use is due)."""
        now, typical = self.clock(), None
        for key in keys:
            last = self.last.get(key)
            if last is None:
                yield key, (2,)
                continue
            if (gap := self.gap.get(key)) is None:
                if typical is None:
                    typical = self.typical_gaps()
                if tenant_of(key) not in typical:  # no session of its tenant has come back yet:
                    yield key, (0, last + PRIOR_GAP_S)  # due by the prior, never taken for abandoned
                    continue
                gap = typical[tenant_of(key)]
            idle = now - last
            yield key, (1, idle) if idle > 2 * gap + SLACK_S else (0, last + gap)


def _best(ranked: Iterable[tuple[str, tuple]], at_least: int) -> str | None:
    """The key of the highest rank whose class is ``at_least`` or more; the first among equals."""
    best, best_rank = None, None
    for key, rank in ranked:
        if rank[0] >= at_least and (best_rank is None or rank > best_rank):
            best, best_rank = key, rank
    return best


def tenant_of(key: str) -> str:
    """The tenant of a tier key: ``tenant/session_id`` (actors/turns.py ``TurnRequest.key``; ids
    hold no "/", actors/held.py), or ``tenant/session_id/full`` for a re-selection's full copy."""
    return key.split("/", 1)[0]


EVICTION_POLICIES = {"lru": LRU, "next_use": NextUse}
