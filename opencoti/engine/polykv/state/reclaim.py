"""``Reclaim``: the memory policy, a part of ``PolyKV``: which KV goes when the KV tables run short
of pages (it is their ``kv.tables.Reclaimer``, through ``PolyKV.reclaim``). Cache pages first
(least recently used leaves), then idle sessions' KV, then pools neither pinned nor auto-pinned
(least recently used first). So any allocation that may reclaim (``KVTables.extend_reclaiming``
while the scheduler plans, ``share_into``, ``reserve_partial_copy``, ``promote``) may evict."""

from __future__ import annotations

import time

from ...requests import Session
from ...kv.pool import Residency
from .base import TreeState


class Reclaim:
    def __init__(self, state: TreeState):
        self.state = state

    def reclaim(self, num_pages: int, keep: Session | None = None) -> int:
        """Free at least num_pages if possible: cache pages first (LRU, leaves first), then idle
        sessions' KV, then idle pools (LRU). An evicted session stays attached to its pool (it
        recomputes on its next turn). Returns the pages freed."""
        state = self.state
        kv, tables = state.kv, state.tables
        start = kv.num_free

        def short() -> int:
            return num_pages - (kv.num_free - start)

        now = time.monotonic()
        idle = sorted((s for s in state.sessions.values() if s.is_idle and s.seq.page_table and s is not keep),
                      key=lambda s: s.last_access)
        # sessions idle for longer than kv_idle_spill_s (waiting on a tool, a sub-agent, a user) go
        # before the prefix cache's pages; those idle for less (about to come back) after them
        waiting = [s for s in idle if now - s.last_access >= state.config.kv_idle_spill_s]
        for s in waiting + [None] + [s for s in idle if s not in waiting]:
            if short() <= 0:
                break
            if s is not None:
                self._spill_session(s)
            tables.evict_cache(short())
        while short() > 0:
            cands = [p for p in state.tree.pools.values()
                     if p.residency == Residency.RESIDENT and not p.pinned and not state.auto_pinned(p, now)]
            if not cands:
                break
            state.evict_kv(min(cands, key=lambda p: p.last_access_wall))
            tables.evict_cache(short())
            state.counters["evicted_pools"] += 1
        return kv.num_free - start

    def _spill_session(self, s: Session) -> None:
        """Reclaim an idle session's KV: its pages fall into the prefix cache (evicted from there to
        the disk tier, when there is one); it stays attached to its pool and keeps the page keys
        of what it had (``drop_session_kv``)."""
        self.state.drop_session_kv(s, detach=False)
        self.state.counters["evicted_sessions"] += 1
