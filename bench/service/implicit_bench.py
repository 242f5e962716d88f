"""Implicit sessions through the unmodified openai client, side by side with x-session-id.

Two conversations per round over the same kind of document (about --context tokens, a
pass-key text), each of --turns turns: one sent with ``x-session-id``, one with no session
header at all (the service matches it by content). Their turns alternate, so both see the
same machine. Streamed; the time to first token is measured at the client (the first chunk
with text), the tokens prefilled come from the answer's ``usage.prompt_tokens``. The service
runs in a child process with its own local Ray, embedded Redis and Serve app (1 replica of
the embedded Gemma 3 270M, or --model).

Usage: python bench/service/implicit_bench.py [--context 2048] [--turns 4] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, options, write_json
from harness.service import KEY, emit, in_own_ray, run_phase_process

QUESTIONS = ["What is the pass key?", "Say it once more.", "What colour is the sky in the text?", "And the grass?"]


def converse(cfg, context: int, turns: int, rounds: int) -> dict:
    import openai

    from kvsnap.engine.models import tokenizer_for
    from kvsnap.tools.tasks import pass_key_prompt

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.http_port}/v1", api_key=KEY, timeout=900)
    tok = tokenizer_for(cfg.model)
    rows = []
    for r in range(rounds):
        chats = {}
        for mode in ("header", "implicit"):
            doc = pass_key_prompt(tok, target_tokens=context, seed=100 * r + len(chats)).document
            chats[mode] = {"messages": [{"role": "system", "content": doc}], "sid": f"bench-{uuid.uuid4().hex[:12]}"}
        for t in range(turns):
            for mode in ("header", "implicit") if t % 2 == 0 else ("implicit", "header"):
                chat = chats[mode]
                chat["messages"].append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                extra = {"extra_headers": {"x-session-id": chat["sid"]}} if mode == "header" else {}
                started, first, text, last = time.perf_counter(), None, "", None
                stream = client.chat.completions.create(
                    model=cfg.model, messages=chat["messages"], max_tokens=8, stream=True, **extra
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        text += chunk.choices[0].delta.content
                    last = chunk
                kvsnap = last.model_extra["kvsnap"]
                rows.append(
                    {
                        "round": r,
                        "turn": t + 1,
                        "mode": mode,
                        "ttft_s": (first or time.perf_counter()) - started,
                        "prompt_tokens": last.usage.prompt_tokens,
                        "session_id": kvsnap["session_id"],
                        "source": kvsnap["source"],
                    }
                )
                chat["messages"].append({"role": "assistant", "content": text})
    return {"rows": rows}


def summarize(rows: list[dict], turns: int) -> dict:
    out = {}
    for t in range(1, turns + 1):
        per = {}
        for mode in ("header", "implicit"):
            mine = [r for r in rows if r["turn"] == t and r["mode"] == mode]
            per[mode] = {
                "ttft_s": statistics.median(r["ttft_s"] for r in mine),
                "prompt_tokens": statistics.median(r["prompt_tokens"] for r in mine),
                "sources": sorted({r["source"] for r in mine}),
            }
        per["ttft_implicit_over_header"] = per["implicit"]["ttft_s"] / per["header"]["ttft_s"]
        out[str(t)] = per
    sessions = {r["mode"]: set() for r in rows}
    for r in rows:
        sessions[r["mode"]].add((r["round"], r["session_id"]))
    out["sessions_per_conversation"] = {m: len(s) / len({x[0] for x in s}) for m, s in sessions.items()}
    return out


def main() -> None:
    ap = options(__doc__, "model", context=2048, turns=4, rounds=2, whole_doc=True)
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--out", default=str(RESULTS / "implicit_bench.json"))
    args = ap.parse_args()
    if args.phase:
        service = dict(model=args.model, replicas=1, cpus_per_replica=2, max_new_tokens=64)
        emit(in_own_ray(converse, args.context, args.turns, args.rounds, **service))
        return
    argv = [f"--model={args.model}", f"--context={args.context}", f"--turns={args.turns}", f"--rounds={args.rounds}"]
    result = run_phase_process(__file__, "converse", argv)
    summary = summarize(result["rows"], args.turns)
    write_json(args.out, {"args": vars(args), "summary": summary, **result})
    print(f"{args.model}, ~{args.context}-token documents, {args.turns} turns, median of {args.rounds} rounds:")
    print(f"{'turn':>4} {'TTFT header':>12} {'TTFT implicit':>14} {'ratio':>6} {'prefilled header/implicit':>26}")
    for t in range(1, args.turns + 1):
        s = summary[str(t)]
        print(
            f"{t:>4} {s['header']['ttft_s'] * 1e3:>10.0f}ms {s['implicit']['ttft_s'] * 1e3:>12.0f}ms "
            f"{s['ttft_implicit_over_header']:>6.2f} {s['header']['prompt_tokens']:>13.0f} / "
            f"{s['implicit']['prompt_tokens']:.0f}"
        )
    print(f"sessions per conversation: {summary['sessions_per_conversation']}; wrote {args.out}")


if __name__ == "__main__":
    main()
