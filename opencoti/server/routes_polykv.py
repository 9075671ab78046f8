"""The PolyKV control plane (spec §4): pools, sessions, tps, admission, capacity.

    POST   /polykv/pools                       create a root pool (tokens | text | messages | from_session)
    GET    /polykv/pools                       the pool tree
    GET    /polykv/pools/{id}                  one pool and its subtree
    DELETE /polykv/pools/{id}                  release (409 while it has child pools)
    POST   /polykv/pools/{id}/fork             extend (branch_pos == L) or branch (branch_pos < L)
    POST   /polykv/pools/{id}/{pin|unpin|evict|flush}
    GET    /polykv/pools/{id}/admission        the policy;  POST sets (merges) it
    GET    /polykv/pools/{id}/capacity         ?expected_tokens=N&session_id=S
    DELETE /polykv/sessions/{id}               release a session's cache
    POST   /polykv/sessions/{id}/compact       compaction by re-fork (spec §13.2)
    GET    /polykv/tps                         SSE every tps_interval_ms; ?once=1 one JSON snapshot
    GET    /polykv/tps/history                 the sampled tps series (?session_id, ?since)
    GET    /polykv/events                      admission events (?pool_id, ?since)
    GET    /polykv/integrity                   run the engine's KV integrity check

Pool bodies given as ``messages`` (+ ``tools``) are rendered exactly as a chat request renders
them (tool definitions injected into the system prompt when the template ignores tools), so the
pool is a token-exact prefix of the chat requests that use it.
"""

from __future__ import annotations

import asyncio

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ..engine.errors import InvalidRequestError
from .app import ServerState
from .schemas import AdmissionRequest, CompactRequest, CreatePoolRequest, ForkPoolRequest
from .sse import sse, sse_response
from .tools import render_chat_prompt

router = APIRouter(prefix="/polykv", tags=["PolyKV"])


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _prefix_tokens(state: ServerState, body, allow_session: bool = True) -> tuple[list[int] | None, str | None]:
    """(tokens, from_session) from exactly one prefix source of a pool body."""
    from_session = getattr(body, "from_session", None) if allow_session else None
    given = [name for name in ("tokens", "text", "messages") if getattr(body, name) is not None]
    if from_session is not None:
        given.append("from_session")
    if len(given) != 1:
        raise InvalidRequestError("give exactly one of tokens / text / messages / from_session"
                                  + (f" (got {', '.join(given)})" if given else ""))
    if body.tools is not None and body.messages is None:
        raise InvalidRequestError("tools are rendered with messages; give messages too")
    eng = state.require_engine()
    if body.tokens is not None:
        return list(body.tokens), None
    if body.text is not None:
        if not body.text:
            raise InvalidRequestError("text must be a non-empty string")
        return eng.tokenize(body.text), None
    if body.messages is not None:
        text = render_chat_prompt(eng.apply_chat_template, state.caps(), body.messages, body.tools,
                                  add_generation_prompt=getattr(body, "add_generation_prompt", False))
        return eng.tokenize(text), None
    return None, from_session


def _pool_dict(info) -> dict:
    return info.as_dict()


# ============================================================================ pools
@router.post("/pools", summary="create a root pool (prefill only; returns when resident)")
def create_pool(request: Request, body: CreatePoolRequest):
    state = _state(request)
    tokens, from_session = _prefix_tokens(state, body)
    info = state.require_engine().create_pool(tokens=tokens, from_session=from_session, pinned=body.pinned,
                                              label=body.label)
    return _pool_dict(info)


@router.get("/pools", summary="the pool tree with sessions, KV bytes by ownership")
def list_pools(request: Request):
    return _state(request).require_engine().pools()


@router.get("/pools/{pool_id}", summary="one pool and its subtree")
def get_pool(request: Request, pool_id: int):
    eng = _state(request).require_engine()
    root = _pool_dict(eng.pool(pool_id))
    tree = {p["pool_id"]: p for p in eng.pools()["pools"]}
    subtree, todo = [], list(root["children"])
    while todo:
        pid = todo.pop(0)
        p = tree.get(pid)
        if p is not None:
            subtree.append(p)
            todo.extend(p["children"])
    return {**root, "subtree": subtree}


@router.delete("/pools/{pool_id}", summary="release a pool (409 while it has child pools)")
def release_pool(request: Request, pool_id: int):
    _state(request).require_engine().release_pool(pool_id)
    return {"pool_id": pool_id, "released": True}


@router.post("/pools/{pool_id}/fork", summary="fork: extend (branch_pos == L) or COW branch (branch_pos < L)")
def fork_pool(request: Request, pool_id: int, body: ForkPoolRequest):
    state = _state(request)
    eng = state.require_engine()
    eng.pool(pool_id)  # 404 before any tokenizing
    tokens, from_session = _prefix_tokens(state, body)
    info = eng.fork_pool(pool_id, branch_pos=body.branch_pos, tokens=tokens, from_session=from_session,
                         pinned=body.pinned, label=body.label)
    return _pool_dict(info)


