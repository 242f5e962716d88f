"""KV compression policies, registered by name.

>>> make_policy("snapkv", budget=256, window=16)
SnapKV(window=16, budget=256, ratio=None, kernel=7, pooling='max', gqa_reduce='mean')

A ``decode`` parameter pairs a prefill policy with one that evicts while decoding:

>>> make_policy("snapkv", budget=256, decode={"policy": "h2o", "budget": 64}).decoder()
H2O(window=32, budget=64, ratio=None)
"""

from __future__ import annotations

import dataclasses
import json

from kvsnap.errors import InvalidArgument

from .base import Policy, gather_rows, step_attention, window_attention
from .decoding import EVICTOR_NAMES, Compose, Evictor
from .eviction import EVICTION_POLICIES, LRU
from .full import FullKV
from .h2o import H2O
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming import StreamingLLM

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (FullKV, SnapKV, StreamingLLM, H2O, Scissorhands)}


def make_policy(name: str, decode: dict | None = None, **params) -> Policy:
    """Build a registered policy; unknown names or parameters raise InvalidArgument listing the valid ones.

    ``decode`` (``{"policy": <evictor>, **its params}``) wraps the policy in a :class:`Compose`
    whose decode-time eviction is that evictor's."""
    if decode is not None:
        if not isinstance(decode, dict) or not isinstance(decode.get("policy"), str):
            raise InvalidArgument('decode must be an object naming its policy: {"policy": "h2o", ...}')
        spec = dict(decode)
        decoder = make_policy(spec.pop("policy"), **spec)
        return Compose(prefill=make_policy(name, **params), decode=decoder)
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - valid)
    if unknown:
        raise InvalidArgument(f"policy {name!r} has no parameter(s) {unknown}; valid: {sorted(valid)}")
    return cls(**params)


def policy_to_json(policy: Policy) -> str:
    """``{"name": ..., "params": {...}}``: what a session directory stores to rebuild the policy."""
    if isinstance(policy, Compose):
        decode = {"policy": policy.decode.name, **dataclasses.asdict(policy.decode)}
        params = dataclasses.asdict(policy.prefill) | {"decode": decode}
        return json.dumps({"name": policy.prefill.name, "params": params}, sort_keys=True)
    return json.dumps({"name": policy.name, "params": dataclasses.asdict(policy)}, sort_keys=True)


def policy_from_json(text: str) -> Policy:
    spec = json.loads(text)
    return make_policy(spec["name"], **spec["params"])


__all__ = [
    "EVICTION_POLICIES",
    "EVICTOR_NAMES",
    "H2O",
    "LRU",
    "POLICIES",
    "Compose",
    "Evictor",
    "FullKV",
    "Policy",
    "Scissorhands",
    "SnapKV",
    "StreamingLLM",
    "gather_rows",
    "step_attention",
    "window_attention",
    "make_policy",
    "policy_from_json",
    "policy_to_json",
]
