"""The peer bench's ``decode`` workload (bench/peers/peer_bench.py): short prompts generating at once,
both servers up together and the rounds alternating between them, so that this machine's
drifting speed falls on both alike."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peers.servers import KEY, Server, alternate, start_pair


def decode_phase(server: Server, model: str, count: int, tokens: int, first: int = 1) -> dict:
    import openai

    client = openai.OpenAI(base_url=server.url, api_key=KEY, timeout=1800, max_retries=0)
    parts = range(first, first + count)
    prompts = [f"Write a long story about a lighthouse keeper named Ada, part {i}." for i in parts]
    t0 = time.perf_counter()

    def one(prompt: str):
        messages = [{"role": "user", "content": prompt}]
        return client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0)

    with ThreadPoolExecutor(count) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    made = sum(d.usage.completion_tokens for d in done)
    return {"wall_s": round(wall, 2), "completion_tokens": made, "decode_tok_s": round(made / wall, 1),
            "texts": [d.choices[0].message.content for d in done]}  # fmt: skip


def decode_alternating(args, work: Path, folder: str) -> tuple[dict, dict]:
    """The ``decode`` workload with both servers up, rounds alternating (:func:`.alternate`)."""
    servers = start_pair(args, work, folder, args.fit_kv_gib)
    unsent = 1 + args.decode_rounds * args.chats  # the first prompt no measured round sends

    def run(name: str, server: Server, r: int) -> dict:
        return decode_phase(server, args.model, args.chats, args.decode_tokens, 1 + r * args.chats)

    def warm_up(server: Server) -> None:  # a first round each, not counted (both ran it slower)
        decode_phase(server, args.model, args.chats, args.decode_tokens, unsent)

    rounds = alternate(servers, args.decode_rounds, run, "decode", warm_up)
    out = {}
    for name, got in rounds.items():
        out[name] = {
            "decode_tok_s": statistics.median(g["decode_tok_s"] for g in got),
            "wall_s": statistics.median(g["wall_s"] for g in got),
            "rounds_tok_s": [g["decode_tok_s"] for g in got],
            "other_server_cpu_s": [g["other_server_cpu_s"] for g in got],
            "settle_s": [g["settle_s"] for g in got],
            "completion_tokens": got[0]["completion_tokens"],
            "texts": got[0]["texts"],  # the first round's: the same prompts to both
        }
    return out["vllm"], out["kvsnap"]
