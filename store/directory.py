"""The Redis session directory: who holds which session, and every session's token log.

Redis is a hint, the worker is the truth. Per session (namespaced by tenant) a hash
holds the owner worker, its incarnation epoch, the tier, both lengths, the KV
bytes, policy / model fingerprints, turn count, times and a ``version`` that grows
with every turn. Every update is a compare-and-set on that version, done in one
Lua script together with the append to the token log, so a turn's metadata and
its tokens land together or not at all.

The token log (prompt turns and generated tokens, packed uint32 chunks in a Redis
list) and the turn marks beside it (each turn's prompt / generated token counts and
KV length, a JSON chunk per commit) are what make a lost KV recoverable: the session
is rebuilt by replaying its turns, each prefilled and compressed as it ran.

Every call has a short socket timeout; a dead Redis raises ``Unavailable`` within
about two seconds, never hangs.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from array import array
from dataclasses import asdict, dataclass, fields

import redis

from kvsnap.engine.session import TurnMark
from kvsnap.errors import Conflict, InvalidArgument, NotFound, Unavailable

from . import scripts

ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(slots=True)
class SessionEntry:
    tenant: str
    session_id: str
    owner: str = ""
    epoch: int = 0
    tier: str = ""
    logical_len: int = 0
    kept_len: int = 0
    kv_bytes: int = 0
    policy: str = ""  # JSON {"name": ..., "params": {...}}: enough to rebuild the policy
    policy_fingerprint: str = ""
    model: str = ""
    recompress: str = "per_turn"
    turns: int = 0
    created: float = 0.0
    last_used: float = 0.0
    version: int = 0
    log_len: int = 0  # tokens in the token log
    last_turn: str = ""  # the caller's id of the last committed turn ("" when it gave none)
    conversation: str = ""  # set: an implicit session, matched by content within this scope

    @classmethod
    def from_hash(cls, tenant: str, session_id: str, raw: dict[bytes, bytes]) -> SessionEntry:
        values = {k.decode(): v.decode() for k, v in raw.items()}
        kwargs = {}
        for f in fields(cls):
            if f.name in ("tenant", "session_id") or f.name not in values:
                continue
            kind = {"int": int, "float": float}.get(f.type, str)
            kwargs[f.name] = kind(values[f.name])
        return cls(tenant, session_id, **kwargs)

    def fields_flat(self, exclude: tuple[str, ...] = ("tenant", "session_id", "version")) -> list[str | int | float]:
        flat: list[str | int | float] = []
        for key, value in asdict(self).items():
            if key not in exclude:
                flat += [key, value]
        return flat


def pack_tokens(tokens: list[int]) -> bytes:
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(chunks: list[bytes]) -> list[int]:
    packed = array("I")
    for chunk in chunks:
        packed.frombytes(chunk)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def session_key(prefix: str, tenant: str, session_id: str) -> str:
    """The Redis key of a session's entry hash (the router reads it too)."""
    return f"{prefix}:s:{check_id('tenant', tenant)}:{check_id('session id', session_id)}"


async def owner_of(aclient, prefix: str, tenant: str, session_id: str) -> str:
    """The worker a session's entry names as its holder ("" when none), read through an asyncio
    Redis client (the router's): the directory's layout stays in this module."""
    owner = await aclient.hget(session_key(prefix, tenant, session_id), "owner")
    return owner.decode() if owner else ""


def _pack_messages(messages: list[dict] | None) -> str:
    return json.dumps(messages) if messages else ""


def _pack_marks(marks: list[TurnMark] | None) -> str:
    return json.dumps([m.to_list() for m in marks]) if marks else ""


CONVERSATION_ROLES = {"system", "document", "user", "assistant"}
RAW_ROLES = {"prompt", "completion"}  # a raw completion session's log


AMBIGUOUS = b"*"  # a conversation two sessions hold: matched by neither


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


TEXT_BLOCK = 64  # characters: a raw prompt is matched at multiples of this many
TEXT_CANDIDATES = 4  # sessions kept (newest first) under one text prefix
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


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise InvalidArgument(f"{kind} must be 1-128 characters of A-Z a-z 0-9 . _ : -, got {value!r}")
    return value


