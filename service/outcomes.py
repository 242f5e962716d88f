"""What comes back from a turn to the edge, shared by HTTP, OpenAI and gRPC: the finished
turn (:class:`TurnOutcome`), a session's state as the APIs show it, and the kvsnap error
inside whatever Ray wrapped a failure in."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray.exceptions
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from kvsnap.errors import KvsnapError, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, DeploymentUnavailableError)


@dataclass(slots=True)
class TurnOutcome:
    """What a finished turn returns to the edge."""

    session_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_tokens: int = 0
    worker: str = ""
    source: str = ""
    state: dict | None = None
    timings: dict = field(default_factory=dict)  # the worker's: queue / prefill / reselect / decode / ttft seconds
    replayed_tokens: int = 0  # tokens replayed to take the session back to a turn boundary (a rewind)
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from a shared prefix (not prefilled)


def as_kvsnap_error(exc: BaseException) -> KvsnapError:
    """The kvsnap error inside whatever Ray wrapped it in; infrastructure failures become Unavailable."""
    if isinstance(exc, KvsnapError):
        return exc
    cause = getattr(exc, "cause", None)
    if isinstance(cause, KvsnapError):
        return cause
    if isinstance(exc, BackPressureError):
        return ResourceExhausted("too many requests queued; retry shortly")
    if isinstance(exc, RETRYABLE):
        return Unavailable(f"worker unavailable: {type(exc).__name__}; retry")
    log.error("unexpected error: %r", exc)
    return KvsnapError(f"internal error: {type(exc).__name__}")


def entry_dict(entry) -> dict:
    return {f: getattr(entry, f) for f in entry.__slots__}


def state_view(entry: dict | None) -> dict:
    if entry is None:
        raise Unavailable("the session's state is not available; retry")
    return {
        "session_id": entry["session_id"],
        "logical_len": entry["logical_len"],
        "kept_len": entry["kept_len"],
        "kv_bytes": entry["kv_bytes"],
        "tier": entry["tier"],
        "turns": entry["turns"],
        "policy": entry["policy_fingerprint"],
        "version": entry["version"],
        "created": entry["created"],
        "last_used": entry["last_used"],
    }
