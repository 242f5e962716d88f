"""The gRPC server of the ingress replica: ``proto/kvsnap.proto`` with reflection and the
standard health service, on the replica's event loop, sharing :class:`SessionAPI`.

(Ray Serve's own gRPC proxy offers neither reflection nor the standard health
service, and maps exceptions to codes coarsely; running grpc.aio here keeps the
status codes identical to the HTTP ones.)
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvsnap.errors import InvalidArgument, KvsnapError
from kvsnap.policies import coerce_params, evictor_names

from .auth import tenant_for
from .grpc_stubs import pb2, pb2_grpc
from .outcomes import as_kvsnap_error, state_view
from .status import grpc_status

log = logging.getLogger(__name__)
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Kvsnap"].full_name


def _settings(msg, default_policy: str) -> dict:
    """Session settings from a SessionSettings message: its fields (0 / "" = unset) and its
    ``params`` map, each value parsed as the policy's parameter type."""
    fields = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields if f.name not in ("decode", "params")}
    out = {k: v or None for k, v in fields.items()}
    out |= coerce_params(msg.policy or default_policy, dict(msg.params))
    out["decode"] = _decode_settings(msg.decode) if msg.HasField("decode") else None
    return out


def _decode_settings(msg) -> dict:
    if not msg.policy:
        raise InvalidArgument(f"decode settings must name their policy: {', '.join(evictor_names())}")
    fields = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields if f.name not in ("policy", "params")}
    return {"policy": msg.policy} | {k: v for k, v in fields.items() if v} | coerce_params(msg.policy, dict(msg.params))


def _sampling(msg) -> dict:
    return {
        "max_tokens": msg.max_tokens or None,
        "temperature": msg.temperature if msg.HasField("temperature") else None,
        "top_p": msg.top_p if msg.HasField("top_p") else None,
        "top_k": msg.top_k or None,
        "seed": msg.seed if msg.HasField("seed") else None,
        "stop": list(msg.stop) or None,
        "ignore_eos": msg.ignore_eos,
    }


def _state(view: dict) -> pb2.SessionState:
    return pb2.SessionState(
        **{
            k: view[k]
            for k in ("session_id", "logical_len", "kept_len", "kv_bytes", "tier", "turns", "policy", "version")
        }
    )


class KvsnapServicer(pb2_grpc.KvsnapServicer):
    def __init__(self, ingress):
        self.ingress = ingress

    @property
    def api(self):
        return self.ingress.api

    def _tenant(self, context) -> str:
        metadata = dict(context.invocation_metadata())
        return tenant_for(self.ingress.cfg.api_keys, metadata.get("authorization"))

    async def _fail(self, context, error: KvsnapError, method: str):
        self.ingress.metrics.requests.labels(f"grpc:{method}", grpc_status(error).name).inc()
        await context.abort(grpc_status(error), error.message)

    # The handlers raise kvsnap errors; kvsnap_handlers (below) turns them into statuses, in one place.
    async def CreateSession(self, request, context):
        tenant = self._tenant(context)
        text = await self.ingress.documents.text_of(tenant, request.document, request.document_id)
        settings = _settings(request.settings, self.api.defaults["policy"])
        return _state(await self.api.create(tenant, request.session_id or None, text, settings, "grpc"))

    async def Turn(self, request, context):
        events = self.api.turn(
            self._tenant(context),
            request.session_id,
            request.message,
            _sampling(request.sampling),
            request.raw,
            "grpc",
        )
        try:
            async for event in events:
                if "text" in event:
                    yield pb2.TurnChunk(text=event["text"], token_ids=event["ids"])
                else:
                    o = event["outcome"]
                    yield pb2.TurnChunk(
                        done=True,
                        finish_reason=o.finish_reason,
                        prompt_tokens=o.prompt_tokens,
                        cached_tokens=o.cached_tokens,
                        completion_tokens=len(o.token_ids),
                        state=_state(state_view(o.state)),
                        worker=o.worker,
                        source=o.source,
                    )
        finally:
            await events.aclose()  # client cancelled: stops generation

    async def GetSession(self, request, context):
        return _state(await self.api.get(self._tenant(context), request.session_id))

    async def DeleteSession(self, request, context):
        await self.api.delete(self._tenant(context), request.session_id)
        return pb2.DeleteResponse(deleted=True)

    async def CreateDocument(self, request, context):
        return pb2.Document(**await self.ingress.documents.add(self._tenant(context), request.document))

    async def GetDocument(self, request, context):
        return pb2.Document(**await self.ingress.documents.get(self._tenant(context), request.document_id))

    async def ListDocuments(self, request, context):
        found = await self.ingress.documents.list(self._tenant(context))
        return pb2.DocumentList(documents=[pb2.Document(**d) for d in found])

    async def DeleteDocument(self, request, context):
        await self.ingress.documents.delete(self._tenant(context), request.document_id)
        return pb2.DeleteResponse(deleted=True)


class Malformed:
    """A request body that did not parse as its message (answered INVALID_ARGUMENT)."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as exc:  # DecodeError, or anything a hostile payload makes protobuf raise
            return Malformed(f"malformed {message_cls.DESCRIPTOR.name}: {exc}")

    return parse


def kvsnap_handlers(servicer: KvsnapServicer) -> grpc.GenericRpcHandler:
    """The Kvsnap service's handlers, as the generated code builds them, except that a request
    that does not parse is answered INVALID_ARGUMENT (grpc's own answer is UNKNOWN), after the
    API key is checked like for every other request."""
    service = pb2.DESCRIPTOR.services_by_name["Kvsnap"]

    def guarded(method, streaming: bool):
        """``method`` with the key and the body checked first, and every error it raises
        answered with its status (the one place gRPC maps kvsnap errors)."""
        name = method.__name__

        def first_checks(request, context) -> None:
            servicer._tenant(context)
            if isinstance(request, Malformed):
                raise InvalidArgument(request.error)

        async def unary(request, context):
            try:
                first_checks(request, context)
                response = await method(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status here
                await servicer._fail(context, as_kvsnap_error(exc), name)
            servicer.ingress.metrics.requests.labels(f"grpc:{name}", "OK").inc()
            return response

        async def stream(request, context):
            try:
                first_checks(request, context)
                async for item in method(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status here
                await servicer._fail(context, as_kvsnap_error(exc), name)
            servicer.ingress.metrics.requests.labels(f"grpc:{name}", "OK").inc()

        return stream if streaming else unary

    handlers = {}
    for m in service.methods:
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            guarded(getattr(servicer, m.name), m.server_streaming),
            request_deserializer=_lenient(getattr(pb2, m.input_type.name)),
            response_serializer=getattr(pb2, m.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


async def start_grpc_server(ingress, address: str) -> grpc.aio.Server:
    """Serve ``proto/kvsnap.proto`` (plus health and reflection) on ``address``, on the calling
    event loop: the ingress replica's own, so a handler calls the worker handle from the loop
    it belongs to (no hop to another thread per request)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", ingress.cfg.max_body_bytes)])
    server.add_generic_rpc_handlers((kvsnap_handlers(KvsnapServicer(ingress)),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if not server.add_insecure_port(address):
        raise OSError(f"cannot bind gRPC to {address}")
    await server.start()
    log.info("gRPC serving on %s", address)
    return server
