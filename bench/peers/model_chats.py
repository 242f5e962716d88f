"""The peer bench's fact chats through kvsnap alone, on each embedded model in turn: which model
answers a user's document better through the service, with full KV and at its defaults.

vLLM refuses Gemma 3's chats (the base model has no chat template), so the peer bench
(bench/peers/peer_bench.py) cannot put the two models side by side; this runs its ``fit``
workload's chats (tools/facts.py: varied prose stating one fact per turn once, asked one per
turn, the plain ``openai`` client, no session header, greedy) against ``kvsnap serve`` alone.
Each model and setting gets a fresh server (an implicit session is found by its messages, so
two settings must not share one); ``full`` sends ``{"policy": "full"}`` with every turn,
``defaults`` sends no settings. The same documents and questions for every model.

Usage: python bench/peers/model_chats.py [--models smollm2-135m,gemma3-270m] [--chats 16]
       [--turns 3] [--doc-tokens 2600] [--out docs/results/model_chats_zen4.json]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from harness.cli import options, write_json

from kvsnap.cpu_kernels import build
from peers.figures import summarize
from peers.peer_bench import Chats, chats
from peers.servers import start_kvsnap

SETTINGS = {"full": {"policy": "full"}, "defaults": None}


def run_model(model: str, args, work: Path) -> dict:
    """Every setting of :data:`SETTINGS` on ``model``, each on a fresh server."""
    convs = chats(model, args.chats, args.turns, args.doc_tokens, seed0=100)
    out = {}
    for name, settings in SETTINGS.items():
        (work / f"{model}-{name}").mkdir()
        server = start_kvsnap(model, args.kv_gib, args.dtype, work / f"{model}-{name}")
        try:
            side = Chats(server, model, convs, args.in_flight, args.max_tokens, settings)
            for turn in range(args.turns):
                side.round(turn)
        finally:
            server.stop()
        out[name] = summarize(side.rows, side.rounds_s)
        out[name]["right_follow_ups"] = out[name]["right"] - out[name]["right_turn1"]
        out[name]["answers"] = [r["text"] for r in side.rows]
        shown = {k: v for k, v in out[name].items() if k in ("wall_s", "right", "right_turn1", "turns")}
        print(f"{model} {name}: {json.dumps(shown)}", flush=True)
    same = sum(a == b for a, b in zip(out["full"]["answers"], out["defaults"]["answers"], strict=True))
    out["defaults_same_as_full"] = same
    return out


def main() -> None:
    ap = options(
        __doc__, "out", models="smollm2-135m,gemma3-270m", chats=16, turns=3, doc_tokens=2600, in_flight=4,
        max_tokens=16, kv_gib=4.0, dtype="auto", whole_doc=True,
    )  # fmt: skip
    args = ap.parse_args()
    result = {"cpu": build.cpu_model(), "when": time.strftime("%Y-%m-%d %H:%M"),
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "models": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="model-chats-") as tmp:
        for model in args.models.split(","):
            result["models"][model] = run_model(model, args, Path(tmp))
    table = {m: {s: f"{r[s]['right_turn1']}/{args.chats} first, {r[s]['right_follow_ups']}/"
                    f"{args.chats * (args.turns - 1)} follow-ups" for s in SETTINGS}
             for m, r in result["models"].items()}  # fmt: skip
    print(json.dumps(table, indent=1))
    write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
