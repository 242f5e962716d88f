"""The KVzap surrogates shipped in policies/kvzap_weights/ serve the embedded models they were
trained on, in either dtype: the file's fingerprint is the loaded weights' (a digest of the
weights, not of the config's JSON, which carried transformers' version), and a kvzap session
keeps rows by them."""

from __future__ import annotations

import pytest

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.policies import make_policy
from kvsnap.policies.kvzap import trained_for, weights_path
from kvsnap.tools.facts import facts_document

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def model(request) -> str:
    return request.param


def test_the_shipped_surrogates_fit_the_embedded_model_in_either_dtype_and_compress(model, monkeypatch):
    """Loaded in float32, then in bf16 under another transformers version in the config's JSON
    (what moved the old fingerprint): the same weights, the shipped surrogates' own, and a
    kvzap session drops rows by them in each dtype."""
    from transformers import configuration_utils

    first = load_model(model, dtype="float32")
    json = first.model.config.to_json_string()
    monkeypatch.setattr(configuration_utils, "__version__", "0.0.0-another")
    again = load_model(model, dtype="bfloat16")
    assert again.model.config.to_json_string() != json  # the old fingerprint's input moved with the library
    assert again.weights == first.weights
    for loaded in (first, again):
        engine = Engine(loaded, prefill_chunk=512)
        for kind in ("linear", "mlp"):
            assert trained_for(weights_path(model, kind)) == loaded.weights, kind
        doc = facts_document(engine.tokenizer, target_tokens=700, facts=1, seed=7)
        tokens = engine.encode(doc.document + "\n" + doc.facts[0].question)
        session = engine.new_session(make_policy("kvzap", budget=128, window=32))
        engine.check(session, tokens, None)  # no "trained on another model" refusal
        engine.turn(session, tokens, SamplingParams(max_new_tokens=4))
        assert session.kept_len < session.logical_len  # the surrogate chose rows to drop
