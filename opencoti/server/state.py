"""What the routes share (``ServerState``: the engine's lifecycle, settings, metrics) and the FastAPI
dependencies that hand it to them: ``get_state`` and ``get_ctx`` (the operations context; 503
while the model loads)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Callable

from fastapi import Depends, Request

from ..engine import Engine
from ..ops import Context
from .config import ServerConfig
from .errors import ApiError
from .metrics import ServerMetrics
from .middleware import PUBLIC_PATHS
from .tenants import request_tenant

log = logging.getLogger("opencoti.server")


class ServerState:
    """The engine (None while loading), config, metrics, and the operations context."""

    def __init__(self, config: ServerConfig, engine: Engine | None, factory: Callable[[], Engine] | None):
        self.config = config
        self.engine = engine
        self.factory = factory
        self.owns_engine = engine is None
        self.load_error: BaseException | None = None
        self.started = time.time()
        self.stopping = threading.Event()
        self.stop_deadline: float | None = None  # time.monotonic() after which open streams end
        self.metrics = ServerMetrics(lambda: self.engine) if config.metrics else None
        self._ctx: Context | None = None
        self._tenant_ctx: dict[str, Context] = {}  # with tenant keys: one view each
        self._loader: threading.Thread | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None  # e.g. stop the server (serve.py)

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
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        if self.stopping.is_set():
            eng.shutdown()
            return
        # The model, the modules and everything made at start live as long as the process: keep
        # them out of every later garbage collection (measured: a full collection over them held the
        # GIL 170-640 ms, stalling the event loop; after this one, collections see new objects only).
        gc.collect()
        gc.freeze()
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

    def context(self, tenant: str | None = None) -> Context:
        """The operations context (raises the 503 / 500 that /health reports until the model is ready)."""
        eng = self.engine
        if eng is None:
            if self.load_error is not None:
                raise ApiError(500, f"model failed to load: {self.load_error}", "model_load_error")
            raise ApiError(503, "Loading model", "unavailable_error", {"Retry-After": "5"})
        if eng.is_closed:
            raise ApiError(503, "the server is shutting down", "unavailable_error", {"Retry-After": "5"})
        if self._ctx is None:
            c = self.config
            self._ctx = Context(eng, default_max_tokens=c.default_max_tokens, model_alias=c.model_alias,
                                tps_interval_ms=c.tps_interval_ms, started=self.started, default_seed=c.default_seed)
        if tenant is None:
            return self._ctx
        ctx = self._tenant_ctx.get(tenant)
        if ctx is None:  # the tenant's view of the engine (engine/api/tenancy.py)
            from ..engine.api.tenancy import TenantEngine
            base = self._ctx
            ctx = self._tenant_ctx[tenant] = Context(
                TenantEngine(eng, tenant), default_max_tokens=base.default_max_tokens, model_alias=base.model_alias,
                tps_interval_ms=base.tps_interval_ms, started=base.started, default_seed=base.default_seed)
        return ctx


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def get_ctx(request: Request, state: ServerState = Depends(get_state)) -> Context:
    tenant = request_tenant(request)
    if tenant is None and state.config.tenant_keys and request.url.path not in PUBLIC_PATHS:
        raise ApiError(401, "missing API key", "authentication_error")  # never the unscoped engine
    return state.context(tenant)