class SessionDirectory:
    def __init__(
        self,
        url: str,
        *,
        session_ttl_s: int = 24 * 3600,
        heartbeat_ttl_s: int = 10,
        timeout_s: float = 1.0,
        prefix: str = "kvsnap",
    ):
        if session_ttl_s < 1 or heartbeat_ttl_s < 1:
            raise InvalidArgument("TTLs must be >= 1 second")
        self.url = url
        self.session_ttl_s = session_ttl_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.prefix = prefix
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._create = self.client.register_script(scripts.CREATE)
        self._commit = self.client.register_script(scripts.COMMIT)
        self._restore = self.client.register_script(scripts.RESTORE)
        self._set_tier = self.client.register_script(scripts.SET_TIER)

    # -- keys ----------------------------------------------------------------------------
    def session_key(self, tenant: str, session_id: str) -> str:
        return session_key(self.prefix, tenant, session_id)

    def log_key(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}:t:{check_id('tenant', tenant)}:{check_id('session id', session_id)}"

    def messages_key(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}:m:{check_id('tenant', tenant)}:{check_id('session id', session_id)}"

    def export_key(self, tenant: str, session_id: str, part: str = "") -> str:
        """A KV hand-over; ``part="full"``: a reselect session's full copy, beside its selection."""
        suffix = f":{part}" if part else ""
        return f"{self.prefix}:x:{check_id('tenant', tenant)}:{check_id('session id', session_id)}{suffix}"

    def marks_key(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}:n:{check_id('tenant', tenant)}:{check_id('session id', session_id)}"

    def session_keys(self, tenant: str, session_id: str) -> list[str]:
        """Every key a session owns (TTL applies to all of them; a short-lived KV export may join them)."""
        return [
            self.session_key(tenant, session_id),
            self.log_key(tenant, session_id),
            self.messages_key(tenant, session_id),
            self.marks_key(tenant, session_id),
        ]

    # -- calls ---------------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise Unavailable(f"session directory (Redis) unavailable: {exc}") from exc
        except redis.ResponseError as exc:
            if "NOSCRIPT" in str(exc) or "LOADING" in str(exc):
                raise Unavailable(f"session directory (Redis) not ready: {exc}") from exc
            raise

    def ping(self) -> bool:
        return bool(self._call(self.client.ping))

    def create(
        self,
        entry: SessionEntry,
        tokens: list[int],
        messages: list[dict] | None = None,
        marks: list[TurnMark] | None = None,
    ) -> SessionEntry:
        """Register a new session at version 1 with its first tokens; Conflict if the id is taken."""
        now = time.time()
        entry.created = entry.created or now
        entry.last_used = now
        entry.log_len = len(tokens)
        keys = self.session_keys(entry.tenant, entry.session_id)
        result = self._call(
            self._create,
            keys=keys,
            args=[
                self.session_ttl_s,
                pack_tokens(tokens),
                _pack_messages(messages),
                _pack_marks(marks),
                *entry.fields_flat(),
            ],
        )
        if result == -2:
            raise Conflict(f"session {entry.session_id!r} already exists")
        entry.version = 1
        return entry

    def get(self, tenant: str, session_id: str) -> SessionEntry | None:
        raw = self._call(self.client.hgetall, self.session_key(tenant, session_id))
        return SessionEntry.from_hash(tenant, session_id, raw) if raw else None

    def require(self, tenant: str, session_id: str) -> SessionEntry:
        entry = self.get(tenant, session_id)
        if entry is None:
            raise NotFound(f"session {session_id!r} not found")
        return entry

    def tokens(self, tenant: str, session_id: str) -> list[int]:
        return unpack_tokens(self._call(self.client.lrange, self.log_key(tenant, session_id), 0, -1))

    def marks(self, tenant: str, session_id: str) -> list[TurnMark]:
        """The session's turn marks, oldest first (empty for a log written before they existed)."""
        chunks = self._call(self.client.lrange, self.marks_key(tenant, session_id), 0, -1)
        return [TurnMark.from_list(m) for chunk in chunks for m in json.loads(chunk)]

    def messages(self, tenant: str, session_id: str) -> list[dict]:
        """The session's message log (what the HTTP / OpenAI APIs sent and answered), oldest first."""
        chunks = self._call(self.client.lrange, self.messages_key(tenant, session_id), 0, -1)
        return [m for chunk in chunks for m in json.loads(chunk)]

    def messages_and_marks(self, tenant: str, session_id: str) -> tuple[list[dict], list[TurnMark]]:
        """The message log and the turn marks (which count each turn's messages), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.lrange(self.messages_key(tenant, session_id), 0, -1)
        pipe.lrange(self.marks_key(tenant, session_id), 0, -1)
        messages, marks = self._call(pipe.execute)
        return [m for c in messages for m in json.loads(c)], [
            TurnMark.from_list(m) for c in marks for m in json.loads(c)
        ]

    def commit(
        self,
        entry: SessionEntry,
        expected_version: int,
        new_tokens: list[int],
        new_messages: list[dict] | None = None,
        new_marks: list[TurnMark] | None = None,
    ) -> SessionEntry:
        """Compare-and-set: write ``entry`` and append ``new_tokens`` iff the stored version is
        ``expected_version``. Raises Conflict when another writer got there first, NotFound when gone."""
        entry.log_len += len(new_tokens)
        return self._cas(entry, expected_version, False, new_tokens, new_messages, new_marks)

    def rewrite(
        self,
        entry: SessionEntry,
        expected_version: int,
        tokens: list[int],
        messages: list[dict],
        marks: list[TurnMark],
    ) -> SessionEntry:
        """As :meth:`commit`, for a session taken back to a turn boundary and given a new turn:
        the whole token log, message log and marks replace the stored ones."""
        entry.log_len = len(tokens)
        return self._cas(entry, expected_version, True, tokens, messages, marks)

    def _cas(self, entry: SessionEntry, expected_version: int, replace: bool, tokens, messages, marks) -> SessionEntry:
        entry.last_used = time.time()
        result = self._call(
            self._commit,
            keys=self.session_keys(entry.tenant, entry.session_id),
            args=[
                self.session_ttl_s,
                expected_version,
                int(replace),
                pack_tokens(tokens),
                _pack_messages(messages),
                _pack_marks(marks),
                *entry.fields_flat(),
            ],
        )
        if result == -1:
            raise NotFound(f"session {entry.session_id!r} not found")
        if result == -2:
            raise Conflict(
                f"session {entry.session_id!r} was updated concurrently (expected version "
                f"{expected_version}); retry the turn"
            )
        entry.version = int(result)
        return entry

    def restore(
        self,
        entry: SessionEntry,
        tokens: list[int],
        messages: list[dict] | None = None,
        marks: list[TurnMark] | None = None,
    ) -> bool:
        """Write back a session a worker holds if Redis lost it or has an older version. True if written."""
        entry.log_len = len(tokens)
        written = self._call(
            self._restore,
            keys=self.session_keys(entry.tenant, entry.session_id),
            args=[
                self.session_ttl_s,
                entry.version,
                pack_tokens(tokens),
                _pack_messages(messages),
                _pack_marks(marks),
                *entry.fields_flat(),
            ],
        )
        return bool(written)

    def set_tier(self, tenant: str, session_id: str, owner: str, epoch: int, tier: str) -> bool:
        """Record that ``owner`` moved the session's KV to ``tier`` (no version change: the KV is the same)."""
        keys = [self.session_key(tenant, session_id)]
        return bool(self._call(self._set_tier, keys=keys, args=[owner, str(epoch), tier]))

    def delete(self, tenant: str, session_id: str) -> bool:
        exports = [self.export_key(tenant, session_id), self.export_key(tenant, session_id, "full")]
        keys = [*self.session_keys(tenant, session_id), *exports]
        return bool(self._call(self.client.delete, *keys))

    # -- KV hand-over between workers (drain) ----------------------------------------------
    def put_export(self, tenant: str, session_id: str, data: bytes, ttl_s: int = 600, part: str = "") -> None:
        self._call(self.client.set, self.export_key(tenant, session_id, part), data, ex=ttl_s)

    def take_export(self, tenant: str, session_id: str, part: str = "") -> bytes | None:
        return self._call(self.client.getdel, self.export_key(tenant, session_id, part))

    # -- workers -------------------------------------------------------------------------
    def heartbeat(self, worker_id: str, epoch: int) -> None:
        self._call(
            self.client.set, f"{self.prefix}:w:{check_id('worker id', worker_id)}", epoch, ex=self.heartbeat_ttl_s
        )

    def publish_load(self, worker_id: str, stats: dict) -> None:
        """A worker's current numbers (KV bytes per tier, counters) for /metrics; expires with the heartbeat."""
        self._call(
            self.client.set,
            f"{self.prefix}:load:{check_id('worker id', worker_id)}",
            json.dumps(stats),
            ex=self.heartbeat_ttl_s,
        )

    def loads(self) -> dict[str, dict]:
        keys = self._call(lambda: list(self.client.scan_iter(match=f"{self.prefix}:load:*", count=100)))
        values = self._call(self.client.mget, keys) if keys else []
        prefix = len(f"{self.prefix}:load:")
        return {k.decode()[prefix:]: json.loads(v) for k, v in zip(keys, values, strict=True) if v}

    # -- implicit sessions: conversations by content ----------------------------------------
    def conversation_key(self, tenant: str, digest: str) -> str:
        return f"{self.prefix}:h:{check_id('tenant', tenant)}:{digest}"

    def register_conversation(self, tenant: str, scope: str, session_id: str, messages: list[dict]) -> None:
        """Record that ``session_id`` holds exactly ``messages`` (an implicit session's log, ending
        with its answer), so that a request repeating them and adding more resumes it. Expires
        with the session's TTL; an older state's record stays until then (it no longer matches
        the session's log, and the edge checks the log). A conversation another session holds
        too (two users of one key saying the same) becomes ambiguous: matched by neither. A raw
        completion's log is recorded by its text instead (:meth:`match_text`)."""
        if messages and all(m.get("role") in RAW_ROLES for m in messages):
            self._register_text(tenant, scope, session_id, messages)
            return
        if not messages or messages[-1].get("role") != "assistant":
            return
        if any(m.get("role") not in CONVERSATION_ROLES for m in messages):
            return
        key = self.conversation_key(tenant, conversation_digests(tenant, scope, messages)[-1])
        taken = not self._call(self.client.set, key, session_id, ex=self.session_ttl_s, nx=True)
        if taken and self._call(self.client.get, key) not in (session_id.encode(), None):
            self._call(self.client.set, key, AMBIGUOUS, ex=self.session_ttl_s)

    def match_conversation(self, tenant: str, scope: str, messages: list[dict]) -> str | None:
        """The implicit session of this tenant and scope whose log is the longest prefix of
        ``messages`` that ends with an answer; None when there is none (or it is ambiguous)."""
        digests = conversation_digests(tenant, scope, messages)
        ends = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not ends:
            return None
        found = self._call(self.client.mget, [self.conversation_key(tenant, digests[i]) for i in ends])
        longest = next((sid for sid in reversed(found) if sid), None)
        return None if longest in (None, AMBIGUOUS) else longest.decode()

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
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for cut in {len(text) // TEXT_BLOCK, prompt_end // TEXT_BLOCK} - {0}:
            key = self.text_key(tenant, digests[cut - 1])
            pipe.zadd(key, {session_id: now})
            pipe.zremrangebyrank(key, 0, -TEXT_CANDIDATES - 1)
            pipe.expire(key, self.session_ttl_s)
        self._call(pipe.execute)

    def match_text(self, tenant: str, scope: str, text: str) -> list[str]:
        """Sessions of this tenant and scope recorded under the longest block prefixes of
        ``text`` that have any (the longest three, newest first within each; the edge checks
        each one's log): candidates for a raw completion without a session id."""
        digests = text_digests(tenant, scope, text[: TEXT_BLOCK * TEXT_MAX_BLOCKS])
        if not digests:
            return []
        pipe = self.client.pipeline(transaction=False)
        for digest in digests:
            pipe.zrevrange(self.text_key(tenant, digest), 0, TEXT_CANDIDATES - 1)
        found = self._call(pipe.execute)
        out: list[str] = []  # the longest prefix's sessions first, then shorter ones' (up to 3 prefixes)
        for ids in [ids for ids in reversed(found) if ids][:3]:
            out += [sid.decode() for sid in ids if sid.decode() not in out]
        return out

    def worker_known(self, worker_id: str) -> bool:
        """True while ``worker_id`` has a live heartbeat (any incarnation)."""
        return bool(self._call(self.client.exists, f"{self.prefix}:w:{check_id('worker id', worker_id)}"))

    def worker_alive(self, worker_id: str, epoch: int) -> bool:
        value = self._call(self.client.get, f"{self.prefix}:w:{check_id('worker id', worker_id)}")
        return value is not None and int(value) == epoch
