"""The worker engine: prefill, compress and decode on a session's compressed KV.

Usable in-process, without Ray or Redis:

    engine = Engine(load_model("tiny-llama"))
    session = engine.new_session(make_policy("snapkv", budget=64, window=8))
    result = engine.turn(session, tokens, SamplingParams(max_new_tokens=16))

A turn reads like a recipe: prefill the new tokens onto the cache (true RoPE
positions), compress the full-attention layers with the session's policy, then
decode, streaming token ids. Generated tokens stay in the transcript for the next turn.
The turn itself is a :class:`~.turn.Turn` (its steps); here it runs alone, one decode step
of one row per token. ``engine/scheduler.py`` runs many turns' steps together; both run
:meth:`Engine.step`, one packed forward over any number of sessions' rows (engine/batch.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvsnap.errors import InvalidArgument
from kvsnap.policies import FullKV, Policy, gather_rows, make_policy, scored_policy, step_attention, window_attention
from kvsnap.policies.kvzap import Surrogate, trained_for, weights_path
from kvsnap.policies.kvzip import REPEAT_PROMPT

from .batch import Row, packed_inputs
from .cache import CompressedLayer, export_kv, full_layer_indices, import_kv, new_session_cache
from .capture import ReconstructionCapture, WindowCapture, hidden_hook
from .detok import Detokenizer
from .head import LMHead
from .models import LoadedModel
from .sampling import SamplingParams
from .session import Session, TurnMark, TurnReport, marks_cover
from .spans import layer_spans, span_ends
from .turn import Prefill, Timer, Turn


@dataclass(slots=True)
class TurnResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    report: TurnReport
    source: str = ""  # set by a worker: where the KV came from (device / host / disk / rebuilt / new)


@dataclass(slots=True)
class TurnStream:
    """Generated token ids as they come; ``finish_reason`` and ``report`` are set once it ends."""

    tokens: Iterator[int] | None = None
    finish_reason: str = "length"
    report: TurnReport | None = None
    source: str = ""  # set by a worker: where the KV came from (device / host / disk / rebuilt / new)
    on_close: Callable[[], None] | None = None  # set by a worker: give the session back (idempotent)
    cancel: Callable[[], None] | None = None  # set by a worker: stop the turn from any thread (client gone)
    detok: Detokenizer | None = None  # the answer's text as it grows, cut at the first stop string

    def __iter__(self) -> Iterator[int]:
        return self.tokens

    @property
    def text(self) -> str:
        """The answer's text as a caller gets it: up to the first stop string (without it)."""
        return self.detok.text if self.detok is not None else ""

    def close(self) -> None:
        """Stop generating (the client went away); the session stays consistent. A stream that
        is never iterated must be closed, so that its session is free for the next turn."""
        try:
            self.tokens.close()
        finally:
            if self.on_close is not None:
                self.on_close()


RESELECT_CHUNK = 4096  # rows of the host-side full cache moved to the device at a time for scoring


