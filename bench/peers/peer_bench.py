"""kvsnap against vLLM's CPU build on this machine: the same model folder, client and requests.

Both servers serve the folder kvsnap converts an embedded model into, fresh for each workload,
through the plain ``openai`` client: streaming chat, no session header, greedy. This machine's
speed moves by up to 1.7x within minutes, so for ``fit``, ``pressure`` and ``decode`` both
servers are up together and the rounds alternate between them (vLLM first in even rounds),
each once the other server is idle (vLLM's engine polls for seconds after its last request),
recording the CPU the idle server used meanwhile. Workloads (the same requests to both):

- ``fit``: --chats chats of --turns turns; each opens with a fact document (tools/facts.py:
  varied prose stating one fact per turn once) and asks about one fact per turn; turns go round
  by round over all chats, --in-flight requests at once. Both servers get room for every chat.
- ``pressure``: more chats (--pressure-chats, 2 turns) at equal KV memory: --kv-gib for vLLM's
  KV cache (VLLM_CPU_KVCACHE_SPACE) and for kvsnap's tiers (half on the device tier, half on the
  host; --kvsnap-kv-quant kivi4 quantizes the host tier's).
- ``decode``: --chats short prompts generating --decode-tokens each, all at once (decode tokens/s
  with that many sequences in the batch), --decode-rounds rounds with new prompts each (the
  same to both): medians, after one round on each server that is not counted (both servers'
  first round ran 25-40 % below their later ones: warm-up, not decoding).
- ``shared``: --chats chats over --shared-docs documents (shared documents for RAG): each chat
  opens with its document and a question of its own, then asks one follow-up. Each document's
  first chat goes first (all documents at once); then every other chat's first turn
  (--in-flight at once), then every follow-up. Turn-1 TTFT of the first chat on a document
  against the later ones on it (which a prefix cache serves), and follow-up TTFT. One server
  after the other: each phase depends on what the server cached in the earlier ones.

Per server and workload: wall time, turn-1 and follow-up TTFT (p50 / p90), prefill tokens/s
(the first round's prompt tokens over that round's wall time), decode tokens/s, answers right
(the fact's value in the answer), and the share of answers equal to the other server's. The
ratios are kvsnap / vLLM. vLLM runs from a virtualenv of its own (``make peer`` makes it:
``.vllm/``); ``--small`` is the test-sized run (2 chats, 2 turns, short documents).

Usage: python bench/peers/peer_bench.py [--model smollm2-135m] [--workloads fit,pressure,decode]
       [--out docs/results/peer_bench.json] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from harness.cli import write_json

from kvsnap.cpu_kernels import build
from peers.decode_workload import decode_alternating
from peers.figures import compare, prefilled_follow_ups, summarize
from peers.servers import KEY, Server, alternate, model_folder, start_kvsnap, start_pair, start_vllm


def chats(model: str, count: int, turns: int, doc_tokens: int, seed0: int) -> list[dict]:
    from kvsnap.engine.models import tokenizer_for
    from kvsnap.tools.facts import facts_document

    tok = tokenizer_for(model)
    out = []
    for i in range(count):
        doc = facts_document(tok, target_tokens=doc_tokens, facts=turns, seed=seed0 + i)
        out.append({"document": doc.document, "facts": doc.facts})
    return out


def ask(client, model: str, messages: list[dict], max_tokens: int, settings: dict | None = None) -> dict:
    """One streamed chat completion: its TTFT (first text), the answer, and the tokens the server
    says it prefilled: usage's ``prompt_tokens`` less ``cached_tokens`` (vLLM counts the whole
    prompt and its prefix-cache hits; kvsnap the turn's new tokens and those from shared rows,
    not the replay of a session it rebuilt first: ``source`` "rebuilt", kvsnap's own field).
    ``settings``: kvsnap's session settings (``extra_body={"kvsnap": ...}``), for kvsnap alone."""
    t0 = time.perf_counter()
    ttft, parts, usage, source = None, [], None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"kvsnap": settings} if settings else None,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        source = ((chunk.model_extra or {}).get("kvsnap") or {}).get("source", source)  # where its KV came from
    if usage is None:
        raise RuntimeError("the server sent no usage with include_usage")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "text": "".join(parts),
            "prefilled": usage.prompt_tokens - cached, "completion_tokens": usage.completion_tokens,
            "source": source}  # fmt: skip


def ask_in_chat(
    client, model: str, tok_count, history: list, last: list, chat: int, text: str, max_tokens: int,
    settings: dict | None = None,
):  # fmt: skip
    """Chat ``chat``'s next turn ``text``, asked (:func:`ask`) and recorded: its prompt's tokens,
    what it adds to the chat (:func:`new_tokens`), the chat's history and last turn."""
    messages = history[chat] + [{"role": "user", "content": text}]
    got = ask(client, model, messages, max_tokens, settings)
    got["prompt_tokens"] = tok_count(messages)
    got["new_tokens"] = new_tokens(got, last[chat])
    history[chat], last[chat] = messages + [{"role": "assistant", "content": got["text"]}], got
    return got


