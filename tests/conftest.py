"""Shared fixtures: one engine per tiny preset per test run, and the embedded model once."""

from __future__ import annotations

import os

# a kernel variant that does not compile fails the run (in a service it would log and fall back);
# set before anything loads the kernels, in this process and the replicas it starts
os.environ["KVSNAP_KERNELS_STRICT"] = "1"

from kvsnap.service.config import ray_environment  # noqa: E402

ray_environment()  # the Ray Serve data path `kvsnap serve` uses; set before any test module imports Ray

import pytest  # noqa: E402
import torch  # noqa: E402

from kvsnap.cpu_kernels import build  # noqa: E402
from kvsnap.engine import Engine, load_model  # noqa: E402


def pytest_sessionstart(session) -> None:
    """Every kernel variant this compiler targets is built before any test runs (compile only
    where this CPU lacks its instructions), one line each, also under ``-q``; a build error
    (``KVSNAP_KERNELS_STRICT=1``: warnings too) stops the run."""
    if build.compiler() is None:
        raise pytest.UsageError("no C compiler (cc or CC): the kernels cannot be built or tested")
    lines = []
    for variant, path in build.compile_all().items():
        runs = "runs here" if build.runs_here(variant) else "compile only: this CPU lacks its instructions"
        lines.append(f"kernels {variant}: built {path.name} ({runs})")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in [*lines, f"kernels: this machine runs {build.chosen()}"]:
        reporter.write_line(line) if reporter else print(line)


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-gemma3"])
def tiny_engine(request) -> Engine:
    return Engine(load_model(request.param), prefill_chunk=16)


@pytest.fixture(scope="session")
def llama_engine() -> Engine:
    return Engine(load_model("tiny-llama"), prefill_chunk=16)


@pytest.fixture(scope="session")
def gemma_engine() -> Engine:
    """The embedded Gemma 3 270M (converted once into ~/.cache/kvsnap, then loaded in seconds),
    in its default dtype (bfloat16 on CPUs with AMX / AVX-512 BF16)."""
    return Engine(load_model("gemma3-270m"), prefill_chunk=512)


@pytest.fixture(scope="session")
def gemma_fp32_engine() -> Engine:
    """The embedded Gemma 3 270M in float32: the dtype whose exactness invariants (a batched
    session's tokens and cache equal its run alone) hold bit for bit on a real model."""
    return Engine(load_model("gemma3-270m", dtype="float32"), prefill_chunk=512)


def random_tokens(n: int, seed: int, low: int = 3, high: int = 300) -> list[int]:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server process for the test run (the embedded one kvsnap starts)."""
    from kvsnap.store.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def directory_factory(redis_server, request):
    """Directories on the shared server, namespaced per test so tests never see each other's keys."""
    from kvsnap.store.directory import SessionDirectory

    prefix = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[-60:]

    def make(url: str | None = None, **kwargs) -> SessionDirectory:
        return SessionDirectory(url or redis_server.url, prefix=prefix, **kwargs)

    return make


API_KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
# tests/service/test_aiperf_sessions.py: one tenant per aiperf run (aiperf names its sessions alike in every run)
API_KEYS |= {f"key-{case}": case for case in ("chat-header", "chat-none", "completions-header", "completions-none")}
ADMIN_KEY = "key-admin"


class RunningService:
    """A real local Ray Serve app (tiny-llama, 2 replicas) with HTTP and gRPC clients' addresses."""

    def __init__(self, cfg, redis_url):
        self.cfg = cfg
        self.redis_url = redis_url
        self.http = f"http://127.0.0.1:{cfg.http_port}"
        self.grpc = f"127.0.0.1:{cfg.grpc_port}"

    def headers(self, key: str = "key-alpha") -> dict:
        return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="session")
def service(redis_server, tmp_path_factory):
    """One local Ray + Serve app for the whole test run (Ray takes many seconds to start), started by
    the first test that asks for it: tests/bench/, whose suites start their own, sorts before it."""
    import ray
    from ray import serve

    from kvsnap.ports import free_port
    from kvsnap.service.app import APP_NAME, build_app
    from kvsnap.service.config import PolicyDefaults, ServiceConfig

    cfg = ServiceConfig(
        model="tiny-llama",
        replicas=2,
        cpus_per_replica=1,
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=API_KEYS,
        admin_keys=[ADMIN_KEY],
        policy_modules=["tests.policies.test_policy_plugin"],  # a policy written in a test file
        data_dir=str(tmp_path_factory.mktemp("service")),
        max_prompt_tokens=3000,
        max_body_bytes=64 * 1024,
        max_new_tokens=4000,
        max_ongoing_requests=3,
        max_batch=3,
        max_queued_requests=5,
        overload_queue_len=3,
        request_timeout_s=60,
        # the paper's SnapKV: the tests compare the service with policies built without sentence spans
        defaults=PolicyDefaults(policy="snapkv", budget=48, window=8, kernel=3, spans=False),
    )
    # 3 logical CPUs: 2 worker replicas of 1, and room for the Serve-config app test
    # (tests/cluster/test_cluster_configs.py)
    ray.init(num_cpus=3, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": cfg.http_port})
    serve.run(build_app(cfg, redis_server.url), name=APP_NAME, route_prefix="/")
    yield RunningService(cfg, redis_server.url)
    serve.shutdown()
    ray.shutdown()
