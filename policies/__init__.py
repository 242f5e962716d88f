"""KV compression policies, registered by name.

>>> make_policy("snapkv", budget=256, window=16)
SnapKV(window=16, budget=256, ratio=None, kernel=7, pooling='max', gqa_reduce='mean')
"""

from __future__ import annotations

import dataclasses
import json

from kvsnap.errors import InvalidArgument

from .base import Policy, gather_rows
from .eviction import EVICTION_POLICIES, LRU
from .full import FullKV
from .snapkv import SnapKV
from .streaming import StreamingLLM

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (FullKV, SnapKV, StreamingLLM)}


def make_policy(name: str, **params) -> Policy:
    """Build a registered policy; unknown names or parameters raise InvalidArgument listing the valid ones."""
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
    return json.dumps({"name": policy.name, "params": dataclasses.asdict(policy)}, sort_keys=True)


def policy_from_json(text: str) -> Policy:
    spec = json.loads(text)
    return make_policy(spec["name"], **spec["params"])


__all__ = [
    "EVICTION_POLICIES",
    "LRU",
    "POLICIES",
    "FullKV",
    "Policy",
    "SnapKV",
    "StreamingLLM",
    "gather_rows",
    "make_policy",
    "policy_from_json",
    "policy_to_json",
]
