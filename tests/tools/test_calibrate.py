"""``kvsnap calibrate``: the choice rule, the candidates, and a run whose file the engine and the
service's start-up line then take (a tiny random model: the mechanics, not its answers)."""

from __future__ import annotations

import json

import pytest

from kvsnap.engine import defaults
from kvsnap.service.config import ServiceConfig
from kvsnap.tools import calibrate, cli
from kvsnap.tools.serve import _defaults_line
from kvsnap.tools.specs import PolicySpec


def _row(turn1: float, follow_ups: float, held: float) -> dict:
    return {"per_turn": {"1": turn1}, "follow_up_accuracy": follow_ups, "held_bytes_mean": held,
            "full_kv_bytes_mean": 100.0}  # fmt: skip


def test_choose_takes_the_fewest_bytes_that_answer_as_full_kv_does():
    summary = {
        "full": _row(0.8, 1.0, 100),
        "snapkv:r0.25/f512/s": _row(0.8, 0.5, 25),  # follow-ups lost
        "snapkv:r0.5/f512/s": _row(0.77, 0.92, 50),  # 0.96x and 0.92x full KV's: holds
        "snapkv:r0.75/f512/s": _row(0.8, 1.0, 75),
        "kvzap:r0.5/f512/s": _row(0.70, 1.0, 50),  # first questions lost (0.875x)
    }
    best, table = calibrate.choose(summary, turn1=0.95, follow_ups=0.9)
    assert best == "snapkv:r0.5/f512/s"
    assert [r["policy"] for r in table][0] == "snapkv:r0.25/f512/s"  # least bytes first
    assert {r["policy"]: r["holds"] for r in table} == {
        "full": True, "snapkv:r0.25/f512/s": False, "snapkv:r0.5/f512/s": True, "snapkv:r0.75/f512/s": True,
        "kvzap:r0.5/f512/s": False,
    }  # fmt: skip
    del summary["snapkv:r0.5/f512/s"], summary["snapkv:r0.75/f512/s"]
    assert calibrate.choose(summary, turn1=0.95, follow_ups=0.9)[0] == "full"  # none holds: full KV


def test_candidates_sweep_kvzap_only_where_a_surrogate_ships():
    embedded = calibrate.candidates("smollm2-135m", (0.5, 0.25))
    assert embedded == ["full", "snapkv:r0.25/f512/s", "snapkv:r0.5/f512/s", "kvzap:r0.25/f512/s", "kvzap:r0.5/f512/s"]
    for other in ("tiny-llama", "/models/some folder", "Qwen/Qwen2.5-0.5B-Instruct"):
        assert calibrate.candidates(other, (0.5,)) == ["full", "snapkv:r0.5/f512/s"]
    mixed = calibrate.candidates("tiny-llama", (0.5,), (0.25, 0.125), (4, 2))
    assert mixed == ["full", "snapkv:r0.5/f512/s", *(f"snapkv:r{r}/s/q{b}" for b in (2, 4) for r in (0.125, 0.25))]
    for spec in embedded + mixed:
        PolicySpec.parse(spec)  # each a spec the eval runs


def test_bad_settings_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSNAP_DEFAULTS_DIR", str(tmp_path))
    bad_args = (["--ratios", "1.5"], ["--ratios", "0"], ["--turn1", "2"], ["--lengths", "100"], ["--keys", "1"],
                ["--bits", "3"], ["--mixed-ratios", "1.5"])  # fmt: skip
    for bad in bad_args:
        with pytest.raises(SystemExit, match="kvsnap calibrate: "):
            cli.main(["calibrate", "--model", "no-such-model-anywhere", *bad])
    assert not list(tmp_path.iterdir())


def test_a_calibration_is_what_the_engine_and_the_service_then_take(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSNAP_DEFAULTS_DIR", str(tmp_path))
    model = "tiny-llama"
    assert defaults.defaults_of(model)[0] == defaults.GENERIC  # never calibrated
    args = ["--lengths", "1024", "--seeds", "1", "--keys", "2", "--ratios", "0.5,0.25", "--mixed-ratios", "0.125"]
    assert cli.main(["calibrate", "--model", model, *args, "--bits", "4"]) == 0
    path = defaults.calibrated_path(model)
    result = json.loads(path.read_text())
    assert path.parent == tmp_path and result["model"] == model and result["weights"] == "tiny-llama-seed0"
    held = {r["policy"]: r["bytes_x_full"] for r in result["table"]}
    # measured from the sessions: a quarter of a 1K document's rows is under the floor of 512
    assert held["full"] == 1.0 and held["snapkv:r0.25/f512/s"] < held["snapkv:r0.5/f512/s"] < 0.9, held
    assert 0.125 < held["snapkv:r0.125/s/q4"] < 0.6, held  # an eighth bf16, the rest at 4 bits (with scales)
    assert list(held.values()) == sorted(held.values())  # the table: least bytes first
    holding = [r for r in result["table"] if r["holds"]]
    assert result["policy"] == min(holding, key=lambda r: r["bytes_x_full"])["policy"]
    assert result["settings"] == {k: v for k, v in PolicySpec.parse(result["policy"]).settings(32).items()
                                  if k != "recompress"}  # fmt: skip
    assert f"defaults for {model}: {result['policy']}" in capsys.readouterr().out

    assert defaults.default_settings(model) == {"recompress": "per_turn"} | result["settings"]
    assert ServiceConfig(model=model).session_defaults() == defaults.default_settings(model)
    line = _defaults_line(ServiceConfig(model=model))
    assert "calibrated on this model by kvsnap calibrate" in line and str(path) in line, line


def test_a_calibration_overrides_an_embedded_models_shipped_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSNAP_DEFAULTS_DIR", str(tmp_path))
    shipped, how = defaults.defaults_of("gemma3-270m")
    assert shipped == defaults.MODEL_DEFAULTS["gemma3-270m"] and "docs/BENCHMARKS.md" in how
    mine = {"policy": "snapkv", "ratio": 0.75, "floor": 512, "spans": True, "window": 32}
    defaults.calibrated_path("gemma3-270m").write_text(json.dumps({"settings": mine, "when": "2026-12-07 21:00"}))
    assert defaults.defaults_of("gemma3-270m")[0] == mine
    # a folder or an HF id gets a file name of its own, inside the defaults folder
    assert defaults.calibrated_path("/data/models/../qwen 0.5b").parent == tmp_path
    assert defaults.calibrated_path("Qwen/Qwen2.5-0.5B").name == "Qwen--Qwen2.5-0.5B.json"


def test_a_damaged_calibration_file_is_a_clear_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSNAP_DEFAULTS_DIR", str(tmp_path))
    path = defaults.calibrated_path("my-model")
    for text in ("{not json", json.dumps({"settings": {"ratio": 0.5}, "when": "x"}), json.dumps({"when": "x"})):
        path.write_text(text)
        with pytest.raises(ValueError, match="calibration file .*my-model.json cannot be read"):
            ServiceConfig(model="my-model").session_defaults()
