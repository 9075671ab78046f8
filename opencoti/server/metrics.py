"""Server-side Prometheus series (a per-app registry) next to the engine's own exposition.

``/metrics`` = these series (prometheus_client) + ``Engine.prometheus_metrics()`` (the pool-labelled
PolyKV gauges and counters, docs/polykv.md) + llama.cpp's own ``llamacpp:*`` series (``LlamaCppSeries``:
the names, types and meanings of llama.cpp's server, which its users' dashboards scrape). Names follow
vLLM's ``<prefix>:<name>`` style; the only label on the PolyKV series is ``pool`` (never a session:
cardinality).
"""

from __future__ import annotations

import logging
import threading
import time
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


class LlamaCppSeries:
    """llama.cpp's ``/metrics`` series (tools/server: ``server_task_result_metrics::to_metrics``), each
    with its ``# HELP`` and ``# TYPE`` lines: the token and time counters are summed from every
    finished generation's ``timings`` (as llama.cpp sums its tasks'), the throughput gauges are over
    the window since the previous scrape (as llama.cpp's buckets), and the engine's numbers (steps,
    sequences per step, running / waiting requests, KV use) are read at scrape time. Also the two KV
    gauges of earlier llama.cpp versions (``kv_cache_usage_ratio``, ``kv_cache_tokens``), which
    dashboards made for them still read."""

    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_n = self.cache_n = self.predicted_n = self.n_tokens_max = 0
        self.draft_n = self.draft_accepted = 0
        self.prompt_ms = self.predicted_ms = 0.0
        self._bucket = [0, 0.0, 0, 0.0]  # prompt tokens, prompt ms, predicted tokens, predicted ms since the last scrape

    def add(self, timings: dict | None) -> None:
        """One finished generation (its ``timings``, llama.cpp's fields)."""
        if not timings:
            return
        prompt_n, cache_n = int(timings.get("prompt_n") or 0), int(timings.get("cache_n") or 0)
        predicted_n = int(timings.get("predicted_n") or 0)
        prompt_ms, predicted_ms = float(timings.get("prompt_ms") or 0.0), float(timings.get("predicted_ms") or 0.0)
        with self._lock:
            self.prompt_n += prompt_n
            self.cache_n += cache_n
            self.predicted_n += predicted_n
            self.prompt_ms += prompt_ms
            self.predicted_ms += predicted_ms
            self.n_tokens_max = max(self.n_tokens_max, cache_n + prompt_n + predicted_n)
            self.draft_n += int(timings.get("draft_n") or 0)
            self.draft_accepted += int(timings.get("draft_n_accepted") or 0)
            b = self._bucket
            b[0] += prompt_n
            b[1] += prompt_ms
            # llama.cpp's generation rate leaves out the first token (it costs no decode step of its own)
            b[2] += max(0, predicted_n - 1)
            b[3] += predicted_ms

    def render(self, engine) -> str:
        """The series as Prometheus text; the throughput window restarts."""
        with self._lock:
            b, self._bucket = self._bucket, [0, 0.0, 0, 0.0]
            totals = (self.prompt_n, self.cache_n, self.prompt_ms, self.predicted_n, self.predicted_ms,
                      self.n_tokens_max, self.draft_n, self.draft_accepted)
        prompt_n, cache_n, prompt_ms, predicted_n, predicted_ms, n_tokens_max, draft_n, draft_accepted = totals
        steps = seqs = verifications = running = waiting = 0
        kv_ratio = kv_tokens = 0.0
        if engine is not None:
            try:
                counted = engine.metrics_counters()["totals"]
                st = engine.stats()
                page_size = engine.pools()["page_size"]
            except Exception:  # noqa: BLE001 - a closed engine: its numbers stay 0
                pass
            else:
                steps, seqs = counted.get("model_steps", 0), counted.get("step_seqs", 0)
                verifications = counted.get("draft_verifications", 0)
                running, waiting = st["running"], st["waiting"]
                kv_ratio = st["kv_pages_used"] / st["kv_pages_total"] if st["kv_pages_total"] else 0.0
                kv_tokens = st["kv_pages_used"] * page_size
        counters = (
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt_n),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cache_n),
            ("prompt_seconds_total", "Total time spent processing prompts", prompt_ms / 1e3),
            ("tokens_predicted_total", "Number of generation tokens processed", predicted_n),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", predicted_ms / 1e3),
            ("n_decode_total", "Total number of model steps (llama_decode() calls), each a batch of sequences", steps),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", draft_n),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             draft_accepted),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", verifications),
        )
        gauges = (
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", 1e3 * b[0] / b[1] if b[1] > 0 else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             1e3 * b[2] / b[3] if b[3] > 0 else 0.0),
            ("requests_processing", "Number of requests processing", running),
            ("requests_deferred", "Number of requests deferred", waiting),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", seqs / max(steps, 1)),
            ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage", kv_ratio),
            ("kv_cache_tokens", "KV-cache tokens (pages in use times the page size)", kv_tokens),
        )
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_, value in items:
                v = float(value)
                lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {int(v) if v.is_integer() else repr(v)}"]
        return "\n".join(lines) + "\n"


class ServerMetrics:
    def __init__(self, get_engine: Callable[[], object | None]):
        self.t_start = int(time.time())  # llama.cpp's Process-Start-Time-Unix header on /metrics
        self.llamacpp = LlamaCppSeries()
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
        return text + self.llamacpp.render(engine)
