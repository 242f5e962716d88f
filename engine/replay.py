"""Replay: a lost session's KV recreated from its token log, turn by turn as it ran.

A replay is steps, like a turn (engine/turn.py): each logged turn's prompt goes on in chunks and
is compressed, then the tokens it generated are fed back one decode step each, as the turn fed
them (decode-time eviction included). :class:`Replaying` is those steps in the shape the
scheduler runs (engine/scheduler.py), so a rebuild rides in the batch beside the running turns,
a chunk a step, instead of holding every one of them up for its whole prefill; ``rebuild`` runs
the same steps alone. Either way the cache equals the lost one: chunks are cut the same way and
every row is computed from its own session only.

:class:`Replay` is a mixin of :class:`~.engine.Engine` (it runs the engine's prefill and decode steps).
"""

from __future__ import annotations

import torch

from kvsnap.errors import InvalidArgument

from .session import Session, TurnMark, marks_cover
from .turn import Turn


class Replay:
    """:meth:`rebuild`: the exact replay of a session's turns (prefill, compression, decode)."""

    def replaying(
        self, session: Session, transcript: list[int], logical_len: int, marks: list[TurnMark] | None = None
    ) -> Replaying | None:
        """The replay of ``marks`` onto the empty ``session``, as steps for the scheduler; None
        when the marks do not describe the whole log (a log written before marks existed:
        :meth:`rebuild` prefills it in one pass)."""
        if not 0 < logical_len <= len(transcript) or session.logical_len:
            raise InvalidArgument("rebuild needs an empty session and 0 < logical_len <= len(transcript)")
        if marks and marks_cover(marks, len(transcript)) and marks[-1].logical_len == logical_len:
            return Replaying(self, session, transcript, marks)
        return None

    @torch.inference_mode()
    def rebuild(
        self, session: Session, transcript: list[int], logical_len: int, marks: list[TurnMark] | None = None
    ) -> None:
        """Recreate a lost KV from the token log, alone. With the turns' ``marks`` (the normal
        case) it replays history (:class:`Replaying`), so the cache equals the lost one. Without
        them (a log written before marks existed) it prefills the first ``logical_len`` tokens
        in one pass; the rest stay pending, as they were."""
        replay = self.replaying(session, transcript, logical_len, marks)
        if replay is None:
            self.prefill(session, transcript[:logical_len])
            session.transcript.extend(transcript[logical_len:])
            return
        while not replay.done:
            if replay.prefilling:
                replay.prefill_step(self.prefill_chunk)
            else:
                replay.settle()
                replay.accept(self.decode_step([session], greedy=True)[0])


class Logged(Turn):
    """One logged turn fed again: its prompt, then its generated tokens in place of sampling,
    each fed by a decode step while the KV is short of the length the turn left it at (the last
    one stays pending, as it did). Its logits are not read: its rows are greedy (the head's
    cheap path). Its end appends the logged mark, not a new one."""

    def __init__(self, engine, session: Session, prompt: list[int], generated: list[int], mark: TurnMark):
        if session.policy.reselects and not mark.reselected:
            session.full_kv = None  # this turn ran as plain SnapKV: its full copy was gone
        super().__init__(engine, session, prompt, None)
        self.forced, self.logged = generated, mark
        self.ended = False

    @property
    def greedy(self) -> bool:
        return True

    def _chunk_done(self, logits: torch.Tensor | None) -> None:
        if logits is not None:
            self.accept(logits)

    def accept(self, logits: torch.Tensor) -> None:
        """The next logged token joins the transcript; fed by the next decode step while the KV
        is short of the logged length, else the rest follow it unfed and the turn ends."""
        session = self.session
        while len(self.generated) < len(self.forced):
            token = self.forced[len(self.generated)]
            session.transcript.append(token)
            self.generated.append(token)
            if session.logical_len < self.logged.logical_len:
                return  # a decode step feeds it
        self.done = True

    def finish(self) -> None:
        if not self.ended and self.prefill is not None:
            self.ended = self.done = True
            self.settle()
            self.session.marks.append(self.logged)


class Replaying:
    """A session's logged turns (:class:`Logged`) one after the other, as one job of the
    scheduler: it has the steps' shape of a :class:`~.turn.Turn` and hands out no tokens. Each
    turn starts once the one before it ended (it reads the session as that one left it)."""

    detok = None  # no text
    greedy = True

    def __init__(self, engine, session: Session, transcript: list[int], marks: list[TurnMark]):
        self.engine, self.session = engine, session
        self._plan = []  # (prompt, generated, mark) of each turn, in order
        start = 0
        for mark in marks:
            end = start + mark.prompt
            self._plan.append((transcript[start:end], transcript[end : end + mark.generated], mark))
            start = end + mark.generated
        self.current: Logged | None = None
        self._advance()

    def _advance(self) -> None:
        """Past every turn that ended: finish it, start the next."""
        while self.current is None or self.current.done:
            if self.current is not None:
                self.current.finish()
            if not self._plan:
                self.current = None
                return
            self.current = Logged(self.engine, self.session, *self._plan.pop(0))

    @property
    def done(self) -> bool:
        return self.current is None

    @property
    def prefill(self):  # the current turn's prompt (a cancelled job mid-prompt finishes it first)
        return None if self.done else self.current.prefill

    @property
    def prefilling(self) -> bool:
        return not self.done and self.current.prefilling

    @property
    def decoding(self) -> bool:
        return not self.done and self.current.decoding

    @property
    def unsettled(self) -> bool:
        return not self.done and self.current.unsettled

    def next_chunk(self, chunk: int) -> int:
        return self.current.next_chunk(chunk)

    def prefill_row(self, chunk: int):
        return self.current.prefill_row(chunk)

    def prefill_done(self, row, logits: torch.Tensor, elapsed_s: float) -> None:
        self.current.prefill_done(row, logits, elapsed_s)
        self._advance()

    def prefill_step(self, chunk: int) -> None:
        """The next prompt chunk alone."""
        self.current.prefill_step(chunk)
        self._advance()

    def settle(self) -> None:
        if not self.done:
            self.current.settle()

    def accept(self, logits: torch.Tensor) -> None:
        self.current.accept(logits)
        self._advance()

    def finish(self) -> None:
        """Nothing to report (a cut-short replay leaves a session nobody keeps)."""
        self.settle()
