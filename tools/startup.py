"""Why the service did not start, on the console: each Serve deployment's own start-up error.

A replica whose constructor raises (a model that cannot load, a package not installed) is
retried by Serve and, after a few failures, the application is marked failed; ``serve.run``
then raises a RuntimeError that names the deployments, not the reason, which Serve keeps in
each deployment's status message (the replica's traceback). :func:`deploy` runs the app and
prints a replica's error as soon as one fails (Serve may still retry it), and raises
:class:`StartupFailed` with every failed deployment's own error when the app fails. The app
fails with its first failed deployment; the others may still be starting (a busy machine), so
the report waits for them to settle first (``settle_s`` at most): each gets its own line.
"""

from __future__ import annotations

import sys
import threading
import time

STARTING = frozenset({"UPDATING", "UPSCALING"})  # a deployment whose replicas are still starting


class StartupFailed(RuntimeError):
    """The application did not start; the message holds each failed deployment's error."""


def deploy(app, name: str, route_prefix: str = "/", poll_s: float = 1.0, settle_s: float = 120.0) -> None:
    """``serve.run`` for ``app``, telling each replica start-up failure on stderr once as it
    happens; StartupFailed (each deployment's own error) when the application fails."""
    from ray import serve

    stop = threading.Event()
    seen: dict[str, str] = {}
    watch = threading.Thread(target=_watch, args=(name, seen, stop, poll_s), name="kvsnap-startup", daemon=True)
    watch.start()
    try:
        serve.run(app, name=name, route_prefix=route_prefix)
    except RuntimeError as exc:
        stop.set()
        watch.join(timeout=5)
        errors = startup_errors(_settled(name, settle_s, poll_s)) or seen
        if not errors:
            raise
        lines = "\n".join(f"  {deployment}: {error}" for deployment, error in sorted(errors.items()))
        raise StartupFailed(f"the application {name!r} did not start; its replicas failed with:\n{lines}") from exc
    finally:
        stop.set()


def startup_errors(status) -> dict[str, str]:
    """Deployment name -> its replicas' last start-up error (the exception line of the
    traceback Serve keeps in the deployment's status message), for every deployment of an
    application's ``status`` (``serve.status().applications[name]``) whose message has one."""
    if status is None:
        return {}
    out = {}
    for deployment, info in status.deployments.items():
        message = info.message or ""
        if "Error:" in message and "failed to start" in message:
            out[deployment] = reason(message.split("Error:", 1)[1])
    return out


def reason(traceback_text: str) -> str:
    """The exception line of a formatted traceback (its last non-empty line)."""
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _settled(name: str, bound_s: float, poll_s: float):
    """The application's status once no deployment is still starting (or ``bound_s`` passed)."""
    deadline = time.monotonic() + bound_s
    status = _app_status(name)
    while status is not None and time.monotonic() < deadline and _starting(status):
        time.sleep(poll_s)
        status = _app_status(name)
    return status


def _starting(status) -> bool:
    return any(str(getattr(info.status, "value", info.status)) in STARTING for info in status.deployments.values())


def _app_status(name: str):
    from ray import serve

    try:
        return serve.status().applications.get(name)
    except Exception:  # noqa: BLE001 - the controller is gone: nothing more to tell
        return None


def _watch(name: str, seen: dict[str, str], stop: threading.Event, poll_s: float) -> None:
    """Print each deployment's start-up error once, as soon as Serve reports it."""
    while not stop.wait(poll_s):
        for deployment, error in startup_errors(_app_status(name)).items():
            if seen.get(deployment) != error:
                seen[deployment] = error
                print(f"kvsnap serve: a {deployment} replica failed to start: {error}", file=sys.stderr, flush=True)
