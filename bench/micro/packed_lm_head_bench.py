"""The LM head's first pass on a CPU without AMX: oneDNN's product on the head packed once at
start-up (engine/models/head.py) against ``F.linear``, which reorders the head on every call, side by
side in one run. In-process ``Engine``, bf16, both embedded models: the mean decode step of
--sessions greedy full-KV sessions on --short and --tokens token caches, the two ways alternating
--reps times (medians). Both give the same bits (tests/engine/models/test_lm_head.py); this measures the time.

    .venv/bin/python bench/micro/packed_lm_head_bench.py --out docs/results/packed_head_bench.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.compare import alternate, decode_step_main, medians, speedup
from harness.engine import DOC, sessions_on, step_ms

from kvsnap.cpu_kernels import build
from kvsnap.engine import Engine, load_model


def model_report(name: str, args) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    head, packed = engine.head, engine.head.packed
    if packed is None:
        raise SystemExit("the head is not packed here (AMX tiles take its first pass, or the screen is off)")

    def use(way: str) -> None:
        head.packed = packed if way == "packed" else None

    doc = engine.encode(DOC)
    rows = {}
    for length in (args.short, args.tokens):
        sessions = sessions_on(engine, doc[:length], args.sessions)
        steps = {"ms": lambda s=sessions: step_ms(engine, s, args.steps)}
        times = alternate(("packed", "f_linear"), use, steps, args.reps)["ms"]
        head.packed = packed
        rows[f"decode_ms_{length}"] = speedup(medians(times, 1), "f_linear", "packed")
        print(name, length, rows[f"decode_ms_{length}"], flush=True)
    return rows


def main() -> None:
    decode_step_main(__doc__, model_report, show=False, cpu=build.cpu_model())


if __name__ == "__main__":
    main()
