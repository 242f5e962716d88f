"""Shared fixtures: one engine per tiny preset per test run, and the embedded model once."""

from __future__ import annotations

import pytest
import torch

from kvsnap.actors import Engine, load_model


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-gemma3"])
def tiny_engine(request) -> Engine:
    return Engine(load_model(request.param), prefill_chunk=16)


@pytest.fixture(scope="session")
def llama_engine() -> Engine:
    return Engine(load_model("tiny-llama"), prefill_chunk=16)


@pytest.fixture(scope="session")
def gemma_engine() -> Engine:
    """The embedded Gemma 3 270M (converted once into ~/.cache/kvsnap, then loaded in seconds)."""
    return Engine(load_model("gemma3-270m"), prefill_chunk=512)


def random_tokens(n: int, seed: int, low: int = 3, high: int = 300) -> list[int]:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
