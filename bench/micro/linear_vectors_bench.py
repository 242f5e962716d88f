"""A decode step's products on AVX-512 BF16 vectors (cpu_kernels/linear_vectors.py) against oneDNN's, side
by side in one run, on a CPU without AMX.

In-process ``Engine``, bfloat16 (packed weights, fused kernels, attention kernels: what a
replica runs), both embedded models. Two cases, alternating --reps times (medians):

- ``onednn``: every product through oneDNN's packed weights (the LM head's first pass too: the
  head packed once), what a decode step ran before the kernel;
- ``few``: a step's one-token rows on the kernel's repacked weights, and the head's first pass.

Each gives: all of the model's projections at --sessions rows, as a decode step calls them
(grouped where the layer groups them), the LM head's first pass at that many rows, and the mean
decode step of --sessions full-KV sessions on short (--short tokens) and long (--tokens) caches.
The two cases do not compute the same bits (tests/cpu_kernels/test_linear_vectors.py says what each keeps).

    .venv/bin/python bench/micro/linear_vectors_bench.py --out docs/results/few_linear_bench.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.compare import ab_medians, decode_step_main
from harness.engine import step_measures, timed_ms

from kvsnap.cpu_kernels import linear_vectors
from kvsnap.cpu_kernels.build import cpu_model
from kvsnap.engine import Engine, load_model
from kvsnap.engine.models import packed

CASES = ("onednn", "few")


def use(case: str, engine: Engine, heads: dict) -> None:
    packed.FEW_ROWS = case == "few"
    engine.head.few, engine.head.packed = heads[case]


def product_calls(model: nn.Module) -> list:
    """The decode step's product calls: per layer, each group of projections taken together
    (:func:`packed.products`) and each other projection alone."""
    grouped = {m for g in packed.groups(model) for m in g}
    calls = [(lambda x, g=g: packed.products(g, x), g[0].in_features) for g in packed.groups(model)]
    for m in model.modules():
        if type(m) is nn.Linear and packed.uses_few(m) and m not in grouped:
            calls.append((m, m.in_features))
    return calls


def model_report(name: str, args) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    weight = engine.head.weight_bf16
    heads = {"few": (engine.head.few, None), "onednn": (None, packed.pack(weight))}
    calls = product_calls(engine.model)
    widths = {k for _, k in calls}
    rows = {k: torch.randn(1, args.sessions, k).to(torch.bfloat16) for k in widths}
    hidden = torch.randn(args.sessions, weight.shape[1]).to(torch.bfloat16)

    def projections() -> None:
        with torch.inference_mode(), packed.step_rows([1] * args.sessions):
            for call, k in calls:
                call(rows[k])

    measures = {
        "projections_ms": lambda: timed_ms(projections),
        "head_first_pass_ms": lambda: timed_ms(lambda: engine.head._first_pass(hidden)),
    }
    measures |= step_measures(engine, args)
    projected = [m for m in engine.model.modules() if type(m) is nn.Linear and packed.uses_few(m)]
    result = {"projections": len(projected), "projection_mb": round(sum(m.weight.nbytes for m in projected) / 1e6, 1)}
    result["head_mb"] = round(weight.nbytes / 1e6, 1)
    result |= ab_medians(measures, CASES, lambda case: use(case, engine, heads), args.reps)
    use("few", engine, heads)
    return result


def main() -> None:
    why = "no AVX-512 BF16 kernel here (no such instructions, or AMX: linear_tiles_bench.py)"
    decode_step_main(__doc__, model_report, needs=linear_vectors.available, why=why, indent=1, cpu=cpu_model())


if __name__ == "__main__":
    main()
