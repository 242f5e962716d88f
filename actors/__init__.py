"""The model worker, usable in-process without Ray: models, session KV, the engine."""

from .engine import Engine, TurnResult, TurnStream
from .models import DEFAULT_MODEL, TINY_PRESETS, LoadedModel, load_model
from .sampling import SamplingParams
from .session import Session, TurnReport

__all__ = [
    "DEFAULT_MODEL",
    "TINY_PRESETS",
    "Engine",
    "LoadedModel",
    "SamplingParams",
    "Session",
    "TurnReport",
    "TurnResult",
    "TurnStream",
    "load_model",
]
