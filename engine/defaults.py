"""Each model's default session settings, in one place: chosen by measurement, per model.

The numbers come from ``kvsnap eval --tasks facts`` (documents of 2K-4K tokens in varied prose
stating facts once, asked one per turn over the chat template) swept against full KV on both
embedded models; docs/BENCHMARKS.md ("Fact retrieval: the defaults") has the sweep, the
command and why each default won. A model not listed gets ``GENERIC``.

Settings are the session API's (``POST /v1/sessions`` ``settings``): a policy name, its
parameters, ``recompress``. Layers of defaults overlay one another (:func:`overlay`): the
model's, then an operator's (``ServiceConfig.defaults``), then a caller's; a layer that names
another policy keeps only the window from below it, and one that sizes the selection (budget,
ratio or tau) replaces the size from below it.
"""

from __future__ import annotations

GENERIC: dict = {"policy": "snapkv", "budget": 512, "window": 32, "kernel": 7, "pooling": "max", "spans": True}

MODEL_DEFAULTS: dict[str, dict] = {
    "gemma3-270m": GENERIC,
    "smollm2-135m": GENERIC,
}

SIZES = ("budget", "ratio", "tau")  # one of them sizes a selection


def default_settings(model: str) -> dict:
    """The measured defaults of ``model`` (``GENERIC`` for a model not measured), with ``recompress``."""
    return {"recompress": "per_turn"} | MODEL_DEFAULTS.get(model, GENERIC)


def overlay(below: dict, above: dict) -> dict:
    """Settings ``above`` over settings ``below`` (both with ``policy``; ``above``'s None values
    are unset). Another policy above keeps only ``window`` and ``recompress`` from below (the
    rest are the other policy's parameters); a size above (budget, ratio, tau) drops the sizes
    below."""
    above = {k: v for k, v in above.items() if v is not None}
    base = dict(below)
    if above.get("policy", base["policy"]) != base["policy"]:
        base = {k: base[k] for k in ("window", "recompress") if k in base}
    if any(k in above for k in SIZES):
        base = {k: v for k, v in base.items() if k not in SIZES}
    return base | above
