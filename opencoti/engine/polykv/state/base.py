"""``TreeState``: the pool tree and the sessions, what they are read for, and the few changes every
other part of ``PolyKV`` is made of (attach, detach, drop a session's KV, evict a pool's KV, unlink
and reap a released pool, expire a session).

``PolyKV`` (``polykv.py``) is this state plus the parts it composes, each given the state:
``Timers`` (``timers.py``: session TTL, deferred releases), ``Reclaim`` (``reclaim.py``: which KV
goes when pages run short) and ``Restore`` (``restore.py``: materialization and the restore calls).
Step thread only.
"""

from __future__ import annotations

import time
from typing import Callable

from ...config import EngineConfig
from ...limits import Limits
from ...requests import SeqState, Session
from ...errors import SessionNotFoundError
from ...kv.pages import PagePool
from ...kv.pool import Pool, Residency
from ...kv.tables import KVTables
from ..view import PoolView
from .tree import PoolTree

Listener = Callable[[str, dict], None]


class TreeState:
    def __init__(self, config: EngineConfig, kv: PagePool, limits: Limits, tables: KVTables, *,
                 listeners: list[Listener], counters: dict):
        self.config = config
        self.kv = kv
        self.page_size = kv.page_size
        self.limits = limits
        self.listeners = listeners
        self.counters = counters
        self.sessions: dict[str, Session] = {}
        self.tree = PoolTree(config.max_pools, id_base=config.pool_id_base)
        self.tables = tables

    # ======================================================================== reads
    def get_session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            raise SessionNotFoundError(f"session {session_id!r} not found")
        return s

    def session_pool(self, session: Session) -> Pool | None:
        """The pool ``session`` is attached to (live or released), or None."""
        return self.tree.find(session.pool_id)

    def sessions_in_use(self, pool: PoolView) -> bool:
        for sid in pool.sessions:
            s = self.sessions.get(sid)
            if s is not None and (s.job is not None or s.seq.num_borrowed_pages):
                return True
        return False

    def auto_pinned(self, pool: PoolView, now: float) -> bool:
        """Whether ``pool`` stays resident (not evictable) at ``now``: it has live children, a busy
        attached session or one holding its pages, or is inside its grace TTL."""
        return pool.is_auto_pinned(now, self.sessions_in_use(pool))

    def decoding_on(self, pool: Pool) -> bool:
        """A request is in flight on one of the pool's sessions (idle sessions do not count)."""
        return any(s is not None and s.job is not None for s in map(self.sessions.get, pool.sessions))

    def holders(self) -> list[SeqState]:
        """Every sequence that holds pages: pools (live and released) and sessions."""
        return ([p.seq for p in self.tree.pools.values()] + [p.seq for p in self.tree.released.values()]
                + [s.seq for s in self.sessions.values()])

    def holding_sessions(self, pool: Pool) -> list[Session]:
        """Sessions attached to ``pool`` or to any of its descendants, live or released (a released
        pool's KV lives while they read it): what keeps its KV."""
        out: list[Session] = []
        todo = [pool]
        while todo:
            p = todo.pop(0)
            out += [self.sessions[sid] for sid in sorted(p.sessions) if sid in self.sessions]
            todo.extend(p.children)
        return out

    # ======================================================================== the changes
    def attach(self, session: Session, pool: Pool) -> None:
        """``session`` becomes a leaf of ``pool`` (it must not be attached elsewhere)."""
        session.pool_id = pool.pool_id
        pool.sessions.add(session.session_id)

    def detach(self, s: Session) -> None:
        pool = self.session_pool(s)
        s.pool_id = None
        if pool is None:
            return
        pool.sessions.discard(s.session_id)
        if not pool.sessions and not pool.children:
            pool.grace_until = time.monotonic() + self.config.pool_grace_ttl_s
        self.reap(pool)

    def drop_session_kv(self, s: Session, detach: bool = True) -> None:
        """Drop a session's cached KV (its pages fall into the prefix cache); ``detach``: and its pool.
        It keeps the page keys of what it had (``spilled_keys``): its reports say where that KV is now."""
        if s.seq.page_keys:
            s.spilled_keys = list(s.seq.page_keys)
        self.tables.drop(s.seq)
        s.seq = SeqState()
        if detach:
            self.detach(s)

    def expire_session(self, s: Session) -> None:
        """An anonymous session ends (its TTL ran out, or ``session_ttl_s`` is 0)."""
        self.drop_session_kv(s)
        self.sessions.pop(s.session_id, None)
        self.counters["expired_sessions"] += 1

    def evict_kv(self, pool: Pool) -> None:
        """A resident pool's KV goes; it stays in the tree (re-materialized on its next use)."""
        self.tables.drop(pool.seq)
        pool.residency = Residency.EVICTED

    def unlink(self, pool: Pool) -> None:
        """``pool`` is released: out of the live tree, its KV kept while sessions read it."""
        self.tree.unlink(pool)
        self.reap(pool)

    def reap(self, pool: Pool | None) -> None:
        """A released pool's KV lives until its sessions and released children are gone."""
        while pool is not None and pool.residency == Residency.RELEASED and not pool.sessions and not pool.children:
            self.tables.drop(pool.seq)
            parent = pool.parent
            if self.tree.forget(pool):
                assert parent is not None
                parent.grace_until = time.monotonic() + self.config.pool_grace_ttl_s
            pool = parent
