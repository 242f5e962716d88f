"""Tiered session store benchmark, measured side by side in one run.

1. Sessions resident in a fixed device-tier budget at --context tokens: SnapKV
   (--budget) vs full KV. Real blobs of one real session each way are put into a
   device tier (copies) until the first demotion; the count is what stayed.
2. Bringing a session back: promote host -> device (with checksum check) vs
   rebuild by re-prefilling its transcript.

Usage: python bench/micro/tiers_bench.py [--context 8192] [--budget 512] [--device-mib 256] [--reps 3] [--out PATH]
Writes the JSON to --out (default bench/results/tiers_bench.json, not committed) and prints a summary.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, command_line, machine, options, write_json

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.cache import export_kv
from kvsnap.policies import make_policy
from kvsnap.store.tiers import DeviceTier, HostTier, KVBlob, TieredStore
from kvsnap.tools.tasks import pass_key_prompt


def resident(blob: KVBlob, budget: int) -> int:
    """Copies of ``blob`` the device tier holds before its first demotion."""
    store = TieredStore([DeviceTier(budget), HostTier(1 << 40)])
    n = 0
    while not store.stats.demotions:
        store.put(f"s{n}", KVBlob([t.clone() for t in blob.tensors], blob.logical_len, 1))
        n += 1
    return store.sessions_by_tier()["device"]


def main() -> None:
    ap = options(__doc__, "model", context=8192, budget=512, device_mib=256, reps=3)
    ap.add_argument("--out", default=str(RESULTS / "tiers_bench.json"))
    args = ap.parse_args()

    engine = Engine(load_model(args.model), prefill_chunk=1024)
    task = pass_key_prompt(engine.tokenizer, target_tokens=args.context, depth=0.5)
    prompt = engine.encode(task.document + task.question)
    blobs, sessions = {}, {}
    for name, policy in (("full", make_policy("full")), ("snapkv", make_policy("snapkv", budget=args.budget))):
        session = engine.new_session(policy)
        engine.turn(session, prompt, SamplingParams(max_new_tokens=1))
        blobs[name] = KVBlob(export_kv(session.cache), session.logical_len, 1)
        sessions[name] = session
    budget = args.device_mib << 20
    counts = {name: resident(blob, budget) for name, blob in blobs.items()}

    promote, rebuild = [], []
    for _ in range(args.reps):
        store = TieredStore([DeviceTier(1 << 40), HostTier(1 << 40)])
        store.tiers[1].put("s", KVBlob([t.clone() for t in blobs["snapkv"].tensors], blobs["snapkv"].logical_len, 1))
        t0 = time.perf_counter()
        assert store.get("s") is not None
        promote.append(time.perf_counter() - t0)
        fresh = engine.new_session(make_policy("snapkv", budget=args.budget))
        t0 = time.perf_counter()
        engine.rebuild(fresh, sessions["snapkv"].transcript, sessions["snapkv"].logical_len)
        rebuild.append(time.perf_counter() - t0)

    summary = {
        "prompt_tokens": len(prompt),
        "device_budget_bytes": budget,
        "kv_bytes_full": blobs["full"].nbytes,
        "kv_bytes_snapkv": blobs["snapkv"].nbytes,
        # measured: rows a full-attention layer of each session holds after its turn
        "full_attention_rows_full": sessions["full"].kept_len,
        "full_attention_rows_snapkv": sessions["snapkv"].kept_len,
        "resident_full": counts["full"],
        "resident_snapkv": counts["snapkv"],
        "resident_gain": counts["snapkv"] / max(1, counts["full"]),
        "promote_host_to_device_s": statistics.median(promote),
        "rebuild_s": statistics.median(rebuild),
    }
    summary["promote_speedup"] = summary["rebuild_s"] / summary["promote_host_to_device_s"]
    run = {"command": command_line(), "args": vars(args), "machine": machine(), "device": str(engine.device)}
    write_json(args.out, run | {"summary": summary})
    print(
        f"\n{args.model}, {len(prompt)} prompt tokens, device tier {args.device_mib} MiB, SnapKV budget {args.budget}"
    )
    print(
        f"KV per session: full {blobs['full'].nbytes / 2**20:.2f} MiB, SnapKV {blobs['snapkv'].nbytes / 2**20:.2f} MiB"
    )
    print(
        f"rows per full-attention layer: full {summary['full_attention_rows_full']:,}, "
        f"SnapKV {summary['full_attention_rows_snapkv']:,}"
    )
    print(f"sessions resident: full {counts['full']}, SnapKV {counts['snapkv']} ({summary['resident_gain']:.2f}x)")
    print(
        f"promote host->device {summary['promote_host_to_device_s'] * 1e3:.1f} ms vs rebuild "
        f"{summary['rebuild_s'] * 1e3:.0f} ms ({summary['promote_speedup']:.0f}x faster), median of {args.reps}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
