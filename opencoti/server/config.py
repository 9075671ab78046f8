"""HTTP-side settings (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    """api_key: when set, every route but /health needs ``Authorization: Bearer <key>`` or ``X-Api-Key``.
    max_body_bytes: request bodies above this are refused with 413.
    cors_origins: origins allowed by CORS (empty = CORS off).
    tps_interval_ms: default period of the ``GET /polykv/tps`` SSE stream.
    default_max_tokens: max tokens when a request gives none (None = until EOS or the context is full).
    default_seed: the sampling seed of every request that gives none (``--seed N``, llama.cpp's rule:
        the same request sampled again gives the same answer); None: a fresh seed per request.
    model_alias: the model id reported by /v1/models (default: the engine's model name).
    allowed_hosts: Host header names the server answers (None: any; ``opencoti serve`` bound to loopback
        sets the loopback names plus ``--allowed-host``): a defence against DNS rebinding.
    body_timeout_s: a request body must arrive within this many seconds (408 otherwise).
    tenant_keys: ``{key: tenant}`` (an API keys file, ``tenants.load_keys_file``): every key a tenant that
        sees only its own pools and sessions (docs/persistence.md); not together with ``api_key``.
    metrics: serve ``GET /metrics`` and collect its server-side series (request counters, latency
        histograms). False (``--no-metrics``): ``GET /metrics`` answers 501 (llama.cpp without ``--metrics``) and
        nothing is collected for it.
    metrics_key: a key that opens ``GET /metrics`` only (for a Prometheus scraper). With ``tenant_keys``
        it is the only key ``/metrics`` answers (it shows every tenant's pools and sessions; a tenant's
        key gets 403 there); with ``api_key`` the API key opens it too.
    """

    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    cors_origins: list[str] = field(default_factory=list)
    tps_interval_ms: float = 500.0
    default_max_tokens: int | None = None
    default_seed: int | None = None
    model_alias: str | None = None
    allowed_hosts: list[str] | None = None
    body_timeout_s: float = 30.0
    tenant_keys: dict[str, str] | None = None
    metrics: bool = True
    metrics_key: str | None = None
