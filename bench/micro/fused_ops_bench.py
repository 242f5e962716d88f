"""The fused C kernels for RMSNorm and gated MLP activations (engine/fused.py) against
transformers' operators, side by side in one run.

In-process ``Engine``, bfloat16 (packed weights, the decode attention kernel), both embedded
models (transformers' decoder layers: engine/lean.py's, which call the kernels themselves, are
off): the mean decode step of 1 and 8 full-KV sessions on short (--short tokens) and long
(--tokens) caches, and one long prefill, each with the kernels off and on in turn (alternating,
--reps times; the medians). The values are transformers' up to float32 rounding order
(tests/test_fused.py); this measures the time.

    .venv/bin/python bench/fused_bench.py --out docs/results/fused_bench.json
"""

from __future__ import annotations

import argparse
import json

import torch
from decode_bench import prefill_s
from dtype_bench import DOC
from packed_bench import measure

from kvsnap.engine import Engine, lean, load_model
from kvsnap.engine.fused import fuse, unfuse

FUSING = (unfuse, fuse, ("torch", "fused"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--short", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "short": args.short, "threads": args.threads, "dtype": "bfloat16"}
    report["torch"] = torch.__version__
    for name in args.models.split(","):
        engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
        lean.uninstall(engine.model)  # transformers' layers both ways: engine/lean.py calls the kernels itself
        unfuse(engine.model)
        rows = {"fused_modules": fuse(engine.model)}
        if not rows["fused_modules"]:
            raise SystemExit("the fused kernels are not available here (no C compiler, or KVSNAP_C_KERNELS=0)")
        doc = engine.encode(DOC)[: args.tokens]
        prefill_s(engine, doc[:256])  # warm-up
        measure(engine, doc, rows, args, FUSING)
        report[name] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
