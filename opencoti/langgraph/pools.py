"""Pools that outlive their pools: what a pool *is*, kept in the graph state, and ``ensure_pool``.

A checkpointed ``pool_id`` is only a number: after the engine or the server restarts (or when a
thread is resumed against another engine) the pool is gone, or the number names another pool.
So a graph keeps, next to the id, what the pool is — its prefix (messages + tools, text or
tokens), its parent and its branch position — in ``state["pools"]`` (``track_pool``), and
``ensure_pool`` re-creates a missing pool (its missing ancestors first) from that record,
transparently:

    root = client.create_pool(messages=SYSTEM, pinned=True)
    return {"pool_id": root.pool_id, "root_pool_id": root.pool_id, **track_pool(root, messages=SYSTEM)}
    ...
    pool_id, update = ensure_pool(client, state)      # the live id + a state update (empty if nothing moved)

A re-created pool gets a new id: the update moves ``pool_id`` / ``root_pool_id`` and the record
to it and appends ``{"old_pool_id", "pool_id", "label", "prefix_len"}`` to
``state["pools_recreated"]`` (and logs it). Within one process a re-created pool is re-created
once, however many nodes or parallel branches ask for it. With server-side persistence the pool
survives and ``ensure_pool`` is one ``pool(id)`` call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from typing import Any, Generator, Optional, TypedDict

from ..client import AsyncPolyKVClient, PolyKVClient, PoolNotFoundError

log = logging.getLogger("opencoti.langgraph")

POOLS_KEY = "pools"
RECREATED_KEY = "pools_recreated"
_POOL_KEYS = ("pool_id", "root_pool_id")
_CONTENT = ("tokens", "text", "messages", "tools", "add_generation_prompt", "from_session")


class PoolSpec(TypedDict, total=False):
    """What a pool is: enough to make it again (``state["pools"][str(pool_id)]``)."""

    pool_id: int
    """The pool's current id."""
    parent: Optional[int]
    """The parent pool's id (a key of the same record), None for a root."""
    branch_pos: Optional[int]
    """D: where it branches off its parent (== the parent's length for an extension)."""
    prefix_len: int
    """L, checked when the id is found again (after a restart an id may name another pool)."""
    tokens: Optional[list[int]]
    text: Optional[str]
    messages: Optional[list[dict]]
    tools: Optional[list[dict]]
    add_generation_prompt: bool
    from_session: Optional[str]
    """Pools snapshotted from a session cannot be re-created (the session is gone with them)."""
    pinned: bool
    label: str


def merge_pools(current: Optional[dict], update: Optional[dict]) -> dict:
    """Reducer of ``state["pools"]``: merge by pool id; a ``None`` value removes that entry."""
    out = dict(current or {})
    for k, v in (update or {}).items():
        if v is None:
            out.pop(str(k), None)
        else:
            out[str(k)] = v
    return out


def pool_spec(pool: Any, *, tokens=None, text=None, messages=None, tools=None, add_generation_prompt: bool = False,
              from_session: str | None = None) -> PoolSpec:
    """The record of ``pool`` (a client ``Pool`` or its dict) made from the given prefix source."""
    p = pool.model_dump() if hasattr(pool, "model_dump") else dict(pool)
    given = [k for k, v in (("tokens", tokens), ("text", text), ("messages", messages),
                            ("from_session", from_session)) if v is not None]
    if len(given) != 1:
        raise ValueError("track a pool with exactly one of tokens / text / messages (+ tools) / from_session: "
                         "the prefix it was made from")
    spec: PoolSpec = {"pool_id": int(p["pool_id"]), "parent": p.get("parent"),
                      "branch_pos": p.get("branch_pos") if p.get("parent") is not None else None,
                      "prefix_len": int(p.get("prefix_len") or 0), "pinned": bool(p.get("pinned")),
                      "label": p.get("label") or ""}
    for k, v in (("tokens", list(tokens) if tokens is not None else None), ("text", text),
                 ("messages", messages), ("tools", tools), ("from_session", from_session)):
        if v is not None:
            spec[k] = v
    if add_generation_prompt:
        spec["add_generation_prompt"] = True
    return spec


def track_pool(pool: Any, **source: Any) -> dict:
    """A state update recording ``pool`` in ``state["pools"]`` (``source``: how it was made,
    as for ``pool_spec``)."""
    spec = pool_spec(pool, **source)
    return {POOLS_KEY: {str(spec["pool_id"]): spec}}


