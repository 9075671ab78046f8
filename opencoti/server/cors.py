"""CORS without ``--cors-origin``: llama.cpp's ``--cors-origins localhost`` policy.

* Every preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered 200 with an
  empty body, before the API key is asked for (a browser never sends one on a preflight):
  ``Access-Control-Allow-Credentials: true``, ``Access-Control-Allow-Methods: GET, POST, DELETE,
  OPTIONS`` and ``Access-Control-Allow-Headers`` (the headers the preflight asks for; ``*`` when
  it names none).
* A request whose ``Origin`` is a localhost origin (host ``localhost``, ``127.0.0.1`` or ``::1``,
  any scheme and port) gets that origin back in ``Access-Control-Allow-Origin``, with the
  ``x-*`` answer headers exposed; any other origin gets no CORS header at all (the browser then
  withholds the answer from the page).

Header names go out in their canonical case (``Access-Control-Allow-Origin``), as llama.cpp sends
them: HTTP names are case-insensitive, but clients that read the headers into a plain dict (llama.cpp's
own test suite does) look them up by that spelling.

With ``--cors-origin`` the app uses Starlette's CORSMiddleware with exactly those origins instead.
"""

from __future__ import annotations

from urllib.parse import urlsplit

METHODS = b"GET, POST, DELETE, OPTIONS"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def origin_is_localhost(origin: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) names a loopback host, as llama.cpp decides it."""
    try:
        host = urlsplit(origin).hostname if "://" in origin else origin.split(":", 1)[0]
    except ValueError:
        return False
    return (host or "").lower() in LOCAL_HOSTS


class LocalhostCorsMiddleware:
    def __init__(self, app, expose_headers: list[str]):
        self.app = app
        self.expose = ", ".join(expose_headers).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        allow = origin is not None and origin_is_localhost(origin.decode("latin-1"))
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            out = [(b"Access-Control-Allow-Credentials", b"true"), (b"Access-Control-Allow-Methods", METHODS),
                   (b"Access-Control-Allow-Headers", headers.get(b"access-control-request-headers") or b"*"),
                   (b"Vary", b"Origin"), (b"Content-Length", b"0"), (b"Content-Type", b"text/plain")]
            if allow:
                out.append((b"Access-Control-Allow-Origin", origin))
            await send({"type": "http.response.start", "status": 200, "headers": out})
            await send({"type": "http.response.body", "body": b""})
            return
        if not allow:
            return await self.app(scope, receive, send)

        async def with_cors(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"Access-Control-Allow-Origin", origin),
                                          (b"Access-Control-Allow-Credentials", b"true"),
                                          (b"Access-Control-Expose-Headers", self.expose), (b"Vary", b"Origin")]}
            await send(msg)

        return await self.app(scope, receive, with_cors)
