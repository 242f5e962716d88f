"""float32 against bfloat16, side by side in one run, on both embedded models (issue 27, item 1):
a 2K-token prefill, one decode step of one session, and the KV one session of 2K tokens holds
(full KV: the bytes of its cache tensors), so sessions resident per GiB. In-process (``Engine``), the
threads a replica gets (``--threads``), each measurement the best of ``--reps``.

    .venv/bin/python bench/micro/dtype_bench.py --out docs/results/dtype_bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options, write_json
from harness.engine import DOC, best

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.policies import make_policy


def measure(model: str, dtype: str, tokens: int, reps: int) -> dict:
    engine = Engine(load_model(model, dtype=dtype), prefill_chunk=1024)
    doc = engine.encode(DOC)[:tokens]
    assert len(doc) == tokens, f"the bench document has {len(doc)} tokens, fewer than {tokens}"
    engine.prefill(engine.new_session(make_policy("full")), doc[:256])  # warm-up
    prefill_s = best(lambda: engine.prefill(engine.new_session(make_policy("full")), doc), reps)
    session = engine.new_session(make_policy("full"))
    engine.turn(session, doc, SamplingParams(max_new_tokens=1))
    steps = 16
    sampling = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    decode_s = best(lambda: engine.turn(session, engine.encode(" Go on.", first=False), sampling), reps) / steps
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in session.cache.layers)
    kv_per_token = kv / session.logical_len
    return {
        "prefill_s": round(prefill_s, 3),
        "prefill_tokens_per_s": round(tokens / prefill_s, 1),
        "decode_step_ms": round(decode_s * 1000, 1),
        "kv_bytes_per_2k_session": int(kv_per_token * tokens),
        "sessions_per_gib_at_2k": round((1 << 30) / (kv_per_token * tokens), 2),
    }


def main() -> None:
    args = options(__doc__, "tokens", "reps", "threads", "out", models="gemma3-270m,smollm2-135m").parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "torch": torch.__version__, "models": {}}
    for model in args.models.split(","):
        rows = {dtype: measure(model, dtype, args.tokens, args.reps) for dtype in ("float32", "bfloat16")}
        f, b = rows["float32"], rows["bfloat16"]
        rows["bf16_vs_fp32"] = {
            "prefill_speedup": round(f["prefill_s"] / b["prefill_s"], 2),
            "decode_step_speedup": round(f["decode_step_ms"] / b["decode_step_ms"], 2),
            "sessions_per_gib": round(b["sessions_per_gib_at_2k"] / f["sessions_per_gib_at_2k"], 2),
        }
        report["models"][model] = rows
        print(model, json.dumps(rows), flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
