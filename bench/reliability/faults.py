"""Reliability suite, fault phases (bench/reliability/suite.py runs every group; this one alone:
``python bench/reliability/faults.py [--quick] [--phase NAME]``):

- disconnect:  streamed turns cut after their first token: the session answers its next turn.
- corrupt:     the disk tier's session files truncated or garbled: detected, rebuilt from the
               token log, right answers.
- kill:        a worker replica killed every few seconds while the sessions converse: every
               turn succeeds or fails with a retryable 503 / 429, none past its timeout.
- redis:       redis-server crashed (SIGKILL) mid-load and restarted over its data, then
               restarted empty: requests fail fast with 503 while it is down; afterwards the
               workers re-register what they hold and no session is lost.
"""

from __future__ import annotations

import random
import shutil
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from reliability.common import (
    CLIENT_TIMEOUT_S,
    KEY_A,
    Client,
    Recorder,
    Sessions,
    one_turn,
    register_documents,
    verify_all,
)
from reliability.local_service import running_replicas, worker_actor_names
from reliability.runner import Phase, Suite, main


def phase_disconnect(client: Client, sessions: Sessions, rec: Recorder, n: int) -> None:
    """Streamed turns cut after their first token; each session then answers a turn."""
    cut = sessions.ids[-n:]
    for sid in cut:
        state = client.request("disconnect", "get", f"/v1/sessions/{sid}").json()
        r = requests.post(
            f"{client.http}/v1/sessions/{sid}/turns",
            headers={"Authorization": f"Bearer {KEY_A}"},
            json={"message": "Go on and on.", "max_tokens": 1000, "stream": True},
            stream=True,
            timeout=CLIENT_TIMEOUT_S,
        )
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                break
        r.close()
        deadline = time.time() + 20
        while time.time() < deadline:
            after = client.request("disconnect", "get", f"/v1/sessions/{sid}").json()
            if after["turns"] > state["turns"]:
                break
            time.sleep(0.2)
        stopped = after["turns"] == state["turns"] + 1 and after["logical_len"] < state["logical_len"] + 1000
        rec.check(stopped, f"disconnect: {sid} did not stop generating or commit the cut turn ({state} -> {after})")
        follow = client.request(
            "disconnect", "post", f"/v1/sessions/{sid}/turns", json={"message": "Still there?", "max_tokens": 3}
        )
        rec.check(follow is not None and follow.status_code == 200, f"disconnect: {sid} did not answer after the cut")
    # these sessions now hold answers nobody can predict: they leave the verified set
    for sid in cut:
        sessions.ids.remove(sid)
    rec.figures["disconnect"]["streams_cut"] = n


def phase_corrupt(client: Client, sessions: Sessions, data_dir: Path, redis_url: str, rec: Recorder) -> None:
    """Truncate half of the verified sessions' files in their holder's disk tier, garble the other half."""
    from kvsnap.store.directory import SessionDirectory

    directory = SessionDirectory(redis_url)
    files = {}
    for sid in sessions.ids:
        entry = directory.get("alpha", sid)
        # the holder's file (a replica that gave a session up may keep a stale copy until LRU drops it)
        found = list((data_dir / "disk" / entry.owner).glob(f"alpha_{sid}-*.safetensors")) if entry else []
        if entry is not None and entry.tier == "disk" and found:
            files[sid] = found[0]
    rec.check(len(files) >= 2, f"corrupt: only {len(files)} verified sessions in the disk tier (tiers too large?)")
    for i, path in enumerate(files.values()):
        data = path.read_bytes()
        if i % 2:
            path.write_bytes(data[: len(data) // 2])  # truncated
        else:
            middle = len(data) // 2
            path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :])
    result = verify_all(client, sessions, "corrupt", rec)
    rebuilt = sorted(sid for sid in files if result["by_session"].get(sid) == "rebuilt")
    rec.figures["corrupt"] |= {"files_corrupted": len(files), "rebuilt": len(rebuilt)}
    rec.check(rebuilt == sorted(files), f"corrupt: corrupted {sorted(files)}, rebuilt {rebuilt}")


