"""The serving layer: the Ray Serve application and nothing else. The ingress (HTTP and gRPC,
auth, validation into one typed turn request), the cache-affinity router, the app builder, the
configuration, metrics and the error-to-status mapping."""
