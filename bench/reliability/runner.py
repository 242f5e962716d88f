"""The reliability suite's runner: start the service, run the chosen phases in the suite's
order (the sessions opened before the first that needs them, every session verified at the
end), stop it, write reliability.json and print the table."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reliability.common import (
    LONG,
    QUESTIONS_BEYOND_KILL,
    QUICK,
    Client,
    Recorder,
    Sessions,
    open_all,
    verify_all,
)
from reliability.local_service import start

# -- running phases --------------------------------------------------------------------------------

# every phase, in the order the suite runs them (a phase group run alone keeps this order)
ORDER = ["auth", "tenants", "fuzz_http", "fuzz_grpc", "disconnect", "overload", "corrupt", "kill", "redis", "logs"]


@dataclass
class Suite:
    """What a phase works on: the running service, its Redis, the verified sessions."""

    params: dict
    rec: Recorder
    sessions: Sessions
    data_dir: Path
    out_dir: Path
    cfg: object = None
    redis: object = None
    client: Client | None = None

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.cfg.grpc_port}"


@dataclass
class Phase:
    name: str
    run: Callable[[Suite], None]
    sessions: bool = True  # needs the verified sessions open
    after_stop: bool = False  # runs once the service is stopped (the log scan)


def main(phases: list[Phase], argv: list[str] | None = None, description: str = "") -> int:
    """Run ``phases`` (selected with ``--phase``, default all) against a service of their own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the bounded version the tests run (minutes)")
    parser.add_argument("--out", default="bench/results", help="folder for reliability.json")
    names = [p.name for p in phases]
    parser.add_argument("--phase", action="append", choices=names, help="run only this phase (repeatable)")
    args = parser.parse_args(argv)
    chosen = [p for p in phases if not args.phase or p.name in args.phase]
    chosen.sort(key=lambda p: ORDER.index(p.name))
    report = run(chosen, QUICK if args.quick else LONG, Path(args.out), "quick" if args.quick else "long")
    return 1 if report["failures"] else 0


def run(phases: list[Phase], params: dict, out_dir: Path, mode: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="kvsnap-reliability-"))
    rec, started = Recorder(), time.perf_counter()
    need_sessions = any(p.sessions for p in phases)
    sessions = Sessions(params["sessions"] if need_sessions else 0, turns=params["turns_kill"] + QUESTIONS_BEYOND_KILL)
    suite = Suite(params, rec, sessions, data_dir, out_dir)
    if need_sessions:
        print(f"reference answers for {len(sessions.ids)} sessions (in-process engine)...", flush=True)
        sessions.reference()
    print("starting Ray, Redis and the Serve app...", flush=True)
    suite.cfg, suite.redis = start(data_dir)
    suite.client = Client(f"http://127.0.0.1:{suite.cfg.http_port}", rec)
    try:
        opened = False
        for phase in [p for p in phases if not p.after_stop]:
            if phase.sessions and not opened:
                _timed("setup", lambda s: open_all(s.client, s.sessions, s.rec), suite, started)
                opened = True
            _timed(phase.name, phase.run, suite, started)
        if opened:
            verify_all(suite.client, sessions, "final", rec)
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        suite.redis.stop()
    for phase in [p for p in phases if p.after_stop]:
        phase.run(suite)
    report = make_report(suite, [p.name for p in phases], mode, time.perf_counter() - started)
    (out_dir / "reliability.json").write_text(json.dumps(report, indent=1))
    print(format_table(report))
    print(f"wrote {out_dir / 'reliability.json'}")
    return report


def _timed(name: str, fn: Callable[[Suite], None], suite: Suite, started: float) -> None:
    t0 = time.perf_counter()
    print(f"[{time.perf_counter() - started:6.0f}s] {name}...", flush=True)
    fn(suite)
    suite.rec.figures[name]["phase_s"] = round(time.perf_counter() - t0, 1)


def make_report(suite: Suite, names: list[str], mode: str, elapsed_s: float) -> dict:
    rec, sessions = suite.rec, suite.sessions
    summary = rec.summary()
    lost = sum(v.get("sessions_lost", 0) for v in summary.values())
    by_policy = {
        policy: {
            "sessions": sum(1 for sid in sessions.ids if sessions.policy[sid] == policy),
            "lost": sum(v.get("by_policy", {}).get(policy, {}).get("lost", 0) for v in summary.values()),
            # checked answers, each equal to the uninterrupted twin's, by where their KV came from
            "answers_by_source": dict(
                sum(
                    (Counter(v.get("sources_by_policy", {}).get(policy, {})) for v in summary.values()),
                    Counter(),
                )
            ),
            "wrong_answers": sum(1 for f in rec.failures if f"[{policy}]" in f),
        }
        for policy in sorted(set(sessions.policy.values()))
    }
    return {
        "mode": mode,
        "params": suite.params,
        "phases_run": names,
        "elapsed_s": round(elapsed_s, 1),
        "sessions": len(sessions.ids),
        "sessions_lost": lost,
        "by_policy": by_policy,
        "on_documents": {  # opened from a registered document (POST /v1/documents), either policy
            "sessions": len(sessions.document_of),
            "lost": sum(v.get("on_documents", {}).get("lost", 0) for v in summary.values()),
        },
        "requests": sum(v.get("requests", 0) for v in summary.values()),
        "faults": {
            "replicas_killed": summary.get("kill", {}).get("replicas_killed", 0),
            "redis_crashes": int("redis" in names),
            "redis_wipes": int("redis" in names),
            "blobs_corrupted": summary.get("corrupt", {}).get("files_corrupted", 0),
            "streams_cut": summary.get("disconnect", {}).get("streams_cut", 0),
        },
        "phases": summary,
        "failures": rec.failures,
    }


def format_table(report: dict) -> str:
    lines = [
        f"\nreliability ({report['mode']}): {report['requests']} requests, {report['sessions']} verified sessions, "
        f"{report['sessions_lost']} lost, {len(report['failures'])} failed checks, {report['elapsed_s']:.0f}s",
        f"faults: {report['faults']}",
        f"by policy: {report['by_policy']}; opened from documents: {report['on_documents']}",
        f"{'phase':18}{'requests':>9}{'max s':>8}  statuses / figures",
    ]
    for phase, s in report["phases"].items():
        extra = {k: v for k, v in s.items() if k not in ("requests", "max_latency_s", "by_status")}
        lines.append(
            f"{phase:18}{s.get('requests', 0):>9}{s.get('max_latency_s', 0):>8}  {s.get('by_status', {})} {extra}"
        )
    for failure in report["failures"]:
        lines.append(f"FAILED: {failure}")
    return "\n".join(lines)
