"""The session API core, shared by HTTP and gRPC: validate, tokenize, route, stream.

Everything a request can get wrong is checked here, before any model work:
auth happens at the edge, then ids, sizes, settings and sampling parameters. Calls
go to the worker deployment through a handle tagged with ``"<tenant>/<session>"``,
which the affinity router turns into "the replica that holds this session".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing

from kvsnap.actors.turns import TurnRequest
from kvsnap.engine.prefixes import root_key
from kvsnap.engine.sampling import SamplingParams
from kvsnap.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvsnap.store.directory import SessionDirectory, check_id

from .checks import RequestChecks
from .config import ServiceConfig
from .metrics import Metrics
from .outcomes import RETRYABLE, TurnOutcome, as_kvsnap_error, entry_dict, state_view
from .template import template_for

log = logging.getLogger(__name__)

DRAIN_RESUME_S = 60.0  # a drained replica stays out of placement this long, then takes sessions again
RETRY_WINDOW_S = 30.0  # a replica that died before answering: retry this long (a replacement starts meanwhile)


class SessionAPI(RequestChecks):
    """The operations (create, turn, get, delete, drain, stream) on top of the request checks
    (service/checks.py), which every operation runs before any model work."""

    def __init__(self, cfg: ServiceConfig, workers, tokenizer, directory: SessionDirectory, metrics: Metrics):
        self.cfg = cfg
        self.workers = workers
        self.tokenizer = tokenizer
        self.template = template_for(tokenizer)  # the model's chat template, or the plain one
        self.marker = self.template.marker
        self.defaults = cfg.session_defaults()  # the model's measured defaults, the operator's over them
        self.directory = directory
        self.metrics = metrics
        self.in_flight: Counter = Counter()  # turns in flight per tenant (turn_slot)

    # -- operations ----------------------------------------------------------------------
    async def create(
        self, tenant: str, session_id: str | None, document: str, settings: dict | None, protocol: str
    ) -> dict:
        sid = self.session_id(session_id)
        log, tokens = self.document_tokens(document)
        outcome = await self.collect(self.open_session(tenant, sid, protocol, tokens, settings, None, log, None, False))
        return state_view(outcome.state) | {"cached_tokens": outcome.cached_tokens}

    def turn(
        self,
        tenant: str,
        session_id: str,
        message: str,
        sampling: dict,
        raw: bool,
        protocol: str,
        streaming: bool = True,
    ) -> AsyncIterator[dict]:
        """Validated before the first event is awaited: errors surface before any model work."""
        sid = check_id("session id", session_id)
        if not message:
            raise InvalidArgument("message is empty")
        params = self.sampling(sampling, template=not raw)
        role, answer = ("prompt", "completion") if raw else ("user", "assistant")
        new = [{"role": role, "content": message}]
        tokens = self.raw_tokens(message, first=False) if raw else self.tokens(new, first=False)
        req = self.next_turn(tenant, sid, tokens, params, new, answer, templated=not raw)
        return self.stream(req, protocol, streaming)

    async def get(self, tenant: str, session_id: str) -> dict:
        entry = await asyncio.to_thread(self.directory.get, tenant, check_id("session id", session_id))
        if entry is None:
            raise NotFound(f"session {session_id!r} not found")
        return state_view(entry_dict(entry))

    async def delete(self, tenant: str, session_id: str) -> None:
        sid = check_id("session id", session_id)
        await self._call("delete", f"{tenant}/{sid}", tenant, sid)

    async def drain(self, worker_id: str, resume_after_s: float = DRAIN_RESUME_S) -> int:
        """Drain one replica by its id (NotFound, nothing drained, when no live replica has it)."""
        check_id("worker id", worker_id)
        if not await asyncio.to_thread(self.directory.worker_known, worker_id):
            raise NotFound(f"no worker {worker_id!r} (see GET /metrics for the live ones)")
        return await self._call("drain", f"worker:{worker_id}", worker_id, resume_after_s)

    # -- building and running turns (the OpenAI routes use these too) -------------------------
    def open_session(
        self,
        tenant: str,
        session_id: str | None,
        protocol: str,
        tokens: list[int],
        settings: dict | None,
        sampling: SamplingParams | None,
        log: list[dict],
        answer_role: str | None,
        streaming: bool,
        conversation: str = "",
    ):
        """A new session from its first tokens: settings resolved and checked before any model work
        (the worker's engine checks the window against the prompt, before it writes anything).
        ``conversation``: an implicit session's scope (resumable by its content)."""
        spec = self.settings(settings, len(tokens))
        req = TurnRequest(
            tenant, self.session_id(session_id), tokens, sampling, spec, log, answer_role, conversation=conversation
        )
        return self.stream(req, protocol, streaming)

    def next_turn(
        self,
        tenant,
        session_id,
        tokens,
        sampling,
        log,
        answer_role,
        expected_version=0,
        templated=True,
        keep_turns: int | None = None,
        keep_prompt: bool = False,
    ) -> TurnRequest:
        """A turn on an existing session, with an id of its own (see the retry rule in stream);
        ``templated``: its tokens come from the template (a marker the session holds is skipped);
        ``keep_turns``: the session first goes back to the end of that turn (a diverging request);
        ``keep_prompt``: and on to the end of the next turn's prompt, before its answer."""
        marker = self.marker if templated else []
        turn_id = uuid.uuid4().hex
        return TurnRequest(
            tenant,
            session_id,
            tokens,
            sampling,
            None,
            log,
            answer_role,
            turn_id,
            expected_version,
            marker,
            keep_turns=keep_turns,
            keep_prompt=keep_prompt,
        )

    async def stream(self, req: TurnRequest, protocol: str, streaming: bool = True):
        """Events from the worker: {"text": delta, "ids": [token ids]} for the tokens that came in
        one batch (one token while the model is slow, several when it outpaces the hop back),
        then {"done": ..., "outcome": ...}.

        ``streaming=False`` fetches the whole turn in one call (one Ray round trip instead of
        one per token). A replica that dies before the first event is retried (the router
        then moves the session)."""
        events = self._stream(req, protocol, streaming)
        release = self.turn_slot(req.tenant)  # before any model work
        try:
            async for event in events:
                if event.get("done"):
                    release()  # the turn is over: its place is free before its caller reads the end
                yield event
        finally:  # also closed early (the client went away): the worker stops generating now
            release()
            await events.aclose()

    def turn_slot(self, tenant: str):
        """Take one of ``tenant``'s places for a turn in flight through this ingress, at most
        ``cfg.tenant_turns()`` at once (ResourceExhausted, 429, past them: one tenant's flood
        cannot take every place the replicas have and leave the other tenants nothing but 429s).
        Returns the function that gives it back (once, however often it is called)."""
        cap = self.cfg.tenant_turns()
        if self.in_flight[tenant] >= cap:
            raise ResourceExhausted(
                f"this tenant has {cap} turns in flight, the most one tenant may have at once; "
                "retry when one of them ends"
            )
        self.in_flight[tenant] += 1
        taken = True

        def release() -> None:
            nonlocal taken
            if taken:
                taken = False
                self.in_flight[tenant] -= 1
                if not self.in_flight[tenant]:
                    del self.in_flight[tenant]

        return release

    async def _stream(self, req: TurnRequest, protocol: str, streaming: bool):
        tenant, sid = req.tenant, req.session_id
        key = req.key if req.new_session is None else self.prefix_route(req.key, tenant, req.tokens)
        started = time.perf_counter()
        first_token_at = None
        ids: list[int] = []
        unsent: list[int] = []  # token ids not yet sent with a text delta
        deadline = time.monotonic() + self.cfg.request_timeout_s
        retry_until = time.monotonic() + min(RETRY_WINDOW_S, self.cfg.request_timeout_s)
        # a turn is retried only if it was not committed: a replica can die after its commit and
        # before its answer arrives, and a second attempt would apply the turn twice. The commit
        # stores the turn's id (the entry's last_turn); only a failure costs a directory read.
        turn_id = req.turn_id
        for attempt in itertools.count():
            got_event = False
            try:
                if streaming:
                    gen = self.workers.options(session_id=key, stream=True).turn.remote(req)
                else:
                    gen = self.workers.options(session_id=key).turn_once.remote(req)
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    async for batch in gen if streaming else _aiter([await gen]):
                        got_event = True
                        new_ids = [event["t"] for event in batch if "t" in event]
                        if new_ids:
                            ids += new_ids
                            unsent += new_ids
                            if first_token_at is None:
                                first_token_at = time.perf_counter()
                                self.metrics.ttft.labels(protocol).observe(first_token_at - started)
                        delta = "".join(event["d"] for event in batch if "d" in event)  # the worker's text
                        if delta:
                            yield {"text": delta, "ids": unsent}
                            unsent = []
                        if "done" in batch[-1]:
                            if unsent:  # tokens behind no text (a stop string's, a partial character)
                                yield {"text": "", "ids": unsent}
                            outcome = self._outcome(sid, ids, batch[-1], started, first_token_at)
                            yield {"done": True, "outcome": outcome}
                return
            except (GeneratorExit, asyncio.CancelledError):
                gen.cancel()  # the caller went away (client disconnect): stop the worker generating
                raise
            except TimeoutError:
                gen.cancel()
                raise DeadlineExceeded(f"the request ran past {self.cfg.request_timeout_s:.0f} s") from None
            except Exception as exc:  # noqa: BLE001 - mapped below
                error = as_kvsnap_error(exc)
                retry = not got_event and (isinstance(exc, RETRYABLE) or "draining" in str(error))
                if retry and turn_id:
                    now = await self._entry_or_none(tenant, sid)
                    if now is None or now.last_turn == turn_id:  # cannot tell, or committed
                        raise Unavailable(
                            "the replica failed during this turn and the turn may have been applied (its answer "
                            "was lost); read the session (GET) before sending it again"
                        ) from None
                if retry and time.monotonic() < retry_until:
                    log.warning("turn of %s failed before any output (%s); retrying", key, error)
                    await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
                    continue
                raise error from None

    async def _entry_or_none(self, tenant: str, sid: str):
        """The session's directory entry; None when there is none or Redis cannot be reached
        (a held session's turns go on while Redis is down)."""
        try:
            return await asyncio.to_thread(self.directory.get, tenant, sid)
        except Unavailable:
            return None

    def _outcome(self, sid, ids, event, started, first_token_at) -> TurnOutcome:
        text, finish, report = event["text"], event["finish_reason"], event["report"]
        self.metrics.record_turn(report, time.perf_counter() - (first_token_at or started))
        prefilled = report["prompt_tokens"]  # this turn's new tokens plus the previous answer's last one
        timings = {k: report[k] for k in ("queue_s", "prefill_s", "reselect_s", "decode_s", "ttft_s")}
        state = event["state"]
        return TurnOutcome(sid, text, ids, finish, prefilled, event["worker"], event["source"], state, timings,
                           replayed_tokens=report.get("replayed_tokens", 0),
                           cached_tokens=report.get("cached_tokens", 0))  # fmt: skip

    @staticmethod
    async def collect(events: AsyncIterator[dict]) -> TurnOutcome:
        """The turn's outcome (its done event's), the event stream closed; a stream that ends
        without one (its worker went away mid-turn) is Unavailable: the client may retry."""
        async with aclosing(events):
            async for event in events:
                if event.get("done"):
                    return event["outcome"]
        raise Unavailable("the worker ended the turn without a result")

    def prefix_route(self, key: str, tenant: str, tokens: list[int]) -> str:
        """The router's tag of new work on ``tokens``: ``key`` ("<tenant>/<session>"), and where the
        tokens hold a whole prefill chunk, "#" and the name of that first block, so that the router
        prefers a replica holding it as a shared prefix (engine/prefixes.py, service/routing.py)."""
        root = root_key(tenant, tokens, self.cfg.prefill_chunk) if self.cfg.prefix_cache_mib else None
        return key if root is None else f"{key}#{root}"

    async def _call(self, method: str, key: str, *args):
        """``method(*args)`` on the replica the router picks for ``key``: "<tenant>/<session>" (its
        holder) or "worker:<id>" (that replica; admin calls). A session id never contains "/"."""
        retry_until = time.monotonic() + min(RETRY_WINDOW_S, self.cfg.request_timeout_s)
        for attempt in itertools.count():
            try:
                response = getattr(self.workers.options(session_id=key), method).remote(*args)
                async with asyncio.timeout(self.cfg.request_timeout_s):
                    return await response
            except TimeoutError:
                raise DeadlineExceeded(f"the request ran past {self.cfg.request_timeout_s:.0f} s") from None
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, RETRYABLE) and time.monotonic() < retry_until:
                    await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
                    continue
                raise as_kvsnap_error(exc) from None


async def _aiter(items):
    for item in items:
        yield item
