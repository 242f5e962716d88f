"""What every HTTP route shares: the Ingress serving the app, and turning a turn's events into a
response (the whole answer, or Server-Sent Events whose first event is pulled before the
response starts, so that early errors still get their status code)."""

from __future__ import annotations

import json
import time

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from kvsnap.errors import KvsnapError

from .api import SessionAPI
from .status import error_body


def current(app):
    """The Ingress serving ``app`` (it puts itself into the app's state when it starts)."""
    ingress = getattr(app.state, "ingress", None)
    if ingress is None:
        raise KvsnapError("ingress not initialised")
    return ingress


SERVED_TTL_S = 5.0  # /health is polled by load balancers: the workers' loads are read at most this often


def served(app) -> dict:
    """The model the service serves and what its live workers compute it in (from the load each
    publishes with its heartbeat): ``{"model", "dtype": [...], "device": [...], "workers": n}``,
    read from Redis at most every SERVED_TTL_S (a scan of the workers' keys). Redis down reads as
    no workers; the model's name is the service's own."""
    ingress = current(app)
    cached = getattr(ingress, "served_cache", None)
    if cached is not None and time.monotonic() - cached[0] < SERVED_TTL_S:
        return cached[1]
    try:
        loads, down = ingress.directory.loads(), False
    except KvsnapError:  # Redis down: not asked again for SERVED_TTL_S (liveness stays quick)
        loads, down = {}, True
    view = {
        "model": ingress.cfg.model,
        "dtype": sorted({s["dtype"] for s in loads.values() if "dtype" in s}),
        "device": sorted({s["device"] for s in loads.values() if "device" in s}),
        "workers": len(loads),
    }
    if loads or down:  # none yet (a replica publishes its first load 2 s after it starts): ask next time
        ingress.served_cache = (time.monotonic(), view)
    return view


def api_of(request: Request) -> SessionAPI:
    return current(request.app).api


async def first_event(events):
    """Pull the first event before the response starts, so early errors get a real status code."""
    iterator = events.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        first = None
    return first, iterator


async def sse(events, shape, request: Request, done_marker: bool = False) -> StreamingResponse:
    first, iterator = await first_event(events)

    async def body():
        try:
            event = first
            while event is not None:
                yield f"data: {json.dumps(shape(event))}\n\n"
                if await request.is_disconnected():
                    break  # the client went away: stop generating
                try:
                    event = await iterator.__anext__()
                except StopAsyncIteration:
                    event = None
            if done_marker:
                yield "data: [DONE]\n\n"
        except KvsnapError as exc:
            yield f"data: {json.dumps(error_body(exc))}\n\n"
        finally:
            # A client disconnect cancels this task; closing the event stream is what stops the
            # worker generating, so it must run to the end even inside the cancelled scope.
            with anyio.CancelScope(shield=True):
                await iterator.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")
