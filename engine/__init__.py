"""The engine: one model prefilling, compressing and decoding on one session's KV, in-process
(no Ray, no Redis). Models, the session cache with its two lengths, sampling, detokenization."""

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
