"""Packed linear weights (engine/packed.py) against plain ``F.linear``, side by side in one run.

In-process ``Engine``, bfloat16, both embedded models: the mean decode step of 1 and 8
full-KV sessions on short (--short tokens) and long (--tokens) caches, and one long prefill,
each measured with the weights packed and unpacked in turn (alternating, --reps times; the
medians), plus the bytes the packed copies add. The answers are the same either way (the
logits are bit-equal, tests/test_packed.py); this measures only the time.

``--compare grouped``: the same measures with the projections taken together (a layer's query,
key and value; its gate and up) packed as one weight each (``packed.group``) against each
packed alone (``packed.ungroup``), in turn.

    .venv/bin/python bench/packed_bench.py --out docs/results/packed_bench.json
    .venv/bin/python bench/packed_bench.py --compare grouped --out docs/results/grouped_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from decode_bench import prefill_s, sessions_on, step_ms
from dtype_bench import DOC

from kvsnap.engine import Engine, cbuild, load_model, packed
from kvsnap.engine.packed import pack_linears, unpack_linears

PACKING = (unpack_linears, pack_linears, ("plain", "packed"))  # off, on, and their labels


def side_by_side(model: torch.nn.Module, measure, reps: int, toggle=PACKING) -> dict:
    """``measure()`` with the change off and on (by default the weights unpacked and packed),
    alternating; medians and the ratio."""
    off, on, labels = toggle
    times = {label: [] for label in labels}
    for _ in range(reps):
        for switch, label in zip((off, on), labels, strict=True):
            switch(model)
            times[label].append(measure())
    before, after = (statistics.median(times[label]) for label in labels)
    return {labels[0]: round(before, 3), labels[1]: round(after, 3), "speedup": round(before / after, 2)}


def measure(engine: Engine, doc: list[int], rows: dict, args, toggle=PACKING) -> None:
    for label, length in (("short", args.short), ("long", args.tokens)):
        sessions = sessions_on(engine, doc[:length], 8)
        for count in (1, 8):
            key = f"decode_ms_{count}_{label}"
            steps = lambda s=sessions[:count]: step_ms(engine, s, args.steps)  # noqa: E731
            rows[key] = side_by_side(engine.model, steps, args.reps, toggle)
            print(engine.loaded.name, key, rows[key], flush=True)
    rows["prefill_s_long"] = side_by_side(engine.model, lambda: prefill_s(engine, doc), args.reps, toggle)
    print(engine.loaded.name, "prefill_s_long", rows["prefill_s_long"], flush=True)


def grouping(model: torch.nn.Module) -> tuple:
    """``side_by_side``'s toggle for the model's groups of projections: alone, then grouped."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--short", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", default="packed", choices=("packed", "grouped"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "short": args.short, "threads": args.threads, "dtype": "bfloat16"}
    report |= {"torch": torch.__version__, "cpu": cbuild.cpu_model(), "compare": args.compare}
    for name in args.models.split(","):
        engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
        model = engine.model
        unpack_linears(model)
        rows = {"packed_mib": round(pack_linears(model) / 2**20, 1)}
        toggle = grouping(model) if args.compare == "grouped" else PACKING
        doc = engine.encode(DOC)[: args.tokens]
        prefill_s(engine, doc[:256])  # warm-up
        measure(engine, doc, rows, args, toggle)
        report[name] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
