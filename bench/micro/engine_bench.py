"""Worker engine benchmark, measured side by side in one run.

At --context tokens on the embedded model:
  1. SnapKV scoring time as a share of prefill time         (target < 5%)
  2. KV bytes held: full vs SnapKV budget --budget, and the rows each layer actually holds
     (read from the session caches' tensors after the turn, full-attention and sliding-window
     layers apart)
  3. a resumed turn (20 new tokens onto the compressed cache) vs re-prefilling the
     whole transcript, as a stateless server would           (target >= 20x faster)

Usage: python bench/micro/engine_bench.py [--context 4096] [--budget 512] [--reps 3] [--out PATH]
Writes the JSON to --out (default bench/results/engine_bench.json, not committed) and prints a table.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, command_line, machine, options, write_json

from kvsnap.engine import Engine, load_model
from kvsnap.engine.cache import full_layer_indices
from kvsnap.policies import make_policy
from kvsnap.tools.tasks import pass_key_prompt


def main() -> None:
    ap = options(__doc__, "model", context=4096, budget=512, window=32, new_tokens=20, reps=3)
    ap.add_argument("--out", default=str(RESULTS / "engine_bench.json"))
    args = ap.parse_args()

    engine = Engine(load_model(args.model), prefill_chunk=1024)
    task = pass_key_prompt(engine.tokenizer, target_tokens=args.context, depth=0.5)
    prompt = engine.encode(task.document + task.question)
    follow_up = engine.encode(" Please repeat the pass key once more, then stop. The key:", first=False)
    follow_up = (follow_up * args.new_tokens)[: args.new_tokens]
    snapkv = make_policy("snapkv", budget=args.budget, window=args.window)

    rows = []
    for rep in range(args.reps):  # interleaved, so machine noise hits every variant alike
        full = engine.new_session("full")
        t0 = time.perf_counter()
        engine.prefill(full, prompt)
        full_prefill = time.perf_counter() - t0

        compressed = engine.new_session(snapkv, recompress="never")
        stream = engine.stream(compressed, prompt, _one_token())
        list(stream)
        report = stream.report
        held_full, held_snapkv = held(full), held(compressed)  # after the first turn, before the follow-up

        t0 = time.perf_counter()
        engine.prefill(compressed, follow_up)
        resume = time.perf_counter() - t0

        stateless = engine.new_session(snapkv, recompress="never")
        t0 = time.perf_counter()
        engine.prefill(stateless, compressed.transcript[: -len(follow_up)] + follow_up)
        reprefill = time.perf_counter() - t0

        rows.append(
            {
                "rep": rep,
                "prompt_tokens": len(prompt),
                "full_prefill_s": full_prefill,
                "snapkv_prefill_s": report.prefill_s,
                "snapkv_compress_s": report.compress_s,
                "full_kv_bytes": full.kv_bytes,
                "snapkv_kv_bytes": report.kv_bytes,
                "resume_s": resume,
                "reprefill_s": reprefill,
                "held_full": held_full,
                "held_snapkv": held_snapkv,
            }
        )
        print(
            f"rep {rep}: prefill {report.prefill_s:.2f}s compress {report.compress_s * 1e3:.1f}ms "
            f"resume {resume * 1e3:.0f}ms re-prefill {reprefill:.2f}s",
            flush=True,
        )

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("rep", "held_full", "held_snapkv")}
    for key in ("held_full", "held_snapkv"):  # the same prompt and policy: the same rows every rep
        assert all(r[key] == rows[0][key] for r in rows), [r[key] for r in rows]
    held_full, held_snapkv = rows[0]["held_full"], rows[0]["held_snapkv"]
    summary = {
        "scoring_share_of_prefill": med["snapkv_compress_s"] / med["snapkv_prefill_s"],
        "kv_bytes_full": med["full_kv_bytes"],
        "kv_bytes_snapkv": med["snapkv_kv_bytes"],
        "kv_bytes_ratio": med["full_kv_bytes"] / med["snapkv_kv_bytes"],
        # measured: rows each full-attention layer holds (its keys' sequence dimension) after the turn
        "full_attention_rows_full": held_full["full_attention_rows"],
        "full_attention_rows_snapkv": held_snapkv["full_attention_rows"],
        "full_attention_rows_ratio": held_full["full_attention_rows"] / held_snapkv["full_attention_rows"],
        "sliding_window_rows_full": held_full["sliding_window_rows"],
        "sliding_window_rows_snapkv": held_snapkv["sliding_window_rows"],
        "full_attention_bytes_full": held_full["full_attention_bytes"],
        "full_attention_bytes_snapkv": held_snapkv["full_attention_bytes"],
        "sliding_window_bytes_full": held_full["sliding_window_bytes"],
        "sliding_window_bytes_snapkv": held_snapkv["sliding_window_bytes"],
        "logical_len_full": held_full["logical_len"],
        "logical_len_snapkv": held_snapkv["logical_len"],
        "kept_len_snapkv": held_snapkv["kept_len"],
        "resume_s": med["resume_s"],
        "reprefill_s": med["reprefill_s"],
        "resume_speedup": med["reprefill_s"] / med["resume_s"],
    }
    result = {
        "command": command_line(),
        "args": vars(args),
        "machine": f"{machine()}, device {engine.device}",
        "reps": rows,
        "summary": summary,
    }
    write_json(args.out, result)

    print(
        f"\n{args.model}, {len(prompt)} prompt tokens, SnapKV budget {args.budget} window {args.window}, "
        f"median of {args.reps}"
    )
    print(f"{'metric':44} {'value':>14}  target")
    print(f"{'SnapKV scoring / prefill time':44} {summary['scoring_share_of_prefill']:>13.2%}  < 5%")
    print(f"{'KV bytes full':44} {summary['kv_bytes_full'] / 2**20:>10.2f} MiB")
    print(f"{'KV bytes SnapKV':44} {summary['kv_bytes_snapkv'] / 2**20:>10.2f} MiB")
    print(f"{'KV bytes full / SnapKV (all layers)':44} {summary['kv_bytes_ratio']:>13.2f}x")
    print(
        f"{'rows per full-attention layer, full / SnapKV':44} "
        f"{summary['full_attention_rows_full']:>6,} / {summary['full_attention_rows_snapkv']:,} "
        f"({summary['full_attention_rows_ratio']:.2f}x, measured; {held_full['full_attention_layers']} layers)"
    )
    print(
        f"{'rows per sliding-window layer, full / SnapKV':44} "
        f"{summary['sliding_window_rows_full']:>6,} / {summary['sliding_window_rows_snapkv']:,} "
        f"({held_full['sliding_window_layers']} layers, "
        f"{summary['sliding_window_bytes_snapkv'] / 2**20:.2f} MiB of the SnapKV session)"
    )
    print(
        f"{'full-attention layers bytes full / SnapKV':44} {summary['full_attention_bytes_full'] / 2**20:>10.2f} MiB"
        f" / {summary['full_attention_bytes_snapkv'] / 2**20:.2f} MiB"
    )
    print(
        f"{'logical_len full / SnapKV, kept_len SnapKV':44} {summary['logical_len_full']:>6,} / "
        f"{summary['logical_len_snapkv']:,}, {summary['kept_len_snapkv']:,}"
    )
    print(f"{'resumed turn (' + str(args.new_tokens) + ' tokens)':44} {summary['resume_s'] * 1e3:>11.1f} ms")
    print(f"{'re-prefill whole transcript':44} {summary['reprefill_s'] * 1e3:>11.1f} ms")
    print(f"{'resume speed-up':44} {summary['resume_speedup']:>13.1f}x  >= 20x")
    print(f"wrote {args.out}")


def held(session) -> dict:
    """What the session's cache holds, read from its tensors: rows per layer (full-attention and
    sliding-window apart; every layer of a kind holds the same number), their bytes, and the
    session's two lengths."""
    cache = session.cache
    full_idx = set(full_layer_indices(cache))
    rows: dict[str, set[int]] = {"full_attention": set(), "sliding_window": set()}
    nbytes = {"full_attention": 0, "sliding_window": 0}
    count = {"full_attention": 0, "sliding_window": 0}
    for i, layer in enumerate(cache.layers):
        kind = "full_attention" if i in full_idx else "sliding_window"
        rows[kind].add(layer.keys.shape[-2])
        for t in (layer.keys, layer.values):
            nbytes[kind] += t.numel() * t.element_size()
        count[kind] += 1
    out = {"logical_len": session.logical_len, "kept_len": session.kept_len}
    for kind in rows:
        assert len(rows[kind]) <= 1, (kind, rows[kind])
        out[f"{kind}_layers"] = count[kind]
        out[f"{kind}_rows"] = next(iter(rows[kind]), 0)
        out[f"{kind}_bytes"] = nbytes[kind]
    return out


def _one_token():
    from kvsnap.engine import SamplingParams

    return SamplingParams(max_new_tokens=1)


if __name__ == "__main__":
    main()
