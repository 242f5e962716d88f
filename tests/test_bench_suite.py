"""`bench/suite.py --small`: the one command behind the docs' load-test figures, run for real.

It starts its own local Ray, embedded Redis and Serve app per phase (in child processes),
so this file runs before the shared service fixture is started by later test files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # its quality phase runs the embedded Gemma 3 270M


def test_small_suite_measures_every_gain(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "suite.py"), "--small", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "suite.json").read_text())

    resume = list(r["resume"].values())
    assert len(resume) == len(r["args"]["lengths"].split(","))
    assert [v["context_tokens"] for v in resume] == sorted(v["context_tokens"] for v in resume)
    for v in resume:
        assert len(v["samples"]["held_ttft_s"]) == r["args"]["reps"]
        assert v["speedup"] == pytest.approx(v["reprefill_ttft_s"] / v["held_ttft_s"])
        assert len(set(v["samples"]["held_ttft_s"] + v["samples"]["reprefill_ttft_s"])) > 1  # measured, not set
    # re-prefilling grows with the transcript; a held follow-up does not
    assert resume[-1]["reprefill_ttft_s"] > resume[0]["reprefill_ttft_s"]
    assert resume[-1]["speedup"] > 1

    c = r["concurrency"]
    full, snap = c["full"], c["snapkv"]
    assert snap["kv_bytes_per_session"] < full["kv_bytes_per_session"]
    assert 1 <= full["resident"] < snap["resident"] and not full["capped"]
    assert full["resident"] * full["kv_bytes_per_session"] <= full["device_tier_bytes"]
    assert c["gain"] == pytest.approx(snap["resident"] / full["resident"])
    for v in (full, snap):  # the load at that many users: no errors, no rebuilds
        assert v["load"]["errors"] == {} and v["rebuilds"] == 0
        assert v["load"]["turns_ok"] == v["resident"] * r["args"]["turns"]

    g = r["routing"]
    assert g["affinity"]["affinity_hits"] == g["affinity"]["turns_ok"] == r["args"]["users"] * r["args"]["turns"]
    assert g["round_robin"]["affinity_hits"] < g["round_robin"]["turns_ok"]  # turns landing elsewhere: rebuilt
    assert g["gain"] == pytest.approx(g["affinity"]["turns_per_s"] / g["round_robin"]["turns_per_s"])

    q = r["quality"]
    assert set(q) == {"passkey", "multikey", "multiturn"}
    for per_policy in q.values():
        assert set(per_policy) == {"full", "snapkv:256", "streaming:256"}
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in per_policy.values())
        assert per_policy["snapkv:256"]["kv_bytes_mean"] < per_policy["full"]["kv_bytes_mean"]
    for name in ("suite.png", "quality.png", "quality.json"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "resume gain" in done.stdout and "concurrency gain" in done.stdout and "routing gain" in done.stdout
