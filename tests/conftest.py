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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server process for the test run (the embedded one kvsnap starts)."""
    from kvsnap.actors.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def directory_factory(redis_server, request):
    """Directories on the shared server, namespaced per test so tests never see each other's keys."""
    from kvsnap.actors.directory import SessionDirectory

    prefix = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[-60:]

    def make(url: str | None = None, **kwargs) -> SessionDirectory:
        return SessionDirectory(url or redis_server.url, prefix=prefix, **kwargs)

    return make
