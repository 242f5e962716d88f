"""The serving layer: the Ray Serve application (ingress with HTTP + gRPC, the cache-affinity
router, the worker deployment), its configuration, metrics, the spot watcher and the CLI."""
