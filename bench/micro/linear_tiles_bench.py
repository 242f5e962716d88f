"""A decode step's products on AMX tiles against oneDNN's, side by side in one run.

In-process ``Engine``, bfloat16 (packed weights, fused kernels, attention kernels: what a
replica runs), both embedded models. Two cases, alternating --reps times (medians):

- ``onednn``: every projection with a few rows through oneDNN's packed weights, the LM head's
  first pass through ``F.linear`` (what a decode step ran before cpu_kernels/linear_tiles.py);
- ``amx``: those products on the AMX tiles.

Each gives: all of the model's projections at 8 rows, once each (the products alone), the LM
head's first pass at 8 rows, and the mean decode step of --sessions full-KV sessions on short
(--short tokens) and long (--tokens) caches. Both cases compute the same bits
(tests/cpu_kernels/test_linear_tiles.py); this measures the time.

    .venv/bin/python bench/micro/linear_tiles_bench.py --out docs/results/amx_linear_bench.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.compare import ab_medians, decode_step_main
from harness.engine import step_measures, timed_ms

from kvsnap.cpu_kernels import linear_tiles
from kvsnap.engine import Engine, load_model
from kvsnap.engine.models import packed

CASES = ("onednn", "amx")


def use(case: str, engine: Engine) -> None:
    packed.AMX_MAX_ROWS = linear_tiles.MAX_ROWS if case == "amx" else 0
    engine.head.tiles = case == "amx" and linear_tiles.takes(engine.head.weight_bf16)


def model_report(name: str, args) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    linears = [m for m in engine.model.modules() if type(m) is nn.Linear and packed.uses_amx(m)]
    rows = {k: torch.randn(args.sessions, k).to(torch.bfloat16) for k in {m.in_features for m in linears}}
    hidden = torch.randn(args.sessions, engine.head.weight_bf16.shape[1]).to(torch.bfloat16)
    measures = {
        "projections_ms": lambda: timed_ms(lambda: [m(rows[m.in_features]) for m in linears]),
        "head_first_pass_ms": lambda: timed_ms(lambda: engine.head._first_pass(hidden)),
    }
    measures |= step_measures(engine, args)
    result = {"projections": len(linears), "projection_mb": round(sum(m.weight.nbytes for m in linears) / 1e6, 1)}
    result |= ab_medians(measures, CASES, lambda case: use(case, engine), args.reps)
    use("amx", engine)
    return result


def main() -> None:
    why = "no AMX kernel on this machine: nothing to compare"
    decode_step_main(__doc__, model_report, needs=linear_tiles.available, why=why, indent=1, dtype="bfloat16")


if __name__ == "__main__":
    main()
