"""The worker deployment: one Ray Serve replica = one model + its session tiers.

A turn arrives as the :class:`~kvsnap.actors.turns.TurnRequest` the ingress validated
(token ids, sampling, a new session's settings) and streams lists of events:
``{"t": token_id}`` per generated token, then one ``{"done": True, ...}``
with the report and the session's new state. Errors are kvsnap errors; they pickle
across Ray and the ingress maps them to status codes.

The streaming methods are async generators fed by one thread per turn: Ray Serve
cancels an async method when its caller goes away (a client disconnect), and the
cancellation stops the thread between two tokens, which cancels the turn in the worker's
batch. A sync generator method would keep generating to the end. The model itself runs on
the worker's scheduler thread (engine/scheduler.py), many turns at a time; a turn's thread
loads its session, waits for its tokens and commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from ray import serve

from kvsnap import cpu_kernels
from kvsnap.actors.turns import TurnRequest
from kvsnap.actors.worker import Worker
from kvsnap.engine import Engine, load_model
from kvsnap.errors import NotFound
from kvsnap.policies.kivi import parse_kivi
from kvsnap.service.config import ServiceConfig
from kvsnap.store.directory import SessionDirectory
from kvsnap.store.tiers import build_store

log = logging.getLogger(__name__)
_END = object()


async def _threaded(events: Iterator[dict], on_cancel=None) -> AsyncIterator[list[dict]]:
    """``events`` (a sync generator doing model work) as an async generator of batches.

    One thread per turn iterates ``events`` from start to end (the worker takes its locks in
    that generator, so every step and the close must run on the same thread) and hands each
    item over. Each batch is every item that is ready when the consumer asks: one token while
    the model is slower than the hop back to the ingress (the first token never waits), several
    when it is faster, so a fast model does not pay one Ray round trip per token. When the
    consumer is cancelled or stops (client gone), ``on_cancel`` stops the turn at the next step
    (one still waiting for a place in the batch leaves the queue; one in the middle of its
    prompt finishes the prompt first), the thread stops after the token in flight and closes
    ``events``: the worker commits what was generated."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def hand_over(item, error=None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the replica is shutting down
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))

    def produce() -> None:
        error = None
        try:
            for item in events:
                hand_over(item)
                if stop.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            error = exc
        finally:
            try:
                events.close()
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
            hand_over(_END, error)  # always: the consumer must never wait forever

    threading.Thread(target=produce, name="kvsnap-turn", daemon=True).start()
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            items = [item for item, _ in batch if item is not _END]
            if items:
                yield items
            if batch[-1][0] is _END:  # the end always comes last, with the error if there was one
                if batch[-1][1] is not None:
                    raise batch[-1][1]
                return
    finally:
        stop.set()
        if on_cancel is not None:
            on_cancel()


