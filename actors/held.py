"""What a worker keeps of its sessions between turns, and what it lends one turn: the records
the session store (:mod:`.sessions`), its loading (:mod:`.loading`) and rewinds
(:mod:`.rewinds`) share."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsnap.engine.session import Session, TurnMark
from kvsnap.policies import Policy
from kvsnap.store.directory import SessionEntry

from .claims import Claim

ANSWER_ROLES = {"assistant", "completion"}  # how a turn's answer is logged


@dataclass(slots=True)
class Held:
    """What this worker knows of a session it holds (the KV itself is in the tiers)."""

    entry: SessionEntry  # as last committed (or to be replayed, when ``dirty``)
    transcript: list[int]
    messages: list[dict]  # the message log (HTTP / OpenAI APIs), for re-registration
    marks: list[TurnMark] = field(default_factory=list)  # each turn's place in the transcript (replays)
    policy: Policy | None = None  # the entry's policy, built once
    dirty: bool = False  # committed locally while Redis was unreachable


@dataclass(slots=True)
class Lease:
    """A session lent to one turn (:meth:`~.sessions.SessionStore.checkout`): its claim, the
    directory entry the turn builds on, the session ready to run, where its KV came from, and
    for a rewind the messages it kept and the tokens replayed. Handed back once
    (:meth:`~.sessions.SessionStore.checkin`)."""

    claim: Claim
    entry: SessionEntry
    session: Session
    source: str  # new / device / host / disk / imported / rebuilt / rewound
    kept: list[dict] | None = None  # a rewind: the messages the session keeps
    replayed: int = 0  # a rewind: the tokens replayed


def copy_entry(entry: SessionEntry) -> SessionEntry:
    return SessionEntry(**{f: getattr(entry, f) for f in entry.__slots__})


def full_key(key: str) -> str:
    """Where a reselect session's full copy lives in the tiers ("/" never occurs in ids)."""
    return f"{key}/full"
