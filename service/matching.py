"""Conversation matching for the OpenAI routes: which session a request continues, and from
where.

- Implicit sessions (no session header): the sessions of this tenant and scope whose
  conversation (chat) the messages extend, or the one whose text (completions) the prompt
  extends or shares the most of, by the directory's digests (store/conversations.py), checked
  here against each session's own log and settings; when every match is refused before any
  output (busy, changed), a session of the request's own.
- Histories: where a request that departs from its session's log still shares it (the last
  turn boundary; for raw completions also the end of a turn's prompt), so the session can be
  taken back there (a rewind, actors/rewinds.py).
"""

from __future__ import annotations

import asyncio
import json

from kvsnap.actors.turns import turn_boundaries
from kvsnap.errors import Conflict, NotFound
from kvsnap.store.conversations import RAW_ROLES

from .api import SessionAPI


async def match_chat(api: SessionAPI, tenant: str, scope: str, messages: list[dict], settings: dict | None):
    """Each implicit session of this tenant whose conversation ``messages`` extend with a user
    message, by content, as (session id, its messages, its version): the longest conversation
    first, the newest first among equals; none when no session's log is a prefix of them, or
    when the request's settings are not a session's (they apply when a session opens)."""
    found = []
    for sid in await asyncio.to_thread(api.directory.match_conversation, tenant, scope, messages[:-1]):
        entry = await asyncio.to_thread(api.directory.get, tenant, sid)
        if entry is None or entry.conversation != scope or not same_settings(settings, entry):
            continue
        stored = await asyncio.to_thread(api.directory.messages, tenant, sid)
        if len(messages) <= len(stored) or messages[: len(stored)] != stored or messages[len(stored)]["role"] != "user":
            continue
        found.append((sid, stored, entry.version))
    return found


def same_settings(settings: dict | None, entry) -> bool:
    """Whether every setting a request names is the session's (policy, recompress, parameters)."""
    spec, recompress = json.loads(entry.policy), entry.recompress
    if spec["name"] == "reselect":
        spec, recompress = spec["params"]["inner"], "reselect"
    params = spec["params"]
    for key, value in (settings or {}).items():
        if value is None:
            continue
        if key == "decode":
            have = params.get("decode") or {}
            if any(have.get(k) != v for k, v in value.items() if v is not None):
                return False
        elif {"policy": spec["name"], "recompress": recompress}.get(key, params.get(key)) != value:
            return False
    return True


async def resume_or_open(attempts, open_fresh, used: dict, fresh_sid: str):
    """The events of the first of ``attempts`` ((session id, a function that starts its turn))
    not refused before any output (another turn runs on it, or it changed or went since it was
    matched: two identical conversations' next turns at once go one to each session); those of
    a session of its own (``open_fresh``) when every one is. ``used["sid"]``: the session used."""
    events = None
    try:
        for sid, start in attempts:
            used["sid"], events = sid, start()
            try:
                first = await events.__anext__()
                break
            except (Conflict, NotFound):  # busy, changed, or gone since it was matched
                await events.aclose()
                events = None
        if events is None:
            used["sid"], events = fresh_sid, open_fresh()
            first = await events.__anext__()
        yield first
        async for event in events:
            yield event
    finally:
        if events is not None:
            await events.aclose()


def scope_of(body) -> str:
    """Whose implicit sessions a request may resume: its tenant's, within the OpenAI ``user`` it names."""
    user = (body.model_extra or {}).get("user")
    return f"u:{user}" if isinstance(user, str) and user else "-"


async def match_text(api: SessionAPI, tenant: str, scope: str, prompt: str, settings: dict | None, strict: bool):
    """(session id, its log, entry, marks) of this tenant's implicit raw session that shares the
    most of ``prompt``: one the prompt extends, else the one it shares the longest turn boundary
    or prompt with (``strict``: only one it extends); None when there is none (or the request's
    settings are not its own)."""
    best, best_len = None, -1
    for sid in await asyncio.to_thread(api.directory.match_text, tenant, scope, prompt):
        entry = await asyncio.to_thread(api.directory.get, tenant, sid)
        if entry is None or entry.conversation != scope or not same_settings(settings, entry):
            continue
        stored, marks = await asyncio.to_thread(api.directory.messages_and_marks, tenant, sid)
        if not stored or any(m["role"] not in RAW_ROLES for m in stored):
            continue
        shared = shared_text(prompt, stored, marks, strict)
        if shared > best_len:
            best, best_len = (sid, stored, entry, marks), shared
    return best


def shared_text(prompt: str, stored: list[dict], marks: list, strict: bool = False) -> int:
    """How many characters of a raw session's log ``prompt`` reuses: all of it when it extends
    it, else up to the last turn boundary or prompt it shares; -1 when none."""
    if extends_text(prompt, stored, len(stored)):
        return len(raw_text(stored, len(stored)))
    if strict:
        return -1
    keep, _, at = shared_turns(stored, marks, lambda upto: extends_text(prompt, stored, upto), prompts=True)
    return -1 if keep is None else len(raw_text(stored, at))


def raw_text(stored: list[dict], upto: int) -> str:
    """A raw session's text: its first ``upto`` logged prompts and completions."""
    return "".join(m["content"] for m in stored[:upto])


def extends_text(prompt: str, stored: list[dict], upto: int) -> bool:
    """Whether ``prompt`` starts with a raw session's first ``upto`` messages and adds text."""
    head = raw_text(stored, upto)
    return prompt.startswith(head) and len(prompt) > len(head)


def with_empty_answers(messages: list[dict], stored: list[dict]) -> list[dict]:
    """``messages`` with the session's empty answers put back where the client left them out
    (clients such as aiperf drop an assistant message that had no text). The session holds
    such an answer as it was generated; the request means the same conversation."""
    out, i = [], 0
    for m in stored:
        if i < len(messages) and messages[i] == m:
            out.append(messages[i])
            i += 1
        elif m["role"] == "assistant" and m["content"] == "":
            out.append(m)
        else:
            return messages  # a real departure: the caller sees it as it is
    return out + messages[i:]


def unknown_turns(stored: list[dict], marks: list | None) -> str:
    """What a refusal adds when the session's log does not record where its turns end."""
    return "" if turn_boundaries(stored, marks or []) else " (its log does not record where its turns end)"


def shared_turns(stored: list[dict], marks: list | None, shares, prompts: bool = False) -> tuple[int | None, bool, int]:
    """The longest point of a session (``stored`` messages, its turns' ``marks``) before its end
    that a diverging request ``shares`` (called with a count of messages): a turn boundary, or
    with ``prompts`` also the end of a turn's prompt before its answer (raw completions, where
    no template sits between a prompt and its answer). Returns (the whole turns to keep,
    whether the next turn's prompt is kept too, the messages kept), or (None, False, 0)."""
    bounds = turn_boundaries(stored, marks or [])
    for turn in range(len(bounds), 0, -1):
        end, start = bounds[turn - 1], bounds[turn - 2] if turn > 1 else 0
        if prompts and end - start > 1 and stored[end - 1]["role"] == "completion" and shares(end - 1):
            return turn - 1, True, end - 1
        if turn > 1 and shares(start):  # the last boundary is the whole log: not a divergence
            return turn - 1, False, start
    return None, False, 0
