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

# Both embedded models: SnapKV with sentence spans, sized by a share of the document, per turn;
# the least share that answers what full KV answers, first questions and follow-ups (each asks
# another fact than the turn before), on the sweep in BENCHMARKS. Spans bring turn 1 to full
# KV's accuracy (without them the selection keeps a fact's subject and drops digits of its
# value); follow-ups need the share: below it a later turn's fact is gone. The floor keeps a
# short document whole (a share alone halves two sentences, and Gemma 3 then misread a number
# it was just told); at 2K-4K tokens the share is the larger, so the sweep's numbers hold.
FLOOR = 512  # prefix rows: GENERIC's budget, below which a share drops nothing
MODEL_DEFAULTS: dict[str, dict] = {
    # half of its 3 full-attention layers' rows answers as full KV does (0.72 x its bytes: its 15
    # sliding-window layers, 512 rows each, are not shrunk)
    "gemma3-270m": {k: v for k, v in GENERIC.items() if k != "budget"} | {"ratio": 0.5, "floor": FLOOR},
    # all 30 layers full attention: 7 / 8 of each layer's rows (0.88 x full KV's bytes); at
    # 3 / 4 or less it answers 8 of full KV's 11 follow-ups (re-selecting from a full copy
    # reaches 10 at 3 / 4 on the device, holding 1.75 x full KV with that copy)
    "smollm2-135m": {k: v for k, v in GENERIC.items() if k != "budget"} | {"ratio": 0.875, "floor": FLOOR},
}

SIZES = ("budget", "ratio", "tau")  # one of them sizes a selection


def default_settings(model: str) -> dict:
    """The measured defaults of ``model`` (``GENERIC`` for a model not measured), with ``recompress``."""
    return {"recompress": "per_turn"} | MODEL_DEFAULTS.get(model, GENERIC)


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
