"""The ``kvsnap`` command line.

``kvsnap serve`` runs the service (local Ray, embedded Redis, HTTP + gRPC) in the
foreground; ``kvsnap chat`` is an interactive client for it; ``kvsnap load`` is a
multi-turn load generator against it; ``kvsnap eval`` is the quality harness (in-process
or against a service); ``kvsnap calibrate`` measures a model's session defaults against full
KV (tools/calibrate.py); ``kvsnap spot-watch`` runs on spot GPU nodes (see cluster/README.md).

``kvsnap generate`` runs one session in-process on the embedded SmolLM2-135M-Instruct (or
``--model``): it prefills a long prompt (by default a generated pass-key document
of ``--context-tokens`` tokens), compresses it with the chosen policy, streams the
answer, asks an optional follow-up on the compressed cache, and prints what each
turn cost and what the compression saved.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from kvsnap.errors import KvsnapError

from . import clients
from .calibrate import add_calibrate_parser
from .clients import DTYPES
from .eval_cli import add_eval_parser

# Where the CLI's defaults differ from the policies' own (kvsnap generate has always used these).
CLI_POLICY_DEFAULTS = {"budget": 256, "window": 32}


def _add_policy_args(parser: argparse.ArgumentParser) -> None:
    """--policy, and one flag per parameter of the registered policies (their dataclass fields)."""
    from kvsnap.policies import POLICIES, policy_params

    parser.add_argument("--policy", default="snapkv", help=f"compression policy: {', '.join(sorted(POLICIES))}")
    owners: dict[str, tuple[type, list[str]]] = {}
    for name in sorted(POLICIES):
        for param, kind in policy_params(name).items():
            owners.setdefault(param, (kind, []))[1].append(name)
    for param, (kind, names) in sorted(owners.items()):
        parser.add_argument(
            f"--{param.replace('_', '-')}",
            type=str if kind is bool else kind,  # a bool is parsed by coerce_params ("true" / "false")
            default=CLI_POLICY_DEFAULTS.get(param),
            help=f"a parameter of {', '.join(names)} (default: {CLI_POLICY_DEFAULTS.get(param, 'the policy default')})",
        )
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="another policy parameter")
    parser.add_argument("--recompress", default="per_turn", choices=["per_turn", "never", "reselect"])
    parser.add_argument(
        "--decode",
        default=None,
        metavar="POLICY:D",
        help="also evict while decoding: h2o:D, scissorhands:D or streaming:D (at most D + window rows)",
    )


def _policy_from(args):
    from kvsnap.policies import coerce_params, make_policy, policy_params
    from kvsnap.tools.specs import PolicySpec

    given = {k: getattr(args, k) for k in policy_params(args.policy) if getattr(args, k, None) is not None}
    params = {k: v for k, v in given.items() if not isinstance(v, str)}
    text = {k: v for k, v in given.items() if isinstance(v, str)} | dict(p.partition("=")[::2] for p in args.param)
    params |= coerce_params(args.policy, text)
    if args.decode:
        params["decode"] = PolicySpec.parse(f"full+{args.decode}").settings(args.window)["decode"]
    return make_policy(args.policy, **params)


def cmd_generate(args) -> int:
    from kvsnap.engine import Engine, SamplingParams, load_model
    from kvsnap.tools.tasks import pass_key_prompt

    policy = _policy_from(args)  # bad parameters fail before the model loads
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(
        f"loading model {args.model!r} (the first run converts the embedded GGUF once, about a minute)...",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    loaded = load_model(args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype)
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
        for _ in stream:
            print(stream.detok.take(), end="", flush=True)  # the text, detokenized once
        print(stream.detok.take(final=True), end="", flush=True)
        r = stream.report
        print(
            f"\n[{policy.name}] prompt {r.prompt_tokens} tok, generated {r.generated_tokens}, "
            f"seen {r.logical_len}, kept {r.kept_len} rows per full layer | KV {r.kv_bytes / 2**20:.2f} MiB "
            f"vs full {r.full_kv_bytes / 2**20:.2f} MiB ({r.compression_ratio:.2f}x) | prefill "
            f"{r.prefill_s * 1e3:.0f} ms, compress {r.compress_s * 1e3:.1f} ms, decode {r.decode_s * 1e3:.0f} ms, "
            f"TTFT {r.ttft_s * 1e3:.0f} ms"
        )
    return 0


def cmd_load(args) -> int:
    import json

    from kvsnap.tools import loadgen

    api_key = clients.api_key(args)
    settings = {k: v for k in ("policy", "budget", "window") if (v := getattr(args, k)) is not None}
    spec = loadgen.LoadSpec(
        users=args.users,
        context=args.context,
        turns=args.turns,
        max_tokens=args.max_tokens,
        protocol=args.protocol,
        arrival=args.arrival,
        rate=args.rate,
        settings=settings,
        timeout_s=args.timeout,
        open_first=args.open_first,
    )
    model = args.model or clients.served_model(args.url, api_key)
    if args.protocol == "grpc":
        client = loadgen.GrpcClient(args.grpc, api_key, spec.timeout_s)
    else:
        client = loadgen.HttpClient(args.url, api_key, spec.timeout_s)
    result = loadgen.run(client, clients.tokenizer(model), spec, progress_s=args.progress)
    print(loadgen.format_report(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")
    return 0 if not result["errors"] else 1


def _lazy(module: str, name: str):
    """A verb that lives in tools/<module>.py, imported when it runs."""

    def run(args) -> int:
        return getattr(importlib.import_module(f"kvsnap.tools.{module}"), name)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    from kvsnap.policies import import_policy_modules
    from kvsnap.service.config import policy_modules_from_env

    import_policy_modules(policy_modules_from_env())  # their policies' flags and names, below
    parser = argparse.ArgumentParser(prog="kvsnap", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one in-process session over a long prompt")
    gen.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m or gemma3-270m (embedded), tiny-llama, tiny-gemma3, an HF model id or a local path",
    )
    gen.add_argument("--gguf-file", default=None, help="GGUF file name inside --model's directory")
    gen.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    gen.add_argument("--dtype", default=None, choices=DTYPES, help="default auto: the device's fast one")
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

    srv = sub.add_parser("serve", help="run the service: local Ray, embedded Redis, HTTP + gRPC")
    srv.add_argument(
        "--model",
        default=None,
        help="default smollm2-135m (or KVSNAP_MODEL), the embedded chat model; gemma3-270m (a base model), "
        "an HF model id or a local path",
    )
    srv.add_argument("--replicas", type=int, default=None, help="worker replicas (default 2)")
    srv.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="default auto: the device's fast one (bfloat16 on CUDA and CPUs with AMX / AVX-512 BF16)",
    )
    srv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    srv.add_argument("--http-port", type=int, default=None, help="default 8000")
    srv.add_argument("--grpc-port", type=int, default=None, help="default 9000; 0 disables gRPC")
    srv.add_argument("--data-dir", default=None, help="embedded Redis data and disk tier (default .kvsnap)")
    srv.add_argument(
        "--kv-quant",
        default=None,
        choices=["none", "kivi2", "kivi4"],
        help="KIVI-quantize the host and disk tiers (default none; lossy, more sessions per GiB)",
    )
    srv.set_defaults(func=_lazy("serve", "cmd_serve"))

    chat = sub.add_parser("chat", help="interactive multi-turn client against a running service")
    chat.add_argument("document", help="file whose text opens the session")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--api-key", default=None, help="or KVSNAP_API_KEY")
    chat.add_argument("--policy", default=None, help="default: the model's measured defaults (README)")
    chat.add_argument("--budget", type=int, default=None)
    chat.add_argument("--window", type=int, default=None)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.set_defaults(func=_lazy("chat", "cmd_chat"))

    add_eval_parser(sub)
    add_calibrate_parser(sub)

    ld = sub.add_parser("load", help="multi-turn load generator against a running service (HTTP or gRPC)")
    ld.add_argument("--url", default="http://127.0.0.1:8000", help="the service's HTTP address")
    ld.add_argument("--grpc", default="127.0.0.1:9000", help="the service's gRPC address (with --protocol grpc)")
    ld.add_argument("--api-key", default=None, help="or KVSNAP_API_KEY")
    ld.add_argument("--protocol", default="http", choices=["http", "grpc"])
    ld.add_argument("--users", type=int, default=8, help="simulated users, one session each")
    ld.add_argument("--context", type=int, default=2048, help="document tokens per session")
    ld.add_argument("--turns", type=int, default=3, help="follow-up turns per user")
    ld.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ld.add_argument("--arrival", default="closed", choices=["closed", "poisson"])
    ld.add_argument("--rate", type=float, default=1.0, help="users arriving per second (poisson)")
    ld.add_argument("--policy", default=None, help="session policy (default: the service's)")
    ld.add_argument("--budget", type=int, default=None)
    ld.add_argument("--window", type=int, default=None)
    ld.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ld.add_argument("--open-first", action="store_true", help="open every session before any follow-up starts")
    ld.add_argument("--progress", type=float, default=2.0, help="seconds between progress lines (0: none)")
    ld.add_argument("--model", default=None, help="tokenizer for sizing documents (default: what the service serves)")
    ld.add_argument("--out", default=None, help="write the report as JSON here")
    ld.set_defaults(func=cmd_load)

    spot = sub.add_parser("spot-watch", help="on a spot node: drain it and move its sessions on an interruption")
    spot.add_argument("--kvsnap-url", default="http://127.0.0.1:8000")
    spot.add_argument("--admin-key", default=None, help="an admin key of the service (KVSNAP_ADMIN_KEYS)")
    spot.add_argument("--admin-key-file", default=None, help="a file holding the admin key")
    spot.add_argument("--metadata-url", default="http://169.254.169.254", help="instance metadata endpoint")
    spot.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    spot.add_argument("--ray-address", default="auto")
    spot.add_argument(
        "--node-ip-address",
        default=None,
        help="the Ray node to watch, where one host runs several (default: this host's)",
    )
    spot.set_defaults(func=_lazy("serve", "cmd_spot_watch"))
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
