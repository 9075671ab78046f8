"""The Ray Serve application: ``ClusterIngress`` in front of N ``EngineReplica`` replicas.

On an existing Ray cluster (``ray start`` on each node)::

    serve run opencoti.cluster.app:build replicas=4 gpus_per_replica=1 model=/models/smollm2

``build`` takes string arguments (as ``serve run`` passes them) and returns the application;
``opencoti cluster serve`` calls it with its command-line options.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

ROUTERS = ("opencoti", "pow2", "ray-prefix")


@dataclass
class ClusterConfig:
    """replicas: engine replicas. cpus_per_replica / gpus_per_replica: Ray resources of each (an
    engine on a GPU takes one; on CPU, threads defaults to cpus_per_replica). router: "opencoti"
    (pool/session/prefix affinity) or "pow2" (Ray Serve's default power-of-two-choices router, for
    comparison: pool ids then reach a random replica) or "ray-prefix" (Ray Serve's own
    PrefixCacheAffinityRouter, ray_prefix.py, also for comparison: it routes by the prompt text only,
    pool ids reach any replica). imbalance_threshold / match_threshold: the prefix-routing balance
    rule (policy.py; ray-prefix gets the same two values). auto_replicate: copy a saturated pool to a replica
    with room. engine: EngineConfig fields; server: ServerConfig fields."""

    replicas: int = 2
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    router: str = "opencoti"
    imbalance_threshold: float = 4.0
    match_threshold: float = 0.1
    auto_replicate: bool = True
    max_ongoing_requests: int = 256
    engine: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.replicas, int) and self.replicas >= 1):
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0")
        from .policy import RoutingOptions
        RoutingOptions(imbalance_threshold=self.imbalance_threshold, match_threshold=self.match_threshold)
        from ..engine import EngineConfig
        if "pool_id_base" in self.engine:
            raise ValueError("pool_id_base is set by the cluster (each replica gets its own id range)")
        EngineConfig(**self.engine)  # validate here, not in N replicas


def make_app(cfg: ClusterConfig):
    """The bound Serve application for ``cfg``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .ingress import ClusterIngress
    from .replica import EngineReplica
    from . import routes  # noqa: F401 - registers the ingress routes

    engine_opts = dict(cfg.engine)
    if cfg.gpus_per_replica > 0:
        engine_opts.setdefault("device", "cuda")
    else:
        engine_opts.setdefault("device", "cpu")
        engine_opts.setdefault("num_threads", max(1, int(cfg.cpus_per_replica)))
    router_cfg = {}
    if cfg.router == "opencoti":
        router_cfg["request_router_config"] = RequestRouterConfig(
            request_router_class="opencoti.cluster.router:OpencotiRouter",
            request_router_kwargs={"imbalance_threshold": cfg.imbalance_threshold,
                                   "match_threshold": cfg.match_threshold})
    elif cfg.router == "ray-prefix":
        router_cfg["request_router_config"] = RequestRouterConfig(
            request_router_class="opencoti.cluster.ray_prefix:RayPrefixAffinityRouter",
            request_router_kwargs={"imbalanced_threshold": cfg.imbalance_threshold,
                                   "match_rate_threshold": cfg.match_threshold})
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=cfg.replicas, max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica},
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5, **router_cfg)
    ingress = serve.deployment(serve.ingress(_ingress_app())(ClusterIngress), name="ClusterIngress", num_replicas=1,
                               max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(engine_opts, cfg.server),
                        {"router": cfg.router, "auto_replicate": cfg.auto_replicate,
                         "api_key": cfg.server.get("api_key")})


def _ingress_app():
    from .ingress import ingress_app
    return ingress_app


def _parse(value: str, kind):
    if kind is bool:
        return value.lower() in ("1", "true", "yes", "on")
    if kind is int:
        return int(value)
    if kind is float:
        return float(value)
    return value


_ENGINE_KEYS = {"model": str, "dtype": str, "page_size": int, "kv_budget_tokens": int, "kv_budget_mib": float,
                "max_batch_tokens": int, "max_running": int, "max_pools": int, "max_context": int,
                "num_threads": int, "pool_grace_ttl_s": float, "kv_dtype": str}


def build(args: dict):
    """``serve run opencoti.cluster.app:build key=value ...``: ClusterConfig fields, plus EngineConfig
    fields (model=..., kv_budget_tokens=..., num_threads=...) and api_key=..."""
    kw: dict = {"engine": {}, "server": {}}
    types = {f.name: f.type for f in fields(ClusterConfig)}
    kinds = {"replicas": int, "cpus_per_replica": float, "gpus_per_replica": float, "router": str,
             "imbalance_threshold": float, "match_threshold": float, "auto_replicate": bool,
             "max_ongoing_requests": int}
    for k, v in (args or {}).items():
        v = str(v)
        if k in kinds:
            kw[k] = _parse(v, kinds[k])
        elif k in _ENGINE_KEYS:
            kw["engine"][k] = _parse(v, _ENGINE_KEYS[k])
        elif k == "api_key":
            kw["server"]["api_key"] = v
        else:
            raise ValueError(f"unknown option {k!r}; options: {sorted(set(types) - {'engine', 'server'})}, "
                             f"engine: {sorted(_ENGINE_KEYS)}, api_key")
    return make_app(ClusterConfig(**kw))
