"""Decoding: every session's pending token in one packed step, with decode-time eviction (a
policy's decoder, or KVzap scoring the answer's rows) before and after it.

A mixin of :class:`~.engine.Engine` (it reads the engine's ``step`` and ``surrogate``).
"""

from __future__ import annotations

import torch

from kvsnap.errors import InvalidArgument
from kvsnap.policies import Policy, scored_policy, step_attention

from .batch import Row
from .cache import CompressedLayer
from .capture import WindowCapture
from .session import Session


class Decoding:
    """The decode half of :class:`~.engine.Engine`: a packed decode step and its evictors."""

    def _make_room(self, session: Session, decoder: Policy, room: int) -> None:
        """Evict so that ``room`` new rows fit in every full-attention layer's capacity."""
        for idx, state in session.decoding.items():
            layer: CompressedLayer = session.cache.layers[idx]
            if layer.kept_len + room > decoder.capacity():
                positions = decoder.keep(state, layer.kept_len, room).to(layer.keys.device)
                layer.keep(positions.expand(layer.keys.shape[0], layer.keys.shape[1], -1))

    @torch.inference_mode()
    def decode_step(self, sessions: list[Session], greedy: bool = False) -> torch.Tensor:
        """Feed every session its pending token in one packed forward; next-token logits ``[B, V]``
        (``greedy``: only their argmax is wanted)."""
        rows = [self.decode_row(session, greedy) for session in sessions]
        logits = self.step(rows)
        for row in rows:
            self.after_decode(row)
        return logits

    @torch.inference_mode()
    def decode_row(self, session: Session, greedy: bool = False) -> Row:
        """A session's row in a decode step: its pending token. A decode-time evictor makes room
        first, and gets a capture of this step's query when it scores by attention."""
        if len(session.pending) != 1:
            raise InvalidArgument(f"a decode step feeds one pending token; the session has {len(session.pending)}")
        decoder = session.policy.decoder()
        capture = None
        if decoder is not None:
            self._make_room(session, decoder, 1)
            if decoder.needs_attention:
                capture = WindowCapture(1, set(session.decoding))
        elif session.decoding and self.prunes_answers(session.policy):  # KVzap with a threshold
            net = self.surrogate(scored_policy(session.policy).surrogate)
            capture = WindowCapture(1, set(session.decoding), net.forward)
        return Row(session, session.pending, capture, greedy)

    @torch.inference_mode()
    def after_decode(self, row: Row) -> None:
        """Let a decode-time evictor see the step's attention over its session's rows."""
        if row.capture is None:
            return
        session, decoder = row.session, row.session.policy.decoder()
        if decoder is None:  # KVzap scoring its answer's rows
            self._zap_answer(session, row.capture)
            return
        for idx, state in session.decoding.items():
            query = row.capture.queries[idx]  # [1, H, 1, D]
            attn = step_attention(query, session.cache.layers[idx].keys, row.capture.scales.get(idx))
            decoder.observe(state, attn)  # attn: [1, H_kv, rows]

    @staticmethod
    def prunes_answers(policy: Policy) -> bool:
        """Whether ``policy`` drops rows while decoding: a decode-time evictor, or KVzap with a
        threshold (it scores the answer's rows too)."""
        if policy.decoder() is not None:
            return True
        scored = scored_policy(policy)
        return scored is not None and scored.scored_by == "hidden" and scored.tau is not None

    def _zap_answer(self, session: Session, capture: WindowCapture) -> None:
        """KVzap while decoding (with ``tau``): each step's new row gets its surrogate score; once
        ``window`` rows of the answer are older than the last ``window``, that block is pruned
        like a prompt's rows (per KV head, the mean count above ``tau``, each head's best)."""
        policy = scored_policy(session.policy)
        w = policy.window
        for idx in session.decoding:
            new = torch.cat(capture.scores.pop(idx))[None]  # [1, H_kv, 1]
            pending = new if session.decoding[idx] is None else torch.cat([session.decoding[idx], new], dim=-1)
            if pending.shape[-1] >= 2 * w:  # the oldest w are out of the recent window: decide them
                layer: CompressedLayer = session.cache.layers[idx]
                recent = pending.shape[-1] - w  # the rows after that block stay, undecided
                layer.keep(policy.keep_scored(pending, layer.kept_len, window=recent).to(layer.keys.device))
                pending = pending[..., w:]
            session.decoding[idx] = pending

    def _decode_step(self, session: Session) -> torch.Tensor:
        return self.decode_step([session])[0]

    @torch.inference_mode()
    def force(self, session: Session, token: int) -> torch.Tensor:
        """Append ``token`` as if it had been generated (teacher forcing: decode-time eviction
        runs as in a turn); returns the next-token logits [V]."""
        if session.logical_len == 0 or session.pending:
            raise InvalidArgument("force continues a prefilled session whose last token is in its cache")
        session.transcript.append(token)
        return self._decode_step(session)
