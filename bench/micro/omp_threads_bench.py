"""OpenMP teams (engine/threads.py): the model's steps on the scheduler thread, after a model
load on two threads elsewhere (what the worker replica did) against a load on one (what it
does now), side by side in one run.

Each case runs in a child process of its own (OpenMP's teams are per process), alternating,
--reps times: in-process ``Engine`` in bfloat16, the model loaded on the main thread with
``old``: 2 torch threads and a scheduler left at torch's default, ``new``: 1 thread and a
scheduler that takes 2 (``Scheduler(threads=2)``). On the scheduler thread (``Scheduler.call``)
it times the mean decode step of 8 full-KV sessions on 64-token caches and one 2K-token
prefill, then 8 concurrent greedy turns of --tokens tokens each through the scheduler
(continuous batching, as the service runs them): decode tokens/s.

    .venv/bin/python bench/micro/omp_threads_bench.py --out docs/results/threads_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options, write_json


def child(case: str, model: str, tokens: int) -> dict:
    from harness.engine import DOC, prefill_s, sessions_on, step_ms

    from kvsnap.engine import Engine, SamplingParams, load_model
    from kvsnap.engine.scheduler import Scheduler
    from kvsnap.policies import make_policy

    torch.set_num_threads(2 if case == "old" else 1)
    engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
    scheduler = Scheduler(engine, threading.RLock(), max_batch=16, threads=None if case == "old" else 2)
    doc = engine.encode(DOC)[:2048]

    def steps() -> float:
        return step_ms(engine, sessions_on(engine, doc[:64], 8), 10)

    def prefill() -> float:
        prefill_s(engine, doc[:128])  # warm
        return prefill_s(engine, doc)

    out = {"decode_step_ms_8": round(scheduler.call(steps), 1), "prefill_2k_s": round(scheduler.call(prefill), 2)}
    sampling = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)

    def one(i: int) -> int:
        prompt = engine.encode(f"Write a long story about a lighthouse keeper named Ada, part {i + 1}.")
        return len(list(scheduler.submit(engine.start(engine.new_session(make_policy("full")), prompt, sampling))))

    one(0)  # warm
    began = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        made = sum(pool.map(one, range(8)))
    out["batched_decode_tok_s_8"] = round(made / (time.perf_counter() - began), 1)
    scheduler.stop()
    scheduler._thread.join(timeout=60)  # a thread still in torch at exit aborts the process
    return out


def main() -> None:
    parser = options(__doc__, model="smollm2-135m", tokens=64, reps=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.tokens)))
        return
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(args.reps):
        for case in runs:
            cmd = [sys.executable, __file__, "--child", case, "--model", args.model, "--tokens", str(args.tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[case].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(case, runs[case][-1], flush=True)
    report = {"model": args.model, "tokens": args.tokens, "reps": args.reps, "torch": torch.__version__, "runs": runs}
    for key in runs["old"][0]:
        old, new = (statistics.median(r[key] for r in runs[case]) for case in ("old", "new"))
        better = old / new if key.endswith(("_ms_8", "_s")) else new / old
        report[key] = {"old": round(old, 3), "new": round(new, 3), "new_better_by": round(better, 2)}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    write_json(args.out, report)


if __name__ == "__main__":
    main()
