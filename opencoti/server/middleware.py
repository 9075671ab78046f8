"""Pure ASGI middleware: API key, body limit and timeout, request guard (Host, Origin, JSON bodies),
request metrics, unexpected errors. Every error they answer takes the shape of the request's API
(Anthropic's on /v1/messages, ``errors.shaped``)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import secrets

from starlette.exceptions import HTTPException as StarletteHTTPException

from . import gcpause
from .cors import origin_is_localhost
from .errors import error_body, error_response, shaped
from .metrics import ServerMetrics

log = logging.getLogger("opencoti.server")

LARGE_BODY = 1 << 20  # bodies from this size on are handled with automatic GC paused (gcpause)
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
METRICS_PATH = "/metrics"
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/dashboard", "/dashboard/"})  # the page holds no data


async def send_error(send, scope, status: int, message: str, etype: str, headers: list | None = None) -> None:
    """Answer an ASGI request with the error body of its API (``scope``'s path; before any app code ran)."""
    body = json.dumps(shaped(scope.get("path", ""), error_body(status, message, etype))).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` or ``X-Api-Key: <key>`` on every route but /health."""

    def __init__(self, app, api_key: str, metrics_key: str | None = None):
        self.app = app
        self.key = api_key.encode()
        self.metrics_key = metrics_key.encode() if metrics_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = None
        for k, v in scope["headers"]:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                given = v[7:].strip()
            elif k == b"x-api-key" and given is None:
                given = v.strip()
        metrics_ok = (self.metrics_key is not None and given is not None and scope["path"] == METRICS_PATH
                      and secrets.compare_digest(given, self.metrics_key))
        if not metrics_ok and (given is None or not secrets.compare_digest(given, self.key)):
            msg = "Invalid API Key" if given is not None else \
                "missing API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'"
            return await send_error(send, scope, 401, msg, "authentication_error",
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyTimeout(Exception):
    """The request body did not arrive in time."""


class BodyLimitMiddleware:
    """Refuse request bodies larger than ``limit`` bytes with 413 (by Content-Length, or while reading),
    and bodies that do not arrive within ``timeout_s`` (a slow or short-of-its-Content-Length client)
    with 408. A request whose body reaches ``LARGE_BODY`` bytes is handled, until its answer is sent,
    with automatic garbage collection paused (``gcpause``: collections would walk its lists of
    millions of ids while holding the GIL)."""

    def __init__(self, app, limit: int, timeout_s: float = 30.0):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = 0
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    n = length = int(v)
                except ValueError:
                    return await send_error(send, scope, 400, "invalid Content-Length", "invalid_request_error")
                if n > self.limit:
                    return await send_error(send, scope, 413, f"request body of {n} bytes exceeds the limit of "
                                                               f"{self.limit} bytes", "invalid_request_error")
        seen = 0
        limit = self.limit
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False
        started = False
        large = length >= LARGE_BODY
        if large:
            gcpause.enter()

        async def limited_receive():
            nonlocal seen, body_done, large
            if body_done:  # the body is in: later receives wait for a disconnect, without a deadline
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                raise BodyTimeout() from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise StarletteHTTPException(413, f"request body exceeds the limit of {limit} bytes")
                if not large and seen >= LARGE_BODY:  # a chunked body (no Content-Length) grew large
                    large = True
                    gcpause.enter()
                body_done = not msg.get("more_body", False)
            return msg

        async def tracked_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            return await self.app(scope, limited_receive, tracked_send)
        except BodyTimeout:
            if not started:
                await send_error(send, scope, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                                 "invalid_request_error", [(b"connection", b"close")])
        finally:
            if large:
                gcpause.leave()


class RequestGuardMiddleware:
    """Requests from web pages and DNS rebinding: a ``Host`` that is not an allowed name is refused
    (400; only when ``allowed_hosts`` is given, as ``opencoti serve`` does on loopback), a state-changing
    request whose ``Origin`` is neither the server itself nor a CORS origin is refused (403), and a
    request body must be ``application/json`` (415): a page can send a "simple" cross-site POST with
    ``text/plain`` or a form, never with JSON."""

    UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})

    def __init__(self, app, allowed_hosts: list[str] | None = None, cors_origins: list[str] | None = None):
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.cors_origins = set(cors_origins or ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.allowed_hosts is not None and not self._host_ok(host_name(host)):
            return await send_error(send, scope, 400, f"Host {host!r} is not allowed: the server answers only "
                                                       "loopback names (start it with --allowed-host NAME to add one)",
                                    "invalid_request_error")
        method = scope["method"]
        origin = headers.get("origin")
        if method in self.UNSAFE and origin is not None and not self._origin_ok(origin, host):
            return await send_error(send, scope, 403, f"cross-site request refused: Origin {origin!r} is not this "
                                                       "server (allow it with --cors-origin)", "permission_error")
        if method in self.UNSAFE and _has_body(headers):
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
                got = f"got {ctype!r}" if ctype else "got no Content-Type"
                return await send_error(send, scope, 415, "request bodies must be JSON, sent with 'Content-Type: "
                                                           f"application/json' ({got})", "invalid_request_error")
        return await self.app(scope, receive, send)

    def _host_ok(self, name: str) -> bool:
        if name in self.allowed_hosts:
            return True
        try:  # an IP literal is never a rebound DNS name: loopback addresses are answered
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def _origin_ok(self, origin: str, host: str) -> bool:
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        if not self.cors_origins and origin_is_localhost(origin):  # the default CORS policy (cors.py)
            return True
        return origin != "null" and origin.split("://", 1)[-1].rstrip("/").lower() == host.lower()


def host_name(host: str) -> str:
    """The name of a Host header without its port (``[::1]:8080`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _has_body(headers: dict[str, str]) -> bool:
    if "transfer-encoding" in headers:
        return True
    try:
        return int(headers.get("content-length", "0")) > 0
    except ValueError:
        return True


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
            method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"  # bounded label values
            self.metrics.http_requests.labels(handler, method, str(status[0])).inc()


class UnexpectedErrorMiddleware:
    """An exception no handler answers (a bug) becomes a 500 in the API's shape, and the connection
    stays usable. Starlette's own handler of ``Exception`` answers the 500 too, but then raises the
    exception again for the server to log, and uvicorn closes the connection: the client's next
    request on it (keep-alive) was reset. Here the exception is logged and answered, not raised
    again, unless the answer had already started (a cut answer can only end with the connection).
    Installed innermost, so the metrics, CORS and body-limit middleware see the 500 like any answer."""

    def __init__(self, app, passthrough: tuple[type[BaseException], ...] = ()):
        self.app = app
        self.passthrough = passthrough  # what an outer middleware answers itself (a body timeout)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            if started or isinstance(exc, self.passthrough):
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await error_response(exc, path=scope.get("path", ""))(scope, receive, send)
