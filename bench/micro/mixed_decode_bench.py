"""Decode steps of mixed-precision sessions against the same sessions with full bf16 KV, side by
side in one run: 8 sessions of ``--tokens`` tokens each, both embedded models, bf16.

Three cases alternate ``--reps`` times (medians): ``full`` (every row bf16), ``mixed`` (the
``--policy`` setting: SnapKV's selection bf16, the rest KIVI-quantized, engine/cold.py; a decode
step reads the quantized rows in C, cpu_kernels/cold_attention.py) and ``mixed-torch`` (the same
sessions with that kernel off: every quantized row dequantized and concatenated each step).
Each session's bytes are measured from its cache, as a tier counts them.

    .venv/bin/python bench/micro/mixed_decode_bench.py --out docs/results/mixed_decode_bench.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options
from harness.compare import alternate, report_models
from harness.engine import DOC, bf16_engine, step_ms

from kvsnap.cpu_kernels import cold_attention
from kvsnap.engine import SamplingParams
from kvsnap.tools.specs import PolicySpec

KERNEL = cold_attention.available


def sessions(engine, doc: list[int], policy, count: int) -> list:
    """``count`` sessions of ``policy`` on ``doc``, each with its answer's first token pending."""
    out = []
    for _ in range(count):
        session = engine.new_session(policy)
        engine.turn(session, doc, SamplingParams(max_new_tokens=1))
        out.append(session)
    return out


def model_report(model: str, args) -> dict:
    engine = bf16_engine(model, args.threads)
    doc = engine.encode(DOC * 3)[: args.tokens]
    mixed_policy, _, _ = PolicySpec.parse(args.policy).build(32)
    full_policy, _, _ = PolicySpec.parse("full").build(32)
    made = {"full": sessions(engine, doc, full_policy, args.sessions)}
    made["mixed"] = made["mixed-torch"] = sessions(engine, doc, mixed_policy, args.sessions)

    def use(case: str) -> None:
        cold_attention.available = KERNEL if case != "mixed-torch" else (lambda: False)

    measures = {"ms": lambda: step_ms(engine, made[current[0]], args.steps)}
    current = ["full"]
    times = alternate(tuple(made), lambda case: (use(case), current.__setitem__(0, case)), measures, args.reps)
    use("mixed")
    row = {"policy": args.policy, "tokens": len(doc), "sessions": args.sessions}
    for case, ms in times["ms"].items():
        median = statistics.median(ms)
        row[case] = {"step_ms": round(median, 1), "tokens_per_s": round(args.sessions * 1000 / median, 1)}
    row["kv_mib_a_session"] = {
        case: round(statistics.mean(s.kv_bytes for s in made[case]) / 2**20, 2) for case in ("full", "mixed")
    }
    row["bytes_x_full"] = round(row["kv_mib_a_session"]["mixed"] / row["kv_mib_a_session"]["full"], 3)
    row["speedup"] = round(row["full"]["step_ms"] / row["mixed"]["step_ms"], 2)
    row["kernel_speedup"] = round(row["mixed-torch"]["step_ms"] / row["mixed"]["step_ms"], 2)
    print(model, {k: v for k, v in row.items() if k != "policy"}, flush=True)
    return row


def main() -> None:
    args = options(
        __doc__, "models", "threads", "out", tokens=4096, sessions=8, steps=4, reps=3, policy="snapkv:r0.0625/s/q4"
    ).parse_args()
    if not KERNEL():
        raise SystemExit("the kernel is not available here (no C compiler, or KVSNAP_C_KERNELS=0)")
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "reps": args.reps, "steps": args.steps, "dtype": "bfloat16"}
    report_models(args, report, model_report, show=False)


if __name__ == "__main__":
    main()
