"""The load generator and the Locust file, against the shared real Ray Serve app (tiny-llama)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsnap.engine.models import tokenizer_for
from kvsnap.errors import InvalidArgument
from kvsnap.tools import loadgen

ROOT = Path(__file__).resolve().parents[2]


def check_percentiles(p: dict) -> None:
    assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_load_generator_measures_multi_turn_sessions(service, protocol):
    # 2 users: below the shared app's overload threshold (3 ongoing), so no turn is moved away
    spec = loadgen.LoadSpec(users=2, context=600, turns=3, max_tokens=6, protocol=protocol, open_first=True)
    if protocol == "http":
        client = loadgen.HttpClient(service.http, "key-alpha", 60)
    else:
        client = loadgen.GrpcClient(service.grpc, "key-alpha", 60)
    r = loadgen.run(client, tokenizer_for("tiny-llama"), spec, progress_s=0)

    assert r["errors"] == {} and r["sessions_opened"] == 2 and r["turns_ok"] == 6
    assert r["affinity_hits"] == 6, r["sources"]  # every follow-up found its KV on the replica that held it
    assert 600 - 100 <= r["context_tokens"] <= 600  # sized with the model's tokenizer, to one filler sentence
    for key in ("ttft_s", "e2e_s", "open_s", "tpot_s"):
        check_percentiles(r[key])
    assert r["ttft_s"]["max"] <= r["e2e_s"]["max"]
    assert r["turns_per_s"] == pytest.approx(6 / r["turns_elapsed_s"])
    assert r["turns_elapsed_s"] < r["elapsed_s"]  # open_first: the follow-ups ran after every open
    text = loadgen.format_report(r)
    assert "TTFT ms" in text and "errors by status {}" in text


def test_load_generator_counts_errors_by_status(service):
    client = loadgen.HttpClient(service.http, "not-a-key", 60)
    r = loadgen.run(client, tokenizer_for("tiny-llama"), loadgen.LoadSpec(users=2, turns=1), progress_s=0)
    assert r["errors"] == {"401": 2} and r["turns_ok"] == 0 and r["ttft_s"]["p50"] is None


def test_load_spec_rejects_bad_input():
    with pytest.raises(InvalidArgument):
        loadgen.LoadSpec(users=0)
    with pytest.raises(InvalidArgument):
        loadgen.LoadSpec(arrival="poisson", rate=0)
    with pytest.raises(InvalidArgument):
        loadgen.LoadSpec(protocol="udp")


def test_kvsnap_load_cli_poisson_arrivals_writes_json(service, tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "kvsnap.tools.cli", "load", "--url", service.http, "--api-key", "key-beta"]
    cmd += ["--users", "2", "--turns", "1", "--context", "120", "--arrival", "poisson", "--rate", "4"]
    cmd += ["--max-tokens", "4", "--progress", "0.5", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["spec"]["arrival"] == "poisson" and r["turns_ok"] == 2 and r["errors"] == {}
    assert "turns/s" in done.stdout


def test_locustfile_runs_headless_against_the_service(service, tmp_path):
    locust = shutil.which("locust", path=os.path.dirname(sys.executable))  # a dev dependency
    assert locust, "locust is installed with the dev extras"
    cmd = [locust, "-f", str(ROOT / "bench" / "service" / "locustfile.py"), "--host", service.http, "--headless"]
    cmd += ["-u", "2", "-r", "2", "-t", "8s", "--csv", str(tmp_path / "run"), "--only-summary"]
    env = os.environ | {"KVSNAP_API_KEY": "key-alpha", "KVSNAP_LOAD_CONTEXT": "60", "KVSNAP_LOAD_TOKENS": "4"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["Name"]: r for r in csv.DictReader((tmp_path / "run_stats.csv").open())}
    assert int(rows["open"]["Request Count"]) == 2 and int(rows["turn"]["Request Count"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0
