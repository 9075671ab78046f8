"""Routes of the cluster ingress (registered on ``ingress.ingress_app``).

Routes that need the whole cluster come first; everything else falls through to the catch-all
that forwards the request to the replica the router picks.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..engine.errors import OpencotiError
from ..ops.schemas import ReleasePoolQuery
from ..ops.validation import validate_query
from . import aggregate
from .hints import Hint, parse_json
from .ids import tag_of
from .ingress import POOL_FANOUT_OPS, ClusterIngress, ReplicaError, error_response, ingress_app
from .policy import POLICY

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def _ingress() -> ClusterIngress:
    from ray import serve
    return serve.get_replica_context().servable_object


def _loads(body: bytes):
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


async def _fanout_json(ing: ClusterIngress, request: Request, path: str, query: str | None = None) -> dict:
    res = await ing.fanout(ing.replica_request(request, b"", path=path, method="GET", query=query))
    return {t: (st, _loads(body)) for t, (st, _, body) in res.items()}


def _first_error(res: dict) -> JSONResponse | None:
    """The replicas' answer when none of them succeeded (e.g. 401, 503 while loading)."""
    if not res:
        return error_response(503, "no replica is available", "unavailable_error", {"Retry-After": "1"})
    if all(st != 200 for st, _ in res.values()):
        st, body = next(iter(res.values()))
        return JSONResponse(body, status_code=st)
    return None


# ============================================================================ cluster routes
@ingress_app.get("/cluster/replicas", tags=["cluster"], summary="each replica: tag, process, pools, counters")
async def replicas(request: Request):
    ing = _ingress()
    try:
        ing.check_key(request)
    except ReplicaError as e:
        return error_response(e.status, e.message, e.etype, e.headers)
    tags = await ing.ready_tags()
    out = []
    for t in tags:  # one after the other (see ClusterIngress.fanout)
        try:
            out.append(await ing.call("info", Hint(tag=t)))
        except Exception:  # noqa: BLE001 - a replica that stopped is left out
            continue
    return {"replicas": out, "routing": {"decisions": dict(POLICY.decisions), "load": dict(POLICY.load),
                                         "sessions_known": len(POLICY.sessions), "prefix_entries": len(POLICY.index)}}


@ingress_app.post("/polykv/pools/{pool_id}/replicate", tags=["cluster"], summary="copy a pool to another replica")
async def replicate(request: Request, pool_id: int):
    ing = _ingress()
    try:
        ing.check_key(request)
    except ReplicaError as e:
        return error_response(e.status, e.message, e.etype, e.headers)
    body = parse_json(await request.body()) or {}
    target = body.get("replica")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int)):
        return error_response(400, "replica must be an integer replica tag (see GET /cluster/replicas)", "invalid_request_error")
    try:
        return await ing.replicate(pool_id, target)
    except ReplicaError as e:
        return error_response(e.status, e.message, e.etype, e.headers)


@ingress_app.get("/polykv/pools/{pool_id}/capacity", tags=["PolyKV"], summary="capacity over the pool's copies")
async def capacity(request: Request, pool_id: int):
    ing = _ingress()
    await ing.sync_copies()
    if len(POLICY.holders(pool_id)) < 2:
        return await ing.forward(request, Hint(pool_id=pool_id), b"")
    caps = await ing.capacities(pool_id, request.url.query)
    if not caps:
        return await ing.forward(request, Hint(pool_id=pool_id), b"")
    return aggregate.merge_capacity(pool_id, caps, tag_of(pool_id))