def phase_kill(
    client: Client, sessions: Sessions, every_s: float, duration_s: float, turns: int, rec: Recorder
) -> None:
    import ray  # (reliability.common has set the Ray environment)

    from kvsnap.service.app import wait_for_workers

    stop = threading.Event()
    kills = []

    def killer():
        """Every few seconds, one replica of the two, never the last one running (the fault
        model: losing one of N replicas; Serve restarts it)."""
        rng = random.Random(5)
        wait = every_s / 2
        while not stop.wait(wait):
            wait = every_s
            names = sorted(worker_actor_names())
            if running_replicas() >= 2:
                name = rng.choice(names)
                try:
                    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                    kills.append(name)
                except ValueError:
                    pass

    def converse(sid):
        """``turns`` turns spread over the phase, so that kills land between and during them."""
        goal = sessions.done[sid] + turns
        pace = random.Random(sid)
        while not stop.is_set() and sessions.done[sid] < goal:
            outcome = one_turn(client, sessions, sid, "kill", rec)
            stop.wait(0.5 if outcome == "retry" else duration_s / (turns + 1) * pace.uniform(0.5, 1.2))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    deadline = time.time() + duration_s
    with ThreadPoolExecutor(len(sessions.ids)) as pool:
        futures = [pool.submit(converse, sid) for sid in sessions.ids]
        while time.time() < deadline and not all(f.done() for f in futures):
            time.sleep(0.5)
        stop.set()
        for f in futures:
            f.result()
    thread.join()
    statuses = Counter(s for s, _ in rec.calls["kill"])
    bad = {s: n for s, n in statuses.items() if s not in ("200", "429", "503")}
    rec.check(not bad, f"kill: turns failed with non-retryable statuses {bad}")
    rec.check(wait_for_workers(2), "kill: the worker replicas did not all come back within 120 s")
    rec.figures["kill"]["replicas_killed"] = len(kills)
    verify_all(client, sessions, "kill-verify", rec, patience_s=90)


def phase_redis(client: Client, sessions: Sessions, redis, down_s: float, rec: Recorder) -> None:
    # 1. a crash mid-load, restarted over its data
    stop = threading.Event()

    def converse(sid):
        goal = sessions.done[sid] + 4
        while not stop.is_set() and sessions.done[sid] < goal:
            if one_turn(client, sessions, sid, "redis-down", rec) == "retry":
                time.sleep(0.3)

    created = []
    with ThreadPoolExecutor(4) as pool:
        for sid in sessions.ids[:4]:
            pool.submit(converse, sid)
        time.sleep(1)
        redis.kill()
        down_at = time.perf_counter()
        for i in range(3):  # a new session needs the directory: it must fail, fast and clearly
            sid = f"rel-outage-{i}"
            r = client.request("redis-down", "post", "/v1/sessions", json={"session_id": sid, "document": "Outage."})
            created.append((sid, None if r is None else r.status_code))
            time.sleep(down_s / 4)
        time.sleep(max(0.0, down_s - (time.perf_counter() - down_at)))
        redis.start()
        rec.figures["redis-down"]["down_s"] = round(time.perf_counter() - down_at, 1)
        time.sleep(2)
        stop.set()
    failing = [t for s, t in rec.calls["redis-down"] if s == "503"]
    served = sum(1 for s, _ in rec.calls["redis-down"] if s == "200")
    rec.figures["redis-down"] |= {
        "failed_503": len(failing),
        "max_503_latency_s": round(max(failing, default=0.0), 3),
        "served_while_down_or_after": served,
        "creates_while_down": [code for _, code in created],
    }
    rec.check(all(code == 503 for _, code in created), f"redis: creating a session while Redis was down: {created}")
    rec.check(max(failing, default=0) < 5, f"redis: failing requests took up to {max(failing, default=0):.1f}s")
    statuses = Counter(s for s, _ in rec.calls["redis-down"])
    bad = {s: n for s, n in statuses.items() if s not in ("200", "201", "429", "503")}
    rec.check(not bad, f"redis: statuses other than 200/503 around the outage: {bad}")
    for sid, _ in created:  # nothing half-created
        r = client.request("redis-down", "get", f"/v1/sessions/{sid}")
        rec.check(r is not None and r.status_code == 404, f"redis: {sid} exists after a failed create")
    verify_all(client, sessions, "redis-restarted", rec)
    # 2. restarted empty: every worker re-registers what it holds on its next heartbeat
    redis.stop()
    shutil.rmtree(redis.data_dir)
    redis.start()
    time.sleep(6)  # a few heartbeats (2 s each)
    verify_all(client, sessions, "redis-wiped", rec, patience_s=30)
    # the wipe took the document records (the sessions opened from them hold their own text):
    # registered again, each gets its id back (a content address) and shared rows
    gone = [client.request("redis-wiped", "get", f"/v1/documents/{i}") for i in sessions.document_ids.values()]
    rec.figures["redis-wiped"]["documents_after_wipe"] = [None if r is None else r.status_code for r in gone]
    register_documents(client, sessions, "redis-wiped", rec)


def _kill(s: Suite) -> None:
    p = s.params
    phase_kill(s.client, s.sessions, p["kill_every_s"], p["kill_duration_s"], p["turns_kill"], s.rec)


PHASES = [
    Phase("disconnect", lambda s: phase_disconnect(s.client, s.sessions, s.rec, n=2)),
    Phase("corrupt", lambda s: phase_corrupt(s.client, s.sessions, s.data_dir, s.redis.url, s.rec)),
    Phase("kill", _kill),
    Phase("redis", lambda s: phase_redis(s.client, s.sessions, s.redis, s.params["redis_down_s"], s.rec)),
]


if __name__ == "__main__":
    sys.exit(main(PHASES, description=__doc__))