class WorkerReplica:
    def __init__(self, config: dict, redis_url: str):
        cfg = ServiceConfig(**config)
        cfg.load_policy_modules()  # sessions of those policies may be rebuilt here
        threads = max(1, int(cfg.cpus_per_replica))  # the scheduler thread's, which runs the steps
        torch.set_num_threads(1)  # the load's: a team made here would slow every step (engine/threads.py)
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        loaded = load_model(cfg.model, gguf_file=cfg.gguf_file, dtype=cfg.dtype)
        engine = Engine(
            loaded,
            prefill_chunk=cfg.prefill_chunk,
            greedy_screen=cfg.greedy_screen,
            prefix_cache_bytes=cfg.prefix_cache_mib << 20,
            prefix_block=cfg.prefix_block,
        )
        directory = SessionDirectory(redis_url, session_ttl_s=cfg.session_ttl_s)
        disk_dir = str(Path(cfg.data_dir) / "disk" / self.worker_id) if cfg.disk_tier_mib else None
        store = build_store(
            cfg.device_tier_mib << 20,
            cfg.host_tier_mib << 20,
            cfg.disk_tier_mib << 20,
            disk_dir,
            device=loaded.device,
            kivi=parse_kivi(cfg.kv_quant, cfg.kv_quant_group, cfg.kv_quant_residual),
            kivi_device=cfg.kv_quant_device,
        )
        self.worker = Worker(engine, directory, store, self.worker_id, max_batch=cfg.max_batch, threads=threads)
        self.worker.start_heartbeat(interval_s=2.0)
        self.ongoing = 0
        pid = os.getpid()
        # bf16 on a CPU: the C kernels of this CPU's variant (cpu_kernels/build.py), loaded now, not mid-step
        own = loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"
        attention = cpu_kernels.warm() if own else "torch attention"
        engine.span_table()  # the defaults keep sentence spans: the first turn would build it mid-step
        # what is here now lives as long as the replica (the model's modules, torch, Ray, Serve:
        # ~370K objects): out of the collector's sight, a full collection (one in each minute of
        # 4-turn chats measured here) takes 0.3-0.5 ms, not 210-330 ms holding the GIL from the steps
        gc.collect()
        gc.freeze()
        log.info(
            "worker %s ready: %s on %s, %s, %s (pid %d)",
            self.worker_id,
            cfg.model,
            loaded.device,
            loaded.dtype,
            attention,
            pid,
        )

    # Ray Serve calls this periodically; the affinity router reads it from each replica. Async, so
    # it answers from the replica's event loop even while every request thread is busy.
    async def record_routing_stats(self) -> dict:
        return {
            "kv_bytes": sum(self.worker.store.bytes_by_tier().values()),
            "sessions": len(self.worker.held),
            "draining": self.worker.draining,
            "ongoing": self.ongoing,
            "prefix_roots": self.worker.engine.prefixes.roots() if self.worker.engine.prefixes is not None else [],
        }

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose scheduler thread died is replaced."""
        if not self.worker.scheduler.alive:
            raise RuntimeError(f"worker {self.worker_id}: the batch scheduler thread is not running")

    async def turn(self, req: TurnRequest):
        """Stream one turn (a new session's first one too) as batches of events."""
        started: dict = {}  # the worker's stream, once the turn's thread has made it

        def cancel() -> None:
            started["cancelled"] = True  # seen by _events if the stream is not made yet
            if (stream := started.get("stream")) is not None and stream.cancel is not None:
                stream.cancel()

        async for batch in _threaded(self._events(req, started), cancel):
            yield batch

    def turn_once(self, req: TurnRequest) -> list[dict]:
        """A non-streaming request: the whole turn in one Ray round trip instead of one per token."""
        return list(self._events(req, {}))

    def state(self, tenant: str, session_id: str) -> dict:
        return asdict(self.worker.state(tenant, session_id))

    def messages(self, tenant: str, session_id: str) -> list[dict]:
        return self.worker.messages(tenant, session_id)

    def delete(self, tenant: str, session_id: str) -> None:
        self.worker.delete(tenant, session_id)

    def hold_prefix(self, tenant: str, tokens: list[int]) -> dict:
        """A registered document's whole chunks into this replica's shared prefixes."""
        return {"shared_tokens": self.worker.hold_prefix(tenant, tokens), "worker": self.worker_id}

    def drain(self, worker_id: str, resume_after_s: float) -> int:
        """Drain this replica; the router sends the call to ``worker_id`` only, and a call that
        lands elsewhere (that replica just went away) drains nothing."""
        if worker_id != self.worker_id:
            raise NotFound(f"no worker {worker_id!r}")
        return self.worker.drain(resume_after_s)

    def stats(self) -> dict:
        return self.worker.stats()

    def _events(self, req: TurnRequest, started: dict):
        """``{"t": token, "d": text delta}`` per token (the text detokenized once, by the worker's
        scheduler), then the end: the rest of the text, the answer's whole text (cut at a stop
        string), the report."""
        stream = started["stream"] = self.worker.stream(req)
        if started.get("cancelled") and stream.cancel is not None:  # the client left during the load
            stream.cancel()
        detok = stream.detok
        self.ongoing += 1
        try:
            for token in stream:
                yield {"t": token, "d": detok.take()}
        finally:
            try:
                stream.close()  # client gone: stop generating; the worker commits what was generated
            finally:
                self.ongoing -= 1
        if stream.report is None:  # cancelled before it ran (its client is gone): nothing to report
            return
        entry = self.worker.held.get(req.key)
        yield {
            "done": True,
            "d": detok.take(final=True) if detok is not None else "",
            "text": stream.text,
            "finish_reason": stream.finish_reason,
            "report": asdict(stream.report),
            "source": stream.source,
            "worker": self.worker_id,
            "state": asdict(entry.entry) if entry else None,
        }
