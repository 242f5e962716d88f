"""Shared prefix blocks smaller than a prefill chunk, measured (issue 29): why a block is one
chunk, and what a smaller chunk (so a smaller block) buys a later chat on a shared document.
In-process (``Engine``), both embedded models, the dtype a replica runs here (``--dtype``).

1. **Are a document's rows the same whatever follows it in its last chunk?** The document
   (~``--doc-tokens``) is prefilled alone with tails of different lengths after it; the rows of
   the document's whole chunks are compared bit for bit, and so are the rows past its last whole
   chunk, which share their forward pass with the tail. Where those differ, a block smaller than
   a chunk cannot keep today's guarantee: a session started from shared rows holds the cache a
   session that prefilled alone holds, bit for bit, and a replay rebuilds it exactly.
2. **A later chat's first turn**, per ``--chunks``: a first chat on the document adds its whole
   chunks to the shared prefixes, then ``--later`` chats open with it and their own question
   (the model's default settings, 16 tokens); the medians of their prefill, compression and
   first-token times, and the tokens they took from the shared rows.

    .venv/bin/python bench/prefix_blocks.py --out docs/results/prefix_blocks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.cache import export_kv
from kvsnap.engine.defaults import default_settings
from kvsnap.policies import make_policy
from kvsnap.tools.facts import facts_document


def rows_after_tails(engine: Engine, doc: list[int], tails: list[list[int]]) -> dict:
    """Per tail, whether the document's rows of full-attention layers equal those prefilled with
    the first tail: in its whole chunks, and past them (its last chunk, shared with the tail)."""
    whole = len(doc) // engine.prefill_chunk * engine.prefill_chunk

    def rows(tail):
        session = engine.new_session(make_policy("full"))
        engine.turn(session, doc + tail, SamplingParams(max_new_tokens=1, temperature=0.0))
        length = session.logical_len
        return [t[..., : len(doc), :] for t in export_kv(session.cache) if t.shape[-2] == length]

    first = rows(tails[0])
    out = []
    for tail in tails[1:]:
        other = rows(tail)
        diff = [(a.float() - b.float()).abs() for a, b in zip(first, other, strict=True)]
        past = max(float(d[..., whole:, :].max()) for d in diff) if whole < len(doc) else 0.0
        out.append({
            "tail_tokens": len(tail),
            "whole_chunks_equal": all(bool((d[..., :whole, :] == 0).all()) for d in diff),
            "past_whole_chunks_equal": past == 0.0,
            "past_whole_chunks_max_diff": past,
        })  # fmt: skip
    return {"doc_tokens": len(doc), "rows_in_whole_chunks": whole, "first_tail_tokens": len(tails[0]), "tails": out}


def later_chats(model: str, dtype: str, chunk: int, doc: str, questions: list[str]) -> dict:
    """A first chat, then one chat per further question, each opening with ``doc``."""
    engine = Engine(load_model(model, dtype=dtype), prefill_chunk=chunk, prefix_cache_bytes=512 << 20)
    settings = default_settings(model)
    recompress, name = settings.pop("recompress"), settings.pop("policy")
    reports = []
    for question in questions:
        session = engine.new_session(make_policy(name, **settings), recompress)
        session.prefix_scope = "bench"  # one tenant
        ids = engine.encode(f"{doc}\n\nQuestion: {question}")
        began = time.perf_counter()
        report = engine.turn(session, ids, SamplingParams(max_new_tokens=16, temperature=0.0)).report
        reports.append((report, time.perf_counter() - began, len(ids)))
    first, later = reports[0], reports[1:]

    def median(field):
        return round(statistics.median(getattr(r, field) for r, _, _ in later), 3)

    return {
        "chunk": chunk,
        "prompt_tokens": first[2],
        "first_ttft_s": round(first[0].ttft_s, 3),
        "later_ttft_p50_s": median("ttft_s"),
        "later_prefill_p50_s": median("prefill_s"),
        "later_compress_p50_s": median("compress_s"),
        "later_turn_p50_s": round(statistics.median(t for _, t, _ in later), 3),
        "later_cached_tokens": [r.cached_tokens for r, _, _ in later],
    }


def measure(model: str, dtype: str, doc_tokens: int, chunks: list[int], later: int) -> dict:
    engine = Engine(load_model(model, dtype=dtype), prefill_chunk=max(chunks))
    facts = facts_document(engine.tokenizer, target_tokens=doc_tokens, facts=4, seed=100)
    doc = engine.encode(facts.document)
    gen = torch.Generator().manual_seed(0)
    tails = [torch.randint(100, min(engine.vocab_size, 30000), (n,), generator=gen).tolist() for n in (5, 40, 200)]
    questions = [f.question for f in facts.facts] * (1 + later // len(facts.facts))
    return {
        "rows_after_tails": rows_after_tails(engine, doc, tails),
        "later_chats": [later_chats(model, dtype, c, facts.document, questions[: later + 1]) for c in chunks],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m", type=lambda s: s.split(","))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--doc-tokens", type=int, default=2350)
    ap.add_argument("--chunks", default="256,1024", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--later", type=int, default=3, help="later chats per chunk size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    for model in args.models:
        result[model] = measure(model, args.dtype, args.doc_tokens, args.chunks, args.later)
        print(model, json.dumps(result[model], indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
