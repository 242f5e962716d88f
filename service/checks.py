"""What a request can get wrong, checked before any model work: a session's settings (the
server's defaults overlaid with the caller's), sampling parameters, prompt sizes and ids.

A mixin of :class:`~.api.SessionAPI`: it reads the API's configuration (``cfg``), the model's
measured defaults with the operator's over them (``defaults``), its tokenizer and chat
template. Every error is an InvalidArgument or PayloadTooLarge (HTTP 4xx / a gRPC status).
"""

from __future__ import annotations

import uuid

from kvsnap.actors.turns import SessionSpec
from kvsnap.engine.defaults import overlay
from kvsnap.engine.sampling import SamplingParams
from kvsnap.errors import InvalidArgument, PayloadTooLarge
from kvsnap.policies import make_policy, policy_params
from kvsnap.store.directory import check_id


class RequestChecks:
    def settings(self, given: dict | None, prompt_len: int) -> SessionSpec:
        """Server defaults overlaid with the caller's settings; raises InvalidArgument when bad.

        The server's defaults are the model's measured ones with the operator's over them
        (``ServiceConfig.session_defaults``); a caller who names another policy gets that
        policy's own parameter defaults (the server's window aside) and recompression per turn
        unless they say otherwise, one who sizes the selection
        (budget, ratio or tau) replaces the default size (kvsnap.engine.defaults.overlay). A
        policy takes the parameters its dataclass declares (policies/). A server-default window longer than the
        first prompt shrinks to the prompt; a window the caller asked for is checked by the
        worker (longer than the prompt: 400)."""
        explicit = {k: v for k, v in (given or {}).items() if v is not None}
        decode = explicit.pop("decode", None)
        chosen = overlay(self.defaults, explicit)
        name, recompress = chosen.pop("policy"), chosen.pop("recompress", "per_turn")
        params = policy_params(name)  # InvalidArgument listing the policies for an unknown one
        unknown = sorted(set(explicit) - set(params) - {"policy", "recompress"})
        if unknown:
            raise InvalidArgument(f"policy {name!r} has no parameter(s) {unknown}; valid: {sorted(params)}")
        chosen = {k: v for k, v in chosen.items() if k in params}  # a default applies where the policy has it
        if "window" in chosen and "window" not in explicit:
            chosen["window"] = max(1, min(chosen["window"], prompt_len))
        if decode is not None:
            chosen["decode"] = {k: v for k, v in decode.items() if v is not None}
        return SessionSpec(make_policy(name, **chosen), recompress)  # validates every parameter

    def sampling(self, fields: dict, template: bool = False) -> SamplingParams:
        """Sampling parameters from a request's fields. ``template``: the prompt used the chat
        template, whose default stop strings apply unless the request names its own ``stop`` (an
        empty list: none): the plain template's turn marker, so that a base model's answer does
        not run on into a made-up next turn; none for a model's own chat template (EOS ends it)."""
        max_tokens = fields.get("max_tokens")
        if max_tokens is None:
            max_tokens = fields.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = self.cfg.default_max_tokens
        if isinstance(max_tokens, int) and max_tokens > self.cfg.max_new_tokens:
            raise InvalidArgument(f"max_tokens must be <= {self.cfg.max_new_tokens}, got {max_tokens}")
        stop = fields.get("stop")
        if stop is None:
            stop = self.template.stop if template else ()
        return SamplingParams(  # raises InvalidArgument
            max_new_tokens=max_tokens,
            temperature=0.0 if fields.get("temperature") is None else fields["temperature"],
            top_p=1.0 if fields.get("top_p") is None else fields["top_p"],
            top_k=fields.get("top_k") or 0,
            seed=fields.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=bool(fields.get("ignore_eos")),
        )

    def tokens(self, messages: list[dict], first: bool) -> list[int]:
        return self._limit(self.template.encode(messages, first))

    def document_tokens(self, document: str) -> tuple[list[dict], list[int]]:
        """A session's opening document: its log entry and the tokens it prefills."""
        if not document:
            raise InvalidArgument("document is empty")
        log = [{"role": "document", "content": document}]
        return log, self.tokens(log, first=True)

    def raw_tokens(self, text: str, first: bool) -> list[int]:
        return self._limit(list(self.tokenizer.encode(text, add_special_tokens=first)))

    def _limit(self, ids: list[int]) -> list[int]:
        if len(ids) > self.cfg.max_prompt_tokens:
            raise PayloadTooLarge(f"the request adds {len(ids)} tokens; the limit is {self.cfg.max_prompt_tokens}")
        return ids

    @staticmethod
    def session_id(given: str | None) -> str:
        return check_id("session id", given) if given else uuid.uuid4().hex