def new_tokens(turn: dict, previous: dict | None) -> int:
    """What a follow-up adds to its chat: its prompt's tokens less the previous prompt's and the
    previous answer's, plus that answer's last token (sampled, never run through the model, so
    no server holds its KV): all that a server which kept the chat's KV has to prefill. The
    whole prompt for a first turn."""
    if previous is None:
        return turn["prompt_tokens"]
    answer = previous["completion_tokens"]
    return turn["prompt_tokens"] - previous["prompt_tokens"] - answer + (answer > 0)


class Chats:
    """One server's side of a multi-turn workload, a round at a time: every chat's next turn,
    ``in_flight`` at once; each turn's figures and answers in ``rows``, each round's seconds in
    ``rounds_s``. ``settings``: kvsnap's session settings for every turn (kvsnap alone)."""

    def __init__(
        self, server: Server, model: str, convs: list[dict], in_flight: int, max_tokens: int,
        settings: dict | None = None,
    ):  # fmt: skip
        import openai

        self.client = openai.OpenAI(base_url=server.url, api_key=KEY, timeout=1800, max_retries=0)
        self.model, self.convs, self.in_flight, self.max_tokens = model, convs, in_flight, max_tokens
        self.settings = settings
        self.tok_count = _prompt_tokens(model)
        self.rows: list[dict] = []
        self.rounds_s: list[float] = []
        self.history: list[list] = [[] for _ in convs]
        self.last: list[dict | None] = [None for _ in convs]  # each chat's previous turn

    def one(self, i: int, turn: int) -> dict:
        conv = self.convs[i]
        fact = conv["facts"][turn]
        text = f"{conv['document']}\n\n{fact.question}" if turn == 0 else fact.question
        got = ask_in_chat(
            self.client, self.model, self.tok_count, self.history, self.last, i, text, self.max_tokens, self.settings
        )  # fmt: skip
        return got | {"chat": i, "turn": turn + 1, "right": fact.answer.lower() in got["text"].lower()}

    def round(self, turn: int) -> dict:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.in_flight) as pool:
            self.rows += list(pool.map(lambda i: self.one(i, turn), range(len(self.convs))))
        self.rounds_s.append(time.perf_counter() - t0)
        return {"seconds": round(self.rounds_s[-1], 2)}


def conversations_alternating(workload: str, args, work: Path, folder: str) -> dict[str, dict]:
    """``fit`` or ``pressure`` with both servers up, round by round: each round on vLLM and on
    kvsnap in turn (:func:`.alternate`), so that both meet the machine's speed of the moment."""
    count, turns = (args.pressure_chats, 2) if workload == "pressure" else (args.chats, args.turns)
    convs = chats(args.model, count, turns, args.doc_tokens, seed0=100)
    servers = start_pair(args, work, folder, args.kv_gib if workload == "pressure" else args.fit_kv_gib)
    sides = {name: Chats(srv, args.model, convs, args.in_flight, args.max_tokens) for name, srv in servers.items()}
    rounds = alternate(servers, turns, lambda name, server, r: sides[name].round(r), workload)
    out = {}
    for name, side in sides.items():
        idle = [g["other_server_cpu_s"] for g in rounds[name]]
        out[name] = summarize(side.rows, side.rounds_s) | {"other_server_cpu_s": idle}
        out[name]["answers"] = [r["text"] for r in side.rows]
        shown = {k: v for k, v in out[name].items() if k != "answers"}
        print(f"{name} {workload}: {json.dumps(shown)}", flush=True)
    return out


def _prompt_tokens(model: str):
    from kvsnap.engine.models import tokenizer_for
    from kvsnap.service.template import encode_messages

    tok, lock = tokenizer_for(model), threading.Lock()

    def count(messages: list[dict]) -> int:  # under kvsnap's template (the model's own where it has one)
        with lock:
            return len(encode_messages(tok, messages, first=True))

    return count


