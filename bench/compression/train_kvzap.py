"""Train the KVzap surrogates of an embedded model and report R² per layer on held-out text.

Collects (attention input, KVzip+ log score) pairs from ``--texts`` texts of about ``--tokens``
tokens (docstrings of installed packages and the project's synthetic tasks; see
tools/kvzap_train.py), the last ``--test`` of them held out; fits a linear and an MLP
surrogate per full-attention layer; writes ``policies/kvzap_weights/<model>.<kind>.safetensors``
and a JSON report (R² per layer for both kinds beside a constant predictor, sizes, timings,
and the thresholds ``tau`` that keep 25 / 33 / 50 % of the held-out rows).

Usage: python bench/compression/train_kvzap.py --model gemma3-270m [--texts 48] [--test 8] [--tokens 1024]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import DOCS_RESULTS, options, write_json

from kvsnap.engine import Engine, load_model
from kvsnap.policies.kvzap import WEIGHTS, weights_path
from kvsnap.tools.kvzap_train import collect, corpus, main_log, threshold_for, train


def main() -> None:
    ap = options(__doc__, "model", whole_doc=True)
    ap.add_argument("--texts", type=int, default=48, help="texts in all (the last --test held out)")
    ap.add_argument("--test", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per text")
    ap.add_argument("--per-text", type=int, default=256, help="rows sampled per text")
    ap.add_argument("--epochs", type=int, default=300, help="MLP training steps (full batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="report JSON (default docs/results/kvzap_train_<model>.json)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    engine = Engine(load_model(args.model), prefill_chunk=512)
    texts = corpus(engine.tokenizer, args.texts, args.tokens, seed=args.seed)
    t0 = time.perf_counter()
    train_set = collect(engine, texts[: -args.test], args.per_text, args.seed, main_log)
    test_set = collect(engine, texts[-args.test :], args.per_text, args.seed + 1, main_log)
    collect_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    nets, report = train(engine, train_set, test_set, args.epochs)
    train_s = time.perf_counter() - t0
    WEIGHTS.mkdir(exist_ok=True)
    meta = {"model": args.model, "fingerprint": engine.loaded.weights, "texts": str(args.texts)}
    for kind, net in nets.items():
        net.save(weights_path(args.model, kind), meta | {"kind": kind})
    summary = {k: {"median": statistics.median(v.values()), "min": min(v.values()), "max": max(v.values())}
               for k, v in report.items()}  # fmt: skip
    out = write_json(
        args.out or DOCS_RESULTS / f"kvzap_train_{args.model}.json",
        {"args": vars(args), "r2_by_layer": report, "r2": summary, "collect_s": collect_s, "train_s": train_s,
         "tau_for_share": {f"{share:g}": {kind: threshold_for(nets, test_set, share, kind) for kind in nets}
                           for share in (0.25, 0.33, 0.5)},
         "train_rows": len(train_set.layer(engine.full_layers[0])[0]),
         "test_rows": len(test_set.layer(engine.full_layers[0])[0])},
    )  # fmt: skip
    print(f"{args.model}: held-out R² per full-attention layer (median / min / max), {collect_s:.0f} s to collect")
    for kind, s in summary.items():
        print(f"  {kind:>8}: {s['median']:.3f} / {s['min']:.3f} / {s['max']:.3f}")
    print(f"wrote {', '.join(str(weights_path(args.model, k).name) for k in nets)} and {out}")


if __name__ == "__main__":
    main()