@ingress_app.api_route("/polykv/pools/{pool_id}", methods=["GET", "DELETE"], tags=["PolyKV"])
async def pool(request: Request, pool_id: int):
    ing = _ingress()
    query = None
    if request.method == "DELETE":  # checked before any copy is dropped (nothing half-done)
        try:
            query = validate_query(ReleasePoolQuery, dict(request.query_params))
        except OpencotiError as e:
            return error_response(400, str(e), "invalid_request_error")
    await ing.sync_copies()
    holders = POLICY.holders(pool_id)
    primary = tag_of(pool_id)
    ended: list[str] = []  # sessions the copies ended (?cascade=sessions)
    if len(holders) < 2 or primary not in holders:
        if query is not None and pool_id in POLICY.copies:
            ended = await _drop_copies(ing, pool_id, query)
        resp = await ing.forward(request, Hint(pool_id=pool_id), b"")  # the query string travels with it
        if not ended:
            return resp
        st, _, body = await _read(resp)
        obj = _loads(body)
        if st == 200 and isinstance(obj, dict):
            obj["ended_sessions"] = list(obj.get("ended_sessions") or []) + ended
            return JSONResponse(obj)
        return Response(body, status_code=st, media_type="application/json")
    try:
        st, h, body = await ing.collect(ing.replica_request(request, b""), Hint(tag=primary))
    except ReplicaError as e:
        return error_response(e.status, e.message, e.etype, e.headers)
    obj = _loads(body)
    if query is not None and st == 200:
        ended = await _drop_copies(ing, pool_id, query)
    if st == 200 and isinstance(obj, dict):
        obj["replica"] = primary
        obj["copies"] = [{"replica": t, "pool_id": p} for t, p in sorted(holders.items())]
        if query is not None and query.cascade == "sessions":  # the primary's and every copy's ended sessions
            obj["ended_sessions"] = list(obj.get("ended_sessions") or []) + ended
        return JSONResponse(obj)
    return Response(body, status_code=st, media_type="application/json")


async def _read(resp: Response) -> tuple[int, dict, bytes]:
    """A forwarded (streaming) answer read whole."""
    chunks = [c async for c in resp.body_iterator] if isinstance(resp, StreamingResponse) else [resp.body]
    return resp.status_code, dict(resp.headers), b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)


async def _drop_copies(ing: ClusterIngress, pool_id: int, query: ReleasePoolQuery) -> list[str]:
    """Release every copy of the pool as the DELETE asked (``immediate``, ``cascade=sessions``);
    returns the sessions the copies ended."""
    ended: list[str] = []
    cascade = query.cascade == "sessions"
    for t, local in list(POLICY.copies.get(pool_id, {}).items()):
        try:
            got = await ing.call("drop_copy", Hint(tag=t), pool_id, bool(query.immediate), cascade)
        except Exception:  # noqa: BLE001 - a dead replica's copy is gone anyway
            continue
        ended.extend(got or [])
    await ing.registry.drop_pool.remote(pool_id)
    POLICY.drop_pool(pool_id)
    return ended


@ingress_app.post("/polykv/pools/{pool_id}/{op}", tags=["PolyKV"])
async def pool_op(request: Request, pool_id: int, op: str):
    """pin/unpin/evict/flush/admission apply to every copy; other operations (fork) to the pool itself."""
    ing = _ingress()
    body = await request.body()
    await ing.sync_copies()
    holders = POLICY.holders(pool_id)
    primary = tag_of(pool_id)
    if op not in POOL_FANOUT_OPS or len(holders) < 2 or primary not in holders:
        hint = Hint(tag=primary) if primary in holders else Hint(pool_id=pool_id)
        return await ing.forward(request, hint, body)
    results = {}
    for t, local in sorted(holders.items()):
        try:
            results[t] = await ing.collect(ing.replica_request(request, body, path=f"/polykv/pools/{local}/{op}"), Hint(tag=t))
        except ReplicaError as e:
            results[t] = (e.status, {}, json.dumps({"error": {"code": e.status, "message": e.message,
                                                               "type": e.etype}}).encode())
    st, _, pbody = results[primary]
    obj = _loads(pbody)
    if st == 200 and isinstance(obj, dict):
        obj["copies"] = [{"replica": t, "pool_id": holders[t], "status": s, **({} if s == 200 else (_loads(b) or {}))}
                         for t, (s, _, b) in sorted(results.items())]
        return JSONResponse(obj)
    return Response(pbody, status_code=st, media_type="application/json")


# ============================================================================ merged views
@ingress_app.get("/health", tags=["llama.cpp"])
@ingress_app.get("/v1/health", tags=["llama.cpp"])
async def health(request: Request):
    ing = _ingress()
    res = await _fanout_json(ing, request, request.url.path)
    ok = [t for t, (st, _) in res.items() if st == 200]
    if ok:
        return {"status": "ok", "replicas": len(res), "replicas_ok": len(ok)}
    return _first_error(res) or error_response(503, "Loading model", "unavailable_error", {"Retry-After": "5"})


