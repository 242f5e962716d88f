"""Mixed precision (engine/cold.py): a selection decides a row's precision, not whether it is
kept. The rows SnapKV selects stay at the cache's precision; the rest are KIVI-quantized and
still read by every later query.

The reference is tests/engine/test_compressed_reference.py's: one uncached forward pass over the
whole transcript with its own attention, where every follow-up token reads the prefix rows of
a full-KV session in each full-attention layer, those its KV head did not keep quantized and
dequantized by KIVI (policies/kivi.py) in the same groups. Tiny random-weight models.
"""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine import Engine, load_model
from kvsnap.engine.cache import export_kv, import_kv
from kvsnap.engine.cold import export_cold, rest_kivi
from kvsnap.errors import InvalidArgument
from kvsnap.policies import Reselect, make_policy
from kvsnap.policies.kivi import dequantize
from kvsnap.store.blobs import KVBlob, blob_from_bytes, blob_to_bytes
from kvsnap.tools.specs import PolicySpec, spec_text

from ..conftest import random_tokens
from .test_compressed_reference import (
    ATOL,
    ATOL_BF16,
    BUDGET,
    FOLLOW_UP,
    WINDOW,
    build_masks,
    compressed_session,
    reference_logits,
    reference_models,  # noqa: F401 - a fixture
)

PROMPT = 80  # 80 - 12 = 68 rows left out per KV head: two key groups of 32 quantized, 4 not


def quantized_prefix(full, kept: dict, bits: int, dtype) -> dict:
    """Per full layer, the reference's prefix rows for follow-up tokens: the full session's,
    those a head did not keep through KIVI's quantize and dequantize (per head, in order)."""
    kivi = rest_kivi(make_policy("snapkv", rest=f"kivi{bits}"))
    rows = {}
    for idx, per_head in kept.items():
        keys, values = (t.clone() for t in (full.cache.layers[idx].keys, full.cache.layers[idx].values))
        for h, kept_rows in enumerate(per_head):
            left = [p for p in range(PROMPT) if p not in kept_rows]
            for t, per in ((keys, "channel"), (values, "token")):
                t[:, h : h + 1, left] = dequantize(*kivi.quantize(t[:, h : h + 1, left], per))
        rows[idx] = (PROMPT, keys.to(dtype), values.to(dtype))
    return rows


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixed_follow_up_equals_a_forward_that_quantizes_the_rows_left_out(
    tiny_engine: Engine,
    dtype,
    bits,
    reference_models,  # noqa: F811 - the fixture imported above
    monkeypatch,
):
    if dtype == "bfloat16":
        tiny_engine = Engine(load_model(tiny_engine.loaded.name, dtype=dtype), prefill_chunk=16)
    atol = ATOL if dtype == "float32" else ATOL_BF16
    model, config = reference_models(tiny_engine), tiny_engine.model.config
    prompt, follow_up = random_tokens(PROMPT, seed=41), random_tokens(FOLLOW_UP, seed=42)
    transcript = prompt + follow_up
    session, kept = compressed_session(tiny_engine, prompt, monkeypatch, rest=f"kivi{bits}")
    full = tiny_engine.new_session("full")
    tiny_engine.prefill(full, prompt)
    for idx in kept:
        layer = session.cache.layers[idx]
        assert layer.kept_len == BUDGET + WINDOW and layer.cold.rows == PROMPT - BUDGET - WINDOW
    every_row = build_masks(config, len(transcript), PROMPT, None)
    ref = reference_logits(model, transcript, every_row, prefix_rows=quantized_prefix(full, kept, bits, model.dtype))

    at_once = tiny_engine.prefill(session, follow_up)
    assert (at_once - ref[-1]).abs().max() < atol
    single, _ = compressed_session(tiny_engine, prompt, monkeypatch, rest=f"kivi{bits}")
    for n, token in enumerate(follow_up):  # one token at a time: the decode path
        assert (tiny_engine.prefill(single, [token]) - ref[PROMPT + n]).abs().max() < atol, n

    # the reference discriminates: the rows left out dropped, or read unquantized, are far off
    dropped = reference_logits(model, transcript, build_masks(config, len(transcript), PROMPT, kept))[-1]
    assert (dropped - ref[-1]).abs().max() > 10 * atol
    if dtype == "float32":
        unquantized = reference_logits(model, transcript, every_row)[-1]
        assert (unquantized - ref[-1]).abs().max() > 10 * atol


def test_mixed_bytes_are_the_rows_kept_plus_the_quantized_parts(llama_engine: Engine):
    prompt = random_tokens(200, seed=5)
    held = {}
    for rest in ("drop", "kivi4", "kivi2"):
        session = llama_engine.new_session(make_policy("snapkv", budget=16, window=8, rest=rest), "never")
        llama_engine.prefill(session, prompt)
        cold = export_cold(session.cache)
        assert (cold is None) == (rest == "drop")
        parts = [] if cold is None else cold[0]
        blob = KVBlob(export_kv(session.cache), session.logical_len, 1, cold=cold)
        assert session.kv_bytes == blob.nbytes == sum(t.numel() * t.element_size() for t in blob.tensors + parts)
        held[rest] = session.kv_bytes
    full = held["drop"] * 200 // 24  # every row at the cache's precision
    assert held["drop"] < held["kivi2"] < held["kivi4"] < full / 2


def test_mixed_rows_survive_a_tier_round_trip_bit_for_bit(llama_engine: Engine):
    """Exported, serialised (the disk tier, a drain's hand-over), imported: the follow-up's
    logits equal the held session's, and a damaged cold layout is refused."""
    engine, prompt, follow_up = llama_engine, random_tokens(120, seed=6), random_tokens(5, seed=7)
    policy = make_policy("snapkv", budget=16, window=8, rest="kivi4")
    held = engine.new_session(policy, "per_turn")
    engine.prefill(held, prompt)
    at_rest = KVBlob(export_kv(held.cache), held.logical_len, 3, cold=export_cold(held.cache))
    blob = blob_from_bytes(blob_to_bytes(at_rest))
    moved = engine.new_session(policy, "per_turn")
    moved.cache = import_kv(engine.model.config, blob.tensors, blob.logical_len, blob.cold)
    moved.logical_len, moved.transcript = held.logical_len, list(held.transcript)
    assert moved.kv_bytes == held.kv_bytes
    assert torch.equal(engine.prefill(moved, follow_up), engine.prefill(held, follow_up))
    parts, layout = blob.cold
    with pytest.raises(ValueError, match="parts"):
        import_kv(engine.model.config, blob.tensors, blob.logical_len, (parts[:-1], layout))


def test_rest_is_checked_and_said_in_specs():
    with pytest.raises(InvalidArgument, match="rest must be one of drop, kivi2, kivi4"):
        make_policy("snapkv", rest="kivi3")
    with pytest.raises(InvalidArgument, match="rest must be drop"):
        Reselect(inner=make_policy("snapkv", rest="kivi4"))
    spec = PolicySpec.parse("snapkv:r0.125/s/q4")
    settings = spec.settings(32)
    assert settings["rest"] == "kivi4" and spec_text(settings) == "snapkv:r0.125/s/q4"
    with pytest.raises(InvalidArgument, match="no /q"):
        PolicySpec.parse("reselect:r0.25/q2")
    assert rest_kivi(make_policy("snapkv")) is None and rest_kivi(make_policy("snapkv", rest="kivi2")).bits == 2
