"""The compute dtype (engine/models/__init__.py ``resolve_dtype``): chosen at load, carried by weights,
activations and KV; a session's KV is valid only on the same dtype; a rebuild replays the same
tokens in bfloat16 as in float32 (tests/actors/test_rebuild_replay.py holds float32 to it for every policy)."""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine import Engine, load_model
from kvsnap.engine.models import fast_dtype, resolve_dtype
from kvsnap.errors import InvalidArgument
from kvsnap.service.config import ServiceConfig

from ...actors.test_rebuild_replay import AFTER, make_worker, open_session, run_turns, stored_kv

CPU = torch.device("cpu")


def test_dtype_choices_resolve_and_bad_ones_are_refused():
    assert resolve_dtype(None, CPU) == resolve_dtype("auto", CPU) == fast_dtype(CPU)  # the default
    assert resolve_dtype(None, CPU, tiny=True) == torch.float32
    assert resolve_dtype("auto", CPU, tiny=True) == torch.float32  # test presets: the exact dtype
    assert resolve_dtype("bfloat16", CPU, tiny=True) == torch.bfloat16
    assert resolve_dtype(torch.float32, CPU) == torch.float32
    with pytest.raises(InvalidArgument, match="unknown dtype 'fp8'.*auto, float32, bfloat16"):
        resolve_dtype("fp8", CPU)
    with pytest.raises(InvalidArgument, match="not supported"):
        resolve_dtype(torch.float16, CPU)
    with pytest.raises(ValueError, match="dtype"):
        ServiceConfig(dtype="fp8")
    assert ServiceConfig(dtype="bfloat16").dtype == "bfloat16"


def test_a_bf16_model_holds_bf16_kv_under_its_own_fingerprint():
    fp32, bf16 = load_model("tiny-llama"), load_model("tiny-llama", dtype="bfloat16")
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert fp32.weights == bf16.weights  # the same weights (a KVzap surrogate serves both) ...
    assert fp32.fingerprint != bf16.fingerprint  # ... but KV made in one dtype is not valid in the other
    engine = Engine(bf16, prefill_chunk=16)
    session = engine.new_session()
    engine.prefill(session, list(range(3, 40)))
    assert all(layer.keys.dtype == torch.bfloat16 for layer in session.cache.layers)
    with pytest.raises(InvalidArgument):
        Engine(fp32, prefill_chunk=16).check(session, [5], None)


@pytest.fixture(scope="module")
def bf16_engine() -> Engine:
    return Engine(load_model("tiny-gemma3", dtype="bfloat16"), prefill_chunk=16)


@pytest.mark.parametrize("spec", ["snapkv", "reselect"])
def test_a_rebuild_in_bf16_answers_like_the_uninterrupted_twin(spec, bf16_engine, directory_factory):
    twin = make_worker(bf16_engine, directory_factory(), "twin")
    assert (twin.stats()["dtype"], twin.stats()["device"]) == ("bfloat16", "cpu")  # what /health reports
    open_session(twin, "twin", spec)
    want = [tokens for tokens, _ in run_turns(twin, "twin", AFTER)]

    directory = directory_factory()
    first = make_worker(bf16_engine, directory, "w1")
    open_session(first, "s", spec)
    first.stop()
    second = make_worker(bf16_engine, directory, "w2")  # a replica kill: nothing but Redis
    got = run_turns(second, "s", AFTER)
    assert got[0][1] == "rebuilt"
    assert [tokens for tokens, _ in got] == want
    for a, b in zip(stored_kv(second, "s"), stored_kv(twin, "twin"), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same arithmetic, replayed in order
