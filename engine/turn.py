"""One turn of one session as a sequence of steps: prefill chunks, then one token per decode step.

The same :class:`Turn` runs alone (``Engine.stream`` drives it: every chunk, then a decode step
of one row per token) and in a batch (``engine/scheduler.py`` interleaves many turns' chunks
and runs one decode step for all of them). The turn owns everything that is one session's
own: its prompt's chunks and compression, its sampling (temperature, top-p/top-k, seed), its
stop strings and token limit, its timings and its mark in the session's log.

    prefill_row(chunk)   # while ``prefilling``: the next chunk of the prompt, a row of a packed
    prefill_done(...)    # step; after the last one it samples the first token
    settle()             # then (once the first token is out) the prompt's compression
    accept(logits)       # after each decode step: sample the next token, or end the turn
    (prefill_step runs one chunk alone)
    finish()             # once, also when cut short: the turn's mark and report

The first token comes from the prompt's last logits, which no compression changes, so it goes
out before the compression runs: a turn's first-token time is its prefill's, and the
compression (SnapKV's scoring of every row, 0.1 s on SmolLM2) runs before the session's first
decode step (:meth:`Turn.settle`, called by whoever drives the turn, and by :meth:`Turn.finish`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from kvsnap.policies import scored_policy

from .batch import Row
from .cache import BLOCK_ROWS, full_layer_indices
from .capture import WindowCapture
from .detok import Detokenizer
from .prefix_rows import blocks_written, fill_prefix, own_all
from .prefixes import PrefixCache, window_queries
from .sampling import SamplingParams, sample_next
from .session import Session, TurnMark, TurnReport


class TurnEngine(Protocol):
    """What a turn (and the scheduler running it) needs of its engine; :class:`~.engine.Engine`
    is one. The engine imports turns; a turn knows the engine by this shape only."""

    tokenizer: object
    eos_ids: set[int]
    max_context: int
    prefill_chunk: int
    prefixes: PrefixCache | None  # shared prompt prefixes (engine/prefixes.py); None: not shared

    def step(self, rows: list[Row]) -> torch.Tensor: ...

    def surrogate(self, kind: str): ...

    def after_prefill(self, job: Prefill) -> None: ...

    def decode_row(self, session: Session, greedy: bool = False) -> Row: ...

    def after_decode(self, row: Row) -> None: ...


@dataclass(slots=True)
class Timer:
    prefill_s: float = 0.0
    compress_s: float = 0.0
    reselect_s: float = 0.0


class Prefill:
    """A prompt (the session's pending tokens plus the new ones) going onto the cache chunk by
    chunk; after the last chunk the session's policy compresses the full-attention layers."""

    def __init__(self, engine: TurnEngine, session: Session, tokens: list[int], timer: Timer, greedy: bool = False):
        """``greedy``: the prompt's next token is taken by argmax (only that is computed exactly)."""
        self.engine, self.session, self.timer, self.greedy = engine, session, timer, greedy
        self.first_turn = session.logical_len == 0
        self.new = session.pending + list(tokens)
        session.transcript.extend(tokens)
        policy = session.policy
        self.window = min(policy.window, len(self.new))
        self.decoder = policy.decoder()
        self.compress = policy.compresses_anything and (self.first_turn or session.recompress != "never")
        layers = set()
        if self.compress or (self.decoder is not None and self.decoder.needs_attention):
            layers = set(full_layer_indices(session.cache))
        scorer = None
        if self.compress and scored_as_passing(policy):
            scorer = engine.surrogate(scored_policy(policy).surrogate).forward
        self.capture = WindowCapture(self.window, layers, scorer)
        self.done = 0  # tokens of ``new`` on the cache
        self.settled = False  # the prompt is all on the cache and compressed (:meth:`settle`)
        self.cached = 0  # of them, those a shared prefix gave (engine/prefixes.py)
        self.prefixes = engine.prefixes if self.first_turn and session.prefix_scope is not None else None
        if self.prefixes is not None and scorer is None:
            self._start_from_prefix()

    def _start_from_prefix(self) -> None:
        """Start from the longest shared prefix of the prompt that leaves one token at least to
        prefill: the rows a prefill of it makes. Where a policy reads the observation window's
        queries (a compression, an evictor) and the prefix reaches into the window, the blocks
        must hold those tokens' queries too (the prefill that made them kept its own window's:
        engine/prefixes.py ``window_queries``), or the prefix stops before the window."""
        session, block = self.session, self.prefixes.block
        window = self.window if self.capture.layers else 0
        start = len(self.new) - window
        blocks = self.prefixes.lookup(session.prefix_scope, self.new, len(self.new) - 1, start if window else None)
        if not blocks:
            return
        n = len(blocks) * block
        spare = len(self.new) - n + BLOCK_ROWS  # the prompt's own tokens and some answer go in place
        fill_prefix(session.cache, blocks, spare)
        session.logical_len = self.done = self.cached = n
        if window and n > start:
            self.capture.queries.update(window_queries(blocks, block, start))

    def _share_blocks(self, n: int) -> None:
        """The whole blocks of the chunk of ``n`` tokens that just went onto a first turn's cache:
        the prefix cache keeps a copy of their rows for the tenant's next sessions (a chunk starts
        on a block: a prompt starts at 0 or on a shared prefix's end, and a chunk is whole blocks)."""
        block, start = self.prefixes.block, self.done - n
        if start % block or n < block:
            return
        blocks = blocks_written(self.session.cache, n, block)
        queries = self.capture.queries  # the window so far: its tokens end here
        window = (self.done - next(iter(queries.values())).shape[-2], queries) if queries else None
        self.prefixes.add_chain(self.session.prefix_scope, self.new[: start + len(blocks) * block], blocks, window)

    @property
    def remaining(self) -> int:
        return len(self.new) - self.done

    def row(self, chunk: int) -> Row:
        """The next ``chunk`` tokens as a row of a packed step (its queries go to the capture)."""
        return Row(self.session, self.new[self.done : self.done + chunk], self.capture, self.greedy)

    def advance(self, n: int, logits: torch.Tensor, elapsed_s: float) -> torch.Tensor | None:
        """``n`` tokens went onto the cache; after the last ones, the next-token logits [V] (the
        prompt is not compressed yet: :meth:`settle`)."""
        self.done += n
        self.timer.prefill_s += elapsed_s
        if self.prefixes is not None:
            self._share_blocks(n)
        return None if self.remaining else logits

    def settle(self) -> None:
        """Once the whole prompt is on the cache: compress it (the session's policy) and start
        decode-time eviction. Idempotent; nothing before the prompt's last chunk."""
        if not self.settled and not self.remaining:
            self.settled = True
            self.engine.after_prefill(self)

    def step(self, chunk: int) -> torch.Tensor | None:
        """Run the next ``chunk`` tokens alone; after the last ones, the next-token logits [V]."""
        row = self.row(chunk)
        t0 = time.perf_counter()
        logits = self.engine.step([row])[0]
        return self.advance(len(row.tokens), logits, time.perf_counter() - t0)


class Turn:
    def __init__(self, engine: TurnEngine, session: Session, tokens: list[int], sampling: SamplingParams | None):
        self.engine, self.session, self.sampling = engine, session, sampling
        self.tokens = list(tokens)
        self.detok = Detokenizer(engine.tokenizer, sampling.stop) if sampling is not None else None
        self.generator = sampling.generator() if sampling is not None else None
        self.timer = Timer()
        self.prefill: Prefill | None = None  # made at the first step: nothing changes before
        self.generated: list[int] = []
        self.finish_reason = "length"  # "stop" (EOS or stop string) | "length"
        self.done = False
        self.report: TurnReport | None = None
        self.started = self.decode_started = 0.0
        self.ttft = 0.0
        self.settle_s = 0.0  # the prompt's compression, run after the first token (settle)
        self.prompt_tokens = len(session.pending) + len(self.tokens)
        self.mark = TurnMark(len(self.tokens), 0, 0, reselected=_has_full_copy(session))

    @property
    def prefilling(self) -> bool:
        return not self.done and (self.prefill is None or self.prefill.remaining > 0)

    @property
    def greedy(self) -> bool:
        """Its tokens are the logits' argmax (temperature 0)."""
        return self.sampling is not None and self.sampling.temperature == 0

    @property
    def decoding(self) -> bool:
        """Waiting for a decode step (its last token is pending in the session)."""
        return not self.done and not self.prefilling

    def next_chunk(self, chunk: int) -> int:
        """Tokens the next :meth:`prefill_step` runs (chunks always start at the prompt's start
        and every ``chunk`` tokens after it: alone or in a batch, the same forward passes).
        Before the turn starts, what the shared prefixes hold of its prompt now is not counted:
        a later chat on a shared document asks for its last few tokens, and rides in a step
        beside others (it starts when its row is made, so it finds the blocks of a first chat
        on the same document that is still prefilling)."""
        if self.prefill is not None:
            return min(chunk, self.prefill.remaining)
        prefixes, session = self.engine.prefixes, self.session
        shared = 0
        starts = session.logical_len == 0 and session.prefix_scope is not None and not scored_as_passing(session.policy)
        if prefixes is not None and starts:  # what Prefill._start_from_prefix will take
            shared = min(prefixes.known(session.prefix_scope, session.pending + self.tokens), self.prompt_tokens - 1)
        return min(chunk, self.prompt_tokens - shared)

    def prefill_step(self, chunk: int) -> int | None:
        """Run the next prompt chunk alone; after the last one, the first generated token (None
        when nothing was generated: a prefill-only turn, or EOS at once)."""
        self._begin()
        return self._chunk_done(self.prefill.step(chunk))

    def prefill_row(self, chunk: int) -> Row:
        """The next prompt chunk as a row of a packed step (the first one starts the prefill)."""
        self._begin()
        return self.prefill.row(chunk)

    def prefill_done(self, row: Row, logits: torch.Tensor, elapsed_s: float) -> int | None:
        """``row`` ran (its logits [V]); after the prompt's last chunk, sample the first token."""
        return self._chunk_done(self.prefill.advance(len(row.tokens), logits, elapsed_s))

    def _begin(self) -> None:
        if self.prefill is None:
            self.started = time.perf_counter()
            self.prefill = Prefill(self.engine, self.session, self.tokens, self.timer, self.greedy)

    @property
    def unsettled(self) -> bool:
        """Its prompt is all on the cache and not compressed yet (:meth:`settle`)."""
        return self.prefill is not None and not self.prefill.remaining and not self.prefill.settled

    def settle(self) -> None:
        """Compress the prompt once it is all on the cache (before the session's next decode
        step; idempotent): see the module's docstring. Its time is the report's ``compress_s``
        (and ``reselect_s``), not ``decode_s``, though it runs after the first token."""
        if self.unsettled:
            t0 = time.perf_counter()
            self.prefill.settle()
            self.settle_s = time.perf_counter() - t0

    def _chunk_done(self, logits: torch.Tensor | None) -> int | None:
        """After a prompt chunk: None until the prompt is done (``logits``), then its first token."""
        if logits is None:
            return None
        self.decode_started = time.perf_counter()
        if self.sampling is None:
            self.done = True
            return None
        return self.accept(logits)

    def accept(self, logits: torch.Tensor) -> int | None:
        """Sample the next token from ``logits`` [V]; it joins the transcript (pending until the
        next decode step feeds it). Returns it, or None when the turn ended on EOS."""
        token = sample_next(logits, self.sampling, self.generator)
        if token in self.engine.eos_ids and not self.sampling.ignore_eos:  # EOS ends the answer, not kept
            self.finish_reason, self.done = "stop", True
            return None
        session = self.session
        session.transcript.append(token)
        self.generated.append(token)
        self.detok.add(token)
        if len(self.generated) == 1:
            self.ttft = time.perf_counter() - self.started
        if self.detok.stopped:  # a stop string appeared (the tokens up to it stay in the session)
            self.finish_reason, self.done = "stop", True
        else:  # the token limit, or the model's context is full
            full = session.logical_len + len(session.pending) >= self.engine.max_context
            self.done = full or len(self.generated) >= self.sampling.max_new_tokens
        return token

    def finish(self) -> TurnReport | None:
        """End the turn (idempotent): its mark goes into the session's log and its report is
        made. A turn cut short keeps every token generated so far. None if it never started."""
        if self.report is not None or self.prefill is None:
            return self.report
        self.settle()
        self.done = True
        session = self.session
        own_all(session.cache)  # shared prefix rows still referred to (nothing compressed away): now its own
        if self.detok is not None:
            self.detok.finish()
        session.turns += 1
        mark = self.mark
        mark.generated, mark.logical_len = len(self.generated), session.logical_len
        mark.stopped_on = self.detok.matched if self.detok is not None else ""
        session.marks.append(mark)
        self.report = TurnReport(
            prompt_tokens=self.prompt_tokens,
            generated_tokens=len(self.generated),
            logical_len=session.logical_len,
            kept_len=session.kept_len,
            kv_bytes=session.kv_bytes,
            full_kv_bytes=session.full_kv_bytes,
            prefill_s=self.timer.prefill_s,
            compress_s=self.timer.compress_s,
            decode_s=time.perf_counter() - self.decode_started - self.settle_s if self.decode_started else 0.0,
            ttft_s=self.ttft,
            reselect_s=self.timer.reselect_s,
            cached_tokens=self.prefill.cached,
        )
        session.reports.append(self.report)
        return self.report


def scored_as_passing(policy) -> bool:
    """A first turn's rows are scored as its chunks pass (KVzap: a surrogate on the attention
    input), so it prefills every row and never starts from shared ones."""
    scored = scored_policy(policy) if policy.compresses_anything else None
    return scored is not None and scored.scored_by == "hidden"


def _has_full_copy(session: Session) -> bool:
    """Whether this turn re-selects from a full copy (always true but for a reselect session that lost it)."""
    return not session.policy.reselects or session.logical_len == 0 or session.full_kv is not None
