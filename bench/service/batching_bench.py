"""Continuous batching through the service: batching on (--max-batch) against off (max batch 1),
side by side in one run.

Each mode runs in its own child process with its own local Ray, embedded Redis and Serve app:
one worker replica of the embedded Gemma 3 270M (or --model) on --cpus CPUs. It opens
max(--levels) sessions with a document of about --context tokens each, then for each level N
(1, 2, 4, 8, 16 by default) the first N sessions ask --rounds follow-ups each, all N at once
(closed loop: each asks its next question when its answer is complete), --max-tokens generated
tokens per answer (raw turns with ``ignore_eos``: every answer has exactly that length),
streamed over gRPC. Per level: aggregate decode tokens/s (tokens generated
by all sessions / wall time of the level), follow-up turns/s, p50 / p99 time to first token and
inter-token latency (per token, at the client). The ratios on/off are computed from one run.

Usage: python bench/service/batching_bench.py [--levels 1,2,4,8,16] [--context 2048] [--max-tokens 64]
       [--rounds 2] [--max-batch 16] [--out bench/results/batch_bench.json]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, commit, options, started, write_json
from harness.service import KEY, emit, in_own_ray, run_phase_process

# raw turns of exactly --max-tokens tokens each (no stop at the end-of-sequence token)
QUESTIONS = [
    "\nUser: Tell me everything this document says, in detail.\nAssistant:",
    "\nUser: Now write a long story about the people in this document.\nAssistant:",
    "\nUser: Describe each paragraph of the document once more.\nAssistant:",
]


def levels_phase(cfg, levels: list[int], context: int, max_tokens: int, rounds: int) -> dict:
    from kvsnap.engine.models import tokenizer_for
    from kvsnap.tools.loadgen import GrpcClient, document, percentiles

    client = GrpcClient(f"127.0.0.1:{cfg.grpc_port}", KEY, timeout_s=1800)
    tok = tokenizer_for(cfg.model)
    tag = uuid.uuid4().hex[:6]
    sids = [f"batch-{tag}-{i}" for i in range(max(levels))]
    opened = [client.open(sid, document(tok, context, i), {}) for i, sid in enumerate(sids)]
    if not all(s.ok for s in opened):
        raise SystemExit(f"opening sessions failed: {[s.status for s in opened]}")
    client.turn(sids[0], "Warm up: one word.", 4)  # first-call costs out of the measurement
    rows = []
    for n in levels:
        samples, lock = [], threading.Lock()

        def user(i: int, n: int = n, samples: list = samples, lock=lock) -> None:
            for r in range(rounds):
                s = client.turn(sids[i], QUESTIONS[r % len(QUESTIONS)], max_tokens, fixed_length=True)
                with lock:
                    samples.append(s)

        started = time.perf_counter()
        threads = [threading.Thread(target=user, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        ok = [s for s in samples if s.ok]
        tokens = sum(s.tokens for s in ok)
        rows.append(
            {
                "sessions": n,
                "turns_ok": len(ok),
                "errors": len(samples) - len(ok),
                "tokens": tokens,
                "tokens_per_turn": tokens / len(ok) if ok else 0,
                "wall_s": wall,
                "decode_tokens_per_s": tokens / wall,
                "turns_per_s": len(ok) / wall,
                "ttft_s": percentiles([s.ttft_s for s in ok]),
                "itl_s": percentiles([g for s in ok for g in s.gaps]),
                "context_tokens": opened[0].logical_len,
            }
        )
        print(f"{n} sessions: {tokens / wall:.1f} tok/s, {len(ok) / wall:.2f} turns/s", flush=True)
    return {"levels": rows}


def ratios(on: dict, off: dict) -> list[dict]:
    out = []
    for a, b in zip(on["levels"], off["levels"], strict=True):
        out.append(
            {
                "sessions": a["sessions"],
                "decode_tokens_per_s_x": a["decode_tokens_per_s"] / b["decode_tokens_per_s"],
                "turns_per_s_x": a["turns_per_s"] / b["turns_per_s"],
            }
        )
    return out


def print_table(result: dict) -> None:
    on, off = result["on"]["levels"], result["off"]["levels"]
    single_itl = {m: result[m]["levels"][0]["itl_s"]["p99"] for m in ("on", "off")}
    print(
        f"\n{'N':>3} {'mode':>4} {'tok/s':>7} {'turns/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'tok/turn':>8}"
    )
    for a, b in zip(on, off, strict=True):
        for mode, r in (("on", a), ("off", b)):
            print(
                f"{r['sessions']:>3} {mode:>4} {r['decode_tokens_per_s']:7.1f} {r['turns_per_s']:8.3f} "
                f"{r['ttft_s']['p50'] * 1e3:8.0f}ms {r['ttft_s']['p99'] * 1e3:8.0f}ms "
                f"{r['itl_s']['p50'] * 1e3:7.0f}ms {r['itl_s']['p99'] * 1e3:7.0f}ms {r['tokens_per_turn']:8.1f}"
            )
    print("\nbatching on / off:")
    for r, a in zip(result["ratios"], on, strict=True):
        itl_x = a["itl_s"]["p99"] / single_itl["on"] if single_itl["on"] else float("nan")
        print(
            f"  {r['sessions']:>2} sessions: decode tokens/s x{r['decode_tokens_per_s_x']:.2f}, "
            f"turns/s x{r['turns_per_s_x']:.2f}, p99 ITL {itl_x:.2f}x the single-session value"
        )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode, style in (("on", "o-"), ("off", "s--")):
        rows = result[mode]["levels"]
        n = [r["sessions"] for r in rows]
        axes[0].plot(n, [r["decode_tokens_per_s"] for r in rows], style, label=f"batching {mode}")
        axes[1].plot(n, [r["ttft_s"]["p99"] for r in rows], style, label=f"batching {mode}")
        axes[2].plot(n, [r["itl_s"]["p99"] * 1e3 for r in rows], style, label=f"batching {mode}")
    axes[0].set(xlabel="concurrent sessions", ylabel="aggregate decode tokens/s", xscale="log", xticks=n)
    axes[1].set(xlabel="concurrent sessions", ylabel="p99 TTFT (s)", xscale="log", xticks=n)
    axes[2].set(xlabel="concurrent sessions", ylabel="p99 inter-token latency (ms)", xscale="log", xticks=n)
    for ax in axes:
        ax.set_xticklabels([str(x) for x in n])
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"continuous batching, {result['args']['model']}, {result['args']['context']}-token documents")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = options(
        __doc__, "model", levels="1,2,4,8,16", context=2048, max_tokens=64, rounds=2, max_batch=16, whole_doc=True
    )
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the one worker replica (torch threads)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--out", default=str(RESULTS / "batch_bench.json"))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.phase:
        service = dict(
            model=args.model,
            replicas=1,
            cpus_per_replica=args.cpus,
            max_batch=1 if args.phase == "off" else args.max_batch,
            max_ongoing_requests=max(32, args.max_batch, max(levels)),
            overload_queue_len=10**6,  # one replica: sessions never move
            max_new_tokens=args.max_tokens,
            max_prompt_tokens=max(16384, 2 * args.context),
        )
        emit(
            in_own_ray(levels_phase, levels, args.context, args.max_tokens, args.rounds, num_cpus=args.cpus, **service)
        )
        return
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("phase", "out")]
    result = {
        "args": vars(args),
        "command": "python bench/service/batching_bench.py " + " ".join(argv),
        "started": started(),
        "commit": commit(),
    }
    for mode in ("on", "off"):
        result[mode] = run_phase_process(__file__, mode, argv, timeout_s=7200)
    result["ratios"] = ratios(result["on"], result["off"])
    out = write_json(args.out, result)
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
