"""Engine invariants on the tiny presets (Llama-style GQA and Gemma3-style hybrid)."""

from __future__ import annotations

import math

import pytest
import torch

from kvsnap.engine import Engine, SamplingParams
from kvsnap.engine.cache import CompressedLayer
from kvsnap.errors import InvalidArgument
from kvsnap.policies import make_policy

from ..conftest import random_tokens

GREEDY = SamplingParams(max_new_tokens=6)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_full_policy_three_turns_equal_one_forward(tiny_engine: Engine):
    """Prefill, generate, append, generate, append: logits equal one pass over the transcript."""
    session = tiny_engine.new_session(make_policy("full"))
    tiny_engine.turn(session, random_tokens(45, seed=1), GREEDY)
    tiny_engine.turn(session, random_tokens(13, seed=2), GREEDY)
    logits = tiny_engine.prefill(session, random_tokens(9, seed=3))
    assert len(session.transcript) > 16  # longer than the hybrid preset's sliding window
    assert session.logical_len == len(session.transcript)
    assert max_diff(logits, tiny_engine.reference_logits(session.transcript)) < 1e-4


def test_chunked_prefill_equals_one_chunk(tiny_engine: Engine):
    tokens = random_tokens(70, seed=4)
    whole = Engine(tiny_engine.loaded, prefill_chunk=1000)
    a, b = tiny_engine.new_session("full"), whole.new_session("full")
    assert max_diff(tiny_engine.prefill(a, tokens), whole.prefill(b, tokens)) < 1e-4


def snapkv_session(engine: Engine, **params):
    policy = make_policy("snapkv", **({"budget": 12, "window": 6, "kernel": 3} | params))
    session = engine.new_session(policy, recompress="never")
    engine.prefill(session, random_tokens(60, seed=5))
    return session


def test_multi_token_append_equals_one_by_one(tiny_engine: Engine):
    """Appending N tokens at once onto a compressed cache equals appending them one at a time."""
    batch, single = snapkv_session(tiny_engine), snapkv_session(tiny_engine)
    assert batch.kept_len == 12 + 6 < batch.logical_len  # really compressed
    new = random_tokens(7, seed=6)
    at_once = tiny_engine.prefill(batch, new)
    for token in new:
        one_by_one = tiny_engine.prefill(single, [token])
    assert max_diff(at_once, one_by_one) < 1e-4
    for la, lb in zip(batch.cache.layers, single.cache.layers, strict=True):
        assert max_diff(la.keys, lb.keys) < 1e-4 and max_diff(la.values, lb.values) < 1e-4


def test_appended_tokens_see_the_kept_rows(llama_engine: Engine):
    """A compressed cache is not ignored: dropping more rows changes the next logits."""
    a = snapkv_session(llama_engine, budget=30)
    b = snapkv_session(llama_engine, budget=4)
    new = random_tokens(3, seed=8)
    assert max_diff(llama_engine.prefill(a, new), llama_engine.prefill(b, new)) > 1e-3


def test_snapkv_keeps_budget_plus_window_on_full_layers(tiny_engine: Engine):
    tokens = random_tokens(60, seed=5)
    full = tiny_engine.new_session("full")
    tiny_engine.prefill(full, tokens)
    session = snapkv_session(tiny_engine)
    for idx, layer in enumerate(session.cache.layers):
        if isinstance(layer, CompressedLayer):
            assert layer.keys.shape[-2] == 12 + 6
            # the observation window (the last 6 prompt rows) is kept unchanged
            assert max_diff(layer.keys[..., -6:, :], full.cache.layers[idx].keys[..., -6:, :]) == 0
        else:  # sliding-window layer: its own last rows, untouched by the policy
            assert layer.keys.shape[-2] == layer.sliding_window - 1
    assert session.logical_len == 60


def test_short_prompt_is_not_compressed(llama_engine: Engine):
    session = llama_engine.new_session(make_policy("snapkv", budget=50, window=8))
    llama_engine.prefill(session, random_tokens(58, seed=9))
    assert session.kept_len == 58


def test_chunked_prefill_selects_the_same_rows(llama_engine: Engine):
    """Window queries spanning a chunk boundary are captured whole."""
    tokens = random_tokens(61, seed=10)  # chunk 16: the 6-token window spans two chunks
    whole = Engine(llama_engine.loaded, prefill_chunk=1000)
    policy = make_policy("snapkv", budget=12, window=6, kernel=3)
    a, b = llama_engine.new_session(policy), whole.new_session(policy)
    llama_engine.prefill(a, tokens)
    whole.prefill(b, tokens)
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        assert max_diff(la.keys, lb.keys) < 1e-5


def test_per_turn_recompression_bounds_memory(llama_engine: Engine):
    session = llama_engine.new_session(make_policy("snapkv", budget=20, window=8, kernel=3))
    sampling = SamplingParams(max_new_tokens=5)
    llama_engine.turn(session, random_tokens(80, seed=11), sampling)
    for turn in range(4):
        result = llama_engine.turn(session, random_tokens(30, seed=12 + turn), sampling)
        assert result.report.kept_len <= 20 + 8 + sampling.max_new_tokens
    never = llama_engine.new_session(make_policy("snapkv", budget=20, window=8, kernel=3), recompress="never")
    llama_engine.turn(never, random_tokens(80, seed=11), sampling)
    for turn in range(4):
        llama_engine.turn(never, random_tokens(30, seed=12 + turn), sampling)
    assert never.kept_len > 20 + 8 + 4 * 30
    assert session.logical_len == never.logical_len


