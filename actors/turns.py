"""The turn contract: one typed request, validated once at the edge, carried unchanged through
the Ray handle to the worker replica and the worker.

    edge (service/api.py)  --TurnRequest-->  WorkerReplica.turn  --TurnRequest-->  Worker.stream

A session is opened by a turn whose ``new_session`` says how it compresses; every later turn
names the session only. The policy travels as the policy object the edge built and checked
(frozen dataclasses pickle across Ray); the worker stores its JSON in the directory for the
replicas that rebuild the session elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsnap.engine.sampling import SamplingParams
from kvsnap.engine.session import resolve_recompress
from kvsnap.policies import Policy


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """How a new session compresses: its policy and what later turns do to it (``recompress``)."""

    policy: Policy
    recompress: str = "per_turn"  # "reselect" becomes the Reselect wrapper around ``policy``

    def __post_init__(self) -> None:
        policy, recompress = resolve_recompress(self.policy, self.recompress)  # InvalidArgument before any work
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "recompress", recompress)


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn of one session, as the edge validated it."""

    tenant: str
    session_id: str
    tokens: list[int]  # the new tokens (a document, a templated message, raw text)
    sampling: SamplingParams | None = None  # None: prefill only (a session opened with its document)
    new_session: SessionSpec | None = None  # set: open the session with these settings
    log: list[dict] = field(default_factory=list)  # messages appended to the session's message log
    answer_role: str | None = None  # log the answer under this role (None: not logged)
    turn_id: str = ""  # the caller's id for the turn, stored with its commit (the entry's last_turn)
    expected_version: int = 0  # > 0: the session's version the caller built the turn on (else Conflict)
    # the template's turn marker, when ``tokens`` start with it: skipped if the session's
    # transcript ends with it already (the last answer stopped on it)
    marker: list[int] = field(default_factory=list)
    # a new session's scope for implicit sessions ("" = none: never matched by content)
    conversation: str = ""
    # set: the request diverged from the session's history after its first ``keep_turns`` turns;
    # the session goes back to that turn boundary (replayed from its log) before this turn
    keep_turns: int | None = None
    # with ``keep_turns``: also keep the next turn's prompt, its answer dropped (the request repeats
    # that prompt and re-formats the answer, as a client flattening a conversation into text does)
    keep_prompt: bool = False

    @property
    def key(self) -> str:
        """The session's key in a worker (tenant-namespaced)."""
        return f"{self.tenant}/{self.session_id}"

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop if self.sampling is not None else ()


def turn_boundaries(messages: list[dict], marks: list) -> list[int]:
    """How many of a session's logged ``messages`` its first 1, 2, ... turns hold (each turn's
    mark counts the messages it logged): the points a diverging request can take the session
    back to. Empty when the log does not say (a turn logged before marks counted messages)."""
    ends, total = [], 0
    for mark in marks:
        if mark.messages < 0:
            return []
        total += mark.messages
        ends.append(total)
    return ends if ends and total == len(messages) else []
