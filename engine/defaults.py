"""Each model's default session settings, in one place: chosen by measurement, per model.

The numbers come from ``kvsnap eval --tasks facts`` (documents of 2K-4K tokens in varied prose
stating facts once, asked one per turn over the chat template) swept against full KV on both
embedded models; docs/POLICIES.md ("Defaults, measured per model") has the sweep and why each
default won, docs/BENCHMARKS.md ("The two embedded models on the fact task") the latest run.
Any other model gets the defaults ``kvsnap calibrate``
measured for it on this machine (a file in :func:`calibrated_dir`), or ``GENERIC`` where it was
never calibrated.

Settings are the session API's (``POST /v1/sessions`` ``settings``): a policy name, its
parameters, ``recompress``. Layers of defaults overlay one another (:func:`overlay`): the
model's, then an operator's (``ServiceConfig.defaults``), then a caller's; a layer that names
another policy keeps only the window from below it (and recompresses per turn unless it says
otherwise), and one that sizes the selection (budget, ratio or tau) replaces the size below.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# Each embedded model's default is SnapKV with sentence spans, sized by a share of the document,
# per turn: the least share that answers what full KV answers, first questions and follow-ups
# (each asks another fact than the turn before), on the sweep in BENCHMARKS. Spans bring turn 1 to full
# KV's accuracy (without them the selection keeps a fact's subject and drops digits of its
# value); follow-ups need the share: below it a later turn's fact is gone. The floor keeps a
# short document whole (a share alone halves two sentences, and Gemma 3 then misread a number
# it was just told); at 2K-4K tokens the share is the larger, so the sweep's numbers hold.
SNAPKV_SPANS: dict = {"policy": "snapkv", "window": 32, "kernel": 7, "pooling": "max", "spans": True}
FLOOR = 512  # prefix rows below which a share drops nothing

# A model never calibrated: full KV, which held on every model measured (the sweeps of `kvsnap
# calibrate` on SmolLM2, Gemma 3 and Qwen2.5-Coder-0.5B, BENCHMARKS). Of the settings that drop
# rows none held on all three; mixed precision at 1 / 16 of the rows bf16 and the rest at 4 bits
# did (0.37x, 0.65x, 0.38x of the bytes), but a prompt chunk still dequantizes those rows in
# torch, so it waits for the chunk kernel and a peer-bench run before it is anyone's default.
# A fixed budget of 512 rows, the generic default before, answered 4 of SmolLM2's 12 follow-ups
# where full KV answered 11. `kvsnap calibrate --model` measures a model's own.
GENERIC: dict = {"policy": "full"}

MODEL_DEFAULTS: dict[str, dict] = {
    # half of its 3 full-attention layers' rows answers as full KV does (0.72 x its bytes: its 15
    # sliding-window layers, 512 rows each, are not shrunk)
    "gemma3-270m": SNAPKV_SPANS | {"ratio": 0.5, "floor": FLOOR},
    # all 30 layers full attention: 7 / 8 of each layer's rows (0.88 x full KV's bytes); at
    # 3 / 4 or less it answers 8 of full KV's 11 follow-ups (re-selecting from a full copy
    # reaches 10 at 3 / 4 on the device, holding 1.75 x full KV with that copy)
    "smollm2-135m": SNAPKV_SPANS | {"ratio": 0.875, "floor": FLOOR},
}

SIZES = ("budget", "ratio", "tau")  # one of them sizes a selection


def default_settings(model: str) -> dict:
    """The measured defaults of ``model`` (:func:`defaults_of`), with ``recompress``."""
    return {"recompress": "per_turn"} | defaults_of(model)[0]


def defaults_of(model: str) -> tuple[dict, str]:
    """``model``'s defaults and where they come from: its calibration on this machine (``kvsnap
    calibrate``'s file, which also overrides a shipped measurement), the measurement shipped for
    an embedded model, or ``GENERIC``."""
    path = calibrated_path(model)
    if path.is_file():
        try:
            found = json.loads(path.read_text())
            settings, when = dict(found["settings"]), str(found["when"])
            if not isinstance(settings.get("policy"), str):
                raise ValueError("its settings name no policy")
        except (OSError, ValueError, KeyError, TypeError) as exc:  # json's errors are ValueErrors
            raise ValueError(
                f"the calibration file {path} cannot be read ({exc}): run kvsnap calibrate --model {model} "
                "again, or delete it"
            ) from exc
        return settings, f"calibrated on this model by kvsnap calibrate, {when}: {path}"
    if model in MODEL_DEFAULTS:
        return MODEL_DEFAULTS[model], "measured on this model against full KV: docs/BENCHMARKS.md"
    return GENERIC, "generic: not measured on this model; kvsnap calibrate --model <it> measures them"


def calibrated_dir() -> Path:
    """Where ``kvsnap calibrate`` writes a model's defaults and the engine reads them:
    ``KVSNAP_DEFAULTS_DIR``, default ``<KVSNAP_CACHE_DIR>/defaults`` (``~/.cache/kvsnap/defaults``)."""
    if os.environ.get("KVSNAP_DEFAULTS_DIR"):
        return Path(os.environ["KVSNAP_DEFAULTS_DIR"])
    return cache_root() / "defaults"


def cache_root() -> Path:
    """kvsnap's cache folder: ``KVSNAP_CACHE_DIR``, default ``~/.cache/kvsnap`` (converted models, calibrations)."""
    return Path(os.environ.get("KVSNAP_CACHE_DIR", Path.home() / ".cache" / "kvsnap"))


def calibrated_path(model: str) -> Path:
    """The calibration file of ``model`` (an embedded model's name, an HF id or a folder)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", model).strip("-.") or "model"
    return calibrated_dir() / f"{slug}.json"


def overlay(below: dict, above: dict) -> dict:
    """Settings ``above`` over settings ``below`` (both with ``policy``; ``above``'s None values
    are unset). Another policy above keeps only ``window`` from below and recompresses per turn
    unless it says otherwise (the rest are the other policy's parameters, and re-selection does
    not combine with every policy); a size above (budget, ratio, tau) drops the sizes below
    and their ``floor``."""
    above = {k: v for k, v in above.items() if v is not None}
    base = dict(below)
    if above.get("policy", base["policy"]) != base["policy"]:
        base = {k: base[k] for k in ("window",) if k in base} | {"recompress": "per_turn"}
    if any(k in above for k in SIZES):  # a size replaces the size below, its floor with it
        base = {k: v for k, v in base.items() if k not in (*SIZES, "floor")}
    return base | above
