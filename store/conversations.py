"""Implicit sessions: a request without a session id is matched to a session by its content.

A conversation (chat) is recorded under a hash chain over its messages, a raw completion's
text under hash chains over its blocks of :data:`TEXT_BLOCK` characters, both seeded with the
tenant and a scope (the OpenAI ``user``). :class:`ConversationIndex` is the part of the
session directory (:class:`~.directory.SessionDirectory`, its mixin) that writes and reads
these records; the edge (service/matching.py) checks a match against the session's log.
"""

from __future__ import annotations

import hashlib
import json
import time

from .records import check_id

CONVERSATION_ROLES = {"system", "document", "user", "assistant"}
RAW_ROLES = {"prompt", "completion"}  # a raw completion session's log


def conversation_digests(tenant: str, scope: str, messages: list[dict]) -> list[str]:
    """A hash chain over a conversation, seeded with the tenant and a scope (the OpenAI ``user``
    a request names, else "-"): digest ``i`` stands for ``messages[: i + 1]``. What a request
    without a session id is matched by (implicit sessions)."""
    chain = hashlib.blake2b(f"{check_id('tenant', tenant)}\0{scope}".encode(), digest_size=16)
    digests = []
    for message in messages:
        chain.update(json.dumps([message.get("role"), message.get("content")], ensure_ascii=False).encode() + b"\0")
        digests.append(chain.copy().hexdigest())
    return digests


CANDIDATES = 4  # sessions kept (newest first) under one conversation or text prefix
TEXT_BLOCK = 64  # characters: a raw prompt is matched at multiples of this many
TEXT_MAX_BLOCKS = 4096  # a prompt is looked up by its first this many blocks (256K characters)


def text_digests(tenant: str, scope: str, text: str) -> list[str]:
    """A hash chain over a raw text in blocks of :data:`TEXT_BLOCK` characters, seeded as
    :func:`conversation_digests`: digest ``i`` stands for ``text[: (i + 1) * TEXT_BLOCK]``.
    What a completion without a session id is matched by."""
    chain = hashlib.blake2b(f"{check_id('tenant', tenant)}\0{scope}\0text".encode(), digest_size=16)
    digests = []
    for i in range(len(text) // TEXT_BLOCK):
        chain.update(text[i * TEXT_BLOCK : (i + 1) * TEXT_BLOCK].encode())
        digests.append(chain.copy().hexdigest())
    return digests


class ConversationIndex:
    """The directory's records of implicit sessions by content (a mixin of
    :class:`~.directory.SessionDirectory`: its client, key prefix, TTL and ``_call``)."""

    def conversation_key(self, tenant: str, digest: str) -> str:
        return f"{self.prefix}:hc:{check_id('tenant', tenant)}:{digest}"

    def register_conversation(self, tenant: str, scope: str, session_id: str, messages: list[dict]) -> None:
        """Record that ``session_id`` holds exactly ``messages`` (an implicit session's log, ending
        with its answer), so that a request repeating them and adding more resumes it. Several
        sessions may hold the same conversation (users of one key saying the same; the same chat
        again after a restart): the newest :data:`CANDIDATES` are kept under it, and the edge
        resumes the first whose log the request extends and which is free. Expires with the
        session's TTL; an older state's record stays until then (it no longer matches the
        session's log, and the edge checks the log). A raw completion's log is recorded by its
        text instead (:meth:`match_text`)."""
        if messages and all(m.get("role") in RAW_ROLES for m in messages):
            self._register_text(tenant, scope, session_id, messages)
            return
        if not messages or messages[-1].get("role") != "assistant":
            return
        if any(m.get("role") not in CONVERSATION_ROLES for m in messages):
            return
        self._record([self.conversation_key(tenant, conversation_digests(tenant, scope, messages)[-1])], session_id)

    def match_conversation(self, tenant: str, scope: str, messages: list[dict]) -> list[str]:
        """Implicit sessions of this tenant and scope whose log may be a prefix of ``messages``
        ending with an answer: those recorded under the longest such prefixes that have any (the
        longest three, newest first within each; the edge checks each one's log)."""
        digests = conversation_digests(tenant, scope, messages)
        ends = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        return self._candidates([self.conversation_key(tenant, digests[i]) for i in ends])

    def _record(self, keys: list[str] | set[str], session_id: str) -> None:
        """``session_id`` the newest of the sessions recorded under each of ``keys`` (the newest
        :data:`CANDIDATES` kept), in one round trip."""
        now, pipe = time.time(), self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zadd(key, {session_id: now})
            pipe.zremrangebyrank(key, 0, -CANDIDATES - 1)
            pipe.expire(key, self.session_ttl_s)
        self._call(pipe.execute)

    def _candidates(self, keys: list[str]) -> list[str]:
        """The sessions recorded under the last three of ``keys`` (shortest prefix first) that
        have any, the longest prefix's first, newest first within each."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrevrange(key, 0, CANDIDATES - 1)
        found = self._call(pipe.execute)
        out: list[str] = []
        for ids in [ids for ids in reversed(found) if ids][:3]:
            out += [sid.decode() for sid in ids if sid.decode() not in out]
        return out

    def text_key(self, tenant: str, digest: str) -> str:
        return f"{self.prefix}:ht:{check_id('tenant', tenant)}:{digest}"

    def _register_text(self, tenant: str, scope: str, session_id: str, messages: list[dict]) -> None:
        """Record a raw session's text under two prefixes: its whole transcript (a prompt that
        extends it) and the end of its last prompt (a prompt that repeats that prompt and then
        re-formats its answer, as a client flattening a conversation does), each cut down to a
        whole block. Several sessions may share a prefix: the newest few are kept under it."""
        text = "".join(m["content"] for m in messages)
        prompt_end = len(text) - len(messages[-1]["content"]) if messages[-1]["role"] == "completion" else len(text)
        digests = text_digests(tenant, scope, text)
        cuts = {len(text) // TEXT_BLOCK, prompt_end // TEXT_BLOCK} - {0}
        self._record({self.text_key(tenant, digests[cut - 1]) for cut in cuts}, session_id)

    def match_text(self, tenant: str, scope: str, text: str) -> list[str]:
        """Sessions of this tenant and scope recorded under the longest block prefixes of
        ``text`` that have any (the longest three, newest first within each; the edge checks
        each one's log): candidates for a raw completion without a session id."""
        digests = text_digests(tenant, scope, text[: TEXT_BLOCK * TEXT_MAX_BLOCKS])
        return self._candidates([self.text_key(tenant, digest) for digest in digests])
