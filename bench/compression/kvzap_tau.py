"""The kvzap threshold that keeps a given share of an eval's own documents (equal bytes).

``kvsnap eval`` compares policies at equal KV bytes; a threshold (``kvzap:t<tau>``) keeps what
scores above it, so how many rows it keeps depends on the text. The training report's ``tau``
(``docs/results/kvzap_train_<model>.json``) keeps a share of the *training* text's rows; the
eval's synthetic documents (a few planted facts in repeated filler) score lower, so that tau
keeps fewer of their rows. This script builds the same documents ``kvsnap eval`` builds
(``docfirst``: ``--lengths`` x ``--seeds``, ``--keys`` facts each), runs each surrogate over
every full-attention layer's attention input, and reports the log score above which
``--share`` of the documents' prunable rows lie (every layer, KV head and document together;
the last ``--window`` rows of a document are always kept and not counted). That tau, passed as
``kvzap:t<tau>``, lands on the bytes of ``kvzap:r<share>`` while choosing per layer and per
document by the scores. Writes a JSON report.

Usage: python bench/compression/kvzap_tau.py --model smollm2-135m --lengths 1024,2048 --seeds 6 --share 0.33
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import DOCS_RESULTS, options, write_json

from kvsnap.engine import Engine, load_model
from kvsnap.policies.kvzap import SURROGATES
from kvsnap.tools.kvzap_train import attention_inputs
from kvsnap.tools.quality import EvalSpec, build_cases


@torch.inference_mode()
def predicted(engine: Engine, tokens: list[int], window: int) -> dict[str, torch.Tensor]:
    """Per surrogate kind, every prunable row's predicted log score (all full-attention layers
    and KV heads), from one prefill of ``tokens``."""
    _, hidden = attention_inputs(engine, tokens)
    prunable = len(tokens) - window
    return {
        kind: torch.cat([engine.surrogate(kind)(i, hidden[i])[:, :prunable].flatten() for i in engine.full_layers])
        for kind in SURROGATES
    }


def main() -> None:
    ap = options(__doc__, "model", lengths="1024,2048", seeds=3, keys=4, whole_doc=True)
    ap.add_argument("--share", type=float, default=0.33, help="share of the prunable rows to keep")
    ap.add_argument("--window", type=int, default=32, help="kvsnap eval's window (always kept)")
    ap.add_argument("--out", default=None, help="report JSON (default docs/results/kvzap_tau_<model>.json)")
    args = ap.parse_args()
    if not 0 < args.share < 1:
        ap.error("--share must lie in (0, 1)")
    t0 = time.perf_counter()
    engine = Engine(load_model(args.model), prefill_chunk=512)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    spec = EvalSpec(tasks=("docfirst",), lengths=lengths, seeds=args.seeds, keys=args.keys, policies=("full",))
    documents = [engine.encode(case.opening, first=True) for case in build_cases(engine.tokenizer, spec)]
    report = {"args": vars(args), "documents": len(documents), "tau": {}, "kept_share_per_document": {}}
    per_document = [predicted(engine, doc, args.window) for doc in documents]
    for kind in SURROGATES:
        scores = [by_kind[kind] for by_kind in per_document]
        tau = float(torch.quantile(torch.cat(scores), 1 - args.share))
        report["tau"][kind] = round(tau, 2)  # as a spec gives it: kvzap:t<tau>
        report["kept_share_per_document"][kind] = [round(float((s > tau).float().mean()), 3) for s in scores]
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out = write_json(args.out or DOCS_RESULTS / f"kvzap_tau_{args.model}.json", report)
    for kind, tau in report["tau"].items():
        shares = report["kept_share_per_document"][kind]
        print(f"{args.model} {kind}: tau {tau} keeps {args.share:.0%} of {len(documents)} documents' prunable rows "
              f"(per document {min(shares):.0%}-{max(shares):.0%}); use kvzap:t{tau}")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
