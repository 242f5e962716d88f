"""``kvsnap serve`` (the service in the foreground: a local Ray, an embedded Redis unless
``KVSNAP_REDIS_URL``, the Serve app, HTTP + gRPC) and ``kvsnap spot-watch`` (on a spot GPU
node: drain it and move its sessions when the cloud announces a reclaim)."""

from __future__ import annotations


def cmd_serve(args) -> int:
    """Local Ray, embedded Redis (unless KVSNAP_REDIS_URL), the app; foreground until Ctrl-C.
    Exits 1, naming each failed replica's own error, when the app does not start."""
    import signal
    import sys
    import threading
    from pathlib import Path

    from kvsnap.service.config import ServiceConfig, ray_environment
    from kvsnap.store.redis_server import redis_url_or_embedded

    overrides = {
        "model": args.model,
        "replicas": args.replicas,
        "http_port": args.http_port,
        "grpc_port": args.grpc_port,
        "http_host": args.host,
        "data_dir": args.data_dir,
        "kv_quant": args.kv_quant,
        "dtype": args.dtype,
    }
    cfg, generated_key = ServiceConfig.from_env(**overrides).with_generated_key()
    cfg = _share_the_cores(cfg)
    redis_url, embedded = redis_url_or_embedded(Path(cfg.data_dir) / "redis")
    print(f"redis: {'embedded at ' + redis_url if embedded else 'KVSNAP_REDIS_URL'}", flush=True)
    ray_environment(cfg.fast_path)  # before Ray is imported
    try:
        import ray
        from ray import serve

        from kvsnap.service.app import APP_NAME, build_app

        from .startup import StartupFailed, deploy

        cpus = max(2, int(cfg.replicas * cfg.cpus_per_replica + 0.999))
        # address="local": always a Ray of its own, never one found on the machine (`ray start`)
        ray.init(
            address="local", num_cpus=cpus, include_dashboard=False, configure_logging=True, logging_level="WARNING"
        )
        serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
        print(
            f"loading {cfg.model!r} on {cfg.replicas} replica(s); the first run converts the embedded model "
            "once (about a minute)...",
            flush=True,
        )
        try:
            deploy(build_app(cfg, redis_url), APP_NAME, route_prefix="/")
        except StartupFailed as exc:  # each replica's own error, not Serve's traceback
            print(f"kvsnap serve: {exc}", file=sys.stderr, flush=True)
            serve.shutdown()
            ray.shutdown()
            return 1
        _serving(cfg, generated_key)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        print("\nshutting down...", flush=True)
        serve.shutdown()
        ray.shutdown()
    finally:
        if embedded:
            embedded.stop()
    return 0


def _share_the_cores(cfg):
    """On one machine the replicas share its cores (torch threads follow ``cpus_per_replica``):
    unless ``KVSNAP_CPUS_PER_REPLICA`` says otherwise, each gets the cores this process may run
    on divided by the replicas (at least 1); stated at start-up."""
    import os

    if os.environ.get("KVSNAP_CPUS_PER_REPLICA") is None:
        cores = len(os.sched_getaffinity(0))
        cfg = cfg.model_copy(update={"cpus_per_replica": float(max(1, cores // cfg.replicas))})
    print(f"{cfg.replicas} replica(s), {cfg.cpus_per_replica:g} CPU(s) each", flush=True)
    print(_defaults_line(cfg), flush=True)
    from kvsnap import cpu_kernels

    print(cpu_kernels.warm(), flush=True)  # the C kernels this machine's replicas run (built now, once)
    return cfg


def _defaults_line(cfg) -> str:
    """Which settings a session gets where its caller names none, and whether they were measured
    on this model (shipped, engine/defaults.py, or by ``kvsnap calibrate``) or are the generic ones."""
    from kvsnap.engine.defaults import defaults_of
    from kvsnap.tools.specs import spec_text

    return f"session defaults for {cfg.model}: {spec_text(cfg.session_defaults())} ({defaults_of(cfg.model)[1]})"


def _serving(cfg, generated_key: str | None) -> None:
    """Where the service answers, and with which key."""
    print(f"\nkvsnap is serving\n  HTTP  http://{cfg.http_host}:{cfg.http_port}  (OpenAPI: /docs)")
    if cfg.grpc_port:
        print(f"  gRPC  {cfg.http_host}:{cfg.grpc_port}  (reflection on)")
    if generated_key:
        print(f"  API key (tenant 'default'): {generated_key}")
    else:
        print(f"  API keys: {len(cfg.api_keys)} configured")
    print("Ctrl-C stops everything.", flush=True)


def cmd_spot_watch(args) -> int:
    """Run on each GPU spot node: drain it and move its sessions when AWS announces a reclaim."""
    import json
    import os

    import ray

    from kvsnap.cluster.spot import SpotWatcher

    key = args.admin_key or os.environ.get("KVSNAP_ADMIN_KEY")
    if not key and args.admin_key_file:
        with open(os.path.expanduser(args.admin_key_file), encoding="utf-8") as fh:
            key = fh.read().strip()
    if not key:
        raise SystemExit(
            "kvsnap spot-watch: pass --admin-key, --admin-key-file or set KVSNAP_ADMIN_KEY "
            "(one of the service's KVSNAP_ADMIN_KEYS; tenant keys cannot drain)"
        )
    # joins the Ray node on this host (the one at --node-ip-address where a host runs several)
    ray.init(address=args.ray_address, _node_ip_address=args.node_ip_address, logging_level="WARNING")
    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    watcher = SpotWatcher.for_node(
        node_id, context.gcs_address, args.kvsnap_url, key, metadata_url=args.metadata_url, interval_s=args.interval
    )
    print(f"watching {args.metadata_url} every {args.interval}s for node {node_id}", flush=True)
    watcher.run()
    # one line for the log (~/spot-watch.log on a cluster): which replicas handed over how many sessions
    print(json.dumps({"node": node_id, "drained": watcher.drained}), flush=True)
    return 0
