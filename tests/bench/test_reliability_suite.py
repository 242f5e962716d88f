"""`bench/reliability/suite.py --quick`: faults, overload and hostile input against a real service.

The suite starts its own local Ray, redis-server and Serve app in a child process (it kills
replicas and crashes Redis, which the shared service fixture must not see), so this file
runs before the shared fixture is started (tests/bench/ sorts before every folder that uses
it). `docs/RELIABILITY.md` has the long form's figures (`python bench/reliability/suite.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_reliability_suite_loses_nothing(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "reliability" / "suite.py"), "--quick", "--out", str(tmp_path)]
    # below pytest's timeout (pyproject.toml, 900 s): a hung suite is killed here, not by pytest-timeout
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "reliability.json").read_text())
    assert done.returncode == 0 and report["failures"] == [], done.stdout[-4000:] + done.stderr[-3000:]
    phases = report["phases"]

    assert report["sessions_lost"] == 0 and report["sessions"] >= 16
    # the default policy (SnapKV) is verified turn by turn against uninterrupted twins, like full KV
    policies = report["by_policy"]
    assert set(policies) == {"full", "snapkv"} and policies["snapkv"]["sessions"] >= 8
    assert all(p["lost"] == 0 and p["wrong_answers"] == 0 for p in policies.values()), policies
    assert policies["snapkv"]["answers_by_source"].get("rebuilt", 0) >= 2  # kills and corrupted blobs: replayed
    for name in ("corrupt", "kill-verify", "redis-restarted", "redis-wiped", "final"):
        assert phases[name]["verified_sessions"] == report["sessions"], name  # every one asked, every one right
    # sessions opened from registered documents (shared rows): the same, through every fault
    assert report["on_documents"]["sessions"] >= 4 and report["on_documents"]["lost"] == 0, report["on_documents"]
    assert phases["setup"]["document_sessions_cached_tokens"] > 0
    for name in ("kill-verify", "redis-wiped", "final"):
        assert phases[name]["on_documents"]["lost"] == 0 and phases[name]["on_documents"]["verified"] >= 4, name
    # a wipe takes the document records; registered again, the same ids, the holder's rows still shared
    assert phases["redis-wiped"]["documents_after_wipe"] == [404, 404]
    assert len(phases["redis-wiped"]["shared_tokens"]) == 2 and min(phases["redis-wiped"]["shared_tokens"]) > 0
    faults = report["faults"]
    assert faults["replicas_killed"] >= 1 and faults["blobs_corrupted"] >= 2 and faults["streams_cut"] == 2
    assert phases["corrupt"]["rebuilt"] == faults["blobs_corrupted"]

    # only success or retryable answers under faults; overload sheds load with 429
    for name in ("kill", "overload"):
        assert set(phases[name]["by_status"]) <= {"200", "429", "503"}, phases[name]
    assert phases["overload"]["by_status"].get("429", 0) > 0 and phases["overload"]["recovered_turn"] == "ok"
    assert phases["redis-down"]["creates_while_down"] == [503, 503, 503]
    assert phases["redis-down"]["max_503_latency_s"] < 5

    # hostile input: no server error, every gRPC answer a client-error status
    assert phases["fuzz_http"]["server_errors"] == 0 and phases["fuzz_http"]["test_cases"] > 100
    grpc_codes = phases["fuzz_grpc"]["by_code"]
    assert set(grpc_codes) <= {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND"}
    assert grpc_codes["INVALID_ARGUMENT"] > 0 and grpc_codes["RESOURCE_EXHAUSTED"] > 0
    assert phases["auth"]["by_status"]["401"] == phases["auth"]["http_route_checks"] - 2  # all but /health x2
    assert phases["auth"]["admin_route_checks"] == 3 and phases["auth"]["by_status"]["403"] == 2
    assert phases["logs"]["files_scanned"] > 10 and phases["logs"]["files_with_a_key"] == 0
