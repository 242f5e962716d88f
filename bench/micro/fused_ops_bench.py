"""The fused C kernels for RMSNorm and gated MLP activations (engine/models/fused.py) against
transformers' operators, side by side in one run.

In-process ``Engine``, bfloat16 (packed weights, the decode attention kernel), both embedded
models (transformers' decoder layers: engine/models/lean.py's, which call the kernels themselves, are
off): the mean decode step of 1 and 8 full-KV sessions on short (--short tokens) and long
(--tokens) caches, and one long prefill, each with the kernels off and on in turn (alternating,
--reps times; the medians). The values are transformers' up to float32 rounding order
(tests/engine/models/test_fused_ops.py); this measures the time.

    .venv/bin/python bench/micro/fused_ops_bench.py --out docs/results/fused_bench.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options
from harness.compare import report_models, steps_and_prefill
from harness.engine import bench_doc

from kvsnap.engine import Engine, load_model
from kvsnap.engine.models import lean
from kvsnap.engine.models.fused import fuse, unfuse

FUSING = (unfuse, fuse, ("torch", "fused"))


def model_report(name: str, args) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    lean.uninstall(engine.model)  # transformers' layers both ways: engine/models/lean.py calls the kernels itself
    unfuse(engine.model)
    rows = {"fused_modules": fuse(engine.model)}
    if not rows["fused_modules"]:
        raise SystemExit("the fused kernels are not available here (no C compiler, or KVSNAP_C_KERNELS=0)")
    steps_and_prefill(engine, bench_doc(engine, args.tokens), rows, args, FUSING)
    return rows


def main() -> None:
    args = options(__doc__, "models", "tokens", "short", "steps", "reps", "threads", "out").parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "short": args.short, "threads": args.threads, "dtype": "bfloat16"}
    report["torch"] = torch.__version__
    report_models(args, report, model_report, show=False)


if __name__ == "__main__":
    main()
