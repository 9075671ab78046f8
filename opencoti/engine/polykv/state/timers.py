"""``Timers``: what happens when time passes, a part of ``PolyKV``: idle anonymous sessions end
after ``session_ttl_s``, and a pool's release waits out its grace (``pool_grace_ttl_s``). The step
loop calls ``expire_sessions`` and ``release_due`` on each turn, through ``PolyKV``."""

from __future__ import annotations

import time

from ...requests import Session
from ...errors import PoolBusyError
from ...kv.pool import Pool, Residency
from .base import TreeState


class Timers:
    def __init__(self, state: TreeState):
        self.state = state
        self._next_expiry_check = 0.0

    # ======================================================================== session TTL
    def expire_sessions(self, now: float | None = None) -> None:
        """End idle anonymous sessions older than the TTL (checked at most once a second)."""
        now = time.monotonic() if now is None else now
        if now < self._next_expiry_check:
            return
        ttl = self.state.config.session_ttl_s
        self._next_expiry_check = now + min(1.0, ttl)
        for s in [s for s in self.state.sessions.values() if s.anonymous and s.is_idle and now - s.last_access >= ttl]:
            self.state.expire_session(s)

    def next_expiry(self) -> float | None:
        """Seconds until the next idle anonymous session may expire (None: none to expire)."""
        ttl, now = self.state.config.session_ttl_s, time.monotonic()
        due = [s.last_access + ttl for s in self.state.sessions.values() if s.anonymous and s.is_idle]
        return max(0.0, min(due) - now, self._next_expiry_check - now) if due else None

    def session_expires_in(self, s: Session, now: float) -> float | None:
        """Seconds until an idle anonymous session expires (None: busy, or named: it lives until released)."""
        if not s.anonymous or not s.is_idle:
            return None
        return round(max(0.0, s.last_access + self.state.config.session_ttl_s - now), 3)

    # ======================================================================== deferred releases
    def release_pool(self, pool_id: int, immediate: bool = False) -> None:
        """Release a pool (leaves first). One rule, whatever happened before: the release waits out
        the grace TTL (``pool_grace_ttl_s``, counted from now, or from the end of the last request in
        flight on the pool) and the pool stays resident and attachable meanwhile (``release_in_s``);
        idle attached sessions neither cancel nor extend it. ``immediate`` releases it now."""
        state = self.state
        pool = state.tree.get(pool_id)
        kids = [c for c in pool.children if c.residency != Residency.RELEASED]
        live = [c.pool_id for c in kids if c.release_at is None]  # children released already wait out their grace
        if live:
            raise PoolBusyError(f"pool {pool_id} has child pools {live}; release them first (leaves first)")
        if pool.residency == Residency.MATERIALIZING:
            raise PoolBusyError(f"pool {pool_id} is materializing")
        if immediate:
            for c in kids:  # their release was asked for already: it happens now, leaves first
                self.release_pool(c.pool_id, immediate=True)
        else:
            now = time.monotonic()
            # after its own grace, and after the deferred releases of its children (all deferred: checked above)
            due = max([now + state.config.pool_grace_ttl_s, pool.grace_until]
                      + [c.release_at for c in kids if c.release_at is not None])
            if kids or due > now or state.decoding_on(pool):
                pool.release_at = due
                return
        state.unlink(pool)
        self._expire_with_pool(pool)  # idle anonymous sessions do not keep a released pool's pages

    def release_due(self, now: float | None = None) -> float | None:
        """Complete deferred releases whose grace ran out. While a request is in flight on the pool
        the grace starts again (it counts from the end of the last one); a descendant that comes back
        and leaves again extends it. Returns the next due time (monotonic), or None."""
        state = self.state
        now = time.monotonic() if now is None else now
        nxt: float | None = None
        # deepest first, so a parent whose children go in this pass goes in the same pass
        for pool in sorted((p for p in state.tree.pools.values() if p.release_at is not None),
                           key=lambda p: -p.depth()):
            due = pool.release_at or 0.0
            if state.decoding_on(pool):
                due = max(due, now + state.config.pool_grace_ttl_s)
            due = pool.release_at = max(due, pool.grace_until)
            # a released child kept by its sessions does not hold the release back (as in release_pool):
            # the pool is released now, its KV lives on while those sessions read it (``released_pools``)
            kids = [c for c in pool.children if c.residency not in (Residency.EVICTED, Residency.RELEASED)]
            busy = kids or state.decoding_on(pool) or pool.residency == Residency.MATERIALIZING
            if now >= due and not busy:
                state.unlink(pool)
                self._expire_with_pool(pool)
            elif not busy:
                nxt = due if nxt is None else min(nxt, due)
        return nxt

    def _expire_with_pool(self, pool: Pool) -> None:
        """A released pool: the idle anonymous sessions on it drop their KV now (it falls into the cache,
        evictable) and leave the pool; the sessions themselves live on until their TTL."""
        for sid in list(pool.sessions):
            s = self.state.sessions.get(sid)
            if s is not None and s.anonymous and s.is_idle:
                self.state.drop_session_kv(s)