@ingress_app.get("/polykv/pools", tags=["PolyKV"])
async def pools(request: Request):
    ing = _ingress()
    await ing.sync_copies()
    res = await _fanout_json(ing, request, "/polykv/pools")
    err = _first_error(res)
    if err is not None:
        return err
    return aggregate.merge_pools({t: b for t, (st, b) in res.items() if st == 200}, POLICY.copies)


@ingress_app.get("/polykv/tps", tags=["PolyKV"])
async def tps(request: Request, once: bool = False, interval_ms: float | None = None, count: int | None = None):
    ing = _ingress()
    if interval_ms is not None and not (50 <= interval_ms <= 60000):
        return error_response(400, "interval_ms must be in [50, 60000]", "invalid_request_error")
    if count is not None and count < 1:
        return error_response(400, "count must be >= 1", "invalid_request_error")

    async def snapshot():
        res = await _fanout_json(ing, request, "/polykv/tps", "once=1")
        return res, aggregate.merge_tps({t: b for t, (st, b) in res.items() if st == 200})

    res, snap = await snapshot()
    err = _first_error(res)
    if err is not None:
        return err
    if once:
        return snap
    period = (interval_ms or 500.0) / 1e3

    async def stream():
        nonlocal snap
        n = 0
        while True:
            yield f"data: {json.dumps(snap)}\n\n".encode()
            n += 1
            if count is not None and n >= count:
                return
            t_end = time.monotonic() + period
            while time.monotonic() < t_end:
                if await request.is_disconnected():
                    return
                await asyncio.sleep(min(0.1, max(0.0, t_end - time.monotonic())))
            _, snap = await snapshot()

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@ingress_app.get("/polykv/tps/history", tags=["PolyKV"])
@ingress_app.get("/polykv/events", tags=["PolyKV"])
@ingress_app.get("/polykv/integrity", tags=["PolyKV"])
@ingress_app.get("/slots", tags=["llama.cpp"])
async def merged(request: Request):
    ing = _ingress()
    path = request.url.path
    res = await _fanout_json(ing, request, path, request.url.query)
    if path == "/polykv/integrity":
        if not res:
            return _first_error(res)
        st, body = aggregate.merge_integrity({t: (s, b or {}) for t, (s, b) in res.items()})
        return JSONResponse(body, status_code=st)
    err = _first_error(res)
    if err is not None:
        return err
    ok = {t: b for t, (st, b) in res.items() if st == 200}
    if path == "/polykv/tps/history":
        return aggregate.merge_history(ok)
    if path == "/polykv/events":
        return aggregate.merge_events(ok)
    return aggregate.merge_slots(ok)


@ingress_app.get("/metrics", tags=["llama.cpp"], response_class=PlainTextResponse)
async def metrics(request: Request):
    ing = _ingress()
    res = await ing.fanout(ing.replica_request(request, b"", path="/metrics", method="GET"))
    texts = {t: body.decode() for t, (st, _, body) in res.items() if st == 200}
    if not texts:
        if res:
            st, h, body = next(iter(res.values()))
            return Response(body, status_code=st, media_type=h.get("content-type"))
        return error_response(503, "no replica is available", "unavailable_error", {"Retry-After": "1"})
    extra = ["# HELP opencoti_cluster_routed_total Requests routed by the cluster router, by reason.",
             "# TYPE opencoti_cluster_routed_total counter"]
    extra += [f'opencoti_cluster_routed_total{{reason="{r}"}} {n}' for r, n in sorted(POLICY.decisions.items())]
    extra += ["# HELP opencoti_cluster_replicas Live engine replicas.", "# TYPE opencoti_cluster_replicas gauge",
              f"opencoti_cluster_replicas {len(POLICY.live_tags())}"]
    return PlainTextResponse(aggregate.merge_metrics(texts, "\n".join(extra) + "\n"),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


# ============================================================================ everything else
@ingress_app.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
async def catch_all(request: Request, path: str):
    return await _ingress().forward(request)
