"""One decode step before and after the one-token attention path (issue 27, item 2), side by
side in one run: bf16 sessions on a CPU whose one-token rows take torch's SDPA (before) or
``engine/batch.py``'s ``one_token_attention`` (after), at 1 and 8 sessions generating, each
on its own 2K-token cache; the operators a step spends its time in (torch.profiler), and one
2K prefill's, for both embedded models.

    .venv/bin/python bench/decode_bench.py --out docs/results/decode_bench.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from dtype_bench import DOC
from torch.profiler import ProfilerActivity, profile

from kvsnap.engine import Engine, SamplingParams, batch, load_model
from kvsnap.policies import make_policy


def sessions_on(engine: Engine, doc: list[int], count: int) -> list:
    out = []
    for _ in range(count):
        session = engine.new_session(make_policy("full"))
        engine.turn(session, doc, SamplingParams(max_new_tokens=1))  # its answer's token is pending
        out.append(session)
    return out


def step(engine: Engine, sessions: list) -> None:
    logits = engine.decode_step(sessions, greedy=True)
    for session, row in zip(sessions, logits, strict=True):
        session.transcript.append(int(row.argmax()))


def top_ops(prof, n: int = 6) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
    return [{"op": e.key, "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in rows]


def step_ms(engine: Engine, sessions: list, steps: int, warm: int = 1) -> float:
    """The mean time of ``steps`` decode steps of ``sessions`` (after ``warm`` untimed ones), ms."""
    for _ in range(warm):
        step(engine, sessions)
    began = time.perf_counter()
    for _ in range(steps):
        step(engine, sessions)
    return (time.perf_counter() - began) / steps * 1000


def prefill_s(engine: Engine, doc: list[int]) -> float:
    """One full-KV session's prefill of ``doc``, seconds."""
    began = time.perf_counter()
    engine.prefill(engine.new_session(make_policy("full")), doc)
    return time.perf_counter() - began


def measure_steps(engine: Engine, sessions: list, steps: int) -> dict:
    ms = step_ms(engine, sessions, steps, warm=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(engine, sessions)
    return {"step_ms": round(ms, 1), "tokens_per_s": round(len(sessions) * 1000 / ms, 1), "top_ops": top_ops(prof)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "dtype": "bfloat16", "torch": torch.__version__}
    one_token_pays = batch._one_token_pays
    for model in args.models.split(","):
        engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
        doc = engine.encode(DOC)[: args.tokens]
        engine.prefill(engine.new_session(make_policy("full")), doc[:256])  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            began = time.perf_counter()
            engine.prefill(engine.new_session(make_policy("full")), doc)
        rows = {"prefill_2k": {"s": round(time.perf_counter() - began, 2), "top_ops": top_ops(prof)}}
        sessions = sessions_on(engine, doc, 8)
        for count in (1, 8):
            for label, pays in (("before_sdpa", lambda q: False), ("after", one_token_pays)):
                batch._one_token_pays = pays
                rows[f"{label}_{count}"] = measure_steps(engine, sessions[:count], args.steps)
            batch._one_token_pays = one_token_pays
            before, after = rows[f"before_sdpa_{count}"], rows[f"after_{count}"]
            rows[f"speedup_{count}"] = round(before["step_ms"] / after["step_ms"], 2)
            print(model, count, "sessions:", before["step_ms"], "->", after["step_ms"], "ms a step", flush=True)
        report[model] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
