"""The ASGI app: one Engine behind llama.cpp- and OpenAI-compatible routes plus the /polykv control plane.

    from opencoti.server import create_app, ServerConfig
    app = create_app(engine)                       # an engine you own (tests, embedding)
    app = create_app(engine_factory=lambda: Engine(...), config=ServerConfig(api_key="k"))

With ``engine_factory`` the model loads in a background thread at startup and every route but
``/health`` answers 503 ("Loading model") until it is ready; the app then owns the engine and shuts
it down with itself. Routes get the shared state through FastAPI dependencies (``state.py``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from ..engine import Engine
from .config import ServerConfig
from .errors import SafeJSONResponse, install_handlers
from .middleware import (PUBLIC_PATHS, ApiKeyMiddleware, BodyLimitMiddleware, BodyTimeout, RequestGuardMiddleware,
                         RequestMetricsMiddleware, UnexpectedErrorMiddleware)
from .cors import LocalhostCorsMiddleware
from .openapi import install_openapi
from .routes_anthropic import router as anthropic_router
from .routes_dashboard import router as dashboard_router
from .routes_generate import router as generate_router
from .routes_monitor import metrics_off_router, metrics_router
from .routes_monitor import router as monitor_router
from .routes_ops import operations_router
from .resumable import router as stream_router
from .routes_responses import router as responses_router
from .state import ServerState
from .tenants import TenantKeyMiddleware

EXPOSED_HEADERS = ["x-session-id", "x-pool-id", "x-cached-prefix-tokens", "x-sessions-remaining",
                   "x-admission-warning", "x-admission-retry-after", "x-session-tps", "x-opencoti-resource",
                   "retry-after"]


def create_app(engine: Engine | None = None, *, engine_factory: Callable[[], Engine] | None = None,
               config: ServerConfig | None = None) -> FastAPI:
    """Build the app around ``engine`` (not owned: the caller shuts it down) or ``engine_factory``
    (loaded in the background at startup, owned by the app)."""
    if (engine is None) == (engine_factory is None):
        raise ValueError("give exactly one of engine / engine_factory")
    config = config or ServerConfig()
    if config.api_key and config.tenant_keys:
        raise ValueError("give api_key (one key) or tenant_keys (a key per tenant), not both")
    if config.metrics_key is not None and (not config.metrics_key or config.metrics_key in (config.tenant_keys or {})
                                           or config.metrics_key == config.api_key):
        raise ValueError("metrics_key must be a non-empty key of its own (not the API key or a tenant's key)")
    state = ServerState(config, engine, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="opencoti", version=__version__, lifespan=lifespan, default_response_class=SafeJSONResponse,
                  description="llama.cpp- and OpenAI-compatible API over the opencoti engine, plus the PolyKV "
                              "control plane (/polykv/*): pools, sessions, tps, admission.")
    app.state.server = state
    install_handlers(app)
    install_openapi(app, auth=bool(config.api_key or config.tenant_keys), public_paths=PUBLIC_PATHS,
                    operator_only=frozenset({"/metrics"}) if config.tenant_keys else frozenset(),
                    vocab_size=lambda: getattr(getattr(state.engine, "core", None), "vocab_size", None))
    routers = [operations_router(), generate_router, anthropic_router, responses_router, stream_router,
               monitor_router, dashboard_router]
    # off: GET /metrics answers 501 (llama.cpp's answer without --metrics) and nothing is collected for it
    routers.append(metrics_router if config.metrics else metrics_off_router)
    for router in routers:
        app.include_router(router)
    # (path regex, methods) of every route, for the Allow header of a 405
    app.state.route_methods = [(r.path_regex, frozenset(r.methods)) for router in routers for r in router.routes
                               if getattr(r, "methods", None)]

    # innermost: a bug's exception is a 500 that keeps the connection (the body limit answers its own timeout)
    app.add_middleware(UnexpectedErrorMiddleware, passthrough=(BodyTimeout,))
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes, timeout_s=config.body_timeout_s)
    if config.tenant_keys:
        app.add_middleware(TenantKeyMiddleware, keys=config.tenant_keys, metrics_key=config.metrics_key)
    elif config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, metrics_key=config.metrics_key)
    app.add_middleware(RequestGuardMiddleware, allowed_hosts=config.allowed_hosts, cors_origins=config.cors_origins)
    if state.metrics is not None:
        app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    if not config.cors_origins:  # llama.cpp's localhost policy: preflights answered, localhost origins echoed
        app.add_middleware(LocalhostCorsMiddleware, expose_headers=EXPOSED_HEADERS)
    else:
        # like llama.cpp: the request's origin is echoed (with credentials allowed), also for '*'
        any_origin = "*" in config.cors_origins
        app.add_middleware(CORSMiddleware, allow_origins=[o for o in config.cors_origins if o != "*"],
                           allow_origin_regex=".*" if any_origin else None, allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"], expose_headers=EXPOSED_HEADERS)
    return app
