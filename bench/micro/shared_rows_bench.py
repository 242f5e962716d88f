"""Later chats on shared documents whose sessions refer to the shared rows (copy-on-write,
engine/prefix_rows.py) against sessions that copy them, side by side in one run.

In-process ``Engine`` and ``Scheduler`` (what a replica runs: bf16, packed weights, the C
kernels), SmolLM2-135M-Instruct and its default policy, the peer bench's shared workload
without the servers: each round takes --docs new documents (~2,350 tokens, facts stated once),
sends each document's first chat, then --chats later chats on them with --in-flight at a time,
each asking its own question and generating --max-tokens tokens. Rounds alternate:

- ``refer``: a later chat's full layers refer to the blocks; its prompt's attention and its
  SnapKV compression read them there (the default);
- ``copy``: the blocks copied into each later chat's own buffers before its first step (what
  every session did before).

Per case (medians over its rounds): the later chats' TTFT p50 and mean, and the time a later
chat's compression took (``Turn.settle``). Both cases give the same tokens
(tests/engine/test_prefix_rows.py), so no answers are compared.

    .venv/bin/python bench/micro/shared_rows_bench.py --out docs/results/shared_rows_bench.json
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options, write_json
from harness.engine import bf16_engine
from peers.peer_bench import chats

from kvsnap.cpu_kernels.build import cpu_model
from kvsnap.engine import Engine, SamplingParams, prefix_rows
from kvsnap.engine.defaults import default_settings
from kvsnap.engine.scheduler import Scheduler
from kvsnap.engine.turn import Turn
from kvsnap.policies import make_policy

MODEL = "smollm2-135m"
CASES = ("refer", "copy")


def one_round(engine: Engine, scheduler: Scheduler, args, seed: int) -> dict:
    settings = default_settings(MODEL)
    spec = {k: v for k, v in settings.items() if k not in ("policy", "recompress")}
    sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0)
    tok = engine.tokenizer

    def ttft(doc: dict, question: str) -> float:
        chat = [{"role": "user", "content": f"{doc['document']}\n\n{question}"}]
        tokens = engine.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), first=False)
        session = engine.new_session(make_policy(settings["policy"], **spec))
        session.prefix_scope = "bench"
        sent = time.perf_counter()
        first = None
        for _ in scheduler.submit(engine.start(session, tokens, sampling)):
            first = time.perf_counter() if first is None else first
        return first - sent

    docs = chats(MODEL, args.docs, 8, args.doc_tokens, seed0=seed)
    with ThreadPoolExecutor(args.docs) as pool:
        list(pool.map(lambda d: ttft(d, d["facts"][0].question), docs))
    later = [(docs[c % args.docs], docs[c % args.docs]["facts"][1 + c // args.docs % 7]) for c in range(args.chats)]
    with ThreadPoolExecutor(args.in_flight) as pool:
        times = list(pool.map(lambda pair: ttft(pair[0], pair[1].question), later))
    return {"ttft_p50_s": statistics.median(times), "ttft_mean_s": statistics.mean(times)}


def main() -> None:
    ap = options(__doc__, docs=4, in_flight=4, doc_tokens=2350, max_tokens=16, threads=2, out=None)
    ap.add_argument("--rounds", type=int, default=6, help="rounds in all, the cases alternating")
    ap.add_argument("--chats", type=int, default=28, help="later chats a round")
    args = ap.parse_args()
    engine = bf16_engine(MODEL, args.threads, prefix_cache_bytes=1 << 30)
    scheduler = Scheduler(engine, threading.RLock(), max_batch=16)
    settles: dict[str, list[float]] = {case: [] for case in CASES}
    case = CASES[0]
    real_settle = Turn.settle

    def timed_settle(turn: Turn) -> None:
        start = time.perf_counter()
        owed = turn.unsettled
        real_settle(turn)
        if owed and turn.prefill.cached:  # a later chat's compression (it started from shared rows)
            settles[case].append(time.perf_counter() - start)

    Turn.settle = timed_settle
    rounds: dict[str, list[dict]] = {c: [] for c in CASES}
    try:
        for r in range(args.rounds):
            case = CASES[r % 2]
            prefix_rows.REFER = case == "refer"
            got = one_round(engine, scheduler, args, seed=400 + 10 * r)
            rounds[case].append(got)
            print(f"round {r} {case}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in got.items()), flush=True)
    finally:
        Turn.settle = real_settle
        prefix_rows.REFER = True
        scheduler.stop()
    summary = {
        c: {
            "ttft_p50_s": round(statistics.median(x["ttft_p50_s"] for x in rounds[c]), 4),
            "ttft_mean_s": round(statistics.median(x["ttft_mean_s"] for x in rounds[c]), 4),
            "settle_p50_s": round(statistics.median(settles[c]), 4),
        }
        for c in CASES
    }
    ratios = {k: round(summary["refer"][k] / summary["copy"][k], 3) for k in summary["refer"]}
    out = {"model": MODEL, "cpu": cpu_model(), "args": vars(args), "rounds": rounds, "cases": summary}
    out["refer_over_copy"] = ratios
    print(json.dumps({"cases": summary, "refer_over_copy": ratios}, indent=1))
    write_json(args.out, out, indent=1)


if __name__ == "__main__":
    main()