def test_report_accounts_bytes_exactly(tiny_engine: Engine):
    """KV bytes follow from the model config alone: rows x KV heads x head_dim x 2 (K and V) x 4 (fp32)
    per layer, where a full-attention layer holds budget + window rows plus the tokens fed back
    while decoding, and a sliding-window layer its last ``sliding_window - 1`` rows."""
    budget, window, prompt = 10, 4, 64
    session = tiny_engine.new_session(make_policy("snapkv", budget=budget, window=window, kernel=3))
    result = tiny_engine.turn(session, random_tokens(prompt, seed=13), GREEDY)
    report = result.report
    assert result.finish_reason == "length" and len(result.tokens) == GREEDY.max_new_tokens  # deterministic
    fed_back = len(result.tokens) - 1  # the last generated token is pending, not in the cache
    assert report.logical_len == prompt + fed_back

    config = tiny_engine.model.config
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    row_bytes = kv_heads * head_dim * 2 * 4  # one position: K and V of every KV head, fp32
    kept_rows = budget + window + fed_back
    sliding_rows = (getattr(config, "sliding_window", None) or 0) - 1
    want = want_full = 0
    for idx, kind in enumerate(layer_types):
        keys, values = session.cache.layers[idx].keys, session.cache.layers[idx].values
        rows = kept_rows if kind == "full_attention" else sliding_rows
        assert keys.shape == values.shape == (1, kv_heads, rows, head_dim), (idx, kind)
        assert keys.dtype == values.dtype == torch.float32
        want += rows * row_bytes
        want_full += (report.logical_len if kind == "full_attention" else sliding_rows) * row_bytes
    assert report.kv_bytes == session.kv_bytes == want
    assert report.full_kv_bytes == want_full > want
    assert report.kept_len == kept_rows
    assert report.prompt_tokens == prompt and report.generated_tokens == len(result.tokens)
    assert report.prefill_s > 0 and report.compress_s > 0 and report.decode_s >= 0


def test_generated_tokens_stay_in_the_transcript(llama_engine: Engine):
    session = llama_engine.new_session("full")
    prompt = random_tokens(20, seed=14)
    result = llama_engine.turn(session, prompt, SamplingParams(max_new_tokens=4))
    assert session.transcript == prompt + result.tokens
    assert session.pending == result.tokens[-1:]


def test_stream_closed_early_leaves_a_consistent_session(llama_engine: Engine):
    session = llama_engine.new_session("full")
    stream = llama_engine.stream(session, random_tokens(30, seed=15), SamplingParams(max_new_tokens=50))
    first = [next(iter(stream)) for _ in range(3)]
    stream.close()  # the client went away
    assert session.transcript[-3:] == first and stream.report.generated_tokens == 3
    logits = llama_engine.prefill(session, random_tokens(5, seed=16))
    assert max_diff(logits, llama_engine.reference_logits(session.transcript)) < 1e-4


def test_seeded_sampling_is_reproducible(llama_engine: Engine):
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=123)
    outs = []
    for _ in range(2):
        session = llama_engine.new_session("full")
        outs.append(llama_engine.turn(session, random_tokens(20, seed=17), params).tokens)
    assert outs[0] == outs[1] and len(outs[0]) >= 1


def test_stop_string_ends_the_turn(llama_engine: Engine):
    session = llama_engine.new_session("full")
    free = llama_engine.turn(session, random_tokens(20, seed=18), SamplingParams(max_new_tokens=8))
    text = free.text
    assert free.finish_reason == "length" and len(text) >= 3  # greedy on fixed weights: always enough text
    stop = text[:2]
    # greedy decoding is deterministic: the cut turn is the free one up to the first token whose
    # text completes the stop string, and not one token more
    n = next(i for i in range(1, len(free.tokens) + 1) if stop in llama_engine.decode(free.tokens[:i]))
    assert n < len(free.tokens)  # the stop string really cuts something off
    session = llama_engine.new_session("full")
    cut = llama_engine.turn(session, random_tokens(20, seed=18), SamplingParams(max_new_tokens=8, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.tokens == free.tokens[:n]
    assert stop in cut.text


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda e: make_policy("snapkv", budget=0), "budget must be >= 1"),
        (lambda e: make_policy("lru"), "unknown policy"),
        (lambda e: SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (lambda e: SamplingParams(temperature=math.nan), "temperature must be a finite number"),
        (lambda e: SamplingParams(top_p=0.0), "top_p must be in"),
        (lambda e: e.turn(e.new_session("full"), [], GREEDY), "prompt is empty"),
        (
            lambda e: e.turn(e.new_session(make_policy("snapkv", window=32)), [5] * 10, GREEDY),
            r"observation window \(32\) is longer than the prompt \(10",
        ),
        (lambda e: e.turn(e.new_session("full"), [5, 10_000], GREEDY), "token ids must be integers"),
        (lambda e: e.new_session("full", recompress="sometimes"), "recompress must be one of"),
    ],
)
def test_bad_parameters_raise_typed_errors(llama_engine: Engine, make, match):
    with pytest.raises(InvalidArgument, match=match):
        make(llama_engine)


def test_bad_turn_changes_nothing(llama_engine: Engine):
    session = llama_engine.new_session("full")
    llama_engine.turn(session, random_tokens(20, seed=19), GREEDY)
    before = (list(session.transcript), session.logical_len, session.turns)
    with pytest.raises(InvalidArgument):
        llama_engine.turn(session, [1, -4], GREEDY)
    assert (list(session.transcript), session.logical_len, session.turns) == before
