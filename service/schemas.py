"""Request and response bodies of the HTTP API (pydantic, with descriptions for the OpenAPI schema)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from kvsnap.policies import POLICIES, evictor_names, policy_params


def _parameter_fields(names: list[str]) -> dict:
    """The parameters of the policies ``names`` as optional fields, typed and described from the
    policies' own dataclasses (policies/: the one place a parameter is declared)."""
    by_param: dict[str, tuple[type, list[str]]] = {}
    for name in names:
        for param, kind in policy_params(name).items():
            by_param.setdefault(param, (kind, []))[1].append(name)
    return {
        param: (kind | None, Field(None, description=f"a parameter of {', '.join(owners)}"))
        for param, (kind, owners) in sorted(by_param.items())
    }


# Parameters of policies registered later (policy_modules) are accepted too (extra="allow") and
# checked by the policy itself, like every other: an unknown one is a 400 listing the valid ones.
DecodeSettings = create_model(
    "DecodeSettings",
    __config__=ConfigDict(extra="allow"),
    __doc__="A policy that evicts rows while a turn generates, paired with the session's prefill policy.",
    policy=(str, Field(..., description=f"the decode-time evictor: {' | '.join(evictor_names())}")),
    **_parameter_fields(evictor_names()),
)
Settings = create_model(
    "Settings",
    __config__=ConfigDict(extra="allow"),
    __doc__="Per-session compression settings, applied when the session is created; the parameters "
    "a policy takes are its own (others: 400).",
    policy=(str | None, Field(None, description=f"{' | '.join(sorted(POLICIES))} (default: the server's)")),
    recompress=(Literal["per_turn", "never", "reselect"] | None, None),
    decode=(DecodeSettings | None, Field(None, description="evict while decoding with this policy")),
    **_parameter_fields(sorted(POLICIES)),
)


class SamplingFields(BaseModel):
    max_tokens: int | None = Field(None, description="tokens to generate at most (>= 1)")
    temperature: float | None = Field(None, description="0 = greedy")
    top_p: float | None = Field(None, description="nucleus sampling, in (0, 1]")
    top_k: int | None = Field(None, description="0 = off")
    seed: int | None = None
    stop: str | list[str] | None = Field(
        None,
        description="stop strings; unset: the template's turn marker '\\nUser:' for templated turns, none for "
        "raw ones; [] for none. The text returned and logged ends before the stop string",
    )
    ignore_eos: bool | None = Field(
        None, description="keep generating after the end-of-sequence token, up to max_tokens (fixed-length load tests)"
    )

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value):
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(None, description="your id for the session (default: one is made)")
    document: str | None = Field(None, description="the long context, prefilled once and compressed")
    document_id: str | None = Field(None, description="a registered document (POST /v1/documents) instead")
    settings: Settings = Field(default_factory=Settings)


class CreateDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    document: str = Field(..., description="the text: a shared prefix every session on it starts from")


class DocumentInfo(BaseModel):
    document_id: str
    tokens: int = Field(..., description="the tokens a session on it opens with")
    created: float = Field(..., description="when it was registered (Unix time)")
    text: str | None = None
    shared_tokens: int | None = Field(None, description="of them, those held as shared rows on worker now")
    worker: str | None = None
    new: bool | None = Field(None, description="false: the tenant had registered this text already")


class Turn(SamplingFields):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(..., description="the user's message (a question about the document)")
    raw: bool = Field(False, description="send the message verbatim, without the User/Assistant template")
    stream: bool = Field(False, description="stream the answer as Server-Sent Events")


class SessionState(BaseModel):
    session_id: str
    logical_len: int = Field(description="tokens the session has seen")
    kept_len: int = Field(description="rows kept per full-attention layer")
    kv_bytes: int
    tier: str = Field(description="device | host | disk | dropped")
    turns: int
    policy: str = Field(description="policy fingerprint")
    version: int
    created: float
    last_used: float
    cached_tokens: int | None = Field(None, description="when opened: of its document's tokens, those shared rows gave")


class TurnAnswer(BaseModel):
    session_id: str
    text: str
    finish_reason: str
    prompt_tokens: int = Field(description="tokens prefilled by this turn")
    cached_tokens: int = Field(0, description="of prompt_tokens, those whose KV came from a shared prefix")
    completion_tokens: int
    worker: str = Field(description="replica that served the turn")
    source: str = Field(description="where the KV came from: device/host/disk/imported/rebuilt/new")
    state: SessionState
    timings: dict[str, float] = Field(
        default_factory=dict,
        description="the worker's seconds for this turn: prefill_s, reselect_s (re-selecting from the full "
        "cache, recompress=reselect), decode_s, ttft_s",
    )


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "document"]
    content: str


class CompletionSettings(Settings):
    """The ``kvsnap`` object of an OpenAI request: session settings (for a new session), what a
    request that diverges from its session's history gets, and whether a request without a
    session header may resume a session whose conversation (or text) it extends."""

    session: Literal["auto", "none"] | None = Field(
        None,
        description="auto (default): resume the session whose conversation (chat) or text (completions) this "
        "request extends, matched by content within your tenant; none: always a new session",
    )

    history: Literal["rewind", "strict"] | None = Field(
        None,
        description="rewind (default): a request whose messages (or prompt) depart from the session's "
        "history is served from the last turn boundary they share, the turns after it replaced; "
        "strict: such a request is refused (409)",
    )


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore (n=1, user, ...)

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    stream: bool = False
    n: int | None = Field(None, description="only 1 is supported")
    kvsnap: CompletionSettings | None = Field(
        None, description="session settings (applied when the session is created)"
    )


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    stream: bool = False
    n: int | None = None
    kvsnap: CompletionSettings | None = None
