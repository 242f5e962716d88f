"""Reliability suite, overload phase (bench/reliability/suite.py runs every group; this one alone:
``python bench/reliability/overload.py [--quick]``):

- overload:  twice the service's capacity in concurrent turns: excess answered 429 with
             Retry-After, accepted turns within their timeout, tiers within their budgets, no
             replica lost, and a turn right after answers.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from reliability.common import Client, Recorder, Sessions, one_turn
from reliability.local_service import worker_actor_names
from reliability.runner import Phase, main


def phase_overload(client: Client, sessions: Sessions, cfg, rec: Recorder) -> None:
    capacity = cfg.replicas * cfg.max_ongoing_requests + cfg.max_queued_requests
    load = 2 * capacity
    sids = sessions.ids[:load]
    replicas_before = worker_actor_names()
    t0 = time.perf_counter()
    outcomes = Counter()
    with ThreadPoolExecutor(load) as pool:
        for _ in range(2):  # two waves of twice the capacity at once
            outcomes.update(pool.map(lambda sid: one_turn(client, sessions, sid, "overload", rec), sids))
    elapsed = time.perf_counter() - t0
    statuses = Counter(s for s, _ in rec.calls["overload"])
    rec.check(statuses.get("429", 0) > 0, f"overload: twice the capacity ({load}) drew no 429 ({dict(statuses)})")
    rec.check(statuses.get("200", 0) > 0, "overload: nothing was served")
    slow = [t for s, t in rec.calls["overload"] if s == "429" and t > 5]
    rec.check(not slow, f"overload: {len(slow)} rejections took more than 5 s")
    metrics = client.request("overload", "get", "/metrics").text
    budgets = {"device": cfg.device_tier_mib << 20, "host": cfg.host_tier_mib << 20, "disk": cfg.disk_tier_mib << 20}
    # a put stores first and then demotes: a tier may hold one session more for a moment
    largest = max(client.request("overload", "get", f"/v1/sessions/{sid}").json()["kv_bytes"] for sid in sids)
    for tier, budget in budgets.items():
        held = [float(v) for v in re.findall(rf'kvsnap_kv_bytes\{{[^}}]*tier="{tier}"[^}}]*\}} ([0-9.e+]+)', metrics)]
        over = [v for v in held if v > budget + largest]
        rec.check(not over, f"overload: {tier} tier over its budget: {over} > {budget} + one session ({largest})")
    rec.check(worker_actor_names() == replicas_before, "overload: a worker replica died or restarted")
    t1 = time.perf_counter()
    recovered = one_turn(client, sessions, sids[0], "overload-after", rec)
    rec.figures["overload"] |= {
        "capacity": capacity,
        "concurrent": load,
        "seconds": round(elapsed, 1),
        "recovered_turn": recovered,
        "recovered_turn_s": round(time.perf_counter() - t1, 3),
    }


PHASES = [Phase("overload", lambda s: phase_overload(s.client, s.sessions, s.cfg, s.rec))]


if __name__ == "__main__":
    sys.exit(main(PHASES, description=__doc__))
