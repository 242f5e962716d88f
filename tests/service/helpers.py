"""What the shared service's tests (the `service` fixture, tests/conftest.py) share: a document
and its questions, the HTTP and gRPC calls, the in-process engine's reference answers, and a
worker replica killed or awaited."""

from __future__ import annotations

import os
import time

import grpc
import requests

from kvsnap.engine import SamplingParams
from kvsnap.engine.sampling import cut_at_stop
from kvsnap.service import app
from kvsnap.service.grpc_stubs import pb2_grpc
from kvsnap.service.template import TURN_MARKER, encode_messages
from kvsnap.store.directory import SessionDirectory

DOC = "Foxes are small omnivorous mammals. The pass key is 48213. Foxes live in dens and hunt at night. " * 3
QUESTIONS = ["What is the pass key?", "Where do foxes live?", "And when do they hunt?"]
FULL = {"policy": "full"}


def reference_answers(
    engine, document: str, questions: list[str], max_tokens: int | list[int], policy="full"
) -> list[str]:
    """The same conversation on the in-process engine, never interrupted (policy full by default);
    ``max_tokens`` per turn, or one for all."""
    tok = engine.tokenizer
    session = engine.new_session(policy)
    engine.prefill(session, encode_messages(tok, [{"role": "document", "content": document}], True))
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(questions)
    answers = []
    for q, limit in zip(questions, limits, strict=True):
        sampling = SamplingParams(max_new_tokens=limit, stop=(TURN_MARKER,))  # the templated turns' default
        text = engine.turn(session, encode_messages(tok, [{"role": "user", "content": q}], False), sampling).text
        answers.append(cut_at_stop(text, (TURN_MARKER,)))
    return answers


def create(service, sid: str, settings=None, key="key-alpha", document=DOC) -> requests.Response:
    return requests.post(
        f"{service.http}/v1/sessions",
        headers=service.headers(key),
        json={"session_id": sid, "document": document, "settings": settings or FULL},
    )


def turn(service, sid: str, message: str, key="key-alpha", **fields) -> requests.Response:
    return requests.post(
        f"{service.http}/v1/sessions/{sid}/turns",
        headers=service.headers(key),
        json={"message": message, "max_tokens": 6, **fields},
        stream=fields.get("stream", False),
    )


def kill_replica(worker_id: str, timeout_s: float = 60) -> None:
    """Kill a worker replica and wait until its process is gone. ``ray.kill`` only sends the
    kill; ActorDiedError comes once the GCS marks the actor dead, and a process killed while
    busy still ran a turn in the ~30 ms before it exited (fresh-clone make test beside a CPU
    hog, 2026-12-04: the ingress had not heard of the death and sent the next turn there).
    ActorUnavailableError, also a RayActorError, is a busy or unreachable actor: not dead."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    name = next(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{worker_id}")
    )
    actor = ray.get_actor(name, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _replica: os.getpid()), timeout=timeout_s)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ActorDiedError:
            break
        except (ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.1)
    else:
        raise AssertionError(f"replica {worker_id} still answers {timeout_s} s after ray.kill")
    assert wait_for(lambda: not _process_alive(pid), max(1.0, deadline - time.monotonic())), (
        f"replica {worker_id} (pid {pid}) still runs {timeout_s} s after ray.kill"
    )


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for_workers(count: int = 2, timeout_s: float = 90) -> None:
    """Until Serve runs ``count`` healthy worker replicas again (after a kill or a drain)."""
    assert app.wait_for_workers(count, timeout_s), f"worker replicas did not recover within {timeout_s} s"


def grpc_stub(service):
    return pb2_grpc.KvsnapStub(grpc.insecure_channel(service.grpc))


def md(key="key-alpha"):
    return [("authorization", f"Bearer {key}")]


def entry(service, sid, tenant="alpha"):
    return SessionDirectory(service.redis_url).get(tenant, sid)


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True
