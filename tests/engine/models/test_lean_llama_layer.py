"""engine/models/lean.py: a bf16 CPU Llama layer's forward without transformers' module calls gives
transformers' bits (RoPE in C included), and is installed only where it applies."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvsnap.cpu_kernels import fused_ops
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.models import lean
from kvsnap.engine.scheduler import Scheduler
from kvsnap.policies import make_policy

from ...conftest import random_tokens

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="KVSNAP_C_KERNELS=0: transformers' layers run")


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rope_is_transformers_bit_for_bit(tokens):
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(1, tokens, 9 * 64, generator=gen) * 3).bfloat16()
    y = (torch.randn(1, tokens, 3 * 64, generator=gen) * 3).bfloat16()
    q, k = x.view(1, tokens, 9, 64).transpose(1, 2), y.view(1, tokens, 3, 64).transpose(1, 2)  # as the layer's views
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(tokens)[None] + 5000)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = fused_ops.rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_installed_on_bf16_llama_layers_only():
    loaded = load_model("tiny-llama", dtype="bfloat16")
    layers = loaded.model.config.num_hidden_layers
    assert sum("forward" in m.__dict__ for m in loaded.model.model.layers) == layers  # at load
    assert lean.install(loaded.model) == 0  # installed already
    assert lean.install(load_model("tiny-llama").model) == 0  # float32
    assert lean.install(load_model("tiny-gemma3", dtype="bfloat16").model) == 0  # another architecture


def _turns(engine: Engine, policies) -> tuple[list[list[int]], list]:
    """Greedy turns of sessions under ``policies``, staggered so steps mix prompt chunks and
    decode rows; their tokens and every cache layer's rows."""
    scheduler = Scheduler(engine, threading.RLock(), max_batch=8, start=False)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0)
    jobs, sessions = [], []
    for i, policy in enumerate(policies):
        session = engine.new_session(policy)
        sessions.append(session)
        jobs.append(scheduler.submit(scheduler.job(engine.start(session, random_tokens(40 + 30 * i, seed=i), params))))
        scheduler.run_step()
    while not all(job.ended.is_set() for job in jobs):
        scheduler.run_step()
    layers = [[(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers] for s in sessions]
    return [list(job) for job in jobs], layers


def test_lean_layers_give_transformers_bits(monkeypatch):
    """Whole prompts' logits, and greedy turns (prompt chunks beside decode rows, SnapKV, a
    decode-time evictor, KVzip+, whose scratch pass takes transformers' forward): the same bits and
    tokens with lean layers as with transformers' own (fused norms both ways)."""
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=32)
    model = engine.model
    prompts = torch.tensor([random_tokens(50, seed=s) for s in range(3)])
    with torch.inference_mode():  # three sequences: transformers' forward (RoPE in C takes one)
        assert torch.equal(model(prompts).logits[:1], model(prompts[:1]).logits)
    policies = [
        make_policy("full"),
        make_policy("snapkv", budget=24, window=8, kernel=3),
        make_policy("h2o", budget=12, window=6),
        make_policy("kvzip", budget=20, window=8),
    ]
    ropes = []
    real = fused_ops.rope
    monkeypatch.setattr(fused_ops, "rope", lambda q, *a: (ropes.append(q.shape[2]), real(q, *a))[1])
    with torch.inference_mode():
        lean_logits = model(prompts[:1]).logits  # one sequence: the lean forward
    lean_run = _turns(engine, policies)
    layers = model.config.num_hidden_layers
    assert ropes[:layers] == [50] * layers and 1 in ropes  # the prompt, then prompt chunks and decode rows
    lean.uninstall(model)
    try:
        with torch.inference_mode():
            plain_logits = model(prompts[:1]).logits
        plain_run = _turns(engine, policies)
    finally:
        lean.install(model)
    assert torch.equal(lean_logits, plain_logits)
    assert lean_run[0] == plain_run[0]
    for a, b in zip(lean_run[1], plain_run[1], strict=True):
        for (k0, v0), (k1, v1) in zip(a, b, strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
