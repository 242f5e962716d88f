"""``kvsnap eval``: the quality harness's verb (tools/quality.py runs it, tools/report.py
reports it), in-process on a model or against a running service."""

from __future__ import annotations

import sys
import time

from . import clients
from .clients import DTYPES, csv

# `kvsnap eval --quick`: a small version that runs in a minute or two on 2 CPU cores
QUICK_EVAL = dict(lengths=(1024,), depths=(0.2, 0.8), keys=3, seeds=1, policies=("full", "snapkv:256", "streaming:256"))


def cmd_eval(args) -> int:
    import json
    from pathlib import Path

    from kvsnap.engine.defaults import default_settings
    from kvsnap.tools import quality
    from kvsnap.tools.specs import spec_text

    fields = ("tasks", "lengths", "depths", "policies", "keys", "seeds", "window", "gen_tokens")
    given = {k: v for k in fields if (v := getattr(args, k)) is not None}
    if args.url:
        api_key = clients.api_key(args)
        args.model = args.model or clients.served_model(args.url, api_key)
    args.model = args.model or "smollm2-135m"
    default = spec_text(default_settings(args.model))  # ``default`` in --policies: the model's defaults
    if "default" in given.get("policies", ()):
        given["policies"] = tuple(dict.fromkeys(default if p == "default" else p for p in given["policies"]))
    spec = quality.EvalSpec(**({**QUICK_EVAL, **given} if args.quick else given))
    if args.url:
        backend = quality.OverHTTP(args.url, api_key, args.model)
        where, tokenizer = f"service {args.url}", clients.tokenizer(args.model)
    else:
        from kvsnap.engine import Engine, load_model

        print(f"loading model {args.model!r}...", file=sys.stderr, flush=True)
        engine = Engine(load_model(args.model, device=args.device, dtype=args.dtype))
        where = f"in-process on {engine.device}, {str(engine.model.dtype).removeprefix('torch.')}"
        backend, tokenizer = quality.InProcess(engine), engine.tokenizer
    cases = quality.build_cases(tokenizer, spec)
    print(
        f"{len(cases)} cases x {len(spec.specs)} policies ({', '.join(spec.policies)}), {where}",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    scores = quality.evaluate(backend, cases, spec, progress=lambda m: print(m, file=sys.stderr, flush=True))
    summary = quality.summarize(scores)
    meta = {
        "model": args.model,
        "backend": where,
        "spec": {k: getattr(spec, k) for k in fields},
        "elapsed_s": time.perf_counter() - started,
        "default_policy": default,  # the model's defaults (kvsnap.engine.defaults), as a policy spec
    }
    paths = quality.save(scores, summary, meta, Path(args.out))
    print(f"{args.model}, {where}, {meta['elapsed_s']:.0f}s")
    print(quality.format_tables(summary))
    print(f"\nwrote {' and '.join(str(p) for p in paths.values())}")
    if args.json:
        print(json.dumps(summary))
    return 0


def add_eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval", help="quality harness: pass-key, multi-key and multi-turn retrieval, long generation, per policy"
    )
    ev.add_argument("--model", default=None, help="model to run in-process (default smollm2-135m); with --url: its own")
    ev.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    ev.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="in-process (default auto: the device's fast one)",
    )
    ev.add_argument("--url", default=None, help="evaluate a running service instead (its HTTP address)")
    ev.add_argument("--api-key", default=None, help="with --url (or KVSNAP_API_KEY)")
    ev.add_argument(
        "--tasks",
        type=csv(str),
        default=None,
        help="passkey,multikey,multiturn (the default); facts (varied prose stating facts once, asked one per "
        "turn over the chat template: the task the defaults are chosen by; --keys facts per document); docfirst "
        "(the document alone first, then one question per key) and longgen (long generation), in-process only",
    )
    ev.add_argument("--lengths", type=csv(int), default=None, help="document tokens (default 1024,2048,4096)")
    ev.add_argument("--depths", type=csv(float), default=None, help="pass-key depths (default 0.1,0.5,0.9)")
    ev.add_argument(
        "--policies",
        type=csv(str),
        default=None,
        help="default full,snapkv:128,snapkv:256,snapkv:512,streaming:256; also reselect:B "
        "(SnapKV re-selecting from the full cache each turn), h2o:B, scissorhands:B; +h2o:D, "
        "+scissorhands:D or +streaming:D evict while decoding (e.g. snapkv:256+h2o:128); @kivi2 / @kivi4 "
        "quantize the KV between turns; kvzip:B, kvzap:B (query-agnostic). Each holds B (D) + window rows; "
        "a budget may be r<share> of the prefix (snapkv:r0.33) or, for kvzip/kvzap, t<log score> (kvzap:t-4); "
        "/f<n> after a share keeps at least n rows, /k<n> sets the pooling kernel, /s keeps sentence spans whole "
        "(snapkv:r0.5/f512/s); default: the model's defaults",
    )
    ev.add_argument("--keys", type=int, default=None, help="keys planted for multikey / multiturn (default 4)")
    ev.add_argument("--seeds", type=int, default=None, help="documents per length (default 2)")
    ev.add_argument("--window", type=int, default=None, help="observation window (default 32)")
    ev.add_argument("--gen-tokens", type=int, default=None, help="longgen: tokens generated (default 256)")
    ev.add_argument("--quick", action="store_true", help="a small version: 1K tokens, 2 depths, 3 keys, 3 policies")
    ev.add_argument("--out", default="bench/results", help="folder for quality.json and quality.png")
    ev.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    ev.set_defaults(func=cmd_eval)
