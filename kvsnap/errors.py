"""The one exception module of kvsnap.

Every error a user can cause or meet is one of these classes. They carry only a
message (so they pickle across Ray actors unchanged); the mapping to HTTP / gRPC
status codes happens at the service edge, from ``kind``.
"""

from __future__ import annotations


class KvsnapError(Exception):
    """Base class. ``kind`` names the category the service edge maps to a status code."""

    kind = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # keep pickling explicit: one positional argument
        return (type(self), (self.message,))


class InvalidArgument(KvsnapError):
    """A parameter or input is malformed or out of range (HTTP 400 / INVALID_ARGUMENT)."""

    kind = "invalid_argument"


class NotFound(KvsnapError):
    """The session (or other named thing) does not exist for this caller (404 / NOT_FOUND)."""

    kind = "not_found"


class Conflict(KvsnapError):
    """A concurrent or out-of-date update lost a compare-and-set (409 / ABORTED)."""

    kind = "conflict"


class ResourceExhausted(KvsnapError):
    """A limit was hit: queue full, budget exhausted (429 / RESOURCE_EXHAUSTED)."""

    kind = "resource_exhausted"


class Unavailable(KvsnapError):
    """A dependency (Redis, a worker) is down; retrying later may succeed (503 / UNAVAILABLE)."""

    kind = "unavailable"


class Unauthenticated(KvsnapError):
    """Missing or unknown API key (401 / UNAUTHENTICATED)."""

    kind = "unauthenticated"


class PermissionDenied(KvsnapError):
    """A valid key that may not do this, e.g. a tenant key on an admin route (403 / PERMISSION_DENIED)."""

    kind = "permission_denied"


class PayloadTooLarge(KvsnapError):
    """Request body or prompt exceeds the configured maximum (413 / INVALID_ARGUMENT)."""

    kind = "payload_too_large"


class DeadlineExceeded(KvsnapError):
    """The request ran past its timeout (504 / DEADLINE_EXCEEDED)."""

    kind = "deadline_exceeded"
