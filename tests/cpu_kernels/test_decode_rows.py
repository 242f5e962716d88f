"""A bf16 step's one-token rows appended and attended in C (cpu_kernels/decode_rows.py): the same
bits as the operator path, taken by every row it can take, and nothing else changes."""

from __future__ import annotations

import threading

import pytest
import torch

from kvsnap.cpu_kernels import decode_attention, decode_rows
from kvsnap.engine import Engine, SamplingParams, batch, load_model
from kvsnap.engine.scheduler import Scheduler
from kvsnap.policies import make_policy

from ..conftest import random_tokens

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="KVSNAP_C_KERNELS=0: the operator path runs")

POLICIES = [
    make_policy("full"),
    make_policy("snapkv", budget=24, window=8, kernel=3),
    make_policy("h2o", budget=12, window=6),  # a decode-time evictor: its rows capture every full layer
]


def _run(name: str, fast: bool, monkeypatch) -> tuple[list[list[int]], list, list[int]]:
    """Turns of sessions of every policy in :data:`POLICIES`, submitted two steps apart so that
    steps mix prompt chunks with decode rows; their tokens, every cache layer's rows at the end,
    and the rows the C append took per call."""
    appended = []
    real = decode_rows.append
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(batch.BatchCache, "_fast_rows", lambda self, *a: [])
        m.setattr(decode_rows, "append", lambda index, *a: (appended.append(len(index)), real(index, *a))[1])
        engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=32)
        scheduler = Scheduler(engine, threading.RLock(), max_batch=8, start=False)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0)
        jobs, sessions = [], []
        for i, length in enumerate((5, 70, 120, 40, 140)):  # 120 + 24 crosses a buffer's 128 spare rows
            session = engine.new_session(POLICIES[i % len(POLICIES)])
            sessions.append(session)
            jobs.append(scheduler.submit(scheduler.job(engine.start(session, random_tokens(length, seed=i), params))))
            scheduler.run_step()
            scheduler.run_step()
        while not all(job.ended.is_set() for job in jobs):
            scheduler.run_step()
        tokens = [list(job) for job in jobs]
        layers = [
            [(layer.keys.clone(), layer.values.clone()) for layer in session.cache.layers] for session in sessions
        ]
    return tokens, layers, appended


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_decode_rows_give_the_operator_paths_tokens_and_cache_bits(name, monkeypatch):
    """Greedy turns with prompt chunks, decode rows, a decode-time evictor's capturing rows, a
    buffer that grows and (tiny-gemma3) sliding windows that move: the same tokens and every
    cache layer bit for bit, with and without the C append."""
    slow_tokens, slow_layers, slow_calls = _run(name, fast=False, monkeypatch=monkeypatch)
    fast_tokens, fast_layers, fast_calls = _run(name, fast=True, monkeypatch=monkeypatch)
    assert slow_calls == [] and fast_calls and max(fast_calls) >= 3  # rows of a layer share one call
    assert fast_tokens == slow_tokens
    for slow, fast in zip(slow_layers, fast_layers, strict=True):
        for (k0, v0), (k1, v1) in zip(slow, fast, strict=True):
            assert k0.shape == k1.shape and torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_decode_step_takes_every_row_but_capturing_ones(monkeypatch):
    """Each layer's C append takes the step's one-token rows but those that capture that layer
    (a decode-time evictor's), and prompt chunks never."""
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=32)
    plain = [engine.new_session(make_policy("full")) for _ in range(3)]
    evicting = engine.new_session(make_policy("h2o", budget=12, window=6))
    for i, session in enumerate([*plain, evicting]):
        engine.turn(session, random_tokens(20 + i, seed=i), SamplingParams(max_new_tokens=1))  # one token pending
    counts = []
    real = decode_rows.append
    monkeypatch.setattr(decode_rows, "append", lambda index, *a: (counts.append(len(index)), real(index, *a))[1])
    engine.decode_step([*plain, evicting], greedy=True)
    assert counts == [3] * engine.model.config.num_hidden_layers


def test_fast_rows_fall_back_to_views_where_the_kernel_cannot_take_them(monkeypatch):
    """Rows appended in C that attention does not give the kernel (here: as for a softcap, or
    fp16) become views of their layers and take SDPA, with the logits of the operator path."""
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=32)
    monkeypatch.setattr(batch, "_one_token_pays", lambda q: False)

    def logits(fast: bool) -> torch.Tensor:
        sessions = [engine.new_session(make_policy("full")) for _ in range(2)]
        for i, session in enumerate(sessions):
            engine.turn(session, random_tokens(30 + i, seed=9 + i), SamplingParams(max_new_tokens=1))
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(batch.BatchCache, "_fast_rows", lambda self, *a: [])
            return engine.decode_step(sessions)

    appended = []
    real = decode_rows.append
    monkeypatch.setattr(decode_rows, "append", lambda index, *a: (appended.append(len(index)), real(index, *a))[1])
    assert torch.equal(logits(True), logits(False))
    assert appended == [2] * engine.model.config.num_hidden_layers
