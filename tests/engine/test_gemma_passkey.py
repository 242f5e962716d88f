"""The embedded Gemma 3 270M, a real model: SnapKV keeps the planted pass key retrievable."""

from __future__ import annotations

import pytest

from kvsnap.engine import Engine, SamplingParams
from kvsnap.policies import make_policy
from kvsnap.tools.tasks import pass_key_prompt

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("depth", [0.2, 0.8])
def test_snapkv_budget_256_still_finds_the_pass_key(gemma_engine: Engine, depth: float):
    prompt = pass_key_prompt(gemma_engine.tokenizer, target_tokens=1500, depth=depth, seed=int(depth * 100))
    tokens = gemma_engine.encode(prompt.document + prompt.question)
    assert 1300 <= len(tokens) <= 1600

    session = gemma_engine.new_session(make_policy("snapkv", budget=256, window=32))
    result = gemma_engine.turn(session, tokens, SamplingParams(max_new_tokens=8))
    assert prompt.answer in result.text

    report = result.report
    # every full-attention layer holds budget + window (+ the generated tokens but the pending last one)
    assert report.kept_len == 256 + 32 + len(result.tokens) - 1
    full_layers = sum(t == "full_attention" for t in gemma_engine.model.config.layer_types)
    row_bytes = 2 * gemma_engine.model.config.num_key_value_heads * gemma_engine.model.config.head_dim
    row_bytes *= gemma_engine.model.dtype.itemsize  # the KV takes the model's dtype
    saved = full_layers * (report.logical_len - report.kept_len) * row_bytes
    assert report.full_kv_bytes - report.kv_bytes == saved > 0


def test_follow_up_turns_on_compressed_sessions_answer_the_pass_key(gemma_engine: Engine):
    """The question comes after compression (the first turn's observation window was the end of
    the filler), yet the pass key planted mid-document is among the rows SnapKV kept: follow-ups
    answer it from the compressed caches, prefilling only the new turn.

    Over 8 documents (seeds 3-10), not one: the last digit of a key sits at a near tie for this
    model in bf16, and kernels that sum in another order move it (seed 3 gave " 41190." with
    torch's SDPA and the AMX chunk kernel, " 4119." with the AVX-512 BF16 one; measured on the
    Zen 4: 6 of these 8 with the vector kernel, and full KV's follow-ups, which often start
    "the key is", answer 4 of 8 within the same 8 tokens)."""
    answered = []
    for seed in range(3, 11):
        prompt = pass_key_prompt(gemma_engine.tokenizer, target_tokens=1500, depth=0.5, seed=seed)
        session = gemma_engine.new_session(make_policy("snapkv", budget=256, window=32))
        gemma_engine.turn(session, gemma_engine.encode(prompt.document), SamplingParams(max_new_tokens=1))
        follow_up = gemma_engine.encode(prompt.question, first=False)
        result = gemma_engine.turn(session, follow_up, SamplingParams(max_new_tokens=8))
        assert result.report.prompt_tokens == len(follow_up) + 1  # only the new turn is prefilled
        assert session.logical_len > 1400 and session.kept_len < 400
        answered.append(prompt.answer in result.text)
    assert sum(answered) >= 5, answered
