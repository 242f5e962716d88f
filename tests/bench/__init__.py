"""The benchmarks' test-sized runs (bench/). Each starts its own servers (Ray, Redis, kvsnap serve,
vLLM) in child processes; the reliability suite and the service suite must run before the shared
service fixture (tests/conftest.py) starts, so this folder sorts before every folder whose tests
use it (actors/, the one before it, has none)."""
