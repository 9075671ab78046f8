"""API keys of several tenants (``opencoti serve --api-keys-file``) and the middleware that maps each
request's key to its tenant.

The keys file has one ``<tenant> <key>`` pair per line; blank lines and lines starting with ``#``
are ignored. A tenant name is 1-32 characters of ``A-Z a-z 0-9 _ . -``; a key is 8-512 printable
ASCII characters without spaces. A tenant may have several keys (to rotate them); a key belongs to
one tenant. Example::

    # tenant  key
    alice     sk-alice-4f7d2c9e1b
    bob       sk-bob-9a8e7d6c5b

Every route but ``/health`` then needs one of the keys (``Authorization: Bearer <key>`` or
``X-Api-Key: <key>``); the request runs as that key's tenant (``scope["state"]["tenant"]``).

``GET /metrics`` shows every tenant's pools and sessions, so it is the operator's: it answers the
metrics key (``--metrics-key``) only; a tenant's key gets 403 there.
"""

from __future__ import annotations

import hashlib
import os

from ..engine.errors import InvalidRequestError
from ..engine.api.tenancy import TENANT_NAME, check_tenant_name
from .middleware import METRICS_PATH, PUBLIC_PATHS, send_error


class KeysFileError(InvalidRequestError):
    """The keys file cannot be read or has a bad line."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def load_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """``{key: tenant}`` from a keys file (see the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KeysFileError(f"cannot read the API keys file {path}: {e}") from None
    keys: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeysFileError(f"{path}:{n}: expected '<tenant> <key>', got {len(parts)} fields")
        tenant, key = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise KeysFileError(f"{path}:{n}: a tenant name is 1-32 characters of A-Z a-z 0-9 _ . -")
        if not (8 <= len(key) <= 512 and key.isascii() and key.isprintable()):
            raise KeysFileError(f"{path}:{n}: a key is 8-512 printable ASCII characters without spaces")
        if keys.get(key, tenant) != tenant:
            raise KeysFileError(f"{path}:{n}: this key is already the key of tenant {keys[key]!r}")
        keys[key] = tenant
    if not keys:
        raise KeysFileError(f"the API keys file {path} has no keys")
    return keys


def request_key(headers) -> bytes | None:
    given = None
    for k, v in headers:
        if k == b"authorization" and v[:7].lower() == b"bearer ":
            given = v[7:].strip()
        elif k == b"x-api-key" and given is None:
            given = v.strip()
    return given


class TenantKeyMiddleware:
    """Authenticates with the keys of a keys file and records the tenant in ``scope["state"]``."""

    def __init__(self, app, keys: dict[str, str], metrics_key: str | None = None):
        self.app = app
        self.metrics_key = _digest(metrics_key.encode()) if metrics_key else None
        for key, tenant in keys.items():
            check_tenant_name(tenant)
            if not isinstance(key, str) or not key:
                raise ValueError("API keys must be non-empty strings")
        self.keys = {_digest(k.encode()): t for k, t in keys.items()}  # compared by digest: no timing leak

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = request_key(scope["headers"])
        digest = _digest(given) if given is not None else None
        tenant = self.keys.get(digest) if digest is not None else None
        if scope["path"] == METRICS_PATH and digest is not None and (tenant is not None or digest == self.metrics_key):
            if digest == self.metrics_key:
                return await self.app(scope, receive, send)  # the operator: no tenant, every series
            return await send_error(send, scope, 403, "/metrics shows every tenant's pools and sessions: it answers "
                                                       "the metrics key (--metrics-key) only, not a tenant's key",
                                    "permission_error")
        if tenant is None:
            msg = "Invalid API Key" if given is not None else \
                "missing API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'"
            return await send_error(send, scope, 401, msg, "authentication_error",
                                    [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


def request_tenant(request) -> str | None:
    """The tenant of a request (None without a keys file)."""
    return request.scope.get("state", {}).get("tenant")
