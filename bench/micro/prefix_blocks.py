"""Shared prefix blocks smaller than a prefill chunk, measured (issue 29): what exactness a
block inside a chunk would give up, and what it buys a later chat on a shared document.
In-process (``Engine``), both embedded models, in ``--dtype`` (bf16: the default on this CPU).

1. **Is a chunk's arithmetic the same beside other rows?** A 1,024-token chunk of a document is
   prefilled alone, then in a packed step beside 1, 3 and 8 decode rows of other sessions (what
   the batch does all day); its rows are compared bit for bit. Where they differ, a session's
   rows already depend on the rows that shared its steps, so a block smaller than a chunk
   gives up no bitwise guarantee the dtype keeps.
2. **Are a document's rows the same whatever follows it in its last chunk?** The document
   (~``--doc-tokens``) is prefilled with tails of different lengths after it; the largest
   difference of its rows past its last whole chunk (computed in one pass with the tail).
3. **A later chat's first turn**, per ``--blocks`` (prefill chunks of 1,024): a first chat on
   the document adds its whole blocks to the shared prefixes, then ``--later`` chats open with
   it and their own question (the model's default settings, 16 tokens, greedy); the medians of
   their first-token, prefill and compression times, the tokens they took from the shared rows,
   how many of their answers equal those of the same chat prefilled alone, and how many of
   each hold the fact's value.

    .venv/bin/python bench/micro/prefix_blocks.py --out docs/results/prefix_blocks.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options, write_json

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.batch import Row
from kvsnap.engine.cache import export_kv
from kvsnap.engine.defaults import default_settings
from kvsnap.policies import make_policy
from kvsnap.tools.facts import facts_document

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


def max_diff(a, b) -> float:
    return max(
        float((x.float() - y.float()).abs().max()) for x, y in zip(export_kv(a.cache), export_kv(b.cache), strict=True)
    )


def beside_decode_rows(engine: Engine, doc: list[int]) -> dict:
    """A chunk's rows alone against the same chunk in a step beside n other sessions' decode rows."""
    chunk = doc[: engine.prefill_chunk]
    alone = engine.new_session(make_policy("full"))
    engine.step([Row(alone, chunk)])
    others = []
    for i in range(8):
        other = engine.new_session(make_policy("full"))
        engine.turn(other, doc[i : 50 + i], SamplingParams(max_new_tokens=1))
        others.append(other)
    out = {}
    for n in (1, 3, 8):
        session = engine.new_session(make_policy("full"))
        engine.step([Row(session, chunk)] + [Row(o, list(o.pending)) for o in others[:n]])
        for o in others[:n]:
            o.pending[:] = [5]  # a token to feed next time (their rows do not matter here)
        out[f"beside_{n}_max_diff"] = max_diff(alone, session)
    return out


def rows_after_tails(engine: Engine, doc: list[int], tails: list[list[int]]) -> dict:
    """The largest difference of the document's rows past its last whole chunk, against those
    prefilled with the first tail (full-attention layers)."""
    whole = len(doc) // engine.prefill_chunk * engine.prefill_chunk

    def rows(tail):
        session = engine.new_session(make_policy("full"))
        engine.turn(session, doc + tail, SamplingParams(max_new_tokens=1, temperature=0.0))
        length = session.logical_len
        return [t[..., whole : len(doc), :] for t in export_kv(session.cache) if t.shape[-2] == length]

    first = rows(tails[0])
    past = [
        max(float((a.float() - b.float()).abs().max()) for a, b in zip(first, rows(t), strict=True)) for t in tails[1:]
    ]
    return {"doc_tokens": len(doc), "rows_in_whole_chunks": whole, "past_whole_chunks_max_diff": max(past)}


def later_chats(model: str, dtype: str, block: int, doc: str, facts: list) -> dict:
    """A first chat, then one chat per further question, each opening with ``doc``; each later
    one also prefilled alone (no shared rows) for its answer."""
    loaded = load_model(model, dtype=dtype)
    engine = Engine(loaded, prefill_chunk=1024, prefix_cache_bytes=512 << 20, prefix_block=block)
    alone = Engine(loaded, prefill_chunk=1024)
    settings = default_settings(model)
    recompress, name = settings.pop("recompress"), settings.pop("policy")
    reports, same, right, right_alone = [], 0, 0, 0
    for i, fact in enumerate(facts):
        ids = engine.encode(f"{doc}\n\nQuestion: {fact.question}")
        session = engine.new_session(make_policy(name, **settings), recompress)
        session.prefix_scope = "bench"  # one tenant
        began = time.perf_counter()
        result = engine.turn(session, ids, GREEDY)
        reports.append((result.report, time.perf_counter() - began, len(ids)))
        if i:
            solo = alone.turn(alone.new_session(make_policy(name, **settings), recompress), ids, GREEDY)
            same += solo.tokens == result.tokens
            right += fact.answer.lower() in result.text.lower()
            right_alone += fact.answer.lower() in solo.text.lower()
    first, later = reports[0], reports[1:]

    def median(field):
        return round(statistics.median(getattr(r, field) for r, _, _ in later), 3)

    return {
        "block": block,
        "prompt_tokens": first[2],
        "first_ttft_s": round(first[0].ttft_s, 3),
        "later_ttft_p50_s": median("ttft_s"),
        "later_prefill_p50_s": median("prefill_s"),
        "later_compress_p50_s": median("compress_s"),
        "later_cached_tokens": [r.cached_tokens for r, _, _ in later],
        "later_answers_as_alone": f"{same} / {len(later)}",
        "later_right": f"{right} / {len(later)}",
        "later_right_alone": f"{right_alone} / {len(later)}",
    }


def measure(model: str, dtype: str, doc_tokens: int, blocks: list[int], later: int) -> dict:
    engine = Engine(load_model(model, dtype=dtype), prefill_chunk=1024)
    facts = facts_document(engine.tokenizer, target_tokens=doc_tokens, facts=6, seed=100)
    doc = engine.encode(facts.document)
    gen = torch.Generator().manual_seed(0)
    tails = [torch.randint(100, min(engine.vocab_size, 30000), (n,), generator=gen).tolist() for n in (5, 40, 200)]
    asked = facts.facts * (1 + later // len(facts.facts))
    return {
        "chunk_beside_decode_rows": beside_decode_rows(engine, doc),
        "rows_after_tails": rows_after_tails(engine, doc, tails),
        "later_chats": [later_chats(model, dtype, b, facts.document, asked[: later + 1]) for b in blocks],
    }


def main() -> None:
    ap = options(__doc__, "threads", "out", dtype="bfloat16", doc_tokens=2350, whole_doc=True)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m", type=lambda s: s.split(","))
    ap.add_argument("--blocks", default="1024,64", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--later", type=int, default=11, help="later chats per block size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    for model in args.models:
        result[model] = measure(model, args.dtype, args.doc_tokens, args.blocks, args.later)
        print(model, json.dumps(result[model], indent=1), flush=True)
    write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
