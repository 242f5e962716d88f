"""Tier eviction order (policies/eviction.py's NextUse) and the tiered store that follows it."""

from __future__ import annotations

import torch

from kvsnap.policies import LRU, NextUse
from kvsnap.policies.eviction import PRIOR_GAP_S, SLACK_S
from kvsnap.store.tiers import DeviceTier, HostTier, KVBlob, TieredStore

BLOB_BYTES = 64 * 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def blob() -> KVBlob:
    return KVBlob([torch.zeros(64)], logical_len=1, version=1)


def store(clock: Clock, device: int, host: int, order: str = "next_use") -> TieredStore:
    tiers = TieredStore([DeviceTier(device * BLOB_BYTES), HostTier(host * BLOB_BYTES)], NextUse(clock))
    if order == "lru":  # what the store did before: the least recently used key, always
        tiers.order.victim = lambda keys, sizes=None: next(iter(keys), None)
    return tiers


def rounds(tiers: TieredStore, clock: Clock, sessions: int, count: int) -> list[int]:
    """``count`` rounds of turns over ``sessions`` chats in order (a turn: get, 2 s of work,
    put; 3 s between turns); each round's hits (the chat's KV still in a tier)."""
    hits = []
    for r in range(count):
        found = 0
        for s in range(sessions):
            key = f"t/s{s}"
            found += r > 0 and tiers.get(key) is not None
            clock.now += 2.0
            tiers.put(key, blob())
            clock.now += 3.0
        hits.append(found)
    return hits


def test_a_cycle_of_chats_larger_than_the_tiers_keeps_all_but_the_overflow():
    # 24 chats, room for 22: LRU drops each chat just before its turn comes round
    clock = Clock()
    lru = rounds(store(clock, 11, 11, order="lru"), clock, 24, 4)
    clock = Clock()
    tiers = store(clock, 11, 11)
    next_use = rounds(tiers, clock, 24, 4)
    assert lru[1:] == [0, 0, 0]
    assert next_use[1:] == [22, 22, 22]  # the two that do not fit are rebuilt, no more
    assert tiers.stats.dropped == 2 * 4 and tiers.sessions_by_tier() == {"device": 11, "host": 11}


def test_a_first_round_slower_than_the_prior_gap_abandons_no_session():
    """48 chats, room for 38, a first round of 216 s (past twice the prior gap plus the slack):
    before any chat has come back, none is taken for abandoned, so the 38 asked first are kept
    (with the prior as evidence every follow-up was rebuilt, each rebuild pushing out the next)."""
    clock = Clock()
    tiers = store(clock, 8, 30)
    hits = []
    for r in range(3):
        found = 0
        for s in range(48):
            found += r > 0 and tiers.get(f"t/s{s}") is not None
            clock.now += 4.5
            tiers.put(f"t/s{s}", blob())
        hits.append(found)
    assert 2 * PRIOR_GAP_S + SLACK_S < 48 * 4.5
    assert hits[1:] == [38, 38]


def test_the_device_tier_holds_the_chats_due_next():
    clock = Clock()
    tiers = store(clock, 4, 100)
    rounds(tiers, clock, 10, 2)
    # s0, s1, s2 are asked next: they stay on the device; s9's turn (the last) took the
    # fourth place when it was promoted, pushing down s3, the one due last of those then there
    assert set(tiers.tiers[0].sizes) == {"t/s0", "t/s1", "t/s2", "t/s9"}
    assert tiers.stats.promotions["host->device"] == 6 and tiers.stats.dropped == 0


def test_an_abandoned_session_goes_before_active_ones():
    clock = Clock()
    tiers = store(clock, 3, 0)
    for key in ("t/old", "t/a", "t/b"):
        tiers.put(key, blob())
        clock.now += 10
        tiers.put(key, blob())  # a 10 s gap each
    clock.now += 2 * 10 + SLACK_S + 1  # t/old is idle past twice its gap plus the slack
    tiers.put("t/a", blob())
    tiers.put("t/b", blob())
    tiers.put("t/new", blob())  # over budget: the abandoned one leaves, not the newest
    assert tiers.tier_of("t/old") is None and tiers.tier_of("t/new") == "device"
    assert tiers.take_moves() == {"t/old": "dropped"}