# ============================================================================ the re-creation plan
# Re-created pools of this process, by transport and record fingerprint -> live pool id, so that
# nodes, tools and parallel branches that each see the old id re-create a pool once.
_RECREATED: dict[tuple, dict[str, int]] = {}
_GUARD = threading.Lock()
_LOCKS: dict[tuple, threading.Lock] = {}
_ALOCKS: dict[tuple, asyncio.Lock] = {}


def _transport(client: Any) -> tuple:
    if getattr(client, "engine", None) is not None:
        return ("engine", id(client.engine))
    return ("http", getattr(client, "base_url", None))


def _fingerprint(specs: dict, pid: int, depth: int = 0) -> str:
    spec = specs.get(str(pid)) or {}
    if depth > 64:
        raise ValueError("the pool record has a cycle")
    parent = spec.get("parent")
    body = {k: spec.get(k) for k in (*_CONTENT, "branch_pos", "label", "prefix_len")}
    body["parent"] = _fingerprint(specs, parent, depth + 1) if parent is not None else None
    return hashlib.sha1(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _matches(pool: Any, spec: dict, parent_id: Optional[int]) -> bool:
    if pool is None:
        return False
    if pool.parent != parent_id or pool.prefix_len != spec.get("prefix_len", pool.prefix_len):
        return False
    if (pool.label or "") != (spec.get("label") or ""):
        return False
    return parent_id is None or spec.get("branch_pos") is None or pool.branch_pos == spec["branch_pos"]


def _plan(specs: dict, pid: int, remap: dict[int, int], made: list[int], key: tuple,
          depth: int = 0) -> Generator[tuple[str, dict], Any, int]:
    """Yields client operations (``(op, kwargs)``, sent back their results; ``pool`` answers None
    for a missing pool) and returns the live id of pool ``pid``; fills ``remap`` old -> new and
    ``made`` (the old ids re-created)."""
    if pid in remap:
        return remap[pid]
    if depth > 64:
        raise ValueError("the pool record has a cycle")
    spec = specs.get(str(pid))
    found = yield ("pool", {"pool_id": pid})
    if spec is None:
        if found is None:
            raise PoolNotFoundError(f"pool {pid} not found, and the graph state does not record what it was "
                                    "(record pools with track_pool to have them re-created)")
        return pid
    if _matches(found, spec, spec.get("parent")):
        return pid
    parent = spec.get("parent")
    parent_live = (yield from _plan(specs, parent, remap, made, key, depth + 1)) if parent is not None else None
    if parent_live != parent and _matches(found, spec, parent_live):
        remap[pid] = pid
        return pid
    fp = _fingerprint(specs, pid)
    cached = _RECREATED.get(key, {}).get(fp)
    if cached is not None and cached != pid:
        again = yield ("pool", {"pool_id": cached})
        if _matches(again, spec, parent_live):
            remap[pid] = cached
            return cached
    if spec.get("from_session") is not None:
        raise PoolNotFoundError(f"pool {pid} is gone and cannot be re-created: it was a snapshot of session "
                                f"{spec['from_session']!r}")
    src = {k: spec[k] for k in ("tokens", "text", "messages", "tools") if spec.get(k) is not None}
    if spec.get("add_generation_prompt"):
        src["add_generation_prompt"] = True
    if parent_live is None:
        new = yield ("create_pool", {**src, "pinned": bool(spec.get("pinned")), "label": spec.get("label") or ""})
    else:
        new = yield ("fork_pool", {"parent_id": parent_live, "branch_pos": spec.get("branch_pos"), **src,
                                   "pinned": bool(spec.get("pinned")), "label": spec.get("label") or ""})
    remap[pid] = new.pool_id
    made.append(pid)
    with _GUARD:
        _RECREATED.setdefault(key, {})[fp] = new.pool_id
    log.warning("pool %s (%r, %d tokens) was gone: re-created as pool %s", pid, spec.get("label") or "",
                new.prefix_len, new.pool_id)
    return new.pool_id


def _update(state: dict, specs: dict, remap: dict[int, int], made: list[int]) -> dict:
    moved = {o: n for o, n in remap.items() if o != n}
    if not moved and not made:
        return {}
    pools: dict[str, Any] = {str(o): None for o in moved}
    for k, s in specs.items():
        pid = int(k)
        if pid in remap or s.get("parent") in remap:
            new = dict(s)
            new["pool_id"] = remap.get(pid, pid)
            if s.get("parent") in remap:
                new["parent"] = remap[s["parent"]]
            pools[str(new["pool_id"])] = new
    upd: dict[str, Any] = {POOLS_KEY: pools, RECREATED_KEY: [
        {"old_pool_id": o, "pool_id": remap[o], "label": specs[str(o)].get("label") or "",
         "prefix_len": specs[str(o)].get("prefix_len")} for o in made]}
    for key in _POOL_KEYS:
        if state.get(key) in moved:
            upd[key] = moved[state[key]]
    return upd


def _target(state: dict, pool_id: Optional[int], key: str) -> int:
    pid = state.get(key) if pool_id is None else pool_id
    if pid is None:
        raise ValueError(f"no pool: give pool_id= or set state[{key!r}]")
    return int(pid)


def ensure_pool(client: Any, state: dict, pool_id: Optional[int] = None, *,
                key: str = "pool_id") -> tuple[int, dict]:
    """``(live pool id, state update)`` for ``pool_id`` (default ``state[key]``): the pool as it
    is, or re-created (with its missing ancestors) from ``state["pools"]``. ``client``: a
    ``PolyKVClient`` (an ``AsyncPolyKVClient`` is refused here: use ``aensure_pool``)."""
    if isinstance(client, AsyncPolyKVClient):
        raise TypeError("ensure_pool needs a sync PolyKVClient; use aensure_pool with an AsyncPolyKVClient")
    pid = _target(state, pool_id, key)
    specs = dict(state.get(POOLS_KEY) or {})
    remap: dict[int, int] = {}
    made: list[int] = []
    tkey = _transport(client)
    # first without the lock, reading only: the pools are there as recorded (the common case), so
    # parallel branches do not wait for each other; a re-creation is planned again under the lock
    gen = _plan(specs, pid, remap, made, tkey)
    result: Any = None
    try:
        while True:
            op, kw = gen.send(result)
            if op != "pool":
                break
            result = _sync_op(client, op, kw)
    except StopIteration as stop:
        return stop.value, _update(state, specs, remap, made)
    gen.close()
    remap.clear()
    with _GUARD:
        lock = _LOCKS.setdefault(tkey, threading.Lock())
    with lock:
        gen = _plan(specs, pid, remap, made, tkey)
        result = None
        try:
            while True:
                op, kw = gen.send(result)
                result = _sync_op(client, op, kw)
        except StopIteration as stop:
            live = stop.value
    return live, _update(state, specs, remap, made)


async def aensure_pool(client: Any, state: dict, pool_id: Optional[int] = None, *,
                       key: str = "pool_id") -> tuple[int, dict]:
    """``ensure_pool`` for an ``AsyncPolyKVClient`` (a sync client is run in a thread)."""
    if isinstance(client, PolyKVClient):
        return await asyncio.to_thread(ensure_pool, client, state, pool_id, key=key)
    pid = _target(state, pool_id, key)
    specs = dict(state.get(POOLS_KEY) or {})
    remap: dict[int, int] = {}
    made: list[int] = []
    tkey = _transport(client)
    gen = _plan(specs, pid, remap, made, tkey)  # first without the lock, reading only (see ensure_pool)
    result: Any = None
    try:
        while True:
            op, kw = gen.send(result)
            if op != "pool":
                break
            result = await _async_op(client, op, kw)
    except StopIteration as stop:
        return stop.value, _update(state, specs, remap, made)
    gen.close()
    remap.clear()
    lkey = (tkey, id(asyncio.get_running_loop()))
    with _GUARD:
        lock = _ALOCKS.setdefault(lkey, asyncio.Lock())
    async with lock:
        gen = _plan(specs, pid, remap, made, tkey)
        result = None
        try:
            while True:
                op, kw = gen.send(result)
                result = await _async_op(client, op, kw)
        except StopIteration as stop:
            live = stop.value
    return live, _update(state, specs, remap, made)


def _sync_op(client: PolyKVClient, op: str, kw: dict) -> Any:
    if op == "pool":
        try:
            return client.pool(kw["pool_id"])
        except PoolNotFoundError:
            return None
    if op == "fork_pool":
        kw = dict(kw)
        return client.fork_pool(kw.pop("parent_id"), **kw)
    return getattr(client, op)(**kw)


async def _async_op(client: AsyncPolyKVClient, op: str, kw: dict) -> Any:
    if op == "pool":
        try:
            return await client.pool(kw["pool_id"])
        except PoolNotFoundError:
            return None
    if op == "fork_pool":
        kw = dict(kw)
        return await client.fork_pool(kw.pop("parent_id"), **kw)
    return await getattr(client, op)(**kw)
