"""A session's record in the directory and how its parts are packed for Redis: the entry
hash's fields (:class:`SessionEntry`), the token log's uint32 chunks, the message and mark
logs' JSON, the key of an entry, and the ids every key is built from (:func:`check_id`)."""

from __future__ import annotations

import json
import re
import sys
from array import array
from dataclasses import asdict, dataclass, fields

from kvsnap.engine.session import TurnMark
from kvsnap.errors import InvalidArgument

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


def pack_messages(messages: list[dict] | None) -> str:
    return json.dumps(messages) if messages else ""


def pack_marks(marks: list[TurnMark] | None) -> str:
    return json.dumps([m.to_list() for m in marks]) if marks else ""


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise InvalidArgument(f"{kind} must be 1-128 characters of A-Z a-z 0-9 . _ : -, got {value!r}")
    return value
