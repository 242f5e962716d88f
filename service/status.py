"""The one place where kvsnap errors become HTTP and gRPC status codes (the service edge)."""

from __future__ import annotations

import grpc

from kvsnap.errors import KvsnapError

HTTP_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "conflict": 409,
    "payload_too_large": 413,
    "resource_exhausted": 429,
    "internal": 500,
    "unavailable": 503,
    "deadline_exceeded": 504,
}

GRPC_STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "conflict": grpc.StatusCode.ABORTED,
    "payload_too_large": grpc.StatusCode.INVALID_ARGUMENT,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
}


def http_status(error: KvsnapError) -> int:
    return HTTP_STATUS.get(error.kind, 500)


def grpc_status(error: KvsnapError) -> grpc.StatusCode:
    return GRPC_STATUS.get(error.kind, grpc.StatusCode.INTERNAL)


def retry_after(error: KvsnapError) -> dict[str, str] | None:
    """The ``Retry-After`` header of an answer that is worth retrying shortly (429, 503)."""
    return {"Retry-After": "1"} if http_status(error) in (429, 503) else None


def error_body(error: KvsnapError) -> dict:
    """OpenAI-style error JSON."""
    return {"error": {"type": error.kind, "message": error.message, "code": http_status(error)}}