def test_victim_order():
    clock = Clock()
    order = NextUse(clock)
    assert order.victim([]) is None
    order.used("t/a")
    clock.now += 5
    order.used("t/b")
    assert order.typical_gaps() == {}  # no session has come back yet: each takes PRIOR_GAP_S
    assert order.victim(["t/a", "t/b"]) == "t/b"  # seen once each: the newer is due later
    assert order.victim(["t/unknown", "t/a", "t/b"]) == "t/unknown"  # no recorded use: least recently used first
    clock.now += 1
    order.used("t/a")  # a came back after 6 s: due again 6 s from now; b (the median gap: 6 s) at 11 s
    assert order.typical_gaps() == {"t": 6} and order.victim(["t/a", "t/b"]) == "t/a"
    clock.now += 2 * 6 + SLACK_S + 1
    order.used("t/b")  # b is back (its gap: 20 s + the slack); a has been idle past twice its gap
    assert order.victim(["t/b", "t/a"]) == "t/a"  # overdue (abandoned) goes before anything due
    order.forget("t/a")
    assert order.victim(["t/b", "t/a"]) == "t/a"  # forgotten: no recorded use


def test_another_tenants_quick_turns_do_not_make_a_tenants_sessions_look_abandoned():
    clock = Clock()
    order = NextUse(clock)
    order.used("acme/chat")  # seen once: acme's typical gap is the prior, 60 s
    for i in range(20):  # another tenant: many sessions coming back after 1 s
        order.used(f"evil/{i}")
        clock.now += 1
        order.used(f"evil/{i}")
    order.used("evil/old")  # seen once: evil's typical gap is 1 s
    clock.now += 40
    assert order.typical_gaps() == {"evil": 1}
    # acme/chat (idle 60 s) is within twice its tenant's gap plus the slack; evil/old (idle 40 s)
    # is past twice evil's: abandoned, it goes first (with one median for all, acme's would)
    assert order.victim(["acme/chat", "evil/old"]) == "evil/old"


def test_a_tenant_opening_sessions_in_volume_pushes_out_its_own_not_anothers():
    clock = Clock()
    tiers = store(clock, 4, 4)
    for _ in range(2):  # acme: three chats, a turn each every 100 s
        for s in range(3):
            tiers.put(f"acme/c{s}", blob())
            clock.now += 1
        clock.now += 97
    for i in range(20):  # another tenant opens 20 sessions, a second apart, one turn each
        tiers.put(f"flood/s{i}", blob())
        clock.now += 1
    # by the due times alone acme's chats (due in ~80 s) would go before the flood's (seen once:
    # due 60 s after their turn); by tenant, the flood is over its share of each tier and goes
    assert [tiers.tier_of(f"acme/c{s}") for s in range(3)] == ["device", "device", "host"]
    assert tiers.sessions_by_tier() == {"device": 4, "host": 4}
    assert tiers.stats.dropped == 15  # the flood's own: 5 of its 20 kept in the 5 places left


def test_an_abandoned_session_goes_first_whoever_holds_the_most():
    clock = Clock()
    tiers = store(clock, 4, 0)
    tiers.put("small/old", blob())
    clock.now += 10
    tiers.put("small/old", blob())  # a 10 s gap, then idle
    clock.now += 2 * 10 + SLACK_S + 1
    for i in range(3):
        tiers.put(f"big/s{i}", blob())
    tiers.put("big/s3", blob())  # over budget: big holds the most, but small/old is abandoned
    assert tiers.take_moves() == {"small/old": "dropped"}
    assert sorted(tiers.tiers[0].sizes) == ["big/s0", "big/s1", "big/s2", "big/s3"]


def test_lru_is_still_a_plain_use_order():
    lru = LRU()
    for key in ("a", "b", "c", "a"):
        lru.touch(key)
    assert list(lru) == ["b", "c", "a"] and lru.coldest() == "b"
