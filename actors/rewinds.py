"""Rewinds: a session taken back to one of its turn boundaries (a request departed from its
history there), replayed from its logs as a rebuild does, or, for the last turn's prompt, the
held KV with the answer's rows cut off when that is exactly the KV the session had there.

A mixin of :class:`~.sessions.SessionStore` (its loading, engine, tiers and locks).
"""

from __future__ import annotations

from kvsnap.engine.session import Session, TurnMark, marks_cover
from kvsnap.errors import Conflict
from kvsnap.store.directory import SessionEntry

from .held import ANSWER_ROLES
from .turns import turn_boundaries


class Rewinds:
    """:meth:`rewound`: the session as it was after its first turns, ready for a new one."""

    def rewound(
        self, key: str, entry: SessionEntry, keep: int, prompt: bool = False
    ) -> tuple[Session, list[dict], int]:
        """The session as it was after its first ``keep`` turns (a request diverged from its
        history there), replayed from its logs as a rebuild does: each turn prefilled and
        compressed where it ran, so the KV is exactly the one the session had at that boundary.
        ``prompt``: also turn ``keep + 1``'s prompt, its answer dropped (a request that repeats
        the prompt and re-formats the answer). For the last turn that is the held KV with the
        answer's rows cut off when :meth:`_cut_answer` can do it exactly, else a replay too.
        Returns the session, the messages it kept, and the tokens replayed. What is held stays
        until the new turn commits (the logs are then rewritten: :meth:`commit` with ``kept``)."""
        with self.lock:
            held, policy = self._current(key, entry)
            if held is not None:
                tokens, marks, messages = list(held.transcript), list(held.marks), list(held.messages)
        if held is None:
            tokens, marks = self._log(entry)
            messages = self.directory.messages(entry.tenant, entry.session_id)
        bounds = turn_boundaries(messages, marks)
        turns = keep + 1 if prompt else keep  # whole turns kept, and a prompt-only one
        answered = prompt and keep < len(marks) and marks[keep].generated > 0 and marks[keep].messages > 1
        if (
            not bounds
            or len(marks) != entry.turns
            or not 0 < turns <= len(marks) - (0 if prompt else 1)
            or (prompt and (not answered or messages[bounds[keep] - 1]["role"] not in ANSWER_ROLES))
            or not marks_cover(marks, len(tokens))
        ):
            what = f"the prompt of its turn {keep + 1}" if prompt else f"its turn {keep}"
            raise Conflict(
                f"session {entry.session_id!r} cannot be taken back to {what} "
                f"(it has {len(marks)} turns, logged as {len(bounds)})"
            )
        kept = marks[:keep]
        start = sum(m.prompt + m.generated for m in kept)
        if prompt:  # the turn as it stood before its answer: prefilled and compressed, nothing generated
            m = marks[keep]
            kept = [*kept, TurnMark(m.prompt, 0, start + m.prompt, m.reselected, "", m.messages - 1)]
            start += m.prompt
            kept_messages = messages[: bounds[keep] - 1]
            if turns == len(marks):
                session = self._cut_answer(key, entry, kept, start)
                if session is not None:
                    self.counters["answers_cut"] += 1
                    return session, kept_messages, 0
        else:
            kept_messages = messages[: bounds[keep - 1]]
        session = self.engine.new_session(policy, entry.recompress, entry.session_id)
        self.replay(session, tokens[:start], kept[-1].logical_len, kept)
        session.turns = turns
        self.counters["rewinds"] += 1
        return session, kept_messages, start

    def _cut_answer(self, key: str, entry: SessionEntry, marks: list[TurnMark], upto: int) -> Session | None:
        """The session with its last answer's rows cut off its KV, back to the first ``upto``
        tokens (``marks``: the turns it then holds), or None when that would not be exactly the
        KV the session had there: a model with sliding-window layers (the answer pushed rows out
        of the window), a policy that drops rows while decoding or re-selects, tiers that quantize.
        Otherwise each full-attention layer appended one row per fed token of the answer after
        its prompt was compressed, so dropping those rows undoes exactly that."""
        engine = self.engine
        if any(t.kivi is not None for t in self.tiers.tiers) or len(engine.full_layers) != engine.attention_layers:
            return None
        with self.lock:  # held here at the entry's version, in a tier: else a replay costs less than a load
            held, policy = self._current(key, entry)
            if held is None or self.tiers.tier_of(key) is None or policy.reselects or engine.prunes_answers(policy):
                return None
        session, source = self.load(key, entry)
        cache = session.cache
        if source in ("rebuilt", "imported"):
            return None
        fed = session.logical_len - upto
        if fed < 0 or any(layer.kept_len < fed for layer in cache.layers):
            return None
        for layer in cache.layers:
            layer.values = layer.values[:, :, : layer.kept_len - fed]  # views: the held blob is never written
            layer.keys = layer.keys[:, :, : layer.kept_len - fed]
            layer.logical_len -= fed
        session.logical_len = upto
        session.transcript = session.transcript[:upto]
        session.marks = list(marks)
        session.turns = len(marks)
        return session
