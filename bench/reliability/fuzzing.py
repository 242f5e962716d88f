"""Reliability suite, fuzzing phases (bench/reliability/suite.py runs every group; this one alone:
``python bench/reliability/fuzzing.py [--quick] [--phase NAME]``):

- fuzz_http:  schemathesis over the whole OpenAPI schema: no 5xx.
- fuzz_grpc:  malformed bytes, truncated, oversized and hostile-valued messages to every
              method: only client-error statuses (never INTERNAL / UNKNOWN / UNAVAILABLE).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from reliability.common import CLIENT_TIMEOUT_S, FUZZ_SESSION, KEY_A, Client, Recorder
from reliability.local_service import grpc_callable, grpc_code
from reliability.runner import Phase, main


def phase_fuzz_http(client: Client, out_dir: Path, examples: int, rec: Recorder) -> None:
    """schemathesis over every operation of the OpenAPI schema; the only check: no 5xx."""
    report = (out_dir / "schemathesis-junit.xml").resolve()
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        client.http + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(examples),
        "--seed",
        "7",
        "--header",
        f"Authorization: Bearer {KEY_A}",
        "--request-timeout",
        str(CLIENT_TIMEOUT_S),
        "--workers",
        "1",  # hypothesis describes strategies with ast, which is not thread-safe on Python 3.11
        "--no-color",
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
        "--phases",
        "examples,coverage,fuzzing",
        "--exclude-path",
        "/v1/admin/workers/{worker_id}/drain",  # drains a replica: exercised by the service tests
        "--suppress-health-check",
        "all",
        "--generation-database",
        "none",
    ]
    t0 = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="kvsnap-schemathesis-")  # its caches land in the working directory
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False, cwd=scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    text = run.stdout + run.stderr
    cases = sum(int(n) for n in re.findall(r"(\d+) generated", text)) or None
    server_errors = len(re.findall(r"Server error", text))
    rec.figures["fuzz_http"] = {
        "exit_code": run.returncode,
        "test_cases": cases,
        "server_errors": server_errors,
        "seconds": round(elapsed, 1),
    }
    rec.check(run.returncode == 0, f"fuzz_http: schemathesis failed (exit {run.returncode}):\n{text[-3000:]}")
    (out_dir / "schemathesis.log").write_text(text)


def phase_fuzz_grpc(grpc_addr: str, cases: int, max_bytes: int, rec: Recorder) -> None:
    import grpc

    from kvsnap.service.grpc_stubs import pb2

    allowed = {
        "OK",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "NOT_FOUND",
        "ABORTED",
        "FAILED_PRECONDITION",
        "OUT_OF_RANGE",
    }
    channel = grpc.insecure_channel(grpc_addr, options=[("grpc.max_send_message_length", 4 * max_bytes)])
    service = pb2.DESCRIPTOR.services_by_name["Kvsnap"]
    methods = list(service.methods)
    rng = random.Random(11)
    md = [("authorization", f"Bearer {KEY_A}")]
    codes = Counter()
    kinds = Counter()
    for i in range(cases):
        method = methods[i % len(methods)]
        request_cls = getattr(pb2, method.input_type.name)
        kind = ("random bytes", "truncated", "hostile values", "oversized")[i % 4]
        if kind == "random bytes":
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
        elif kind == "truncated":
            full = _hostile(request_cls, rng).SerializeToString()
            payload = full[: rng.randint(0, max(0, len(full) - 1))]
        elif kind == "hostile values":
            payload = _hostile(request_cls, rng).SerializeToString()
        else:
            payload = b"\x12" + _varint(max_bytes + 10) + b"x" * (max_bytes + 10)  # field 2, length-delimited
        call = grpc_callable(channel, service.full_name, method)
        code = grpc_code(lambda call=call, payload=payload: call(payload, metadata=md, timeout=CLIENT_TIMEOUT_S))
        codes[code] += 1
        kinds[kind] += 1
        rec.call("fuzz_grpc", f"grpc:{code}", 0.0)
        rec.check(code in allowed, f"fuzz_grpc: {method.name} with {kind} answered {code}")
    rec.figures["fuzz_grpc"] = {"cases": cases, "by_kind": dict(kinds), "by_code": dict(codes)}


def _hostile(request_cls, rng: random.Random):
    """A message of ``request_cls`` with every field set to something a server must survive."""
    strings = [
        "",
        "a" * 10_000,
        "../../etc/passwd",
        "\x00\x01",
        "🙂" * 500,
        FUZZ_SESSION,
        "rel-never",
        "full",
        "h2o",
        "reselect",
    ]
    ints = [0, -1, 1, 2**31 - 1, -(2**31), 7, 4096]
    floats = [0.0, -1.0, float("nan"), float("inf"), 1e30, 0.5]
    msg = request_cls()
    for field in msg.DESCRIPTOR.fields:
        if field.message_type is not None:
            if not field.is_repeated:
                sub = getattr(msg, field.name)
                sub.CopyFrom(_hostile(type(sub), rng))
            continue
        pick = {
            field.TYPE_STRING: lambda: rng.choice(strings),
            field.TYPE_BOOL: lambda: rng.random() < 0.5,
            field.TYPE_FLOAT: lambda: rng.choice(floats),
            field.TYPE_DOUBLE: lambda: rng.choice(floats),
        }.get(field.type, lambda: rng.choice(ints))
        if field.is_repeated:
            getattr(msg, field.name).extend(pick() for _ in range(rng.randint(0, 3)))
        else:
            setattr(msg, field.name, pick())
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


PHASES = [
    Phase(
        "fuzz_http", lambda s: phase_fuzz_http(s.client, s.out_dir, s.params["fuzz_examples"], s.rec), sessions=False
    ),
    Phase(
        "fuzz_grpc",
        lambda s: phase_fuzz_grpc(s.grpc_addr, s.params["grpc_cases"], s.cfg.max_body_bytes, s.rec),
        sessions=False,
    ),
]


if __name__ == "__main__":
    sys.exit(main(PHASES, description=__doc__))
