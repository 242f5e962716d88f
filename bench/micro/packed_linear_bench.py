"""Packed linear weights (engine/models/packed.py) against plain ``F.linear``, side by side in one run.

In-process ``Engine``, bfloat16, both embedded models: the mean decode step of 1 and 8
full-KV sessions on short (--short tokens) and long (--tokens) caches, and one long prefill,
each measured with the weights packed and unpacked in turn (alternating, --reps times; the
medians), plus the bytes the packed copies add. The answers are the same either way (the
logits are bit-equal, tests/engine/models/test_packed_linears.py); this measures only the time.

``--compare grouped``: the same measures with the projections taken together (a layer's query,
key and value; its gate and up) packed as one weight each (``packed.group``) against each
packed alone (``packed.ungroup``), in turn.

    .venv/bin/python bench/micro/packed_linear_bench.py --out docs/results/packed_bench.json
    .venv/bin/python bench/micro/packed_linear_bench.py --compare grouped --out docs/results/grouped_bench.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options
from harness.compare import report_models, steps_and_prefill
from harness.engine import bench_doc

from kvsnap.cpu_kernels import build
from kvsnap.engine import Engine, load_model
from kvsnap.engine.models import packed
from kvsnap.engine.models.packed import pack_linears, unpack_linears

PACKING = (unpack_linears, pack_linears, ("plain", "packed"))  # off, on, and their labels


def grouping(model: torch.nn.Module) -> tuple:
    """``harness.compare.side_by_side``'s toggle for the model's groups of projections: alone, then grouped."""
    groups = packed.groups(model)
    if not groups:
        raise SystemExit("no grouped projections in this model on this CPU: nothing to compare")

    def alone(_model) -> None:
        for g in groups:
            packed.ungroup(g)

    def together(_model) -> None:
        for g in groups:
            packed.group(g)

    return alone, together, ("alone", "grouped")


def model_report(name: str, args) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    model = engine.model
    unpack_linears(model)
    rows = {"packed_mib": round(pack_linears(model) / 2**20, 1)}
    toggle = grouping(model) if args.compare == "grouped" else PACKING
    steps_and_prefill(engine, bench_doc(engine, args.tokens), rows, args, toggle)
    return rows


def main() -> None:
    parser = options(__doc__, "models", "tokens", "short", "steps", "reps", "threads")
    parser.add_argument("--compare", default="packed", choices=("packed", "grouped"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "short": args.short, "threads": args.threads, "dtype": "bfloat16"}
    report |= {"torch": torch.__version__, "cpu": build.cpu_model(), "compare": args.compare}
    report_models(args, report, model_report, show=False)


if __name__ == "__main__":
    main()
