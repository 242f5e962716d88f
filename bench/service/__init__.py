"""Service-level benchmarks: a real local service (Ray, embedded Redis, Serve app; each phase in
a process of its own, bench/harness/service.py) under load: what compression, resumed sessions,
routing and batching buy, the service's own overhead, and third-party load tools (aiperf,
Locust) against it."""
