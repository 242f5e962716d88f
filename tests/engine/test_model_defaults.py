"""Each model's measured defaults (kvsnap.engine.defaults) and how the layers of defaults
overlay: the model's, an operator's, a caller's."""

from __future__ import annotations

import pytest

from kvsnap.engine.defaults import GENERIC, MODEL_DEFAULTS, default_settings, overlay
from kvsnap.errors import InvalidArgument
from kvsnap.policies import make_policy
from kvsnap.service.config import PolicyDefaults, ServiceConfig
from kvsnap.tools.specs import PolicySpec, spec_text


def test_every_embedded_model_has_defaults_that_build_a_policy_and_a_spec():
    from kvsnap.engine.models import EMBEDDED

    assert set(MODEL_DEFAULTS) == set(EMBEDDED)
    for model in [*EMBEDDED, "some/hf-model"]:
        settings = default_settings(model)
        params = {k: v for k, v in settings.items() if k not in ("policy", "recompress")}
        make_policy(settings["policy"], **params)  # valid parameters
        spec = PolicySpec.parse(spec_text(settings))  # and the eval can name them
        built, recompress, _ = spec.build(settings.get("window", 32))
        assert built == make_policy(settings["policy"], **params) and recompress == settings["recompress"]
    assert default_settings("some/hf-model") == {"recompress": "per_turn"} | GENERIC
    generic = default_settings("some/hf-model")  # a model never calibrated loses no row, however long
    assert not make_policy(generic["policy"]).compresses_anything and set(generic) == {"policy", "recompress"}


def test_the_defaults_keep_a_short_document_whole():
    """A share of a two-sentence document would drop digits of the number it states (Gemma 3 at
    ratio 0.5 answered '4800000...' for 48213): a prefix up to the floor's rows stays whole."""
    from kvsnap.engine.defaults import FLOOR

    for model in MODEL_DEFAULTS:
        settings = default_settings(model)
        policy = make_policy(
            settings["policy"], **{k: v for k, v in settings.items() if k not in ("policy", "recompress")}
        )
        assert not policy.compresses(FLOOR + policy.window) and policy.compresses(4 * FLOOR), model


def test_layers_overlay_the_size_and_the_policy_as_a_whole():
    model = {"policy": "kvzap", "ratio": 0.5, "kernel": 15, "spans": True, "window": 32, "recompress": "per_turn"}
    assert overlay(model, {}) == model
    sized = overlay(model, {"budget": 256, "kernel": None})  # a size replaces the size; None is unset
    assert sized == {k: v for k, v in model.items() if k != "ratio"} | {"budget": 256}
    # another policy keeps only the window from below: snapkv's own kernel and budget, per turn
    assert overlay(model, {"policy": "snapkv"}) == {"policy": "snapkv", "window": 32, "recompress": "per_turn"}
    reselecting = {"policy": "snapkv", "budget": 512, "recompress": "reselect", "spans": True}
    assert overlay(reselecting, {"policy": "kvzip"}) == {"policy": "kvzip", "recompress": "per_turn"}  # not a 400
    assert overlay(reselecting, {"budget": 64})["recompress"] == "reselect"  # the same policy: its defaults
    assert overlay(model, {"tau": -4.0})["tau"] == -4.0 and "ratio" not in overlay(model, {"tau": -4.0})
    floored = model | {"floor": 512}
    assert overlay(floored, {"floor": 64})["floor"] == 64 and overlay(floored, {"floor": 64})["ratio"] == 0.5
    assert "floor" not in overlay(floored, {"budget": 256})  # a budget is a count: the share's floor goes too


def test_the_service_defaults_are_the_models_with_the_operators_over_them():
    cfg = ServiceConfig(model="smollm2-135m")
    assert cfg.session_defaults() == default_settings("smollm2-135m")
    operator = ServiceConfig(model="smollm2-135m", defaults=PolicyDefaults(policy="streaming", window=8))
    assert operator.session_defaults() == {"policy": "streaming", "window": 8, "recompress": "per_turn"}
    sized = ServiceConfig(model="smollm2-135m", defaults=PolicyDefaults(budget=64)).session_defaults()
    assert sized["budget"] == 64 and "ratio" not in sized and sized["policy"] == cfg.session_defaults()["policy"]
    with pytest.raises(ValueError):
        PolicyDefaults(ratio=1.5)


def test_spec_text_says_what_a_spec_can_and_refuses_the_rest():
    assert spec_text({"policy": "kvzap", "ratio": 0.5, "kernel": 21, "spans": True}) == "kvzap:r0.5/k21/s"
    assert spec_text({"policy": "snapkv", "budget": 512, "kernel": 7, "recompress": "reselect"}) == "reselect:512"
    assert spec_text({"policy": "full", "recompress": "per_turn"}) == "full"
    floored = {"policy": "snapkv", "ratio": 0.5, "floor": 512, "spans": True, "recompress": "per_turn"}
    assert spec_text(floored) == "snapkv:r0.5/f512/s"
    assert PolicySpec.parse("snapkv:r0.5/f512/s").settings(32) == floored | {
        "window": 32,
        "kernel": 7,
        "pooling": "max",
    }
    assert PolicySpec.parse("kvzap:t-4/f64").settings(32)["floor"] == 64
    with pytest.raises(InvalidArgument, match="follows a share"):
        PolicySpec.parse("snapkv:512/f64")
    for bad in (
        {"policy": "snapkv", "budget": 8, "pooling": "avg"},
        {"policy": "snapkv", "budget": 8, "sinks": 2},
        {"policy": "snapkv", "budget": 8, "floor": 64},
    ):
        with pytest.raises(InvalidArgument):
            spec_text(bad)
