"""The README's run command, as a new user meets it: the installed ``kvsnap serve`` with its real
defaults (the embedded Gemma 3 270M, an embedded Redis, a local Ray, the default data directory)
started from a fresh working directory, one turn over HTTP, then SIGTERM: a clean exit that
leaves no redis-server, HAProxy or Ray process of its own behind."""

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
from kvsnap.engine.models import dtype_name, fast_dtype, tokenizer_for

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
        assert (health["model"], health["dtype"]) == ("gemma3-270m", [fast]) and health["workers"] >= 1, health
        defaults = default_settings("gemma3-270m")  # no settings given: the model's measured defaults
        assert made.json()["policy"].startswith(f"{defaults['policy']}("), made.json()
        assert all(f"{k}={v}" in made.json()["policy"] for k, v in defaults.items() if k in ("ratio", "spans"))
        answer = requests.post(
            "http://127.0.0.1:8000/v1/sessions/readme/turns",
            json={"message": "What is the code of the blue door?", "max_tokens": 48},
            headers=headers,
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["completion_tokens"] >= 1 and body["source"] == "device" and body["state"]["turns"] == 2
        # a base model's answer ends at the template's next turn marker instead of writing the next question
        assert body["finish_reason"] == "stop" and "User:" not in body["text"], body
        # the session holds that marker already: the next question's is not prefilled a second time
        again = requests.post(
            "http://127.0.0.1:8000/v1/sessions/readme/turns",
            json={"message": "And the red door?", "max_tokens": 8},
            headers=headers,
            timeout=120,
        )
        assert again.status_code == 200, again.text
        tok = tokenizer_for("gemma3-270m")
        rest = tok.encode(" And the red door?\nAssistant:", add_special_tokens=False)
        assert again.json()["prompt_tokens"] == 1 + len(rest), again.json()  # the pending token, then the rest
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