@router.post("/pools/{pool_id}/pin", summary="pin: never evicted")
def pin_pool(request: Request, pool_id: int):
    return _pool_dict(_state(request).require_engine().pin_pool(pool_id))


@router.post("/pools/{pool_id}/unpin")
def unpin_pool(request: Request, pool_id: int):
    return _pool_dict(_state(request).require_engine().unpin_pool(pool_id))


@router.post("/pools/{pool_id}/evict", summary="drop the pool's KV now (it re-materializes on next use)")
def evict_pool(request: Request, pool_id: int):
    return _pool_dict(_state(request).require_engine().evict_pool(pool_id))


@router.post("/pools/{pool_id}/flush", summary="end the idle sessions attached to the pool")
def flush_pool(request: Request, pool_id: int):
    n = _state(request).require_engine().flush_pool(pool_id)
    return {"pool_id": pool_id, "flushed_sessions": n}


# ============================================================================ admission
@router.get("/pools/{pool_id}/admission", summary="the pool's admission policy")
def get_admission(request: Request, pool_id: int):
    return _state(request).require_engine().admission(pool_id)


@router.post("/pools/{pool_id}/admission", summary="set (merge) the pool's admission policy")
def set_admission(request: Request, pool_id: int, body: AdmissionRequest):
    policy = body.model_dump(exclude_unset=True)
    policy = {k: v for k, v in policy.items() if v is not None or k == "target_tps_per_session"}
    return _state(request).require_engine().set_admission(pool_id, **policy)


@router.get("/pools/{pool_id}/capacity", summary="can one more (new) session be admitted, and why")
def capacity(request: Request, pool_id: int, expected_tokens: int | None = Query(None, ge=0),
             session_id: str | None = None):
    return _state(request).require_engine().capacity(pool_id, expected_tokens=expected_tokens, session_id=session_id)


@router.get("/events", summary="recent admission events")
def events(request: Request, pool_id: int | None = None, since: float | None = None):
    return {"events": _state(request).require_engine().admission_events(pool_id, since)}


# ============================================================================ sessions
@router.delete("/sessions/{session_id}", summary="release a session and its KV")
def release_session(request: Request, session_id: str):
    _state(request).require_engine().release_session(session_id)
    return {"session_id": session_id, "released": True}


@router.post("/sessions/{session_id}/compact", summary="compaction by re-fork of a stable ancestor (spec §13.2)")
def compact_session(request: Request, session_id: str, body: CompactRequest):
    state = _state(request)
    eng = state.require_engine()
    tokens, _ = _prefix_tokens(state, body, allow_session=False)
    out = eng.compact_session(session_id, body.ancestor_pool_id, tokens=tokens, branch_pos=body.branch_pos,
                              release_old=body.release_old)
    return {**out, "pool": _pool_dict(out["pool"])}


# ============================================================================ tps
@router.get("/tps", summary="live tps: SSE every interval (?once=1: one JSON snapshot)")
async def tps(request: Request, once: bool = False, interval_ms: float | None = Query(None, ge=50, le=60000),
              count: int | None = Query(None, ge=1, description="end the stream after this many events")):
    state = _state(request)
    eng = state.require_engine()
    if once:
        return JSONResponse(await anyio.to_thread.run_sync(eng.tps_snapshot))
    period = (interval_ms if interval_ms is not None else state.config.tps_interval_ms) / 1e3

    async def stream():
        n = 0
        while not state.stopping.is_set() and not eng.is_closed:
            try:
                snap = await anyio.to_thread.run_sync(eng.tps_snapshot)
            except Exception:  # noqa: BLE001 - the engine closed under us: end the stream
                return
            yield sse(snap)
            n += 1
            if count is not None and n >= count:
                return
            t_end = asyncio.get_running_loop().time() + period
            while not state.stopping.is_set():  # wake up promptly on shutdown
                left = t_end - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                await asyncio.sleep(min(left, 0.1))

    return sse_response(stream())


@router.get("/tps/history", summary="the sampled tps time series")
def tps_history(request: Request, session_id: str | None = None, since: float | None = None):
    return _state(request).require_engine().tps_history(session_id, since)


@router.get("/integrity", summary="run the KV integrity check (refcounts, ownership)")
def integrity(request: Request):
    eng = _state(request).require_engine()
    try:
        eng.check_integrity()
    except AssertionError as e:
        return JSONResponse({"ok": False, "error": {"code": 500, "message": f"integrity check failed: {e}",
                                                    "type": "server_error"}}, status_code=500)
    st = eng.pools()
    return {"ok": True, "kv_pages_used": st["kv_pages_used"], "kv_pages_total": st["kv_pages_total"]}
