"""The peer bench's ``decode`` workload (bench/peer_bench.py): short prompts generating at once,
both servers up together and the rounds alternating between them, so that this machine's
drifting speed falls on both alike."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peer_servers import KEY, Server, start_kvsnap, start_vllm


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


def group_cpu_s(server: Server) -> float:
    """CPU seconds used so far by the processes of ``server``'s session (itself and what it started)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == server.proc.pid:  # the session id: start_new_session made the server its leader
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def settle(server: Server, quiet_cpu_s: float = 0.05, timeout_s: float = 60.0) -> float:
    """Wait until ``server`` is idle (under ``quiet_cpu_s`` of CPU in half a second: vLLM's engine
    keeps polling for a few seconds after its last request); the seconds waited."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        before = group_cpu_s(server)
        time.sleep(0.5)
        if group_cpu_s(server) - before < quiet_cpu_s:
            break
    return round(time.perf_counter() - began, 1)


def decode_alternating(args, work: Path, folder: str) -> tuple[dict, dict]:
    """The ``decode`` workload with both servers up, rounds alternating (vLLM first in even rounds)."""
    vllm = start_vllm(folder, args.model, args.fit_kv_gib, args.threads, args.vllm_dtype, work)
    try:
        ours = start_kvsnap(args.model, args.fit_kv_gib, args.kvsnap_dtype, work, args.kvsnap_prefill_chunk)
    except BaseException:
        vllm.stop()
        raise
    servers = {"vllm": vllm, "kvsnap": ours}
    rounds: dict[str, list] = {"vllm": [], "kvsnap": []}
    try:
        for r in range(args.decode_rounds):
            order = ("vllm", "kvsnap") if r % 2 == 0 else ("kvsnap", "vllm")
            for name in order:
                other = servers["kvsnap" if name == "vllm" else "vllm"]
                waited = settle(other)
                idle0 = group_cpu_s(other)
                got = decode_phase(servers[name], args.model, args.chats, args.decode_tokens, 1 + r * args.chats)
                got["other_server_cpu_s"] = round(group_cpu_s(other) - idle0, 2)
                got["settle_s"] = waited
                rounds[name].append(got)
                print(f"{name} decode round {r + 1}: {got['decode_tok_s']} tok/s", flush=True)
    finally:
        ours.stop()
        vllm.stop()
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
