"""Replay: a lost session's KV recreated from its token log, turn by turn as it ran.

A mixin of :class:`~.engine.Engine` (it runs the engine's ``prefill`` and decode steps).
"""

from __future__ import annotations

import torch

from kvsnap.errors import InvalidArgument

from .session import Session, TurnMark, marks_cover


class Replay:
    """:meth:`rebuild`: the exact replay of a session's turns (prefill, compression, decode)."""

    def rebuild(
        self, session: Session, transcript: list[int], logical_len: int, marks: list[TurnMark] | None = None
    ) -> None:
        """Recreate a lost KV from the token log. With the turns' ``marks`` (the normal case) it
        replays history: each turn's prefill and compression, then its generated tokens fed back
        as they were decoded (decode-time eviction included), so the cache equals the lost one.
        Without them (a log written before marks existed) it prefills the first ``logical_len``
        tokens in one pass; the rest stay pending, as they were."""
        if not 0 < logical_len <= len(transcript) or session.logical_len:
            raise InvalidArgument("rebuild needs an empty session and 0 < logical_len <= len(transcript)")
        if marks and marks_cover(marks, len(transcript)) and marks[-1].logical_len == logical_len:
            self._replay(session, transcript, marks)
            return
        self.prefill(session, transcript[:logical_len])
        session.transcript.extend(transcript[logical_len:])

    @torch.inference_mode()
    def _replay(self, session: Session, transcript: list[int], marks: list[TurnMark]) -> None:
        start = 0
        for mark in marks:
            if session.policy.reselects and not mark.reselected:
                session.full_kv = None  # this turn ran as plain SnapKV: its full copy was gone
            prompt_end = start + mark.prompt
            self.prefill(session, transcript[start:prompt_end])
            for token in transcript[prompt_end : prompt_end + mark.generated]:
                session.transcript.append(token)
                if session.logical_len < mark.logical_len:
                    self._decode_step(session)  # as the turn fed it back
            start = prompt_end + mark.generated
            session.marks.append(mark)
