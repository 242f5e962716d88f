"""What the peer bench (bench/peers/peer_bench.py) reports: each server's figures for a
multi-turn workload, and kvsnap's over vLLM's."""

from __future__ import annotations

import statistics


def summarize(rows: list[dict], rounds_s: list[float]) -> dict:
    def pct(xs, q):
        return round(statistics.quantiles(xs, n=10)[q - 1], 3) if len(xs) > 1 else round(xs[0], 3)

    first = [r["ttft_s"] for r in rows if r["turn"] == 1]
    later = [r["ttft_s"] for r in rows if r["turn"] > 1]
    round1 = sum(r["prompt_tokens"] for r in rows if r["turn"] == 1)
    return {
        "wall_s": round(sum(rounds_s), 2),
        "turn1_ttft_p50_s": pct(first, 5),
        "turn1_ttft_p90_s": pct(first, 9),
        "follow_up_ttft_p50_s": pct(later, 5) if later else None,
        "prefill_tok_s": round(round1 / rounds_s[0], 1),
        **prefilled_follow_ups(rows),
        "right": sum(r["right"] for r in rows),
        "right_turn1": sum(r["right"] for r in rows if r["turn"] == 1),
        "turns": len(rows),
    }


def prefilled_follow_ups(rows: list[dict]) -> dict:
    """Follow-ups' prefilled tokens (the server's count) against what they add to their chat."""
    later = [r for r in rows if r["turn"] > 1]
    if not later:
        return {}
    return {
        "follow_up_prefilled_p50": statistics.median(r["prefilled"] for r in later),
        "follow_up_prefilled_max": max(r["prefilled"] for r in later),
        "follow_up_new_tokens_p50": statistics.median(r["new_tokens"] for r in later),
        "follow_ups_prefilling_more_than_new": sum(r["prefilled"] > r["new_tokens"] for r in later),
        "follow_ups_rebuilt": sum(r["source"] == "rebuilt" for r in later),  # kvsnap: replayed the chat first
        "follow_ups": len(later),
    }


RATIOS = ("wall_s", "turn1_ttft_p50_s", "follow_up_ttft_p50_s", "prefill_tok_s", "decode_tok_s", "right")
RATIOS += ("first_ttft_p50_s", "later_ttft_p50_s")  # the shared workload's


def compare(vllm: dict, ours: dict) -> dict:
    """kvsnap / vLLM for every figure both have, and the share of equal answers."""
    out = {}
    for workload in vllm:
        a, b = vllm[workload], ours[workload]
        ratios = {k: round(b[k] / a[k], 3) for k in RATIOS if a.get(k) and b.get(k) is not None}
        answers_a, answers_b = a.get("answers") or a.get("texts"), b.get("answers") or b.get("texts")
        same = sum(x.strip() == y.strip() for x, y in zip(answers_a, answers_b, strict=True))
        out[workload] = ratios | {"same_answers": same, "requests": len(answers_a)}
    return out
