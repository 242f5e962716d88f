"""The ingress deployment: HTTP (FastAPI: session API + OpenAI-compatible) and gRPC.

Auth first (API key -> tenant; constant-time comparison; keys never logged), then
body-size limits, then :class:`SessionAPI` validation, all before any model work.
The gRPC server (``proto/kvsnap.proto``, with reflection and the standard health
service) runs inside this replica on its own event loop and shares the same core,
so both protocols answer every error with matching status codes.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.datastructures import Headers

from kvsnap.engine.models import tokenizer_for
from kvsnap.errors import InvalidArgument, KvsnapError, PayloadTooLarge, PermissionDenied
from kvsnap.store.directory import SessionDirectory

from .api import DRAIN_RESUME_S, SessionAPI
from .auth import ADMIN, ADMIN_PREFIX, OPEN_PATHS, check_admin, tenant_for
from .config import ServiceConfig
from .documents import Documents
from .grpc_server import start_grpc_server
from .metrics import Metrics
from .openai import router as openai_router
from .outcomes import TurnOutcome, state_view
from .responses import api_of, current, served, sse
from .schemas import CreateDocument, CreateSession, DocumentInfo, SessionState, Turn, TurnAnswer
from .status import error_body, http_status, retry_after

log = logging.getLogger(__name__)

app = FastAPI(
    title="kvsnap",
    version="0.1.0",
    description="Long-context sessions with SnapKV-compressed KV caches and cache-affinity routing. "
    "Authenticate with `Authorization: Bearer <API key>`.",
)


def error_response(error: KvsnapError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=http_status(error), headers=retry_after(error))


@app.exception_handler(KvsnapError)
async def _kvsnap_error(request: Request, exc: KvsnapError):
    return error_response(exc)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
    return error_response(InvalidArgument(problems or "invalid request"))


class Edge:
    """Auth and body size, before anything else runs; one request counter for all routes.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs
    every request through an extra task and memory streams (docs/BENCHMARKS.md, "Service
    overhead")."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ingress: Ingress = current(scope["app"])
        route = scope["path"].removeprefix(scope.get("root_path", ""))
        status = 500  # unless a response starts

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            try:
                headers = Headers(scope=scope)
                if route.startswith(ADMIN_PREFIX):
                    tenant = check_admin(ingress.cfg, headers.get("authorization"))
                    scope.setdefault("state", {})["tenant"] = tenant
                elif route not in OPEN_PATHS:
                    tenant = tenant_for(ingress.cfg.api_keys, headers.get("authorization"))
                    scope.setdefault("state", {})["tenant"] = tenant  # request.state.tenant
                limit = ingress.cfg.max_body_bytes
                declared = headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > limit:
                    raise PayloadTooLarge(f"request body of {declared} bytes; the limit is {limit}")
                if scope["method"] in ("POST", "PUT"):
                    receive = await _read_body(receive, limit)
            except KvsnapError as exc:
                await error_response(exc)(scope, receive, send_counted)
                return
            await self.app(scope, receive, send_counted)
        finally:
            ingress.metrics.requests.labels(_route_label(route), str(status)).inc()


async def _read_body(receive, limit: int):
    """Read the whole body (PayloadTooLarge past ``limit`` bytes, however it is sent); returns a
    ``receive`` that hands it to the app, then passes on what comes after (a disconnect)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before sending it all
            first = message
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        if not message.get("more_body", False):
            first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            break
    pending = [first]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


app.add_middleware(Edge)
app.include_router(openai_router)


def _route_label(path: str) -> str:
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[1] in ("sessions", "documents"):
        parts[2] = "{id}"
    return "/" + "/".join(parts)


@app.get("/health", summary="liveness (no auth), the model and the dtype its workers compute in")
async def health(request: Request):
    return {"status": "ok", **await asyncio.to_thread(served, request.app)}


@app.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request):
    body = await asyncio.to_thread(current(request.app).metrics.render, request.state.tenant)
    return Response(body, media_type="text/plain; version=0.0.4")


@app.post("/v1/sessions", status_code=201, response_model=SessionState, summary="open a session with a document")
async def create_session(body: CreateSession, request: Request):
    tenant = request.state.tenant
    text = await current(request.app).documents.text_of(tenant, body.document, body.document_id)
    return await api_of(request).create(tenant, body.session_id, text, body.settings.model_dump(), "http")


@app.post("/v1/documents", status_code=201, response_model=DocumentInfo, response_model_exclude_none=True,
          summary="register a shared document: prefilled once, each session on it starts from it")  # fmt: skip
async def create_document(body: CreateDocument, request: Request):
    return await current(request.app).documents.add(request.state.tenant, body.document)


@app.get("/v1/documents", summary="the tenant's documents")
async def list_documents(request: Request):
    return {"documents": await current(request.app).documents.list(request.state.tenant)}


@app.get("/v1/documents/{document_id}", response_model=DocumentInfo, response_model_exclude_none=True,
         summary="a document, with its text")  # fmt: skip
async def get_document(document_id: str, request: Request):
    return await current(request.app).documents.get(request.state.tenant, document_id)


@app.delete("/v1/documents/{document_id}", status_code=204, summary="delete a document's record")
async def delete_document(document_id: str, request: Request):
    await current(request.app).documents.delete(request.state.tenant, document_id)
    return Response(status_code=204)


@app.post(
    "/v1/sessions/{session_id}/turns",
    response_model=TurnAnswer,
    summary="ask a question on the session (SSE when stream=true)",
)
async def session_turn(session_id: str, body: Turn, request: Request):
    fields = body.model_dump(exclude={"message", "raw", "stream"})
    events = api_of(request).turn(
        request.state.tenant, session_id, body.message, fields, body.raw, "http", streaming=body.stream
    )
    if body.stream:
        return await sse(events, lambda e: {"text": e["text"]} if "text" in e else _answer(e["outcome"]), request)
    return _answer(await SessionAPI.collect(events))


@app.get("/v1/sessions/{session_id}", response_model=SessionState, summary="a session's state")
async def get_session(session_id: str, request: Request):
    return await api_of(request).get(request.state.tenant, session_id)


@app.delete("/v1/sessions/{session_id}", status_code=204, summary="delete a session")
async def delete_session(session_id: str, request: Request):
    await api_of(request).delete(request.state.tenant, session_id)
    return Response(status_code=204)


@app.post(
    "/v1/admin/workers/{worker_id}/drain",
    summary="hand every session of one worker replica over to the others (admin key only)",
)
async def drain_worker(worker_id: str, request: Request, resume_after_s: float = DRAIN_RESUME_S):
    """The replica stops taking turns, hands each session's KV over through Redis, stays out of
    placement for ``resume_after_s`` seconds, then takes sessions again. 404 for an unknown id."""
    if request.state.tenant != ADMIN:  # the edge let it through as an admin call, or nothing does
        raise PermissionDenied("admin routes take an admin key")
    if not 0 <= resume_after_s <= 86400:
        raise InvalidArgument("resume_after_s must be in [0, 86400]")
    exported = await api_of(request).drain(worker_id, resume_after_s)
    return {"worker": worker_id, "exported": exported, "resume_after_s": resume_after_s}


# -- response shaping ------------------------------------------------------------------------
def _answer(outcome: TurnOutcome) -> dict:
    return {
        "session_id": outcome.session_id,
        "text": outcome.text,
        "finish_reason": outcome.finish_reason,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "completion_tokens": len(outcome.token_ids),
        "worker": outcome.worker,
        "source": outcome.source,
        "state": state_view(outcome.state),
        "timings": outcome.timings,
    }


# -- the deployment ----------------------------------------------------------------------------
@serve.ingress()  # the app comes from __serve_build_asgi_app__, with this replica in its state
class Ingress:
    async def __init__(self, workers, config: dict, redis_url: str):
        self.cfg = ServiceConfig(**config)
        self.cfg.load_policy_modules()
        self.directory = SessionDirectory(redis_url, session_ttl_s=self.cfg.session_ttl_s)
        self.metrics = Metrics(loads=self.directory.loads)
        self.api = SessionAPI(
            self.cfg, workers, tokenizer_for(self.cfg.model, self.cfg.gguf_file), self.directory, self.metrics
        )
        self.documents = Documents(self.api, self.cfg.max_documents)
        self.grpc = None
        if self.cfg.grpc_port:
            self.grpc = await start_grpc_server(self, f"{self.cfg.http_host}:{self.cfg.grpc_port}")

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The HTTP app this replica serves; routes and the edge find the replica in its state
        (``request.app.state.ingress``)."""
        app.state.ingress = self
        return app

    async def __del__(self):  # Serve awaits it at shutdown
        server, self.grpc = getattr(self, "grpc", None), None
        if server is not None:
            await server.stop(grace=1)


__all__ = ["Ingress", "app", "tenant_for"]
