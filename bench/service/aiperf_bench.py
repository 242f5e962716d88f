"""aiperf (NVIDIA's multi-turn load tool, PyPI ``aiperf``) against the service, unmodified.

Four cases, each a run of ``aiperf profile`` with the same synthetic conversations (a long
first turn, short follow-ups, fixed-length answers):

- ``chat-header`` / ``chat-none``: ``/v1/chat/completions``, with ``--session-header
  x-session-id`` and with no session header (the service matches the conversation by content);
- ``completions-header`` / ``completions-none``: aiperf's template endpoint over
  ``/v1/completions`` with the history flattened into one prompt, the turns joined by
  newlines (:data:`FLAT_TEMPLATE`). Each prompt repeats the previous one, then a newline, the
  answer, a newline and the new question, so it is no byte-for-byte extension of the session's
  text: the service goes back to the end of the last prompt and prefills the rest.

Answers are fixed-length (``ignore_eos``, no stop string: a base model's answer would otherwise
often end at once on the plain template's turn marker, and aiperf refuses empty answers).
Per case and turn index: median TTFT, the tokens aiperf sent (with the history) and the
tokens the service prefilled (``usage.prompt_tokens``), and the errors; per case, the tokens
the service replayed to go back to an earlier point (its ``kvsnap_replayed_tokens`` metric)
per follow-up. aiperf runs from its
own virtualenv (``make aiperf`` makes ``.aiperf/``; it brings its own transformers).

Usage: python bench/service/aiperf_bench.py [--model gemma3-270m] [--context 2048] [--out DIR]
(one local service for all four cases: 1 replica with 2 CPUs, the embedded model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AIPERF = Path(os.environ.get("KVSNAP_AIPERF", ROOT / ".aiperf" / "bin" / "aiperf"))
CASES = ("chat-header", "chat-none", "completions-header", "completions-none")
# aiperf's template endpoint: the conversation's context, then every turn so far (questions and the
# answers aiperf kept), joined by newlines
FLAT_TEMPLATE = (
    '{% set ns = namespace(p=request_info.user_context_message or "") %}'
    "{% for t in turns %}{% for x in t.texts %}{% for c in x.contents %}"
    '{% set ns.p = ns.p ~ ("\\n" if ns.p else "") ~ c %}{% endfor %}{% endfor %}{% endfor %}'
    '{"model": {{ model|tojson }}, "prompt": {{ ns.p|tojson }}, "max_tokens": {{ max_tokens|tojson }}, '
    '"stream": {{ stream|tojson }}}'
)


def profile(
    case: str,
    url: str,
    api_key: str,
    model: str,
    tokenizer: str,
    out: Path,
    conversations: int = 3,
    turns: int = 3,
    context: int = 2048,
    question: int = 16,
    answer: int = 8,
    timeout_s: float = 1800,
) -> list[dict]:
    """Run one case with aiperf; its per-request records (aiperf's ``profile_export.jsonl``)."""
    endpoint, header = case.split("-")
    out.mkdir(parents=True, exist_ok=True)
    # nice: one of aiperf's processes spins a core while it waits to send; the service's Ray
    # workers run at nice 15, so at aiperf's own priority it would take a core from the model
    cmd = [
        "nice", "-n", "19", str(AIPERF), "profile",
        "--model", model, "--url", url, "--api-key", api_key, "--tokenizer", tokenizer,
        "--streaming", "--conversation-num", str(conversations), "--conversation-turn-mean", str(turns),
        "--conversation-turn-stddev", "0", "--num-dataset-entries", str(conversations),
        "--user-context-prompt-length", str(context), "--prompt-input-tokens-mean", str(question),
        "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(answer),
        "--prompt-output-tokens-stddev", "0", "--concurrency", "1", "--random-seed", "1",
        "--output-artifact-dir", str(out), "--ui-type", "none",
        "--extra-inputs", '{"ignore_eos": true, "stop": []}',
    ]  # fmt: skip
    if endpoint == "chat":
        cmd += ["--endpoint-type", "chat"]
    else:
        template = out / "flat_template.jinja"
        template.write_text(FLAT_TEMPLATE)
        cmd += ["--endpoint-type", "template", "--endpoint", "/v1/completions"]
        cmd += ["--extra-inputs", f"payload_template:{template}"]
    if header == "header":
        cmd += ["--session-header", "x-session-id"]
    env = dict(os.environ)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    (out / "aiperf.log").write_text(done.stdout[-20000:] + "\n--- stderr ---\n" + done.stderr[-20000:])
    records = out / "profile_export.jsonl"
    if done.returncode != 0 or not records.exists():
        raise RuntimeError(f"aiperf {case} failed (rc {done.returncode}); see {out / 'aiperf.log'}")
    return [json.loads(line) for line in records.read_text().splitlines() if line.strip()]


def per_turn(records: list[dict], added: dict[int, list[int]] | None = None) -> dict:
    """Median TTFT (ms), tokens sent and tokens prefilled per turn index (aiperf reads them from
    the answers' ``usage`` over chat; over its template endpoint it does not, and ``added``, the
    tokens each turn added by the sessions' own turn marks, stands in); errors counted."""
    out, errors = {}, 0
    for r in records:
        if r.get("error"):
            errors += 1
    indices = sorted({r["metadata"]["turn_index"] for r in records})
    for i in indices:
        mine = [r["metrics"] for r in records if r["metadata"]["turn_index"] == i and not r.get("error")]

        def med(name: str, rows=mine) -> float | None:
            values = [m[name]["value"] for m in rows if name in m]
            return statistics.median(values) if values else None

        out[str(i + 1)] = {
            "requests": len(mine),
            "ttft_ms": med("time_to_first_token"),
            "input_tokens": med("input_sequence_length"),
            "prompt_tokens": med("usage_prompt_tokens"),
        }
        if out[str(i + 1)]["prompt_tokens"] is None and added and added.get(i):
            out[str(i + 1)]["prompt_tokens"] = statistics.median(added[i])
    return {"turns": out, "errors": errors, "requests": len(records)}


def run_cases(cfg, tokenizer: str, out: Path, cases: list[str], shape: dict) -> dict:
    """Every case against the service ``cfg``, each as a tenant of its own (aiperf names its
    sessions alike in every run); their per-turn summaries."""
    url, result = f"http://127.0.0.1:{cfg.http_port}", {}
    for case in cases:
        before = replayed(url, f"key-{case}")
        records = profile(case, url, f"key-{case}", cfg.model, tokenizer, out / case, **shape)
        result[case] = per_turn(records, turn_tokens(cfg.redis_url, case))
        follow_ups = shape["conversations"] * (shape["turns"] - 1)
        result[case]["replayed_per_follow_up"] = (replayed(url, f"key-{case}") - before) / follow_ups
    return result


def replayed(url: str, key: str) -> float:
    """The service's count of tokens replayed by rewinds (its Prometheus metrics)."""
    import requests

    text = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("kvsnap_replayed_tokens_total"))
    return float(line.split()[-1])


