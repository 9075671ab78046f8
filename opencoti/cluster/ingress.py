"""``ClusterIngress``: the HTTP front of the cluster (a Ray Serve ingress deployment).

It speaks the API of ``opencoti serve``: each request is read once, given a routing hint
(hints.py) and sent through the engine deployment's handle, whose ``OpencotiRouter`` picks the
replica; the replica answers with the same app ``opencoti serve`` runs. Routes that describe the
whole service are answered by asking every replica and merging (aggregate.py):
``/polykv/pools``, ``/polykv/tps`` (snapshot and SSE), ``/polykv/tps/history``, ``/polykv/events``,
``/polykv/integrity``, ``/metrics`` (samples labelled ``replica``), ``/slots``, ``/health``, and
``/polykv/pools/{id}/capacity`` (over the pool's copies). Cluster routes:

    POST /polykv/pools/{id}/replicate   copy a pool to another replica ({"replica": tag} optional)
    GET  /cluster/replicas              each replica's tag, process, pools and engine counters
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from .hints import Hint, hint_for
from .ids import tag_of
from .policy import POLICY
from .registry import get_registry

log = logging.getLogger("opencoti.cluster")

ingress_app = FastAPI(title="opencoti cluster", version=__version__,
                      description="The opencoti HTTP API over several engine replicas (Ray Serve).")

POOL_FANOUT_OPS = frozenset({"pin", "unpin", "evict", "flush", "admission"})
_AUTO_COOLDOWN_S = 5.0


class ReplicaError(Exception):
    def __init__(self, status: int, message: str, etype: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.etype, self.headers = status, message, etype, headers or {}


def error_response(status: int, message: str, etype: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message, "type": etype}}, status_code=status,
                        headers=headers)


def _from_exception(e: BaseException) -> ReplicaError:
    cause = getattr(e, "cause", None) or e
    status = getattr(cause, "status_code", None)
    if isinstance(status, int):
        return ReplicaError(status, str(cause), getattr(cause, "error_type", "server_error"))
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return ReplicaError(503, "the replica serving this request stopped; retry", "unavailable_error",
                            {"Retry-After": "1"})
    return ReplicaError(500, f"cluster error: {type(cause).__name__}: {cause}", "server_error")


class ClusterIngress:
    def __init__(self, engine_handle, options: dict | None = None):
        opts = options or {}
        self.engine = engine_handle
        self.auto_replicate = bool(opts.get("auto_replicate", True))
        self.api_key = opts.get("api_key") or None
        self.affinity = opts.get("router", "opencoti") == "opencoti"
        ctx = None
        try:
            from ray import serve
            ctx = serve.get_replica_context()
        except Exception:  # noqa: BLE001
            pass
        self.registry = get_registry(ctx.app_name if ctx is not None else "")
        self._copies_version = -1
        self._copies_synced = -1e9
        self._last_auto: dict[int, float] = {}
        self._bg: set[asyncio.Task] = set()

    def check_key(self, request: Request) -> None:
        """The API key for the ingress's own routes (the replicas check it on everything they answer)."""
        if self.api_key is None:
            return
        import secrets
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        if given is None or not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise ReplicaError(401, "Invalid API Key" if given is not None else
                               "missing API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'",
                               "authentication_error", {"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ calls to replicas
    def call(self, method: str, hint: Hint, *args):
        return self.engine.options(method_name=method).remote(*args, route=hint.as_dict())

    async def sync_copies(self, max_age_s: float = 0.5) -> None:
        """The copies table from the registry (this ingress's own changes apply at once; other
        ingress replicas' changes within ``max_age_s``)."""
        now = time.monotonic()
        if now - self._copies_synced < max_age_s:
            return
        version, copies = await self.registry.all_copies.remote()
        self._copies_synced = time.monotonic()
        if version != self._copies_version:
            POLICY.set_copies(copies)
            self._copies_version = version

    async def ready_tags(self) -> list[int]:
        tags = POLICY.live_tags()
        if not tags:  # the handle's router learns the replica set on its first request
            await self.call("info", Hint())
            for _ in range(50):
                tags = POLICY.live_tags()
                if tags:
                    break
                await asyncio.sleep(0.05)
        return tags

    async def _open(self, req: dict, hint: Hint):
        """(head, generator of the rest) of one forwarded request."""
        gen = self.engine.options(method_name="forward", stream=True).remote(req, route=hint.as_dict())
        try:
            head = await gen.__anext__()
        except StopAsyncIteration:
            raise ReplicaError(500, "the replica sent no answer", "server_error")
        except Exception as e:  # noqa: BLE001
            raise _from_exception(e) from e
        return head, gen

    async def collect(self, req: dict, hint: Hint) -> tuple[int, dict, bytes]:
        head, gen = await self._open(req, hint)
        chunks = []
        try:
            async for c in gen:
                chunks.append(c)
        except Exception as e:  # noqa: BLE001
            raise _from_exception(e) from e
        return head["status"], dict(head["headers"]), b"".join(chunks)

    async def _json(self, req: dict, hint: Hint):
        status, headers, body = await self.collect(req, hint)
        try:
            return status, headers, json.loads(body) if body else None
        except ValueError:
            return status, headers, None

    async def fanout(self, req: dict, tags=None) -> dict[int, tuple[int, dict, bytes]]:
        # One replica after the other: Ray Serve's router matches a routed replica to its pending
        # request by the request id of the HTTP request being served, which concurrent handle
        # calls made while serving one request share (they would be fulfilled crosswise).
        if not self.affinity:  # Ray's default router cannot address a replica: one replica's view
            try:
                st, h, body = await self.collect(req, Hint())
            except ReplicaError:
                return {}
            return {int(h.get("x-opencoti-replica", "0")): (st, h, body)}
        tags = tags if tags is not None else await self.ready_tags()
        out = {}
        for t in tags:
            try:
                out[t] = await self.collect(req, Hint(tag=t))
            except ReplicaError:
                continue
        return out

    @staticmethod
    def replica_request(request: Request, body: bytes, path: str | None = None, method: str | None = None,
             query: str | None = None) -> dict:
        return {"method": method or request.method, "path": path or request.url.path,
                "query": request.url.query if query is None else query,
                "headers": [(k, v) for k, v in request.headers.items()], "body": body}

    def _learn(self, head: dict) -> None:
        h = dict(head["headers"])
        sid, tag = h.get("x-session-id"), h.get("x-opencoti-replica")
        if sid and tag and tag.isdigit() and self.affinity:
            POLICY.remember_session(sid, int(tag))

    def _respond(self, head: dict, gen) -> Response:
        async def rest():
            try:
                async for c in gen:
                    yield c
            except Exception:  # noqa: BLE001 - the replica died mid-answer: the stream ends here
                log.warning("a replica stopped while streaming an answer", exc_info=True)
            finally:
                gen.cancel()

        resp = StreamingResponse(rest(), status_code=head["status"])
        resp.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]]
        return resp

    # ------------------------------------------------------------------ forwarding
    async def forward(self, request: Request, hint: Hint | None = None, body: bytes | None = None) -> Response:
        body = await request.body() if body is None else body
        hint = hint if hint is not None else hint_for(request.method, request.url.path, body)
        if not self.affinity:
            hint = Hint()
        elif hint.pool_id is not None:
            await self.sync_copies()
        req = self.replica_request(request, body)
        try:
            head, gen = await self._open(req, hint)
            if head["status"] == 429 and hint.pool_id is not None and self.auto_replicate:
                retry = await self._on_saturated(hint.pool_id)
                if retry is not None:
                    gen.cancel()
                    head, gen = await self._open(req, Hint(tag=retry, pool_id=hint.pool_id, session_id=hint.session_id))
            elif (head["status"] == 503 and self.affinity and request.method == "POST"
                  and request.url.path == "/polykv/pools" and hint.pool_id is None and hint.session_id is None):
                head, gen = await self._create_elsewhere(req, hint, head, gen)
        except ReplicaError as e:
            return error_response(e.status, e.message, e.etype, e.headers)
        self._learn(head)
        h = dict(head["headers"])
        if (self.auto_replicate and hint.pool_id is not None
                and (h.get("x-sessions-remaining") == "0" or "x-admission-warning" in h)):
            self._spawn(self._maybe_replicate(hint.pool_id))
        return self._respond(head, gen)

    async def _create_elsewhere(self, req: dict, hint: Hint, head: dict, gen):
        """A new root pool that the chosen replica refused with 503 (its pool budget or KV is full, or
        it is stopping) goes to the other live replicas in turn, least loaded first: creating a pool
        on one replica while another has room must not fail. The last refusal is the answer; a
        replica that fails to answer (it died since it was listed) is passed over."""
        tag = dict(head["headers"]).get("x-opencoti-replica", "")
        tried = {int(tag)} if tag.isdigit() else set()
        ranked, _ = POLICY.rank(Hint(), await self.ready_tags())
        for t in ranked:
            if t in tried:
                continue
            tried.add(t)
            try:
                nxt = await self._open(req, Hint(tag=t))
            except ReplicaError:
                log.warning("replica %s failed while a refused pool creation was retried there", t, exc_info=True)
                continue
            gen.cancel()
            head, gen = nxt
            if head["status"] != 503:
                if head["status"] == 200 and hint.prefix:
                    POLICY.learn_prefix(hint.prefix, t)  # later requests with this prefix go to it
                break
        return head, gen

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ replication
    async def replicate(self, pool_id: int, target: int | None = None) -> dict:
        if not self.affinity:
            raise ReplicaError(400, "pool copies need the opencoti router (this cluster runs Ray Serve's default "
                                    "router)", "invalid_request_error")
        await self.sync_copies(max_age_s=0)
        tags = await self.ready_tags()
        primary = tag_of(pool_id)
        if primary is None or primary not in tags:
            hint = Hint(pool_id=pool_id)
            # the replica that gets it says 410 (lost) or 404 (never existed)
            status, _, body = await self.collect({"method": "GET", "path": f"/polykv/pools/{pool_id}",
                                                   "query": "", "headers": [], "body": b""}, hint)
            err = (json.loads(body) if body else {}).get("error", {})
            raise ReplicaError(status, err.get("message", f"pool {pool_id} not found"),
                               err.get("type", "not_found_error"))
        holders = POLICY.holders(pool_id)
        if target is not None:
            if target not in tags:
                raise ReplicaError(400, f"replica {target} is not live (live replicas: {tags})",
                                   "invalid_request_error")
            if target in holders:
                return self._copies_view(pool_id)
        else:
            free = [t for t in tags if t not in holders]
            if not free:
                raise ReplicaError(409, f"every live replica already holds pool {pool_id}", "conflict_error")
            target = sorted(free, key=lambda t: (POLICY.load.get(t, 0), t))[0]
        try:
            tokens = await self.call("pool_tokens", Hint(tag=primary), pool_id)
            _, _, info = await self._json({"method": "GET", "path": f"/polykv/pools/{pool_id}", "query": "",
                                           "headers": [], "body": b""}, Hint(tag=primary))
            _, _, adm = await self._json({"method": "GET", "path": f"/polykv/pools/{pool_id}/admission",
                                          "query": "", "headers": [], "body": b""}, Hint(tag=primary))
            copy = await self.call("create_copy", Hint(tag=target), pool_id, tokens,
                                    bool((info or {}).get("pinned")), (info or {}).get("label", ""), adm)
        except ReplicaError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _from_exception(e) from e
        await self.registry.add_copy.remote(pool_id, target, copy["pool_id"])
        POLICY.add_copy(pool_id, target, copy["pool_id"])
        return self._copies_view(pool_id)

    def _copies_view(self, pool_id: int) -> dict:
        holders = POLICY.holders(pool_id)
        return {"pool_id": pool_id, "replica": tag_of(pool_id),
                "copies": [{"replica": t, "pool_id": p} for t, p in sorted(holders.items())]}

    async def capacities(self, pool_id: int, query: str = "") -> dict[int, tuple[int, dict]]:
        holders = POLICY.holders(pool_id)
        out = {}
        for t, local in holders.items():
            try:
                st, _, body = await self._json({"method": "GET", "path": f"/polykv/pools/{local}/capacity",
                                                "query": query, "headers": [], "body": b""}, Hint(tag=t))
            except ReplicaError:
                continue
            if st == 200 and isinstance(body, dict):
                out[t] = (st, body)
        return out

    async def _on_saturated(self, pool_id: int) -> int | None:
        """A holder refused a new session (429): copy the pool to a replica that has room and
        return its tag for a retry (None: no copy could take it)."""
        await self.sync_copies()
        caps = await self.capacities(pool_id)
        for t, (_, c) in caps.items():
            if c.get("can_admit"):
                return t
        try:
            view = await self.replicate(pool_id)
        except ReplicaError as e:
            log.info("automatic replication of pool %s: %s", pool_id, e.message)
            return None
        caps = await self.capacities(pool_id)
        new = [c["replica"] for c in view["copies"] if c["replica"] in caps and caps[c["replica"]][1].get("can_admit")]
        return new[0] if new else None

    async def _maybe_replicate(self, pool_id: int) -> None:
        now = time.monotonic()
        if now - self._last_auto.get(pool_id, 0.0) < _AUTO_COOLDOWN_S:
            return
        self._last_auto[pool_id] = now
        try:
            caps = await self.capacities(pool_id)
            if caps and not any(c.get("can_admit") for _, c in caps.values()):
                await self.replicate(pool_id)
        except Exception as e:  # noqa: BLE001 - best effort; the next saturation retries
            log.info("automatic replication of pool %s did not happen: %s", pool_id, e)
