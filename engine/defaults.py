"""Each model's default session settings, in one place: chosen by measurement, per model.

The numbers come from ``kvsnap eval --tasks facts`` (documents of 2K-4K tokens in varied prose
stating facts once, asked one per turn over the chat template) swept against full KV on both
embedded models; docs/BENCHMARKS.md ("Fact retrieval: the defaults") has the sweep, the
command and why each default won. A model not listed gets ``GENERIC``.

Settings are the session API's (``POST /v1/sessions`` ``settings``): a policy name, its
parameters, ``recompress``. Layers of defaults overlay one another (:func:`overlay`): the
model's, then an operator's (``ServiceConfig.defaults``), then a caller's; a layer that names
another policy keeps only the window from below it (and recompresses per turn unless it says
otherwise), and one that sizes the selection (budget, ratio or tau) replaces the size below.
"""

from __future__ import annotations

GENERIC: dict = {"policy": "snapkv", "budget": 512, "window": 32, "kernel": 7, "pooling": "max", "spans": True}

# Both embedded models: SnapKV with sentence spans, re-selecting every turn from the full copy
# in the host tier. Spans bring turn 1 to full KV's accuracy (without them the selection keeps
# a fact's subject and drops digits of its value); re-selection answers the most follow-ups of
# every setting swept (each asks another fact than the turn before). No setting swept reaches
# 0.9 x full KV's follow-up accuracy at half its bytes on either model (BENCHMARKS).
MODEL_DEFAULTS: dict[str, dict] = {
    # 15 of 18 layers are sliding-window layers (512 rows) that no policy shrinks: the device
    # holds 0.53 x full KV's bytes at budget 512 whatever is chosen for the 3 full layers
    "gemma3-270m": GENERIC | {"recompress": "reselect"},
    # all 30 layers full attention: half of each layer's rows on the device (0.51 x full KV)
    "smollm2-135m": {k: v for k, v in GENERIC.items() if k != "budget"} | {"ratio": 0.5, "recompress": "reselect"},
}

SIZES = ("budget", "ratio", "tau")  # one of them sizes a selection


def default_settings(model: str) -> dict:
    """The measured defaults of ``model`` (``GENERIC`` for a model not measured), with ``recompress``."""
    return {"recompress": "per_turn"} | MODEL_DEFAULTS.get(model, GENERIC)


def overlay(below: dict, above: dict) -> dict:
    """Settings ``above`` over settings ``below`` (both with ``policy``; ``above``'s None values
    are unset). Another policy above keeps only ``window`` from below and recompresses per turn
    unless it says otherwise (the rest are the other policy's parameters, and re-selection does
    not combine with every policy); a size above (budget, ratio, tau) drops the sizes below."""
    above = {k: v for k, v in above.items() if v is not None}
    base = dict(below)
    if above.get("policy", base["policy"]) != base["policy"]:
        base = {k: base[k] for k in ("window",) if k in base} | {"recompress": "per_turn"}
    if any(k in above for k in SIZES):
        base = {k: v for k, v in base.items() if k not in SIZES}
    return base | above
