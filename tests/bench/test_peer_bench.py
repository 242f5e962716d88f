"""The peer bench's test-sized run (``make peer ARGS=--small``'s ``fit`` workload): vLLM's CPU
build (its own virtualenv, ``.vllm/``, which ``make test`` makes) and ``kvsnap serve`` up side by
side on the folder kvsnap converts the embedded SmolLM2 into, the same multi-turn chats sent to
both through the ``openai`` client. It checks that both servers answer the same requests, and
answer them alike; the timings are the long run's (bench/peers/peer_bench.py, docs/BENCHMARKS.md),
never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "peers" / "peer_bench.py"
VLLM_PYTHON = ROOT / ".vllm" / "bin" / "python"

pytestmark = pytest.mark.slow  # a real model on two real servers


def test_vllm_and_kvsnap_answer_the_same_chats_alike(tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM's CPU build is not installed at {VLLM_PYTHON}: `make peer` (make test does it)")
    out = tmp_path / "peer.json"
    cmd = [sys.executable, str(BENCH), "--small", "--workloads", "fit", "--out", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    vllm, ours = result["vllm"]["fit"], result["kvsnap"]["fit"]
    chats, turns = result["args"]["chats"], result["args"]["turns"]
    for side in (vllm, ours):  # every request answered, with text
        assert side["turns"] == chats * turns and len(side["answers"]) == chats * turns
        assert all(a.strip() for a in side["answers"]), side["answers"]
    same = result["ratios_kvsnap_over_vllm"]["fit"]
    assert same["requests"] == chats * turns
    # greedy on the same weights: most answers equal word for word (bfloat16 on two engines may
    # part at a near tie), and kvsnap finds as many of the facts asked as vLLM, less one at most
    assert same["same_answers"] * 2 >= same["requests"], (vllm["answers"], ours["answers"])
    assert ours["right"] >= vllm["right"] - 1, (vllm["answers"], ours["answers"])
    # without a session header, each follow-up resumed its chat: only its new tokens prefilled
    assert ours["follow_ups"] == chats * (turns - 1)
    assert ours["follow_ups_prefilling_more_than_new"] == 0 and ours["follow_ups_rebuilt"] == 0, ours
