"""aiperf, a third-party multi-turn load tool (PyPI ``aiperf``, from its own virtualenv that
``make test`` makes in ``.aiperf/``), run unmodified against the test service in a test-sized
form: two conversations of three turns over chat and over flattened completions (its template
endpoint, the history joined by newlines), each with ``--session-header x-session-id`` and with
no session header. The long form, with timings, is bench/service/aiperf_bench.py (docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvsnap.engine.models import EMBEDDED
from kvsnap.store.directory import SessionDirectory

BENCH = Path(__file__).resolve().parents[2] / "bench" / "service" / "aiperf_bench.py"
spec = importlib.util.spec_from_file_location("aiperf_bench", BENCH)
aiperf_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aiperf_bench)

pytestmark = pytest.mark.slow  # the tokenizer aiperf synthesizes text with is the embedded Gemma's
CONVERSATIONS, TURNS = 2, 3


def _sessions(redis_url: str, tenant: str) -> int:
    directory = SessionDirectory(redis_url)
    return sum(1 for _ in directory.client.scan_iter(match=f"{directory.prefix}:s:{tenant}:*"))


@pytest.mark.parametrize("case", aiperf_bench.CASES)
def test_aiperf_conversations_reuse_their_sessions_with_and_without_a_header(service, case, tmp_path):
    if not aiperf_bench.AIPERF.exists():
        pytest.fail(f"aiperf is not installed at {aiperf_bench.AIPERF}: `make aiperf` (make test does it)")
    tokenizer = EMBEDDED["gemma3-270m"]()[0]
    records = aiperf_bench.profile(
        case, service.http, f"key-{case}", "tiny-llama", tokenizer, tmp_path / case,
        conversations=CONVERSATIONS, turns=TURNS, context=200, answer=6, timeout_s=600,
    )  # fmt: skip
    summary = aiperf_bench.per_turn(records, aiperf_bench.turn_tokens(service.redis_url, case))
    assert summary["errors"] == 0 and summary["requests"] == CONVERSATIONS * TURNS, summary
    # one session per conversation: found by its id, or by its content without one
    assert _sessions(service.redis_url, case) == CONVERSATIONS
    turns = summary["turns"]
    first = turns["1"]["prompt_tokens"]
    assert first > 500  # the ~200-token context (Gemma's tokens) in tiny-llama's byte tokens
    for t in range(2, TURNS + 1):
        row = turns[str(t)]
        assert row["requests"] == CONVERSATIONS
        # a follow-up prefills its question (and, flattened, the re-formatted answer), not the history
        assert row["prompt_tokens"] < 0.2 * first, turns
        assert row["input_tokens"] > turns["1"]["input_tokens"]  # aiperf did send the whole history
    assert all(r["metrics"]["output_sequence_length"]["value"] > 0 for r in records)  # every answer had text