def shared_phase(server: Server, model: str, args) -> dict:
    """The ``shared`` workload: first chats on each document, then the later ones, then follow-ups."""
    import openai

    client = openai.OpenAI(base_url=server.url, api_key=KEY, timeout=1800, max_retries=0)
    per_doc = -(-args.chats // args.shared_docs)
    docs = chats(model, args.shared_docs, min(per_doc + 1, 8), args.doc_tokens, seed0=200)  # 8 facts at most
    chat_docs = [i % args.shared_docs for i in range(args.chats)]  # chat c reads document c % docs
    nth = [c // args.shared_docs for c in range(args.chats)]  # its place among its document's chats
    history: list[list[dict]] = [[] for _ in chat_docs]
    last: list[dict | None] = [None for _ in chat_docs]
    tok_count = _prompt_tokens(model)

    def one(c: int, turn: int) -> dict:
        doc = docs[chat_docs[c]]
        fact = doc["facts"][(nth[c] + turn) % len(doc["facts"])]  # its own questions, where there are enough
        text = f"{doc['document']}\n\n{fact.question}" if turn == 0 else fact.question
        got = ask_in_chat(client, model, tok_count, history, last, c, text, args.max_tokens)
        right = fact.answer.lower() in got["text"].lower()
        return got | {"chat": c, "turn": turn + 1, "first_on_doc": nth[c] == 0 and turn == 0, "right": right}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(args.in_flight, args.shared_docs)) as pool:
        firsts = [c for c in range(args.chats) if nth[c] == 0]
        rows = list(pool.map(lambda c: one(c, 0), firsts))
    with ThreadPoolExecutor(args.in_flight) as pool:
        rows += list(pool.map(lambda c: one(c, 0), [c for c in range(args.chats) if nth[c] > 0]))
        rows += list(pool.map(lambda c: one(c, 1), range(args.chats)))
    wall = time.perf_counter() - t0
    first = [r["ttft_s"] for r in rows if r["first_on_doc"]]
    later = [r["ttft_s"] for r in rows if r["turn"] == 1 and not r["first_on_doc"]]
    follow = [r["ttft_s"] for r in rows if r["turn"] == 2]
    later_prefilled = [r["prefilled"] for r in rows if r["turn"] == 1 and not r["first_on_doc"]]
    rows.sort(key=lambda r: (r["chat"], r["turn"]))
    return {
        "wall_s": round(wall, 2),
        "first_ttft_p50_s": round(statistics.median(first), 3),
        "later_ttft_p50_s": round(statistics.median(later), 3),
        "later_over_first": round(statistics.median(later) / statistics.median(first), 3),
        "follow_up_ttft_p50_s": round(statistics.median(follow), 3),
        "later_prefilled_p50": statistics.median(later_prefilled),
        **prefilled_follow_ups(rows),
        "right": sum(r["right"] for r in rows),
        "turns": len(rows),
        "answers": [r["text"] for r in rows],
    }


PREFIX_SHARE = 0.25  # of kvsnap's KV memory, the shared workload's shared prefixes (the rest: its tiers)


def shared_sequential(args, work: Path, folder: str) -> dict[str, dict]:
    """The ``shared`` workload on each server in turn, each from a fresh start (its phases depend
    on what the server cached in the earlier ones, so they do not alternate)."""
    out = {}
    for name in ("vllm", "kvsnap"):
        if name == "vllm":
            server = start_vllm(folder, args.model, args.fit_kv_gib, args.threads, args.vllm_dtype, work)
        else:
            server = start_kvsnap(
                args.model, args.fit_kv_gib, args.kvsnap_dtype, work, args.kvsnap_prefill_chunk,
                prefix_share=PREFIX_SHARE, kv_quant=args.kvsnap_kv_quant,
            )  # fmt: skip
        try:
            out[name] = shared_phase(server, args.model, args)
        finally:
            server.stop()
        shown = {k: v for k, v in out[name].items() if k != "answers"}
        print(f"{name} shared: {json.dumps(shown)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="fit,pressure,decode", type=lambda s: s.split(","))
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--pressure-chats", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=2350)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--shared-docs", type=int, default=2, help="the shared workload's documents")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=5, help="the decode workload's rounds per server")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="the pressure case's KV memory, both servers")
    ap.add_argument("--fit-kv-gib", type=float, default=4.0, help="the other workloads' KV memory")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--kvsnap-dtype", default="auto")
    ap.add_argument("--kvsnap-prefill-chunk", type=int, default=None, help="kvsnap's prefill chunk")
    ap.add_argument(
        "--kvsnap-kv-quant", default="none", choices=("none", "kivi4", "kivi2"), help="kvsnap's host tier quantization"
    )
    ap.add_argument("--small", action="store_true", help="the test-sized run: 2 chats x 2 turns, 600-token documents")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.small:
        args.chats, args.turns, args.pressure_chats, args.doc_tokens, args.decode_tokens = 2, 2, 3, 600, 16
        args.decode_rounds = 1
    if "shared" in args.workloads and args.chats <= args.shared_docs:
        ap.error(f"the shared workload needs more chats ({args.chats}) than --shared-docs ({args.shared_docs})")
    folder = model_folder(args.model)
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as tmp:
        work = Path(tmp)
        vllm, ours = {}, {}
        for workload in args.workloads:
            if workload == "decode":
                vllm[workload], ours[workload] = decode_alternating(args, work, folder)
            elif workload == "shared":
                both = shared_sequential(args, work, folder)
                vllm[workload], ours[workload] = both["vllm"], both["kvsnap"]
            else:
                both = conversations_alternating(workload, args, work, folder)
                vllm[workload], ours[workload] = both["vllm"], both["kvsnap"]
    result = {"model": args.model, "folder": folder, "cpu": build.cpu_model(), "when": time.strftime("%Y-%m-%d %H:%M"),
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "vllm": vllm, "kvsnap": ours, "ratios_kvsnap_over_vllm": compare(vllm, ours)}  # fmt: skip
    print(json.dumps(result["ratios_kvsnap_over_vllm"], indent=1))
    write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
