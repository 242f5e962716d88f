"""The ``kvsnap`` command line.

``kvsnap generate`` runs one session in-process on the embedded Gemma 3 270M (or
``--model``): it prefills a long prompt (by default a generated pass-key document
of ``--context-tokens`` tokens), compresses it with the chosen policy, streams the
answer, asks an optional follow-up on the compressed cache, and prints what each
turn cost and what the compression saved.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kvsnap.errors import KvsnapError


def _add_policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="snapkv", help="compression policy: full, snapkv, streaming")
    parser.add_argument("--budget", type=int, default=256, help="prefix rows kept per KV head (snapkv)")
    parser.add_argument("--window", type=int, default=32, help="observation window / recent tokens kept")
    parser.add_argument("--kernel", type=int, default=7, help="SnapKV pooling kernel (odd)")
    parser.add_argument("--pooling", default="max", choices=["max", "avg"])
    parser.add_argument("--recompress", default="per_turn", choices=["per_turn", "never"])


def _policy_from(args):
    from kvsnap.policies import make_policy

    params = {"window": args.window}
    if args.policy == "snapkv":
        params |= {"budget": args.budget, "kernel": args.kernel, "pooling": args.pooling}
    return make_policy(args.policy, **params)


def cmd_generate(args) -> int:
    from kvsnap.actors import Engine, SamplingParams, load_model
    from kvsnap.service.tasks import pass_key_prompt

    policy = _policy_from(args)  # bad parameters fail before the model loads
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(
        f"loading model {args.model!r} (the first run converts the embedded GGUF once, about a minute)...",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    loaded = load_model(args.model, gguf_file=args.gguf_file, device=args.device)
    print(f"loaded in {time.perf_counter() - started:.1f}s on {loaded.device}", file=sys.stderr)
    engine = Engine(loaded, prefill_chunk=args.prefill_chunk)

    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as fh:
            turns = [fh.read()]
    elif args.prompt:
        turns = [args.prompt]
    else:
        task = pass_key_prompt(loaded.tokenizer, target_tokens=args.context_tokens, depth=0.5, seed=args.seed or 0)
        turns = [task.document + task.question]
        print(f"[pass-key prompt of ~{args.context_tokens} tokens; the planted key is {task.answer}]")
    turns += args.follow_up or []

    session = engine.new_session(policy, recompress=args.recompress)
    for i, text in enumerate(turns):
        print(f"\n--- turn {i + 1}: {text[-80:]!r}")
        stream = engine.stream(session, engine.encode(text, first=i == 0), sampling)
        emitted = ""
        generated: list[int] = []
        for token in stream:
            generated.append(token)
            full = engine.decode(generated)
            print(full[len(emitted) :], end="", flush=True)
            emitted = full
        r = stream.report
        print(
            f"\n[{policy.name}] prompt {r.prompt_tokens} tok, generated {r.generated_tokens}, "
            f"seen {r.logical_len}, kept {r.kept_len} rows per full layer | KV {r.kv_bytes / 2**20:.2f} MiB "
            f"vs full {r.full_kv_bytes / 2**20:.2f} MiB ({r.compression_ratio:.2f}x) | prefill "
            f"{r.prefill_s * 1e3:.0f} ms, compress {r.compress_s * 1e3:.1f} ms, decode {r.decode_s * 1e3:.0f} ms, "
            f"TTFT {r.ttft_s * 1e3:.0f} ms"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsnap", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one in-process session over a long prompt")
    gen.add_argument(
        "--model",
        default="gemma3-270m",
        help="gemma3-270m (embedded), tiny-llama, tiny-gemma3, an HF model id or a local path",
    )
    gen.add_argument("--gguf-file", default=None, help="GGUF file name inside --model's directory")
    gen.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    gen.add_argument("--prompt", default=None, help="prompt text (default: a generated pass-key document)")
    gen.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    gen.add_argument("--context-tokens", type=int, default=1500, help="length of the default pass-key prompt")
    gen.add_argument("--follow-up", action="append", help="a follow-up turn (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill forward pass")
    _add_policy_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except KvsnapError as exc:
        print(f"kvsnap: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
