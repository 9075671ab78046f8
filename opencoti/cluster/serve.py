"""``opencoti cluster serve``: N engine replicas behind one endpoint, on Ray Serve.

Without ``--address`` it starts a local Ray instance sized for the replicas (no dashboard, a
small object store) and stops it on exit; with ``--address`` it deploys the application onto a
running cluster and deletes the application (not Serve, not the cluster) on exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

APP_NAME = "opencoti"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", "-r", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--model", "-m", default=None, help="model of every replica (default: the bundled SmolLM2)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("OPENCOTI_API_KEY"), help="as for `opencoti serve`")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica (default 1)")
    p.add_argument("--gpus-per-replica", type=float, default=0.0, help="Ray GPUs per replica (default 0: CPU)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="torch threads per replica (default: --cpus-per-replica)")
    p.add_argument("--kv-budget-tokens", type=int, default=None, help="KV cache size of each replica, in tokens")
    p.add_argument("--max-pools", type=int, default=16, help="pool budget of each replica (default 16)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--ctx-size", "-c", type=int, default=None, help="context length per sequence")
    p.add_argument("--router", choices=["opencoti", "pow2", "ray-prefix"], default="opencoti",
                   help="opencoti: pool/session/prefix affinity (default); pow2: Ray Serve's default router; "
                        "ray-prefix: Ray Serve's PrefixCacheAffinityRouter")
    p.add_argument("--imbalance-threshold", type=float, default=4.0,
                   help="leave the prefix's replica when its in-flight requests exceed the least loaded "
                        "replica's by more than this (default 4)")
    p.add_argument("--match-threshold", type=float, default=0.1,
                   help="follow a cached prefix only when it covers at least this share of the prompt (default 0.1)")
    p.add_argument("--no-auto-replicate", action="store_true", help="never copy a saturated pool automatically")
    p.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto or ray://host:10001)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (default: replicas x cpus-per-replica)")
    p.add_argument("--object-store-mib", type=int, default=256, help="object store of the local Ray instance")


def config_from_args(args):
    from .app import ClusterConfig

    engine = {"max_pools": args.max_pools, "page_size": args.page_size}
    if args.model:
        engine["model"] = args.model
    if args.kv_budget_tokens:
        engine["kv_budget_tokens"] = args.kv_budget_tokens
    if args.ctx_size:
        engine["max_context"] = args.ctx_size
    if args.threads:
        engine["num_threads"] = args.threads
    return ClusterConfig(replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
                         gpus_per_replica=args.gpus_per_replica, router=args.router,
                         imbalance_threshold=args.imbalance_threshold, match_threshold=args.match_threshold,
                         auto_replicate=not args.no_auto_replicate, engine=engine,
                         server={"api_key": args.api_key} if args.api_key else {})


def start_local_ray(num_cpus: int, object_store_mib: int = 256, num_gpus: int | None = None) -> None:
    import ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             object_store_memory=object_store_mib * 2**20, log_to_driver=False,
             configure_logging=True, logging_level="WARNING")


def run(args) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        print("opencoti cluster serve: Ray Serve is not installed: pip install 'opencoti-langgraph[cluster]'",
              file=sys.stderr)
        return 2
    from .app import make_app
    try:
        cfg = config_from_args(args)
    except Exception as e:  # noqa: BLE001 - bad options
        print(f"opencoti cluster serve: {e}", file=sys.stderr)
        return 2
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        n = args.num_cpus or max(1, int(round(cfg.replicas * cfg.cpus_per_replica)))
        start_local_ray(n, args.object_store_mib, int(cfg.replicas * cfg.gpus_per_replica) or None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(make_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"opencoti cluster serve: {cfg.replicas} replicas listening on http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)
        stop.wait()
    finally:
        if args.address:  # leave Serve and the cluster running; take the application down
            try:
                serve.delete(APP_NAME)
            except Exception:  # noqa: BLE001 - it never started
                pass
        else:
            serve.shutdown()
            ray.shutdown()
    return 0
