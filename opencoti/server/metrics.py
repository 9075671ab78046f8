"""Server-side Prometheus series (a per-app registry) next to the engine's own exposition.

``/metrics`` = these series (prometheus_client) + ``Engine.prometheus_metrics()`` (the pool-labelled
PolyKV gauges and counters, docs/polykv.md). Names follow vLLM's ``<prefix>:<name>`` style; the only
label on the PolyKV series is ``pool`` (never a session: cardinality).
"""

from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("opencoti.server")

disable_created_metrics()  # no *_created series: they only add noise to a scrape

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, get_engine: Callable[[], object | None], in_flight: Callable[[], int]):
        self.get_engine = get_engine
        self.in_flight = in_flight

    def collect(self):
        g = GaugeMetricFamily("opencoti:http_requests_in_flight", "Generation requests being served over HTTP")
        g.add_metric([], self.in_flight())
        yield g
        eng = self.get_engine()
        if eng is None:
            return
        try:
            st = eng.stats()
            pools = eng.pools()
        except Exception:  # noqa: BLE001 - a closed engine: no engine gauges
            return
        for name, help_, value in (
            ("opencoti:num_requests_running", "Requests scheduled in the running batch", st["running"]),
            ("opencoti:num_requests_waiting", "Requests waiting to be scheduled", st["waiting"]),
            ("opencoti:num_sessions", "Sessions holding a cache (idle ones included)", st["sessions"]),
            ("opencoti:num_pools", "Live pools", pools["pools_used"]),
            ("opencoti:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full)",
             st["kv_pages_used"] / st["kv_pages_total"] if st["kv_pages_total"] else 0.0),
            ("opencoti:kv_cache_pages_used", "KV pages in use", st["kv_pages_used"]),
            ("opencoti:kv_cache_pages_total", "KV pages allocated at start", st["kv_pages_total"]),
            ("opencoti:prefix_cache_pages", "KV pages held only as reusable prefix cache (evictable)",
             st["prefix_cache"]["cache_pages"]),
            ("opencoti:prefix_cache_hit_rate", "Prompt tokens reused from cached KV / prompt tokens (lifetime)",
             st["prefix_cache"]["hit_rate"]),
            *(() if "kv_memory" not in st else (
                ("opencoti:kv_cache_bytes_reserved", "KV bytes reserved at start: the cap the KV cache can grow to",
                 st["kv_memory"]["reserved_bytes"]),
                ("opencoti:kv_cache_bytes_resident", "KV bytes resident in memory (CPU: pages written at least "
                 "once; they stay resident when freed)", st["kv_memory"]["resident_bytes"]),
                ("opencoti:kv_cache_bytes_used", "KV bytes of the pages in use (the prefix cache's included)",
                 st["kv_memory"]["used_bytes"]))),
        ):
            g = GaugeMetricFamily(name, help_)
            g.add_metric([], value)
            yield g


class ServerMetrics:
    def __init__(self, get_engine: Callable[[], object | None]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.in_flight = 0
        self.http_requests = Counter("opencoti:http_requests", "HTTP requests by route template and status",
                                     ["handler", "method", "status"], registry=self.registry)
        self.request_success = Counter("opencoti:request_success", "Finished generation requests by finish reason",
                                       ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("opencoti:time_to_first_token_seconds", "Time from request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("opencoti:inter_token_latency_seconds", "Time between consecutive streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("opencoti:e2e_request_latency_seconds", "Time from request arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(get_engine, lambda: self.in_flight))

    def render(self, engine) -> str:
        text = generate_latest(self.registry).decode()
        if engine is not None:
            try:
                text += engine.prometheus_metrics()
            except Exception:  # noqa: BLE001 - engine closed or metrics broken: still serve ours
                log.exception("engine metrics failed")
        return text
