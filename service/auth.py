"""Who is calling: an API key maps to a tenant; admin routes take admin keys only.

Every configured key is compared in constant time (``hmac.compare_digest``), every time;
keys are never logged. Shared by the HTTP edge and the gRPC server.
"""

from __future__ import annotations

import hmac

from kvsnap.errors import PermissionDenied, Unauthenticated

from .config import ServiceConfig

OPEN_PATHS = {"/health", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}
ADMIN_PREFIX = "/v1/admin/"
ADMIN = "<admin>"  # request.state.tenant of an admin call (never a tenant name: not a valid id)


def _bearer(authorization: str | None) -> bytes:
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    return authorization[7:].strip().encode()


def _match(given: bytes, keys) -> str | None:
    """The value of the key in ``keys`` (key -> value) equal to ``given``; every key is compared, in constant time."""
    found = None
    for key, value in keys.items():
        if hmac.compare_digest(given, key.encode()):
            found = value
    return found


def tenant_for(keys: dict[str, str], authorization: str | None) -> str:
    """The tenant of a ``Bearer`` key."""
    tenant = _match(_bearer(authorization), keys)
    if tenant is None:
        raise Unauthenticated("invalid API key")
    return tenant


def check_admin(cfg: ServiceConfig, authorization: str | None) -> str:
    """Admin routes take admin keys only: a tenant's key gets PermissionDenied, as does every key
    while no admin key is configured (admin routes off)."""
    given = _bearer(authorization)
    if _match(given, dict.fromkeys(cfg.admin_keys, ADMIN)) is not None:
        return ADMIN
    if _match(given, cfg.api_keys) is None:
        raise Unauthenticated("invalid API key")
    if not cfg.admin_keys:
        raise PermissionDenied("admin routes are off: no admin key is configured (KVSNAP_ADMIN_KEYS)")
    raise PermissionDenied("admin routes take an admin key; a tenant's API key cannot use them")
