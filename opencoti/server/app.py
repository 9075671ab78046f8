"""The ASGI app: one Engine behind llama.cpp- and OpenAI-compatible routes plus the /polykv control plane.

    from opencoti.server import create_app, ServerConfig
    app = create_app(engine)                       # an engine you own (tests, embedding)
    app = create_app(engine_factory=lambda: Engine(...), config=ServerConfig(api_key="k"))

With ``engine_factory`` the model loads in a background thread at startup and every route but
``/health`` answers 503 ("Loading model") until it is ready; the app then owns the engine and shuts
it down with itself.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from ..engine import Engine
from .errors import ApiError, error_body, install_handlers
from .metrics import ServerMetrics
from .tools import TemplateCaps, probe_template_caps

log = logging.getLogger("opencoti.server")

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
EXPOSED_HEADERS = ["x-session-id", "x-pool-id", "x-cached-prefix-tokens", "x-sessions-remaining",
                   "x-admission-warning", "retry-after"]


@dataclass
class ServerConfig:
    """HTTP-side settings (the engine has its own EngineConfig).

    api_key: when set, every route but /health needs ``Authorization: Bearer <key>`` or ``X-Api-Key``.
    max_body_bytes: request bodies above this are refused with 413.
    cors_origins: origins allowed by CORS (empty = CORS off).
    tps_interval_ms: default period of the ``GET /polykv/tps`` SSE stream.
    default_max_tokens: max tokens when a request gives none (None = until EOS or the context is full).
    model_alias: the model id reported by /v1/models (default: the engine's model name).
    """

    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    cors_origins: list[str] = field(default_factory=list)
    tps_interval_ms: float = 500.0
    default_max_tokens: int | None = None
    model_alias: str | None = None


class ServerState:
    """What the routes share: the engine (None while loading), config, metrics, template caps."""

    def __init__(self, config: ServerConfig, engine: Engine | None, factory: Callable[[], Engine] | None):
        self.config = config
        self.engine = engine
        self.factory = factory
        self.owns_engine = engine is None
        self.load_error: BaseException | None = None
        self.started = time.time()
        self.stopping = threading.Event()
        self.stop_deadline: float | None = None  # time.monotonic() after which open streams end
        self.metrics = ServerMetrics(lambda: self.engine)
        self._caps: TemplateCaps | None = None
        self._loader: threading.Thread | None = None
        self._piece_cache: dict[int, str] = {}

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.engine is None and self.factory is not None and self._loader is None:
            self._loader = threading.Thread(target=self._load, name="opencoti-load", daemon=True)
            self._loader.start()

    def _load(self) -> None:
        try:
            eng = self.factory()
        except BaseException as e:  # noqa: BLE001 - reported by /health
            log.exception("model load failed")
            self.load_error = e
            return
        if self.stopping.is_set():
            eng.shutdown()
            return
        self.engine = eng
        log.info("model %s ready", eng.model_name)

    def begin_stop(self, grace_s: float) -> None:
        """Shutdown requested (signal): tps streams end now, generation streams after ``grace_s``."""
        self.stopping.set()
        self.stop_deadline = time.monotonic() + max(0.0, grace_s)

    def check_stream(self) -> None:
        """Called by streams after each event: end the stream once the shutdown grace has passed."""
        if self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
            raise ApiError(503, "the server is shutting down", "unavailable_error")

    def stop(self) -> None:
        self.stopping.set()
        if self._loader is not None:
            self._loader.join(timeout=60)
        if self.owns_engine and self.engine is not None:
            self.engine.shutdown()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and not self.engine.is_closed

    def require_engine(self) -> Engine:
        eng = self.engine
        if eng is None:
            if self.load_error is not None:
                raise ApiError(500, f"model failed to load: {self.load_error}", "model_load_error")
            raise ApiError(503, "Loading model", "unavailable_error", {"Retry-After": "5"})
        if eng.is_closed:
            raise ApiError(503, "the server is shutting down", "unavailable_error")
        return eng

    # ---------------------------------------------------------------- helpers
    @property
    def model_name(self) -> str:
        if self.config.model_alias:
            return self.config.model_alias
        return self.engine.model_name if self.engine is not None else "loading"

    def caps(self) -> TemplateCaps:
        if self._caps is None:
            eng = self.require_engine()
            if not eng.tokenizer.chat_template:
                self._caps = TemplateCaps()
            else:
                self._caps = probe_template_caps(eng.apply_chat_template)
        return self._caps

    def piece(self, token_id: int) -> str:
        s = self._piece_cache.get(token_id)
        if s is None:
            s = self.require_engine().tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._piece_cache) < 200_000:
                self._piece_cache[token_id] = s
        return s


# ============================================================================ middleware (pure ASGI)
async def _send_error(send, status: int, message: str, etype: str, headers: list | None = None) -> None:
    import json
    body = json.dumps(error_body(status, message, etype)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` or ``X-Api-Key: <key>`` on every route but /health."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = None
        for k, v in scope["headers"]:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                given = v[7:].strip()
            elif k == b"x-api-key" and given is None:
                given = v.strip()
        if given is None or not secrets.compare_digest(given, self.key):
            msg = "Invalid API Key" if given is not None else \
                "missing API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'"
            return await _send_error(send, 401, msg, "authentication_error", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies larger than ``limit`` bytes with 413 (by Content-Length, or while reading)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    return await _send_error(send, 400, "invalid Content-Length", "invalid_request_error")
                if n > self.limit:
                    return await _send_error(send, 413, f"request body of {n} bytes exceeds the limit of "
                                                        f"{self.limit} bytes", "invalid_request_error")
        seen = 0
        limit = self.limit

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise StarletteHTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return msg

        return await self.app(scope, limited_receive, send)


class JsonBodyMiddleware:
    """Treat request bodies as JSON whatever their Content-Type says (as llama.cpp does): ``curl -d``
    sends ``application/x-www-form-urlencoded``, and no route here takes a form."""

    _REWRITE = (b"application/x-www-form-urlencoded", b"text/plain", b"")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = next((v for k, v in scope["headers"] if k == b"content-type"), None)
            if ctype is None or ctype.split(b";")[0].strip().lower() in self._REWRITE:
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                scope["headers"] = headers + [(b"content-type", b"application/json")]  # in place: outer
                # middleware reads scope["route"] from this same dict
        return await self.app(scope, receive, send)


class RequestMetricsMiddleware:
    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def wrapped_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, wrapped_send)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "other"
            self.metrics.http_requests.labels(handler, scope["method"], str(status[0])).inc()


# ============================================================================ the app
def create_app(engine: Engine | None = None, *, engine_factory: Callable[[], Engine] | None = None,
               config: ServerConfig | None = None) -> FastAPI:
    """Build the app around ``engine`` (not owned: the caller shuts it down) or ``engine_factory``
    (loaded in the background at startup, owned by the app)."""
    if (engine is None) == (engine_factory is None):
        raise ValueError("give exactly one of engine / engine_factory")
    config = config or ServerConfig()
    state = ServerState(config, engine, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="opencoti", version=__version__, lifespan=lifespan,
                  description="llama.cpp- and OpenAI-compatible API over the opencoti engine, plus the PolyKV "
                              "control plane (/polykv/*): pools, sessions, tps, admission.")
    app.state.server = state
    install_handlers(app)

    from .routes_compat import router as compat_router
    from .routes_generate import router as generate_router
    from .routes_polykv import router as polykv_router

    app.include_router(compat_router)
    app.include_router(generate_router)
    app.include_router(polykv_router)

    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=EXPOSED_HEADERS)
    return app