def turn_tokens(redis_url: str, tenant: str) -> dict[int, list[int]]:
    """The tokens each turn of the tenant's sessions added (its turn mark's prompt), by turn index."""
    from kvsnap.store.directory import SessionDirectory

    directory, by_turn = SessionDirectory(redis_url), {}
    for key in directory.client.scan_iter(match=f"{directory.prefix}:s:{tenant}:*"):
        sid = key.decode().rsplit(":", 1)[1]
        for i, mark in enumerate(directory.marks(tenant, sid)):
            by_turn.setdefault(i, []).append(mark.prompt)
    return by_turn


def table(summary: dict) -> str:
    lines = [
        "| case | turn | TTFT | tokens sent (with history) | tokens prefilled | tokens replayed (follow-up mean) |",
        "|---|---|---|---|---|---|",
    ]
    for case, result in summary.items():
        for turn, row in result["turns"].items():
            again = f"{result['replayed_per_follow_up']:,.0f}" if turn != "1" else "-"
            lines.append(
                f"| {case} | {turn} | {row['ttft_ms']:,.0f} ms | {row['input_tokens']:,.0f} | "
                f"{row['prompt_tokens']:,.0f} | {again} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="an embedded model (its tokenizer folder feeds aiperf)")
    ap.add_argument(
        "--tokenizer", default=None, help="the folder aiperf takes its tokenizer from (default: the model's)"
    )
    ap.add_argument("--context", type=int, default=2048, help="tokens of the first turn's context")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "aiperf"))
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if not AIPERF.exists():
        raise SystemExit(f"aiperf not found at {AIPERF}: run `make aiperf` (or set KVSNAP_AIPERF)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness (tests import this file)
    from harness.service import emit, in_own_ray, run_phase_process

    from kvsnap.engine.models import EMBEDDED

    out, cases = Path(args.out), args.cases.split(",")
    shape = dict(conversations=args.conversations, turns=args.turns, context=args.context)
    if args.phase:
        tokenizer = args.tokenizer or EMBEDDED[args.model]()[0]
        keys = {f"key-{case}": case for case in cases}
        service = dict(model=args.model, replicas=1, cpus_per_replica=2, max_new_tokens=64, api_keys=keys)
        emit(in_own_ray(run_cases, tokenizer, out, cases, shape, **service))
        return
    argv = [f"--{k}={v}" for k, v in vars(args).items() if k != "phase" and v is not None]
    summary = run_phase_process(__file__, "aiperf", argv, timeout_s=7200)
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2))
    print(f"{args.model}, {args.conversations} conversations of {args.turns} turns, ~{args.context}-token context:")
    print(table(summary))
    print(f"errors: { ({c: s['errors'] for c, s in summary.items()}) }; wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
