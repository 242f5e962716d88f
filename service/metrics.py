"""Prometheus metrics served at /metrics by the ingress.

Latency and token counters are measured at the ingress (what a client sees);
per-worker numbers (KV bytes and sessions per tier, moves, rebuilds, affinity hits)
come from the load each worker publishes to Redis with its heartbeat.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvsnap.engine.scheduler import BATCH_BUCKETS, TOKEN_BUCKETS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerLoadCollector:
    def __init__(self, loads):
        self.loads = loads  # () -> {worker_id: stats dict}

    def collect(self):
        loads = _read(self.loads)
        kv = GaugeMetricFamily("kvsnap_kv_bytes", "KV bytes held per worker and tier", labels=["worker", "tier"])
        sessions = GaugeMetricFamily("kvsnap_sessions", "sessions per worker and tier", labels=["worker", "tier"])
        moves = CounterMetricFamily("kvsnap_session_moves", "sessions moved onto a worker", labels=["worker"])
        rebuilds = CounterMetricFamily("kvsnap_session_rebuilds", "KV rebuilt from the token log", labels=["worker"])
        hits = CounterMetricFamily("kvsnap_affinity_hits", "turns served from a worker's own tiers", labels=["worker"])
        for worker, stats in loads.items():
            for tier, value in stats.get("bytes_by_tier", {}).items():
                kv.add_metric([worker, tier], value)
            for tier, value in stats.get("sessions_by_tier", {}).items():
                sessions.add_metric([worker, tier], value)
            moves.add_metric([worker], stats.get("moves_in", 0))
            rebuilds.add_metric([worker], stats.get("rebuilds", 0))
            hits.add_metric([worker], sum(v for k, v in stats.items() if k.startswith("hit_")))
        yield from (kv, sessions, moves, rebuilds, hits)
        yield from _prefix_metrics(loads)
        yield from _batch_histograms(loads)


def _read(loads) -> dict:
    """``loads()``, or nothing when Redis does not answer (no worker numbers this scrape)."""
    try:
        return loads()
    except Exception:
        return {}


def _prefix_metrics(loads: dict):
    """Each worker's shared prompt prefixes (engine/prefixes.py): bytes held, lookups that found
    a prefix and those that did not, and the tokens and bytes they did not compute."""
    held = GaugeMetricFamily(
        "kvsnap_prefix_bytes", "bytes of shared prompt prefixes held per worker", labels=["worker"]
    )
    names = {
        "hits": "new sessions that started from a shared prefix",
        "misses": "new sessions that found no shared prefix",
        "tokens_reused": "prompt tokens taken from shared prefixes instead of prefilled",
        "bytes_reused": "KV bytes taken from shared prefixes instead of computed",
        "evictions": "shared prefix blocks evicted for the budget",
    }
    counters = {k: CounterMetricFamily(f"kvsnap_prefix_{k}", doc, labels=["worker"]) for k, doc in names.items()}
    for worker, stats in loads.items():
        prefixes = stats.get("prefixes") or {}
        held.add_metric([worker], prefixes.get("bytes", 0))
        for k, family in counters.items():
            family.add_metric([worker], prefixes.get(k, 0))
    yield held
    yield from counters.values()


class _TenantPrefixes:
    """One scrape's tenant-scoped series: that tenant's own shared-prefix bytes per worker (a
    scrape never shows another tenant's)."""

    def __init__(self, loads, tenant: str):
        self.loads, self.tenant = loads, tenant

    def collect(self):
        own = GaugeMetricFamily(
            "kvsnap_prefix_tenant_bytes",
            "bytes of the scraping tenant's shared prompt prefixes per worker",
            labels=["worker", "tenant"],
        )
        for worker, stats in _read(self.loads).items():
            by_tenant = (stats.get("prefixes") or {}).get("bytes_by_tenant") or {}
            own.add_metric([worker, self.tenant], by_tenant.get(self.tenant, 0))
        yield own


def _batch_histograms(loads: dict):
    """Each worker's continuous-batching histograms (cumulative, from its scheduler's counters)."""
    batch = HistogramMetricFamily(
        "kvsnap_batch_size", "sessions in each decode step of a worker's batch", labels=["worker"]
    )
    tokens = HistogramMetricFamily(
        "kvsnap_step_tokens", "tokens a worker's batch step runs (prompt chunks plus decode rows)", labels=["worker"]
    )
    for worker, stats in loads.items():
        counts = stats.get("batch") or {}
        for family, prefix, buckets, total in (
            (batch, "batch_le_", BATCH_BUCKETS, counts.get("rows", 0)),
            (tokens, "tokens_le_", TOKEN_BUCKETS, counts.get("tokens", 0)),
        ):
            running, cumulative = 0, []
            for bound in (*buckets, "inf"):
                running += counts.get(f"{prefix}{bound}", 0)
                cumulative.append(("+Inf" if bound == "inf" else str(float(bound)), running))  # as Histogram does
            family.add_metric([worker], cumulative, sum_value=total)
    yield from (batch, tokens)


class Metrics:
    def __init__(self, loads=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "kvsnap_ttft_seconds", "time to first token", ["protocol"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "kvsnap_time_per_output_token_seconds",
            "decode time per generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kvsnap_prompt_tokens", "tokens prefilled", registry=r)
        self.replayed_tokens = Counter(
            "kvsnap_replayed_tokens", "tokens replayed to take sessions back to an earlier point (rewinds)", registry=r
        )
        self.kept_tokens = Counter("kvsnap_kept_tokens", "rows kept per full layer after each turn", registry=r)
        self.generated_tokens = Counter("kvsnap_generated_tokens", "tokens generated", registry=r)
        self.requests = Counter("kvsnap_requests", "requests by route and status", ["route", "code"], registry=r)
        self.queue_wait = Histogram(
            "kvsnap_queue_wait_seconds",
            "per turn: waiting for a place in its worker's batch (continuous batching)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.reselect = Histogram(
            "kvsnap_reselect_seconds",
            "per turn: re-selecting from the full cache (sessions with recompress=reselect)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvsnap_cached_prompt_tokens", "prompt tokens whose KV came from a shared prefix", registry=r
        )
        self.loads = loads
        if loads is not None:
            r.register(WorkerLoadCollector(loads))

    def record_turn(self, report: dict, decode_s: float) -> None:
        self.prompt_tokens.inc(report["prompt_tokens"])
        self.replayed_tokens.inc(report.get("replayed_tokens", 0))
        self.cached_tokens.inc(report.get("cached_tokens", 0))
        self.kept_tokens.inc(report["kept_len"])
        self.generated_tokens.inc(report["generated_tokens"])
        if report["generated_tokens"] > 1:
            self.tpot.observe(decode_s / (report["generated_tokens"] - 1))
        self.queue_wait.observe(report.get("queue_s", 0.0))
        if report.get("reselect_s"):
            self.reselect.observe(report["reselect_s"])

    def render(self, tenant: str | None = None) -> bytes:
        """The text a scrape gets; with the scraping ``tenant``, its own tenant-scoped series too."""
        body = generate_latest(self.registry)
        if tenant is None or self.loads is None:
            return body
        own = CollectorRegistry()
        own.register(_TenantPrefixes(self.loads, tenant))
        return body + generate_latest(own)
