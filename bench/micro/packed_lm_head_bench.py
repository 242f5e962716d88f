"""The LM head's first pass on a CPU without AMX: oneDNN's product on the head packed once at
start-up (engine/head.py) against ``F.linear``, which reorders the head on every call, side by
side in one run. In-process ``Engine``, bf16, both embedded models: the mean decode step of
--sessions greedy full-KV sessions on --short and --tokens token caches, the two ways alternating
--reps times (medians). Both give the same bits (tests/test_head.py); this measures the time.

    .venv/bin/python bench/packed_head_bench.py --out docs/results/packed_head_bench.json
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from decode_bench import sessions_on, step_ms
from dtype_bench import DOC
from step_bench import step_parser

from kvsnap.engine import Engine, cbuild, load_model


def main() -> None:
    args = step_parser(__doc__).parse_args()
    torch.set_num_threads(args.threads)
    report = {"sessions": args.sessions, "threads": args.threads, "reps": args.reps, "cpu": cbuild.cpu_model()}
    for name in args.models.split(","):
        engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
        head, packed = engine.head, engine.head.packed
        if packed is None:
            raise SystemExit("the head is not packed here (AMX tiles take its first pass, or the screen is off)")
        doc = engine.encode(DOC)
        rows = {}
        for length in (args.short, args.tokens):
            sessions = sessions_on(engine, doc[:length], args.sessions)
            times: dict[str, list] = {"packed": [], "f_linear": []}
            for rep in range(args.reps):
                for way in times if rep % 2 == 0 else list(times)[::-1]:
                    head.packed = packed if way == "packed" else None
                    times[way].append(step_ms(engine, sessions, args.steps))
            head.packed = packed
            med = {way: round(statistics.median(t), 1) for way, t in times.items()}
            rows[f"decode_ms_{length}"] = {**med, "speedup": round(med["f_linear"] / med["packed"], 2)}
            print(name, length, rows[f"decode_ms_{length}"], flush=True)
        report[name] = rows
    if args.out:  # the report, as the command that made it wrote it
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
