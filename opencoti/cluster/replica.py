"""``EngineReplica``: one engine and the HTTP app of ``opencoti serve``, as a Ray Serve replica.

The replica runs the very ASGI app that ``opencoti serve`` runs (``create_app(engine)``) in its
own process and answers the ingress's forwarded requests through it, so every route behaves
exactly as on a single server. Forwarded answers stream back as ``{"status", "headers"}``
followed by body chunks (SSE events stay events).

Its engine numbers pools in the replica's own id range (ids.py). A request that names a pool of
another replica reaches this one only when the router found no live holder: the answer is 410
(the pool's replica is gone and pools are not persisted) or 404 (no such pool ever existed).
A copy of a pool (``create_copy``) is known here under the logical id too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import time

import ray

from .hints import Hint, parse_json
from .ids import id_base, tag_of
from .registry import get_registry

log = logging.getLogger("opencoti.cluster")

_POOL_PATH = re.compile(r"^/polykv/pools/(\d+)(/.*)?$")


def error_chunks(status: int, message: str, etype: str, headers: dict | None = None) -> list:
    body = json.dumps({"error": {"code": status, "message": message, "type": etype}}).encode()
    h = [("content-type", "application/json"), ("content-length", str(len(body)))]
    h += [(k.lower(), str(v)) for k, v in (headers or {}).items()]
    return [{"status": status, "headers": h}, body]


class EngineReplica:
    """Ray Serve deployment class (see app.py for the deployment options). Every method takes the
    ``route`` hint the ingress passes for the router (only ``forward`` reads it)."""

    def __init__(self, engine_options: dict, server_options: dict | None = None):
        from ..engine import Engine, EngineConfig
        from ..server import ServerConfig, create_app

        ctx = _replica_context()
        self.app_name = ctx.app_name if ctx is not None else ""
        self.registry = get_registry(self.app_name)
        self.tag = ray.get(self.registry.new_tag.remote({"pid": os.getpid(), "host": socket.gethostname()}))
        self.engine = Engine(EngineConfig(**engine_options, pool_id_base=id_base(self.tag)))
        self.app = create_app(self.engine, config=ServerConfig(**(server_options or {})))
        self.aliases: dict[int, int] = {}  # logical pool id -> local copy id
        self.forwarded = 0
        self.started = time.time()
        self._issued = 0
        self._lifespan_task = None
        log.info("replica tag %d (pid %d) ready", self.tag, os.getpid())

    # ------------------------------------------------------------------ Ray Serve hooks
    def record_replica_metadata(self) -> dict:
        return {"tag": self.tag, "pid": os.getpid(), "host": socket.gethostname()}

    def check_health(self) -> None:
        if self.engine.is_closed:
            raise RuntimeError("the engine has stopped")

    def __del__(self):
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.shutdown()

    # ------------------------------------------------------------------ forwarding
    async def _tag_issued(self, tag: int) -> bool:
        if tag > self._issued:
            self._issued = await self.registry.issued.remote()
        return tag <= self._issued

    async def _localize(self, req: dict, hint: Hint):
        """Rewrite a request naming a pool held here under a logical id; or the error chunks when the
        pool is not here."""
        pid = hint.pool_id
        if pid is None or tag_of(pid) == self.tag:
            return req
        local = self.aliases.get(pid)
        if local is None:
            t = tag_of(pid)
            if t is not None and t != self.tag and await self._tag_issued(t):
                return error_chunks(410, f"pool {pid} was lost: the replica that held it (replica {t}) stopped, "
                                         "and pools do not survive a replica restart; create the pool again",
                                    "pool_lost_error")
            return error_chunks(404, f"pool {pid!r} not found", "not_found_error")
        path = req["path"]
        m = _POOL_PATH.match(path)
        if m and int(m.group(1)) == pid:
            path = f"/polykv/pools/{local}{m.group(2) or ''}"
        body = req.get("body") or b""
        obj = parse_json(body)
        keys = [k for k in ("pool_id", "shared_pool_slot") if obj is not None and obj.get(k) == pid]  # legacy alias
        if keys:
            for k in keys:
                obj[k] = local
            body = json.dumps(obj).encode()
        return {**req, "path": path, "body": body}

    async def forward(self, req: dict, route: dict | None = None):
        """Run one HTTP request through the app: yields {"status", "headers"}, then body chunks."""
        self.forwarded += 1
        hint = Hint.from_dict(route)
        req = await self._localize(req, hint)
        if isinstance(req, list):
            for c in req:
                yield c
            return
        async for chunk in self._asgi(req):
            yield chunk

    async def _asgi(self, req: dict):
        body = req.get("body") or b""
        # the client's headers as sent (Host and Origin included: the app's Host/Origin checks see
        # what the client sent), with the length of the body as read
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.get("headers", [])
                   if k.lower() not in ("content-length", "transfer-encoding")]
        headers.append((b"content-length", str(len(body)).encode()))
        if not any(k == b"host" for k, _ in headers):
            headers.append((b"host", b"opencoti-replica"))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req["method"], "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(),
                 "query_string": req.get("query", "").encode("latin-1"), "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 0), "server": ("opencoti-replica", 80), "state": {}}
        q: asyncio.Queue = asyncio.Queue()
        sent_body = False
        disconnected = asyncio.Event()

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            await q.put(msg)

        async def run():
            try:
                await self.app(scope, receive, send)
            finally:
                await q.put(None)

        task = asyncio.create_task(run())
        extra = [("x-opencoti-replica", str(self.tag))]
        try:
            while True:
                msg = await q.get()
                if msg is None:
                    break
                if msg["type"] == "http.response.start":
                    hs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    yield {"status": msg["status"], "headers": hs + extra}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield bytes(msg["body"])
                    if not msg.get("more_body", False):
                        break
            await task
        finally:
            disconnected.set()  # the client went away (or the answer is complete)
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), timeout=5)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the app logs its own errors
                    task.cancel()

    # ------------------------------------------------------------------ cluster operations
    def info(self, route: dict | None = None) -> dict:
        c = self.engine.metrics_counters()
        return {"tag": self.tag, "pid": os.getpid(), "host": socket.gethostname(), "started": self.started,
                "forwarded": self.forwarded, "counters": c.get("totals", c), "aliases": dict(self.aliases),
                "pools": sorted(p["pool_id"] for p in self.engine.pools()["pools"])}

    def pool_tokens(self, pool_id: int, route: dict | None = None) -> list[int]:
        local = self.aliases.get(pool_id, pool_id)
        return _pool_tokens(self.engine, local)

    def create_copy(self, logical_id: int, tokens: list[int], pinned: bool, label: str,
                    admission: dict | None, route: dict | None = None) -> dict:
        """Create a copy of pool ``logical_id`` here (a root pool with its full prefix)."""
        if logical_id in self.aliases:
            return self.engine.pool(self.aliases[logical_id]).as_dict()
        info = self.engine.create_pool(tokens=tokens, pinned=pinned, label=label or f"copy of {logical_id}")
        if admission:
            policy = {k: v for k, v in admission.items() if k in _ADMISSION_KEYS}
            if policy:
                try:
                    self.engine.set_admission(info.pool_id, **policy)
                except Exception:  # noqa: BLE001 - the copy stays usable with the default policy
                    log.warning("could not copy the admission policy of pool %s", logical_id, exc_info=True)
        self.aliases[logical_id] = info.pool_id
        return info.as_dict()

    def drop_copy(self, logical_id: int, immediate: bool = False, cascade_sessions: bool = False,
                  route: dict | None = None) -> list[str] | None:
        """Release this replica's copy of pool ``logical_id`` as ``DELETE /polykv/pools/{id}`` asked
        (``immediate``; ``cascade_sessions``: first end the sessions that keep the copy's KV).
        Returns the ended session ids ([] without cascade), or None when no copy is held here."""
        local = self.aliases.pop(logical_id, None)
        if local is None:
            return None
        try:
            return list(self.engine.release_pool(local, immediate=bool(immediate),
                                                 cascade_sessions=bool(cascade_sessions)) or [])
        except Exception:  # noqa: BLE001 - already gone
            return []


_ADMISSION_KEYS = ("target_tps_per_session", "mode", "on_saturation", "guarantee_min_sessions", "settle_tokens",
                   "settle_max_ms", "queue_timeout_ms")


def _replica_context():
    try:
        from ray import serve
        return serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return None


def _pool_tokens(engine, pool_id: int) -> list[int]:
    """A pool's full token prefix [0, L)."""
    return list(engine.pool_tokens(pool_id))
