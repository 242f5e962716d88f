"""Is it the choice of rows, or the rows' absence? KVzip+'s own choice beside the same number of
rows with every planted fact forced in, on ``kvsnap eval``'s ``docfirst`` documents.

A ``docfirst`` document (planted facts in repeated filler) is prefilled once per variant and
compressed at ``--ratio`` of every full-attention layer's rows plus a ``--window`` (as
``kvzip:r<ratio>`` does), then asked its questions, greedy, as ``kvsnap eval`` asks them:

- ``full``: nothing dropped;
- ``kvzip`` / ``kvzap``: the policies themselves (``kvzip:r<ratio>``, ``kvzap:r<ratio>``, linear
  surrogate), pooling included, as ``kvsnap eval`` runs them;
- ``kvzip+facts``: the same count, but every token of every planted fact ("The special magic
  number for X is N.") in every layer and KV head, the rest by KVzip+ scores: an oracle that
  knows the questions, which no query-agnostic scorer can beat on retaining the facts.

If ``kvzip+facts`` is no better than ``kvzip``, what a model loses at that compression is not
the facts but the context dropped around them, and a better scorer cannot win it back.
Writes a JSON report (accuracy per variant, and every answer).

Usage: python bench/compression/docfirst_oracle.py --model smollm2-135m --lengths 1024,2048 --seeds 6
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import DOCS_RESULTS, options, write_json

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.policies import FullKV
from kvsnap.policies.kvzap import KVzap
from kvsnap.policies.kvzip import KVzip
from kvsnap.tools.backends import ANSWER_TOKENS
from kvsnap.tools.quality import EvalSpec, build_cases
from kvsnap.tools.tasks import NEEDLE

VARIANTS = ("full", "kvzip", "kvzap", "kvzip+facts")
FACT = re.compile(re.escape(NEEDLE).replace(r"\{name\}", r"\w+").replace(r"\{value\}", r"\d+"))


def fact_rows(tokenizer, document: str, tokens: list[int]) -> list[int]:
    """The rows of ``tokens`` (the document with any BOS) that hold a planted fact's characters."""
    offsets = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    shift = len(tokens) - len(offsets)
    facts = list(FACT.finditer(document))
    if not facts:
        raise SystemExit("no planted fact found: tools/tasks.py NEEDLE and this document disagree")
    return [i + shift for m in facts for i, (a, b) in enumerate(offsets) if a < m.end() and b > m.start()]


@torch.inference_mode()
def run(engine: Engine, case, variant: str, ratio: float, window: int) -> list[bool]:
    tokens = engine.encode(case.opening, first=True)
    policies = {"kvzip": KVzip(ratio=ratio, window=window), "kvzap": KVzap(ratio=ratio, window=window)}
    session = engine.new_session(policies.get(variant, FullKV()))
    engine.prefill(session, tokens)
    if variant == "kvzip+facts":  # questions and answers stay whole after it, as kvzip keeps them
        scores = engine._reconstruction_scores(session, tokens)
        facts = torch.tensor(fact_rows(engine.tokenizer, case.opening, tokens))
        for idx, layer_scores in scores.items():
            layer_scores = layer_scores.clone()
            layer_scores[..., facts] = float("inf")
            layer = session.cache.layers[idx]
            layer.keep(policies["kvzip"].keep_scored(layer_scores, layer.kept_len))
    out = []
    for question, answer in zip(case.turns, case.answers, strict=True):
        result = engine.turn(
            session, engine.encode(question, first=False), SamplingParams(max_new_tokens=ANSWER_TOKENS)
        )
        out.append(answer in result.text)
    return out


def main() -> None:
    ap = options(
        __doc__, model="smollm2-135m", lengths="1024,2048", seeds=6, keys=4, ratio=0.33, window=32, whole_doc=True
    )
    ap.add_argument("--out", default=None, help="report JSON (default docs/results/docfirst_oracle_<model>.json)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(load_model(args.model))
    lengths = tuple(int(x) for x in args.lengths.split(","))
    spec = EvalSpec(tasks=("docfirst",), lengths=lengths, seeds=args.seeds, keys=args.keys, policies=("full",))
    answers = {v: [] for v in VARIANTS}
    for case in build_cases(engine.tokenizer, spec):
        for variant in VARIANTS:  # interleaved per document
            correct = run(engine, case, variant, args.ratio, args.window)
            answers[variant].append({"length": case.length, "seed": case.seed, "correct": correct})
            print(f"L={case.length} seed={case.seed} {variant:>12}: {correct}", flush=True)
    accuracy = {
        v: sum(sum(r["correct"]) for r in rows) / sum(len(r["correct"]) for r in rows) for v, rows in answers.items()
    }
    report = {
        "args": vars(args),
        "accuracy": accuracy,
        "answers": answers,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    out = write_json(args.out or DOCS_RESULTS / f"docfirst_oracle_{args.model}.json", report)
    print("  ".join(f"{v} {a:.0%}" for v, a in accuracy.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
