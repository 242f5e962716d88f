"""The README's run command, as a new user meets it: the installed ``kvsnap serve`` with its real
defaults (the embedded SmolLM2-135M-Instruct with its chat template, an embedded Redis, a local
Ray, the default data directory) started from a fresh working directory; a short document's
question, then a follow-up about a 2K-token prose document with full KV and with the default
settings (the same right answer both ways); then SIGTERM: a clean exit that leaves no
redis-server, HAProxy or Ray process of its own behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch

from kvsnap.engine.defaults import default_settings
from kvsnap.engine.models import DEFAULT_MODEL, dtype_name, fast_dtype, tokenizer_for
from kvsnap.service.template import template_for
from kvsnap.tools.facts import facts_document

pytestmark = pytest.mark.slow

KVSNAP = Path(sys.executable).with_name("kvsnap")  # the console script `make run` runs
START_TIMEOUT_S = 420  # Ray, two replicas of the real model (and its one-time conversion on a new machine)
STOP_TIMEOUT_S = 150


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[str]:
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def test_kvsnap_serve_from_a_fresh_directory_answers_and_stops_cleanly(tmp_path):
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSNAP_", "RAY_"))}
    server = subprocess.Popen(
        [str(KVSNAP), "serve"],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)
    reader.start()
    family: dict[int, psutil.Process] = {}
    try:
        key = _wait_until_serving(server, lines)
        family.update({p.pid: p for p in _descendants(server.pid)})
        names = " ".join(p.name() for p in family.values())
        assert "redis-server" in names, names  # the embedded Redis is its own child
        said = "".join(lines)  # at start-up: which defaults a session gets, and that they were measured
        assert f"session defaults for {DEFAULT_MODEL}: snapkv:r0.875/f512/s (measured" in said, said[-3000:]
        assert "kernels: variant " in said or "kernels: none" in said, said[-3000:]  # which C kernels run

        headers = {"Authorization": f"Bearer {key}"}
        document = "The code of the blue door is 48213. The code of the red door is 99120."
        made = requests.post(
            "http://127.0.0.1:8000/v1/sessions",
            json={"session_id": "readme", "document": document},
            headers=headers,
            timeout=120,
        )
        assert made.status_code == 201, made.text
        deadline = time.monotonic() + 60  # the replica publishes its load with its heartbeat (every 2 s)
        while (health := requests.get("http://127.0.0.1:8000/health", timeout=10).json())["workers"] < 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        fast = dtype_name(fast_dtype(torch.device("cpu")))  # the default: bfloat16 on CPUs with AMX / AVX-512 BF16
        assert DEFAULT_MODEL == "smollm2-135m"  # instruction-tuned, with its own chat template
        assert (health["model"], health["dtype"]) == (DEFAULT_MODEL, [fast]) and health["workers"] >= 1, health
        defaults = default_settings(DEFAULT_MODEL)  # no settings given: the model's measured defaults
        assert made.json()["policy"].startswith(f"{defaults['policy']}("), made.json()
        assert all(f"{k}={v}" in made.json()["policy"] for k, v in defaults.items() if k in ("ratio", "spans"))
        answer = _turn(headers, "readme", "What is the code of the blue door?", 48)
        assert answer["completion_tokens"] >= 1 and answer["source"] == "device" and answer["state"]["turns"] == 2
        assert answer["finish_reason"] == "stop" and "48213" in answer["text"], answer  # it follows the template
        # the follow-up prefills only its own message under the chat template, not the conversation again
        again = _turn(headers, "readme", "And the red door?", 8)
        tok = tokenizer_for(DEFAULT_MODEL)
        rest = template_for(tok).encode([{"role": "user", "content": "And the red door?"}], first=False)
        assert again["prompt_tokens"] == len(rest), (again, len(rest))
        _prose_follow_up(headers, tok)
        # the KVzap surrogates shipped for the embedded model fit its weights as a fresh install loads them
        zap = requests.post(
            "http://127.0.0.1:8000/v1/sessions",
            json={"session_id": "zap", "document": document * 40, "settings": {"policy": "kvzap", "budget": 128}},
            headers=headers,
            timeout=120,
        )
        assert zap.status_code == 201, zap.text
        assert zap.json()["kept_len"] < zap.json()["logical_len"], zap.json()
        # the data directory is the default one, inside the working directory, with Redis's files in it
        assert (workdir / ".kvsnap" / "redis" / "redis.log").exists()
        assert list((workdir / ".kvsnap" / "redis").glob("appendonly*"))
        family.update({p.pid: p for p in _descendants(server.pid)})
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            code = "timeout"
        reader.join(timeout=5)
    output = "".join(lines)
    assert code == 0, f"exit {code}\n{output[-3000:]}"
    deadline = time.monotonic() + 30  # Ray's last helpers exit a moment after the driver
    while _alive(list(family.values())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(list(family.values())), f"left behind: {_alive(list(family.values()))}"


def _turn(headers: dict, session: str, message: str, max_tokens: int) -> dict:
    answer = requests.post(
        f"http://127.0.0.1:8000/v1/sessions/{session}/turns",
        json={"message": message, "max_tokens": max_tokens},
        headers=headers,
        timeout=300,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def _prose_follow_up(headers: dict, tok) -> None:
    """A user's chat over a 2K-token document in varied prose that states each fact once: the
    first question, then a follow-up about another fact, greedy. With full KV the model answers
    both (the document was chosen so); the default settings must give the very same answers."""
    doc = facts_document(tok, target_tokens=2048, facts=2, seed=2048)  # `kvsnap eval --tasks facts`' seed 0
    asked = [doc.facts[0].question, doc.facts[1].question]
    answers = {}
    for name, settings in (("full", {"policy": "full"}), ("defaults", {})):
        made = requests.post(
            "http://127.0.0.1:8000/v1/sessions",
            json={"session_id": f"prose-{name}", "document": doc.document, "settings": settings},
            headers=headers,
            timeout=120,
        )
        assert made.status_code == 201, made.text
        answers[name] = [_turn(headers, f"prose-{name}", q, 24)["text"] for q in asked]
    assert len(tok.encode(doc.document)) >= 2000
    for fact, text in zip(doc.facts, answers["full"], strict=True):
        assert fact.answer in text, (fact, answers)  # full KV answers each fact
    assert answers["defaults"] == answers["full"], answers


def _wait_until_serving(server: subprocess.Popen, lines: list[str]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"kvsnap serve exited with {server.returncode}:\n{''.join(lines)[-3000:]}")
        text = "".join(lines)
        found = re.search(r"API key \(tenant 'default'\): (\S+)", text)
        if found:
            try:
                if requests.get("http://127.0.0.1:8000/health", timeout=2).ok:
                    return found.group(1)
            except requests.ConnectionError:
                pass
        time.sleep(0.5)
    pytest.fail(f"kvsnap serve did not serve within {START_TIMEOUT_S} s:\n{''.join(lines)[-3000:]}")
