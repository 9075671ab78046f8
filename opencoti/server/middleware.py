"""Pure ASGI middleware: API key, body limit, JSON bodies, request metrics."""

from __future__ import annotations

import json
import secrets

from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import error_body
from .metrics import ServerMetrics

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/dashboard", "/dashboard/"})  # the page holds no data


async def _send_error(send, status: int, message: str, etype: str, headers: list | None = None) -> None:
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
