"""OpenAI-compatible routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``).

With a session header (``x-session-id``, configurable) a request continues the session of
that id: it repeats the session's earlier messages (chat) or starts with its earlier prompts
and completions (completions), and only what it adds is prefilled. One that departs from them
is served from the last point it shares (a turn boundary; for completions also the end of a
turn's prompt, its answer re-formatted), unless it asks for ``history: strict``. Without a
header, a request resumes the implicit session of its tenant (and OpenAI ``user``) whose
conversation (chat) or text (completions) it extends or shares, matched by content; one
matching none opens a session of its own, which later requests can match. Which session a
request continues, and from which point, is decided in :mod:`.matching`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvsnap.errors import Conflict, InvalidArgument
from kvsnap.store.conversations import CONVERSATION_ROLES as CHAT_ROLES
from kvsnap.store.conversations import RAW_ROLES
from kvsnap.store.records import check_id

from .api import SessionAPI
from .matching import (
    extends_text,
    match_chat,
    match_text,
    raw_text,
    resume_or_open,
    scope_of,
    shared_turns,
    unknown_turns,
    with_empty_answers,
)
from .outcomes import TurnOutcome, state_view
from .responses import api_of, current, served, sse
from .schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.get("/v1/models", summary="OpenAI-compatible model list")
async def models(request: Request):
    model = await asyncio.to_thread(served, request.app)
    entry = {"id": model["model"], "object": "model", "created": 0, "owned_by": "kvsnap", "dtype": model["dtype"]}
    return {"object": "list", "data": [entry]}


@router.post(
    "/v1/chat/completions",
    summary="OpenAI-compatible; resumes the session whose conversation the messages extend (or x-session-id's)",
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    if body.n not in (None, 1):
        raise InvalidArgument("only n=1 is supported")
    api, tenant = api_of(request), request.state.tenant
    messages = [m.model_dump() for m in body.messages]
    sampling = body.model_dump(
        include={"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
    )
    settings = body.kvsnap.model_dump(exclude={"session", "history"}) if body.kvsnap else None
    strict = body.kvsnap is not None and body.kvsnap.history == "strict"
    sid = session_header(request, api)
    if sid is not None:  # the client names its session
        stored, entry, marks = await stored_messages(api, tenant, sid)
        args = (
            api,
            tenant,
            sid,
            messages,
            sampling,
            settings,
            "http",
            stored,
            body.stream,
            entry.version if entry else 0,
        )
        events = chat(*args, marks=marks, strict=strict)
        return await _openai(events, request, {"sid": sid}, chat=True, stream=body.stream)
    implicit = api.cfg.implicit_sessions and (body.kvsnap is None or body.kvsnap.session != "none")
    scope = scope_of(body)  # the OpenAI `user`: its own conversations
    fresh = {"sid": uuid.uuid4().hex}  # a session of its own, which later requests can resume

    def open_fresh():
        conversation = scope if implicit else ""
        return chat(api, tenant, fresh["sid"], messages, sampling, settings, "http", None, body.stream, 0, conversation)

    matched = await match_chat(api, tenant, scope, messages, settings) if implicit else []
    if not matched:
        return await _openai(open_fresh(), request, fresh, chat=True, stream=body.stream)

    def resume(sid, stored, version):
        return sid, lambda: chat(api, tenant, sid, messages, sampling, settings, "http", stored, body.stream, version)

    used = {"sid": matched[0][0]}
    events = resume_or_open([resume(*m) for m in matched], open_fresh, used, fresh["sid"])
    return await _openai(events, request, used, chat=True, stream=body.stream)


def session_header(request: Request, api: SessionAPI) -> str | None:
    """The session a request names: the first of the configured session headers it carries."""
    return next((request.headers[h] for h in api.cfg.session_headers if request.headers.get(h)), None)


@router.post(
    "/v1/completions",
    summary="OpenAI-compatible; resumes the session whose text the prompt extends or repeats (or x-session-id's)",
)
async def completions(body: CompletionRequest, request: Request):
    if body.n not in (None, 1):
        raise InvalidArgument("only n=1 is supported")
    api, tenant = api_of(request), request.state.tenant
    sampling = body.model_dump(include={"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"})
    settings = body.kvsnap.model_dump(exclude={"session", "history"}) if body.kvsnap else None
    strict = body.kvsnap is not None and body.kvsnap.history == "strict"
    sid = session_header(request, api)
    if sid is not None:  # the client names its session
        stored, entry, marks = await stored_messages(api, tenant, sid)
        args = (api, tenant, sid, body.prompt, sampling, settings, "http", stored, body.stream)
        events = complete(*args, entry=entry, marks=marks, strict=strict)
        return await _openai(events, request, {"sid": sid}, chat=False, stream=body.stream)
    implicit = api.cfg.implicit_sessions and (body.kvsnap is None or body.kvsnap.session != "none")
    scope = scope_of(body)
    fresh = {"sid": uuid.uuid4().hex}

    def open_fresh():
        args = (api, tenant, fresh["sid"], body.prompt, sampling, settings, "http", None, body.stream)
        return complete(*args, conversation=scope if implicit else "")

    matched = await match_text(api, tenant, scope, body.prompt, settings, strict) if implicit else None
    if matched is None:
        return await _openai(open_fresh(), request, fresh, chat=False, stream=body.stream)
    msid, stored, entry, marks = matched
    used = {"sid": msid}
    args = (api, tenant, msid, body.prompt, sampling, settings, "http", stored, body.stream, entry, marks)
    events = resume_or_open([(msid, lambda: complete(*args))], open_fresh, used, fresh["sid"])
    return await _openai(events, request, used, chat=False, stream=body.stream)


def chat(
    api: SessionAPI,
    tenant: str,
    session_id: str | None,
    messages: list[dict],
    sampling: dict,
    settings: dict | None,
    protocol: str,
    stored: list[dict] | None,
    streaming: bool = True,
    expected_version: int = 0,
    conversation: str = "",
    marks: list | None = None,
    strict: bool = False,
) -> AsyncIterator[dict]:
    """A chat turn: a new session under ``session_id`` (``stored`` None), or the next turn of the
    session whose logged messages are ``stored``; one whose messages depart from them is served
    from the last turn boundary they share (``strict``: refused)."""
    params = api.sampling(sampling, template=True)
    if messages[-1]["role"] != "user":
        raise InvalidArgument("the last message must come from the user")
    if stored is None:  # a new session under this id
        tokens = api.tokens(messages, first=True)
        return api.open_session(
            tenant, session_id, protocol, tokens, settings, params, messages, "assistant", streaming, conversation
        )
    if any(m["role"] not in CHAT_ROLES for m in stored):
        raise Conflict("this session was built by /v1/completions; continue it there")
    messages = with_empty_answers(messages, stored)
    keep, at = None, len(stored)
    if len(messages) <= len(stored) or messages[: len(stored)] != stored:
        advice = f"send its {len(stored)} earlier messages unchanged, then the new ones"
        if strict:
            raise Conflict(f"the messages do not extend session {session_id!r} (history: strict): {advice}")
        keep, _, at = shared_turns(stored, marks, lambda b: messages[:b] == stored[:b] and len(messages) > b)
        if keep is None:
            raise Conflict(
                f"the messages share no whole turn with session {session_id!r}{unknown_turns(stored, marks)}: {advice}"
            )
    new = messages[at:]
    tokens = api.tokens(new, first=False)
    req = api.next_turn(tenant, session_id, tokens, params, new, "assistant", expected_version, keep_turns=keep)
    return api.stream(req, protocol, streaming)


def complete(
    api: SessionAPI,
    tenant: str,
    session_id: str | None,
    prompt: str,
    sampling: dict,
    settings: dict | None,
    protocol: str,
    stored: list[dict] | None,
    streaming: bool = True,
    entry=None,
    marks: list | None = None,
    strict: bool = False,
    conversation: str = "",
) -> AsyncIterator[dict]:
    """A raw completion: a new session (``conversation``: an implicit one's scope), or the next
    turn of the session (``entry``, its logged prompts and completions ``stored``) whose text the
    prompt extends; a prompt that departs from it is served from the last turn boundary or
    prompt it shares (``strict``: refused)."""
    params = api.sampling(sampling)
    if not prompt:
        raise InvalidArgument("prompt is empty")
    if stored is None:
        tokens = api.raw_tokens(prompt, first=True)
        return api.open_session(
            tenant,
            session_id,
            protocol,
            tokens,
            settings,
            params,
            [{"role": "prompt", "content": prompt}],
            "completion",
            streaming,
            conversation,
        )
    if any(m["role"] not in RAW_ROLES for m in stored):
        raise Conflict("this session was built by the chat API; continue it with /v1/chat/completions")

    def extends(upto: int) -> bool:
        return extends_text(prompt, stored, upto)

    keep, prompt_kept, at = None, False, len(stored)
    if not extends(len(stored)):
        advice = (
            f"the prompt must start with session {session_id!r}'s transcript (its earlier prompts "
            "and completions, as returned) and add new text"
        )
        if strict:
            raise Conflict(f"{advice} (history: strict)")
        keep, prompt_kept, at = shared_turns(stored, marks, extends, prompts=True)
        if keep is None:
            raise Conflict(f"{advice}; it shares no whole turn with it{unknown_turns(stored, marks)}")
    new = prompt[len(raw_text(stored, at)) :]
    req = api.next_turn(
        tenant,
        session_id,
        api.raw_tokens(new, first=False),
        params,
        [{"role": "prompt", "content": new}],
        "completion",
        entry.version if entry else 0,
        templated=False,
        keep_turns=keep,
        keep_prompt=prompt_kept,
    )
    return api.stream(req, protocol, streaming)


async def stored_messages(api: SessionAPI, tenant: str, session_id: str | None):
    """The session's message log, directory entry and turn marks, or (None, None, None) when
    this tenant has no such session (yet)."""
    if not session_id:
        return None, None, None
    sid = check_id("session id", session_id)
    entry = await asyncio.to_thread(api.directory.get, tenant, sid)
    if entry is None:
        return None, None, None
    messages, marks = await asyncio.to_thread(api.directory.messages_and_marks, tenant, sid)
    return messages, entry, marks


async def _openai(events, request: Request, session: dict, chat: bool, stream: bool):
    """``session["sid"]``: the session the answer comes from, known once the first event is in
    (an implicit session may give way to a new one); sent back in the ``x-session-id`` header."""
    ingress = current(request.app)
    created, rid = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    kind = "chat.completion" if chat else "text_completion"

    def usage(o: TurnOutcome) -> dict:
        return {
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": len(o.token_ids),
            "total_tokens": o.prompt_tokens + len(o.token_ids),
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens},  # from a shared prefix
        }

    def extra(o: TurnOutcome) -> dict:
        return {
            "session_id": o.session_id,
            "worker": o.worker,
            "source": o.source,
            "replayed_tokens": o.replayed_tokens,  # > 0: taken back to a turn boundary first (a rewind)
            "state": state_view(o.state) if o.state else None,
        }

    if not stream:
        o = await SessionAPI.collect(events)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish_reason}
            if chat
            else {"index": 0, "text": o.text, "finish_reason": o.finish_reason, "logprobs": None}
        )
        return JSONResponse(
            {
                "id": rid,
                "object": kind,
                "created": created,
                "model": ingress.cfg.model,
                "choices": [choice],
                "usage": usage(o),
                "kvsnap": extra(o),
            },
            headers={"x-session-id": o.session_id},
        )

    def shape(event: dict) -> dict:
        chunk = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": ingress.cfg.model}
        if "text" in event:
            delta = {"content": event["text"]}
            chunk["choices"] = [
                {"index": 0, "delta": delta, "finish_reason": None}
                if chat
                else {"index": 0, "text": event["text"], "finish_reason": None, "logprobs": None}
            ]
        else:
            o = event["outcome"]
            chunk["choices"] = [
                {"index": 0, "delta": {}, "finish_reason": o.finish_reason}
                if chat
                else {"index": 0, "text": "", "finish_reason": o.finish_reason, "logprobs": None}
            ]
            chunk["usage"], chunk["kvsnap"] = usage(o), extra(o)
        return chunk

    response = await sse(events, shape, request, done_marker=True)
    if session.get("sid"):
        response.headers["x-session-id"] = session["sid"]
    return response
