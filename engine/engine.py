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
Prefill and compression are in :mod:`.compress`, decoding in :mod:`.decode`, the replay of a
lost session (``Engine.rebuild``) in :mod:`.replay`: mixins this class joins.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvsnap.errors import InvalidArgument
from kvsnap.policies import Policy, make_policy, scored_policy
from kvsnap.policies.kvzap import Surrogate
from kvsnap.policies.kvzip import REPEAT_PROMPT

from .batch import Row, packed_inputs
from .cache import full_layer_indices, new_session_cache, shares_blocks
from .capture import hidden_hook
from .compress import Compression
from .decode import Decoding
from .detok import Detokenizer
from .models import LoadedModel, packed
from .models.head import LMHead
from .prefixes import PrefixCache, block_for
from .replay import Replay
from .sampling import SamplingParams
from .session import Session, TurnReport
from .turn import Turn


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


class Engine(Compression, Decoding, Replay):
    """One model on many sessions' KV. Prefill and compression: :mod:`.compress`; decode
    steps and decode-time eviction: :mod:`.decode`; the replay of lost sessions: :mod:`.replay`."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefill_chunk: int = 1024,
        greedy_screen: bool | None = None,
        prefix_cache_bytes: int = 0,
        prefix_block: int | None = None,
    ):
        """``greedy_screen``: greedy rows' argmax through a bf16 screen (engine/models/head.py); None:
        where it pays (a large fp32 head on a CPU with bf16 kernels). ``prefix_cache_bytes``: the
        budget of shared prompt prefixes (engine/prefixes.py), 0 = none; ``prefix_block``: their
        block, a divisor of ``prefill_chunk`` (None: ``prefixes.block_for`` the model's dtype)."""
        if prefill_chunk < 1:
            raise InvalidArgument(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefix_block is not None and (prefix_block < 1 or prefill_chunk % prefix_block):
            raise InvalidArgument(f"prefix_block must divide prefill_chunk ({prefill_chunk}), got {prefix_block}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.prefill_chunk = prefill_chunk
        text = loaded.model.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_context = text.max_position_embeddings
        self.eos_ids = loaded.eos_token_ids
        # the LM head computed here (engine/models/head.py) knows softcapping only; a model that scales its
        # logits otherwise (Granite's logits_scaling, Cohere's logit_scale) gets its own forward's
        self._own_head = all(getattr(text, name, None) in (None, 1, 1.0) for name in ("logits_scaling", "logit_scale"))
        softcap = getattr(text, "final_logit_softcapping", None)
        self.head = LMHead(self.model, softcap, greedy_screen if self._own_head else False)
        # the full-attention layers' attention modules: their input goes to captures that want it
        cache = new_session_cache(self.model.config)
        self.attention_layers = len(cache.layers)  # every attention layer, sliding-window ones too
        self.full_layers = full_layer_indices(cache)
        self.prefixes = None  # shared prompt prefixes, where every layer keeps block rows
        if prefix_cache_bytes > 0 and shares_blocks(cache):
            block = prefix_block or block_for(prefill_chunk, self.model.dtype)
            # the router names a prompt by its first chunk (service/api.py knows no block size)
            self.prefixes = PrefixCache(block, prefix_cache_bytes, route_tokens=prefill_chunk)
        self.attention = {
            m.layer_idx: m
            for m in self.model.modules()
            if hasattr(m, "o_proj") and getattr(m, "layer_idx", None) in self.full_layers
        }
        for module in self.attention.values():
            if not getattr(module, "_kvsnap_hooked", False):  # one hook per module: engines may share a model
                module.register_forward_pre_hook(hidden_hook, with_kwargs=True)
                module._kvsnap_hooked = True
        self._span_ends: bytes | None = None  # engine/spans.py, built when a policy first needs it
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
                    turn.settle()  # the prompt's compression, once its first token is out
                    token = turn.accept(self.decode_step([turn.session], turn.greedy)[0])
                if token is not None:
                    yield token
        finally:
            out.report = turn.finish()
            out.finish_reason = turn.finish_reason

    # -- the steps -----------------------------------------------------------------------
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
        with packed.step_rows([len(row.tokens) for row in rows]):  # one-token rows' products
            if self._own_head:
                hidden = self.model.base_model(**inputs).last_hidden_state[0, ends]  # [B, D]
                logits = self.head(hidden, [row.greedy for row in rows])
            else:
                keep = torch.tensor(ends, device=self.device)
                logits = self.model(**inputs, logits_to_keep=keep).logits[0].float()
        for row in rows:
            row.session.logical_len += len(row.tokens)
        return logits

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

    @torch.inference_mode()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """Next-token logits of one uncached forward pass over ``tokens`` (the exactness oracle)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
