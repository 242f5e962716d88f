"""KV compression policies, registered by name.

>>> make_policy("snapkv", budget=256, window=16)
SnapKV(window=16, budget=256, ratio=None, floor=0, kernel=7, pooling='max', gqa_reduce='mean')

A ``decode`` parameter pairs a prefill policy with one that evicts while decoding:

>>> make_policy("snapkv", budget=256, decode={"policy": "h2o", "budget": 64}).decoder()
H2O(window=32, budget=64, ratio=None, floor=0)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
import types
import typing

from kvsnap.errors import InvalidArgument

from .base import POLICIES, Policy, gather_rows, step_attention, window_attention
from .decoding import Compose, Evictor, evictor_names
from .eviction import EVICTION_POLICIES, LRU, NextUse
from .full import FullKV
from .h2o import H2O
from .kvzap import KVzap
from .kvzip import KVzip
from .reselect import Reselect
from .scissorhands import Scissorhands
from .scored import ScoredPolicy, scored_policy
from .snapkv import SnapKV
from .streaming import StreamingLLM


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Make a policy class usable by name everywhere (one call; also a class decorator).

    ``cls`` is a dataclass deriving from :class:`Policy` with a unique ``name``. In a service,
    list the module that registers it in ``policy_modules`` (``KVSNAP_POLICY_MODULES``) so that
    every replica imports it."""
    if not (isinstance(cls, type) and issubclass(cls, Policy) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a Policy dataclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name) or name in RESERVED:
        raise ValueError(f"policy name {name!r}: 1-32 of a-z 0-9 _, starting with a letter, not {RESERVED}")
    known = POLICIES.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"policy name {name!r} is taken by {known.__module__}.{known.__qualname__}")
    POLICIES[name] = cls
    return cls


RESERVED = ("compose", "reselect", "base")  # wrappers, built from settings, not named
for _cls in (FullKV, SnapKV, StreamingLLM, H2O, Scissorhands, KVzip, KVzap):
    register_policy(_cls)


def policy_params(name: str) -> dict[str, type]:
    """The parameters of policy ``name``: field name -> its type (the first of a union)."""
    return dict(_params_of(_class(name)))


@functools.cache
def _params_of(cls: type[Policy]) -> dict[str, type]:
    """Read once per class (every session open and settings check asks; type hints are slow)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.init:
            kind = hints.get(f.name, str)
            if typing.get_origin(kind) in (typing.Union, types.UnionType):  # "float | None" -> float
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            out[f.name] = kind if kind in (bool, int, float, str) else str
    return out


def coerce_params(name: str, text: dict[str, str]) -> dict:
    """Parameters given as strings (gRPC's ``params`` map, CLI ``--param k=v``) as their types."""
    kinds = policy_params(name)
    out = {}
    for key, value in text.items():
        kind = kinds.get(key)
        if kind is None:
            raise InvalidArgument(f"policy {name!r} has no parameter {key!r}; valid: {sorted(kinds)}")
        try:
            out[key] = {bool: lambda v: v.lower() in ("1", "true", "yes"), int: int, float: float}.get(kind, str)(value)
        except ValueError:
            raise InvalidArgument(f"parameter {key!r} of {name!r} must be a {kind.__name__}, got {value!r}") from None
    return out


def import_policy_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import the modules that register policies of their own (a replica does it at start)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise InvalidArgument(f"policy module {module!r} cannot be imported: {exc}") from exc


def _class(name: str) -> type[Policy]:
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    return cls


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
    cls = _class(name)
    valid = policy_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise InvalidArgument(f"policy {name!r} has no parameter(s) {unknown}; valid: {sorted(valid)}")
    return cls(**params)


def policy_to_json(policy: Policy) -> str:
    """``{"name": ..., "params": {...}}``: what a session directory stores to rebuild the policy
    (a re-selection wrapper as ``{"name": "reselect", "params": {"inner": {...}}}``)."""
    return json.dumps(_to_dict(policy), sort_keys=True)


def _to_dict(policy: Policy) -> dict:
    if isinstance(policy, Reselect):
        return {"name": "reselect", "params": {"inner": _to_dict(policy.inner)}}
    if isinstance(policy, Compose):
        decode = {"policy": policy.decode.name, **dataclasses.asdict(policy.decode)}
        return {"name": policy.prefill.name, "params": dataclasses.asdict(policy.prefill) | {"decode": decode}}
    return {"name": policy.name, "params": dataclasses.asdict(policy)}


def policy_from_json(text: str) -> Policy:
    return _from_dict(json.loads(text))


def _from_dict(spec: dict) -> Policy:
    if spec["name"] == "reselect":
        return Reselect(inner=_from_dict(spec["params"]["inner"]))
    return make_policy(spec["name"], **spec["params"])


__all__ = [
    "EVICTION_POLICIES",
    "H2O",
    "LRU",
    "NextUse",
    "POLICIES",
    "Compose",
    "Reselect",
    "Evictor",
    "FullKV",
    "Policy",
    "KVzap",
    "KVzip",
    "Scissorhands",
    "ScoredPolicy",
    "SnapKV",
    "StreamingLLM",
    "gather_rows",
    "step_attention",
    "window_attention",
    "coerce_params",
    "evictor_names",
    "import_policy_modules",
    "make_policy",
    "policy_params",
    "register_policy",
    "scored_policy",
    "policy_from_json",
    "policy_to_json",
]
