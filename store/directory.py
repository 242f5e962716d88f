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

The entry's fields and the packing of the logs are in :mod:`.records`; the records implicit
sessions are matched by (conversation and text digests) in :mod:`.conversations`.

Every call has a short socket timeout; a dead Redis raises ``Unavailable`` within
about two seconds, never hangs.
"""

from __future__ import annotations

import json
import time

import redis

from kvsnap.engine.session import TurnMark
from kvsnap.errors import Conflict, InvalidArgument, NotFound, Unavailable

from . import scripts
from .conversations import ConversationIndex
from .prefix_holders import PrefixHolders
from .records import SessionEntry, check_id, pack_marks, pack_messages, pack_tokens, session_key, unpack_tokens

__all__ = ["SessionDirectory", "SessionEntry", "check_id", "owner_of", "session_key"]


async def owner_of(aclient, prefix: str, tenant: str, session_id: str) -> str:
    """The worker a session's entry names as its holder ("" when none), read through an asyncio
    Redis client (the router's): the directory's layout stays in this module."""
    owner = await aclient.hget(session_key(prefix, tenant, session_id), "owner")
    return owner.decode() if owner else ""


class SessionDirectory(ConversationIndex, PrefixHolders):
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
                pack_messages(messages),
                pack_marks(marks),
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
                pack_messages(messages),
                pack_marks(marks),
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
                pack_messages(messages),
                pack_marks(marks),
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

    def worker_known(self, worker_id: str) -> bool:
        """True while ``worker_id`` has a live heartbeat (any incarnation)."""
        return bool(self._call(self.client.exists, f"{self.prefix}:w:{check_id('worker id', worker_id)}"))

    def worker_alive(self, worker_id: str, epoch: int) -> bool:
        value = self._call(self.client.get, f"{self.prefix}:w:{check_id('worker id', worker_id)}")
        return value is not None and int(value) == epoch
