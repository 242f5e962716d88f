"""What compression buys, measured side by side against a real local service (load tests).

Phases (each in its own process with its own local Ray, embedded Redis and Serve app):

- resume:       TTFT of a follow-up turn on a held session vs the same turn re-prefilled
                whole (what a stateless server does), at each --lengths, interleaved.
- concurrency:  the most sessions of --context tokens held resident in a --device-mib device
                tier (one replica) before the first demotion, SnapKV (--budget) vs full KV
                (--kivi: also SnapKV with the device tier KIVI 2-bit quantized);
                then the load generator at that many users: turns/s, p99 TTFT, rebuilds.
- routing:      the load generator with --users sessions of --routing-context tokens on
                --routing-replicas replicas (2), cache-affinity routing vs round-robin.
- quality:      ``kvsnap eval`` (in-process): pass-key, multi-key, multi-turn per policy.

Prints a table per phase, writes suite.json + suite.png (and quality.json + quality.png)
into --out. ``--small`` is the minutes-long version that the tests run.

Usage: python bench/service/suite.py [--small] [--phases resume,concurrency,routing,quality] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import ROOT
from harness.service import HEADERS, KEY, emit, in_own_ray, run_phase_process

from kvsnap.engine.models import tokenizer_for
from kvsnap.tools import loadgen

PHASES = ("resume", "concurrency", "routing", "quality")
# each option's value in the full run and with --small (the minutes-long one)
SIZES = {
    "model": ("gemma3-270m", "tiny-llama"),
    "lengths": ("1024,2048,4096,8192,16384", "512,1024,2048"),
    "reps": (3, 3),
    "context": (4096, 1024),
    "budget": (512, 128),
    "device_mib": (160, 2),
    "max_sessions": (24, 40),
    "users": (16, 6),
    "routing_context": (2048, 1024),
    "routing_replicas": (2, 2),
    "turns": (3, 2),
}
FULL = {name: full for name, (full, _) in SIZES.items()}
SMALL = {name: small for name, (_, small) in SIZES.items()}


# -- resume gain ------------------------------------------------------------------------------


def _stateless_ttft(http: str, prompt: str, settings: dict) -> tuple[float, int]:
    """TTFT of a fresh session whose first turn is ``prompt`` (streamed ``/v1/completions``), and the
    tokens it prefilled; the session is deleted afterwards."""
    sid = f"stateless-{uuid.uuid4().hex[:8]}"
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "kvsnap": settings}
    t0, ttft, prefilled = time.perf_counter(), 0.0, 0
    with requests.post(
        f"{http}/v1/completions", headers=HEADERS | {"x-session-id": sid}, json=body, stream=True, timeout=1800
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            ttft = ttft or time.perf_counter() - t0
            prefilled = (chunk.get("usage") or {}).get("prompt_tokens", prefilled)
    requests.delete(f"{http}/v1/sessions/{sid}", headers=HEADERS, timeout=60)
    return ttft, prefilled


def resume_phase(cfg, model: str, lengths: list[int], reps: int, budget: int) -> dict:
    """Held: a follow-up on a session that holds its document. Stateless: a fresh session whose
    first prompt is a document as long as the held session's whole transcript (the same count
    of tokens a stateless server re-prefills), asking the same kind of question."""
    from kvsnap.tools.tasks import pass_key_prompt

    http = f"http://127.0.0.1:{cfg.http_port}"
    tok = tokenizer_for(model)
    client = loadgen.HttpClient(http, KEY, 1800)
    settings = {"policy": "snapkv", "budget": budget, "window": 32}
    question = "Repeat the pass key, please."
    for length in lengths:  # open every session first; its document prefill is not what is measured
        task = pass_key_prompt(tok, target_tokens=length, depth=0.5, seed=length)
        opened = client.open(f"resume-{length}", task.document + task.question, settings)
        if not opened.ok:
            raise RuntimeError(f"could not open the {length}-token session (HTTP {opened.status})")
    rows = {n: {"held_ttft_s": [], "reprefill_ttft_s": [], "reprefill_tokens": []} for n in lengths}
    for _ in range(reps):
        for length in lengths:  # interleaved: noise hits both ways alike
            held = client.turn(f"resume-{length}", question, 4)
            if not held.ok:
                raise RuntimeError(f"held turn failed with {held.status}")
            task = pass_key_prompt(tok, target_tokens=held.logical_len, depth=0.5, seed=length)
            cold_s, prefilled = _stateless_ttft(http, task.document + task.question, settings)
            rows[length]["held_ttft_s"].append(held.ttft_s)
            rows[length]["reprefill_ttft_s"].append(cold_s)
            rows[length]["reprefill_tokens"].append(prefilled)
    out = {}
    for length, r in rows.items():
        held_s, cold_s = statistics.median(r["held_ttft_s"]), statistics.median(r["reprefill_ttft_s"])
        out[str(length)] = {
            "context_tokens": int(statistics.median(r["reprefill_tokens"])),
            "held_ttft_s": held_s,
            "reprefill_ttft_s": cold_s,
            "speedup": cold_s / held_s,
            "samples": r,
        }
    return out


# -- concurrency gain -------------------------------------------------------------------------


def concurrency_phase(cfg, model: str, context: int, settings: dict, max_sessions: int, turns: int) -> dict:
    http = f"http://127.0.0.1:{cfg.http_port}"
    tok = tokenizer_for(model)
    client = loadgen.HttpClient(http, KEY, 1800)
    opened, resident, first_demotion, kv_bytes = [], 0, None, 0
    for i in range(max_sessions):
        sid = f"fill-{i}"
        s = client.open(sid, loadgen.document(tok, context, i), settings)
        if not s.ok:
            raise RuntimeError(f"opening session {i} failed with {s.status}")
        opened.append(sid)
        states = [requests.get(f"{http}/v1/sessions/{x}", headers=HEADERS, timeout=60).json() for x in opened]
        if any(state["tier"] != "device" for state in states):
            first_demotion = i + 1
            break
        resident, kv_bytes = len(opened), states[-1]["kv_bytes"]
    for sid in opened:
        requests.delete(f"{http}/v1/sessions/{sid}", headers=HEADERS, timeout=60)
    # the load at that many users: every turn should be served from the device tier
    spec = loadgen.LoadSpec(
        users=max(1, resident), context=context, turns=turns, max_tokens=8, settings=settings, open_first=True
    )
    load = loadgen.run(client, tok, spec, progress_s=0)
    return {
        "settings": settings,
        "device_tier_bytes": cfg.device_tier_mib << 20,
        "kv_bytes_per_session": kv_bytes,
        "resident": resident,
        "capped": first_demotion is None,  # max_sessions reached without a demotion
        "load": load,
        "rebuilds": load["sources"].get("rebuilt", 0),
    }


# -- routing gain -----------------------------------------------------------------------------


def routing_phase(cfg, model: str, users: int, context: int, turns: int) -> dict:
    client = loadgen.HttpClient(f"http://127.0.0.1:{cfg.http_port}", KEY, 1800)
    spec = loadgen.LoadSpec(users=users, context=context, turns=turns, max_tokens=8, open_first=True)
    return loadgen.run(client, tokenizer_for(model), spec, progress_s=0)


def child(args) -> dict:
    """One phase in this process (``--phase``)."""
    name, _, variant = args.phase.partition(":")
    one_replica = dict(model=args.model, replicas=1, cpus_per_replica=2)
    if name == "resume":
        lengths = [int(x) for x in args.lengths.split(",")]
        phase = (resume_phase, args.model, lengths, args.reps, args.budget)
        # the stateless baseline sends whole transcripts
        return in_own_ray(*phase, **one_replica, max_prompt_tokens=4 * max(lengths))
    if name == "concurrency":
        settings = {"policy": "full"} if variant == "full" else {"policy": "snapkv", "budget": args.budget}
        # kivi2: SnapKV's rows 2-bit quantized in the device tier too (KIVI; lossy)
        quant = dict(kv_quant="kivi2", kv_quant_device=True) if variant == "kivi2" else {}
        tiers = dict(device_tier_mib=args.device_mib, host_tier_mib=4096)
        phase = (concurrency_phase, args.model, args.context, settings, args.max_sessions, args.turns)
        return in_own_ray(*phase, **one_replica, **tiers, **quant)
    if name == "routing":
        phase = (routing_phase, args.model, args.users, args.routing_context, args.turns)
        replicas = dict(replicas=args.routing_replicas, cpus_per_replica=min(1.0, 2 / args.routing_replicas))
        return in_own_ray(*phase, model=args.model, routing=variant, **replicas)  # the local Ray has 2 CPUs
    raise SystemExit(f"unknown phase {args.phase}")


# -- the parent: run phases, print, save ------------------------------------------------------


def print_tables(r: dict, args) -> None:
    if "resume" in r:
        print(f"\nresume gain ({args.model}, TTFT of a follow-up, median of {args.reps})")
        print(f"{'context':>9} {'held ms':>10} {'re-prefill ms':>14} {'speed-up':>9}")
        for v in r["resume"].values():
            print(
                f"{v['context_tokens']:>9} {v['held_ttft_s'] * 1e3:>10.1f} {v['reprefill_ttft_s'] * 1e3:>14.1f} "
                f"{v['speedup']:>8.1f}x"
            )
    if "concurrency" in r:
        c = r["concurrency"]
        print(f"\nconcurrency gain ({args.model}, {args.context}-token sessions, {args.device_mib} MiB device tier)")
        cols = f"{'KV/session MiB':>15} {'resident':>9} {'turns/s':>8} {'p99 TTFT ms':>12} {'rebuilds':>9}"
        print(f"{'policy':10} {cols}")
        for name in [n for n in ("full", "snapkv", "kivi2") if n in c]:
            v = c[name]
            print(
                f"{name:10} {v['kv_bytes_per_session'] / 2**20:>15.2f} {v['resident']:>8}{'+' if v['capped'] else ' '}"
                f" {v['load']['turns_per_s']:>8.2f} {v['load']['ttft_s']['p99'] * 1e3:>12.1f} {v['rebuilds']:>9}"
            )
        print(f"gain: {c['gain']:.2f}x sessions" + (f"; with kivi2: {c['kivi2_gain']:.2f}x" if "kivi2" in c else ""))
    if "routing" in r:
        g = r["routing"]
        shape = (
            f"{args.users} users x {args.turns} follow-ups, {args.routing_context} tokens, "
            f"{args.routing_replicas} replicas"
        )
        print(f"\nrouting gain ({args.model}, {shape})")
        for name in ("affinity", "round_robin"):
            v = g[name]
            print(
                f"{name:12} {v['turns_per_s']:>6.2f} turns/s  p99 e2e {v['e2e_s']['p99']:.2f}s  "
                f"hits {v['affinity_hits']}/{v['turns_ok']}  errors {v['errors']}"
            )
        print(f"gain: {g['gain']:.2f}x turns/s")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("resume", "concurrency", "routing") if k in r]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        if name == "resume":
            xs = [v["context_tokens"] for v in r["resume"].values()]
            ax.plot(xs, [v["held_ttft_s"] * 1e3 for v in r["resume"].values()], "o-", label="held session")
            ax.plot(xs, [v["reprefill_ttft_s"] * 1e3 for v in r["resume"].values()], "s-", label="re-prefill")
            ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT ms", title="resume gain")
            ax.legend(fontsize=8)
        elif name == "concurrency":
            c = r["concurrency"]
            names = [n for n in ("full", "snapkv", "kivi2") if n in c]
            ax.bar(names, [c[n]["resident"] for n in names], color=["grey", "tab:blue", "tab:green"][: len(names)])
            ax.set(ylabel="sessions resident", title=f"concurrency gain {c['gain']:.1f}x")
        else:
            g = r["routing"]
            ax.bar(["round_robin", "affinity"], [g["round_robin"]["turns_per_s"], g["affinity"]["turns_per_s"]])
            ax.set(ylabel="turns/s", title=f"routing gain {g['gain']:.1f}x")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the minutes-long version (tiny-llama service phases)")
    ap.add_argument("--phases", default=",".join(PHASES))
    for name, value in FULL.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    ap.add_argument("--quality-args", default="", help="extra `kvsnap eval` arguments")
    ap.add_argument("--quality-model", default="gemma3-270m", help="the quality phase's model (in-process)")
    ap.add_argument("--kivi", action="store_true", help="concurrency: also SnapKV with a kivi2-quantized device tier")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args()
    for name, value in (SMALL if args.small else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.phase:
        emit(child(args))
        return

    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s) {sorted(unknown)}; valid: {PHASES}")
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FULL] + (["--small"] if args.small else [])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def phase(name: str) -> dict:
        t0 = time.perf_counter()
        got = run_phase_process(__file__, name, argv)
        print(f"phase {name} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        return got

    if "resume" in phases:
        result["resume"] = phase("resume")
    if "concurrency" in phases:
        c = {"full": phase("concurrency:full"), "snapkv": phase("concurrency:snapkv")}
        c["gain"] = c["snapkv"]["resident"] / max(1, c["full"]["resident"])
        if args.kivi:
            c["kivi2"] = phase("concurrency:kivi2")
            c["kivi2_gain"] = c["kivi2"]["resident"] / max(1, c["full"]["resident"])
        result["concurrency"] = c
    if "routing" in phases:
        g = {"affinity": phase("routing:affinity"), "round_robin": phase("routing:round_robin")}
        g["gain"] = g["affinity"]["turns_per_s"] / g["round_robin"]["turns_per_s"]
        result["routing"] = g
    if "quality" in phases:
        from kvsnap.tools.cli import main as kvsnap

        quality_argv = ["eval", "--model", args.quality_model, "--out", str(out_dir), *args.quality_args.split()]
        if args.small:
            quality_argv.append("--quick")
        if kvsnap(quality_argv) != 0:
            raise SystemExit("kvsnap eval failed")
        result["quality"] = json.loads((out_dir / "quality.json").read_text())["summary"]

    (out_dir / "suite.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "suite.png")
    print_tables(result, args)
    print(f"\nwrote {out_dir / 'suite.json'} and {out_dir / 'suite.png'}")


if __name__ == "__main__":
    main()