class Engine:
    def __init__(self, loaded: LoadedModel, *, prefill_chunk: int = 1024, greedy_screen: bool | None = None):
        """``greedy_screen``: greedy rows' argmax through a bf16 screen (engine/head.py); None:
        where it pays (a large fp32 head on a CPU with bf16 kernels)."""
        if prefill_chunk < 1:
            raise InvalidArgument(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.prefill_chunk = prefill_chunk
        text = loaded.model.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_context = text.max_position_embeddings
        self.eos_ids = loaded.eos_token_ids
        # the LM head computed here (engine/head.py) knows softcapping only; a model that scales its
        # logits otherwise (Granite's logits_scaling, Cohere's logit_scale) gets its own forward's
        self._own_head = all(getattr(text, name, None) in (None, 1, 1.0) for name in ("logits_scaling", "logit_scale"))
        softcap = getattr(text, "final_logit_softcapping", None)
        self.head = LMHead(self.model, softcap, greedy_screen if self._own_head else False)
        # the full-attention layers' attention modules: their input goes to captures that want it
        cache = new_session_cache(self.model.config)
        self.attention_layers = len(cache.layers)  # every attention layer, sliding-window ones too
        self.full_layers = full_layer_indices(cache)
        self.attention = {
            m.layer_idx: m
            for m in self.model.modules()
            if hasattr(m, "o_proj") and getattr(m, "layer_idx", None) in self.full_layers
        }
        for module in self.attention.values():
            if not getattr(module, "_kvsnap_hooked", False):  # one hook per module: engines may share a model
                module.register_forward_pre_hook(hidden_hook, with_kwargs=True)
                module._kvsnap_hooked = True
        self._span_ends: torch.Tensor | None = None  # engine/spans.py, built when a policy first needs it
        self.surrogates: dict[str, Surrogate] = {}  # KVzap's, by kind, loaded when first asked for
        self.repeat_ids = self.encode(REPEAT_PROMPT, first=False)  # what KVzip+'s scratch pass asks first

    # -- sessions ------------------------------------------------------------------------
    def new_session(
        self, policy: Policy | str = "snapkv", recompress: str = "per_turn", session_id: str | None = None
    ) -> Session:
        policy = make_policy(policy) if isinstance(policy, str) else policy
        cache = new_session_cache(self.model.config)
        return Session(session_id or uuid.uuid4().hex, policy, recompress, self.loaded.fingerprint, cache)

    def encode(self, text: str, first: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=first))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- one turn ------------------------------------------------------------------------
    def turn(self, session: Session, tokens: list[int], sampling: SamplingParams) -> TurnResult:
        """Run a whole turn and return its tokens, text and report."""
        stream = self.stream(session, tokens, sampling)
        generated = list(stream)
        return TurnResult(generated, self.decode(generated), stream.finish_reason, stream.report)

    def stream(self, session: Session, tokens: list[int], sampling: SamplingParams | None) -> TurnStream:
        """Prefill ``tokens`` (after any pending ones), compress, then yield generated token ids.

        Closing the iterator early (client gone) stops generation; the session stays
        consistent: every yielded token is in the transcript. ``sampling=None`` only
        prefills (e.g. a document opening a session).
        """
        turn = self.start(session, tokens, sampling)
        out = TurnStream(detok=turn.detok)
        out.tokens = self._alone(turn, out)
        return out

    def start(self, session: Session, tokens: list[int], sampling: SamplingParams | None) -> Turn:
        """A turn of ``session``, checked (InvalidArgument before any model work), not started."""
        self.check(session, tokens, sampling)
        return Turn(self, session, list(tokens), sampling)

    def _alone(self, turn: Turn, out: TurnStream) -> Iterator[int]:
        """Drive ``turn`` by itself: every prompt chunk, then a decode step per token."""
        try:
            while not turn.done:
                if turn.prefilling:
                    token = turn.prefill_step(self.prefill_chunk)
                else:
                    token = turn.accept(self.decode_step([turn.session], turn.greedy)[0])
                if token is not None:
                    yield token
        finally:
            out.report = turn.finish()
            out.finish_reason = turn.finish_reason

    # -- the steps -----------------------------------------------------------------------
    def prefill(self, session: Session, tokens: list[int], timer: Timer | None = None) -> torch.Tensor:
        """Prefill pending + ``tokens`` onto the cache, then compress. Returns next-token logits [V]."""
        job = Prefill(self, session, tokens, timer or Timer())
        while (logits := job.step(self.prefill_chunk)) is None:
            pass
        return logits

    @torch.inference_mode()
    def _after_prefill(self, job: Prefill) -> None:
        """The prompt is on the cache: compress it with the session's policy (or re-select from
        its full copy) and start decode-time eviction."""
        session, timer, captured = job.session, job.timer, job.capture
        if job.compress and session.policy.reselects and (job.first_turn or session.full_kv is not None):
            t0 = time.perf_counter()
            self._reselect(session, captured, job.window)
            elapsed = time.perf_counter() - t0
            timer.reselect_s += elapsed
            timer.compress_s += elapsed
        elif job.compress:  # also a reselect session that lost its full copy: plain SnapKV per turn
            t0 = time.perf_counter()
            self._compress(session, captured, job.new)
            timer.compress_s += time.perf_counter() - t0
        if job.decoder is not None:
            session.decoding = self._start_decoding(session, job.decoder, captured)
        elif self.prunes_answers(session.policy):  # KVzap with a threshold: the answer's rows are scored too
            session.decoding = {idx: None for idx in self.full_layers}

    @torch.inference_mode()
    def step(self, rows: list[Row]) -> torch.Tensor:
        """One packed forward over every row's new tokens (each on its own session's cache,
        :mod:`.batch`); each session's ``logical_len`` advances by its tokens. Returns the
        next-token logits of each row's last token ``[B, V]`` (a greedy row's: the exact argmax's,
        :class:`LMHead`)."""
        inputs = packed_inputs(rows, self.device)
        ends, end = [], 0
        for row in rows:
            end += len(row.tokens)
            ends.append(end - 1)
        if self._own_head:
            hidden = self.model.base_model(**inputs).last_hidden_state[0, ends]  # [B, D]
            logits = self.head(hidden, [row.greedy for row in rows])
        else:
            keep = torch.tensor(ends, device=self.device)
            logits = self.model(**inputs, logits_to_keep=keep).logits[0].float()
        for row in rows:
            row.session.logical_len += len(row.tokens)
        return logits

    def _compress(self, session: Session, captured: WindowCapture, new: list[int]) -> None:
        """Apply the session policy to every full-attention layer (the window = this turn's tail;
        a scored policy rates the turn's ``new`` rows by its own signal, see policies/scored.py)."""
        scored = scored_policy(session.policy)
        if scored is not None:
            if scored.scored_by == "hidden":
                scores = {idx: torch.cat(captured.scores[idx], dim=-1)[None] for idx in captured.layers}
            else:
                scores = self._reconstruction_scores(session, new)
            spans = self.row_spans(scored, new)
            for idx, layer_scores in scores.items():
                layer: CompressedLayer = session.cache.layers[idx]
                positions = scored.keep_scored(layer_scores.to(layer.keys.device), layer.kept_len, spans=spans)
                if positions.shape[-1] < layer.kept_len:
                    layer.keep(positions)
            return
        for idx in captured.layers:
            layer: CompressedLayer = session.cache.layers[idx]
            spans = self.row_spans(session.policy, new, old_rows=layer.kept_len - len(new))
            scale = captured.scales.get(idx)
            positions = session.policy.select(
                captured.queries[idx], layer.keys, scale, logical_len=session.logical_len, spans=spans
            )
            if positions.shape[-1] < layer.kept_len:
                layer.keep(positions)

    @torch.inference_mode()
    def _reconstruction_scores(self, session: Session, context: list[int]) -> dict[int, torch.Tensor]:
        """KVzip+ log scores ``[1, H_kv, n]`` per full-attention layer of the session's last
        ``n = len(context)`` rows (this turn's, on the cache, not yet compressed): a scratch
        pass of :data:`REPEAT_PROMPT` and the context again, on a copy of the cache that is then
        dropped (the session's cache, lengths and transcript are untouched)."""
        n = len(context)
        scratch = Session(
            session.session_id, FullKV(), "never", session.model_fingerprint,
            import_kv(self.model.config, export_kv(session.cache), session.logical_len),
        )  # fmt: skip
        scratch.logical_len = session.logical_len
        starts = {idx: session.cache.layers[idx].kept_len - n for idx in self.full_layers}
        capture = ReconstructionCapture(starts, n, skip=len(self.repeat_ids))
        tokens = self.repeat_ids + list(context)
        for start in range(0, len(tokens), self.prefill_chunk):
            self.step([Row(scratch, tokens[start : start + self.prefill_chunk], capture)])
        out = {}
        for idx, start in starts.items():
            values = session.cache.layers[idx].values[:, :, start : start + n]
            out[idx] = capture.scores(idx, values, self.attention[idx].o_proj.weight)
        return out

    def row_spans(self, policy: Policy, tokens: list[int], old_rows: int = 0) -> torch.Tensor | None:
        """Span ids of a layer's rows for a policy that keeps sentence spans (else None): ``old_rows``
        rows kept from earlier turns, a span each, then the rows of ``tokens`` (engine/spans.py)."""
        if not policy.keeps_spans:
            return None
        if self._span_ends is None:  # which tokens end a span: built once
            self._span_ends = span_ends(self.tokenizer, self.vocab_size)
        return layer_spans(self._span_ends, old_rows, tokens)

    def surrogate(self, kind: str) -> Surrogate:
        """This model's KVzap surrogate of ``kind`` (policies/kvzap_weights/); InvalidArgument,
        naming the training command, when none was trained for it."""
        net = self.surrogates.get(kind)
        if net is None:
            path = weights_path(self.loaded.name, kind)
            train = f"train one: python bench/kvzap_train.py --model {self.loaded.name}"
            if not path.exists():
                raise InvalidArgument(
                    f"no KVzap {kind} surrogate for model {self.loaded.name!r} ({path.name}); {train}"
                )
            if trained_for(path) != self.loaded.fingerprint:
                raise InvalidArgument(f"the KVzap {kind} surrogate {path.name} was trained on another model; {train}")
            text = self.model.config.get_text_config()
            net = Surrogate.load(path, self.full_layers, text.hidden_size, text.num_key_value_heads, kind)
            self.surrogates[kind] = net.to(self.device)
        return net

    def _reselect(self, session: Session, captured: WindowCapture, window: int) -> None:
        """Keep every row in the host-side full copy; select this turn's rows from all of them.

        The rows added since the last selection (this turn's prompt, earlier answers) are
        appended to the full copy; SnapKV then scores the whole copy with this turn's window
        queries, RESELECT_CHUNK rows at a time, and the device cache gets just the selection.
        """
        full = session.full_kv if session.full_kv is not None else {}
        new = session.logical_len - session.full_len
        spans = self.row_spans(session.policy, session.transcript[: session.logical_len])  # the full copy's rows
        for idx in captured.layers:
            layer: CompressedLayer = session.cache.layers[idx]
            kept = layer.kept_len - new  # rows before these were selected earlier (all of them in the copy)
            rows_k, rows_v = (_to_host(t[:, :, kept:]) for t in (layer.keys, layer.values))  # [1, H_kv, new, D]
            old = full.get(idx)
            full_k, full_v = (rows_k, rows_v) if old is None else (_cat(old[0], rows_k), _cat(old[1], rows_v))
            full[idx] = (full_k, full_v)
            positions = session.policy.select(
                captured.queries[idx],
                full_k,
                captured.scales.get(idx),
                logical_len=session.logical_len,
                chunk=RESELECT_CHUNK,
                spans=spans,
            )  # [1, H_kv, k] on the device
            host_positions = positions.to(full_k.device)
            layer.keys = gather_rows(full_k, host_positions).to(self.device, non_blocking=True)
            layer.values = gather_rows(full_v, host_positions).to(self.device, non_blocking=True)
        session.full_kv, session.full_len = full, session.logical_len

    def _start_decoding(self, session: Session, decoder: Policy, captured: WindowCapture) -> dict[int, object]:
        """Each full-attention layer's decode-time eviction state, seeded with the observation
        window's attention over the rows the layer kept (the window is their tail)."""
        states = {}
        for idx in full_layer_indices(session.cache):
            layer: CompressedLayer = session.cache.layers[idx]
            attn = None
            if decoder.needs_attention:
                attn = window_attention(captured.queries[idx], layer.keys, captured.scales.get(idx)).mean(dim=2)
            states[idx] = decoder.start(attn, layer.kept_len)  # attn: [B, H_kv, w, kept]
        return states

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

    # -- checks and references -----------------------------------------------------------
    def check(self, session: Session, tokens: list[int], sampling: SamplingParams | None) -> None:
        """Raise InvalidArgument when ``tokens`` and ``sampling`` cannot run on ``session`` (no model work)."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidArgument("sampling must be a SamplingParams")
        if session.model_fingerprint != self.loaded.fingerprint:
            raise InvalidArgument("session was built by a different model")
        if not tokens and not session.pending:
            raise InvalidArgument("prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in tokens):
            raise InvalidArgument(f"token ids must be integers in [0, {self.vocab_size})")
        total = len(session.transcript) + len(tokens)
        if total + 1 > self.max_context:
            raise InvalidArgument(f"session would reach {total} tokens; the model's context is {self.max_context}")
        policy = session.policy
        scored = scored_policy(policy)
        if scored is not None and scored.scored_by == "hidden":
            self.surrogate(scored.surrogate)  # a model without one refuses the session before any work
        if scored is not None and scored.scored_by == "reconstruction":
            repeat = len(session.transcript) + len(tokens) + len(self.repeat_ids)
            if repeat + len(tokens) + len(session.pending) > self.max_context:
                raise InvalidArgument(
                    f"kvzip's scratch pass repeats the turn's {len(tokens)} tokens after it, past the model's "
                    f"context ({self.max_context}); send a shorter turn or use kvzap"
                )
        if scored is None and session.logical_len == 0 and policy.compresses_anything and policy.window > len(tokens):
            raise InvalidArgument(
                f"observation window ({policy.window}) is longer than the prompt ({len(tokens)} "
                "tokens); lower `window` or send a longer prompt"
            )

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

    @torch.inference_mode()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """Next-token logits of one uncached forward pass over ``tokens`` (the exactness oracle)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host-memory copy (pinned when a GPU is there, so copies back are asynchronous)."""
    host = t.detach().to("cpu", copy=True).contiguous()
    return host.pin_memory() if torch.cuda.is_available() else host


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.cat([a, b], dim=-2)
    return out.pin_memory() if torch.cuda.is_available() else out
