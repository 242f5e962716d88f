"""A bf16 decode step's Python and operator overhead, cut by cut, side by side in one run.

In-process ``Engine``, bfloat16 (packed weights, fused norms and activations, the attention
kernels), both embedded models; three cases, alternating --reps times (medians):

- ``operators``: every row's append and attention as torch operators per row and layer, and
  transformers' decoder layers (what a step ran before these cuts);
- ``c_rows``: one-token rows appended and attended by one C call per layer (cpu_kernels/decode_rows.py);
- ``c_rows_lean``: that, and Llama-family layers without transformers' module calls
  (engine/models/lean.py; SmolLM2 only: Gemma 3 keeps transformers' layers, so its two last cases
  are the same code).

Each gives the mean decode step of --sessions full-KV sessions on short (--short tokens) and
long (--tokens) caches, and one --tokens prefill. Every case computes the same bits
(tests/cpu_kernels/test_decode_rows.py, tests/engine/models/test_lean_llama_layer.py); this measures the time.

    .venv/bin/python bench/micro/step_overhead_bench.py --out docs/results/decode_step_main.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.compare import alternate, decode_step_main, medians
from harness.engine import DOC, prefill_s, sessions_on, step_ms

from kvsnap.engine import Engine, batch, load_model
from kvsnap.engine.models import lean

FAST = batch.BatchCache._fast_rows
CASES = ("operators", "c_rows", "c_rows_lean")


def use(case: str, model: torch.nn.Module) -> None:
    batch.BatchCache._fast_rows = FAST if case != "operators" else (lambda self, *a: [])
    (lean.install if case == "c_rows_lean" else lean.uninstall)(model)


def by_case(model: torch.nn.Module, measure, reps: int, digits: int) -> dict[str, float]:
    """``measure()`` in every case, the cases alternating in order and reverse ``reps`` times; medians."""
    return medians(alternate(CASES, lambda case: use(case, model), {"t": measure}, reps)["t"], digits)


def model_report(name: str, args) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    doc = engine.encode(DOC)
    rows = {}
    for label, length in (("short", args.short), ("long", args.tokens)):
        sessions = sessions_on(engine, doc[:length], args.sessions)
        steps = by_case(engine.model, lambda e=engine, s=sessions: step_ms(e, s, args.steps), args.reps, 1)
        rows[f"decode_ms_{label}_{length}"] = steps
        print(name, label, steps, flush=True)
    prefill = by_case(engine.model, lambda e=engine, d=doc[: args.tokens]: prefill_s(e, d), args.reps, 3)
    rows[f"prefill_s_{args.tokens}"] = prefill
    print(name, "prefill", prefill, flush=True)
    for key, got in list(rows.items()):
        rows[key]["speedup"] = round(got["operators"] / got["c_rows_lean"], 3)
    use("c_rows_lean", engine.model)
    return rows


def main() -> None:
    decode_step_main(__doc__, model_report, show=False, dtype="bfloat16")


if __name__ == "__main__":
    main()
