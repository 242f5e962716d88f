"""Why a selection loses a fact: how much of the asked fact's value each policy keeps.

For ``kvsnap eval``'s fact documents (tools/facts.py), the first turn (document + question,
over the chat template) is prefilled and compressed under each policy; then, for every
full-attention layer and KV head, the share of the value's rows (the digits of "65125", the
family name, the code) still in the cache, and of the subject's rows (the words the
question repeats). A value kept in only some heads and layers is what makes a model answer
"7544" for 75471.

    .venv/bin/python bench/compression/fact_coverage.py --model smollm2-135m \\
        --out docs/results/fact_coverage_smollm2-135m.json

Prints a table (mean share of value rows kept, share of layer-heads that keep the whole
value, the same for the subject) and writes a JSON report.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, options, write_json

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine import cache as cache_mod
from kvsnap.service.template import encode_messages
from kvsnap.tools.facts import facts_document, first_question
from kvsnap.tools.specs import PolicySpec


def _rows_of(ids: list[int], tokenizer, text: str) -> list[int]:
    """Positions of ``text``'s tokens in ``ids`` (as the tokenizer writes it after a space)."""
    for variant in (" " + text, text):
        piece = tokenizer.encode(variant, add_special_tokens=False)
        for start in range(len(ids) - len(piece) + 1):
            if ids[start : start + len(piece)] == piece:
                return list(range(start, start + len(piece)))
    raise ValueError(f"{text!r} is not in the prompt as its own tokens")


class Recorder:
    """The positions each layer keeps (CompressedLayer.keep, recorded as it runs)."""

    def __init__(self):
        self.kept: dict[int, torch.Tensor] = {}
        self._keep = cache_mod.CompressedLayer.keep
        recorder = self

        def keep(layer, positions):
            recorder.kept[id(layer)] = positions[0].clone()  # [H_kv, k]
            return recorder._keep(layer, positions)

        cache_mod.CompressedLayer.keep = keep


def coverage(engine: Engine, recorder: Recorder, spec: PolicySpec, ids: list[int], rows: dict[str, list[int]]):
    policy, recompress, _ = spec.build(32)
    session = engine.new_session(policy, recompress=recompress)
    recorder.kept.clear()
    engine.turn(session, ids, SamplingParams(max_new_tokens=1))
    out = {name: [] for name in rows}
    for idx in engine.full_layers:
        kept = recorder.kept.get(id(session.cache.layers[idx]))
        for head in range(session.cache.layers[idx].keys.shape[1]):
            have = set(range(len(ids))) if kept is None else set(kept[head].tolist())
            for name, positions in rows.items():
                out[name].append(len(have & set(positions)) / len(positions))
    return {name: {"mean": statistics.mean(v), "whole": sum(x == 1.0 for x in v) / len(v)} for name, v in out.items()}


def main() -> None:
    policies = "full,snapkv:512,snapkv:512/k21,snapkv:512/s,snapkv:r0.5,snapkv:r0.5/s"
    parser = options(__doc__, model="smollm2-135m", length=2048, documents=8, policies=policies)
    parser.add_argument("--out", default=str(RESULTS / "fact_coverage.json"))
    args = parser.parse_args()
    started = time.time()
    engine = Engine(load_model(args.model), prefill_chunk=512)
    recorder = Recorder()
    specs = [PolicySpec.parse(p) for p in args.policies.split(",")]
    results = {s.name: [] for s in specs}
    for seed in range(args.documents):
        doc = facts_document(engine.tokenizer, target_tokens=args.length, facts=4, seed=seed)
        fact = doc.facts[seed % len(doc.facts)]
        message = {"role": "user", "content": first_question(doc.document, fact.question)}
        ids = encode_messages(engine.tokenizer, [message], first=True)
        subject = fact.sentence[: fact.sentence.index(" is ")].split(" ", 1)[1] if " is " in fact.sentence else ""
        rows = {"value": _rows_of(ids, engine.tokenizer, fact.answer)}
        if subject:
            rows["subject"] = _rows_of(ids, engine.tokenizer, subject)
        for spec in specs:
            results[spec.name].append(coverage(engine, recorder, spec, ids, rows) | {"kind": fact.kind})
        print(f"document {seed + 1}/{args.documents} done", flush=True)
    summary = {}
    print(f"\n{args.model}, {args.documents} documents of {args.length} tokens: rows of the asked fact kept")
    heads = ("value mean", "value whole", "subject mean", "subject whole")
    print(f"{'policy':18}" + "".join(f"{h:>15}" for h in heads))
    for name, rows in results.items():
        agg = {
            f"{part}_{stat}": statistics.mean(r[part][stat] for r in rows if part in r)
            for part in ("value", "subject")
            for stat in ("mean", "whole")
        }
        summary[name] = agg
        print(f"{name:18}" + "".join(f"{agg[k]:>15.0%}" for k in agg))
    meta = {"model": args.model, "length": args.length, "documents": args.documents, "elapsed_s": time.time() - started}
    meta["started"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    write_json(args.out, {"meta": meta, "summary": summary, "documents": results}, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
