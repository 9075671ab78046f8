"""``PolyKV``: the one owner of the pool tree, the sessions, their attachments and residency.

Everything that changes a pool (create, fork, pin, evict, re-materialize, release, reap), a session's
place (new, attach, detach, move, expire, remove, restore) or which request a session serves goes
through a method here; nothing else assigns those fields (``tests/offline/test_owner.py`` walks the
source for it). Pages are not its business: it asks the KV tables (``kv/tables.py``, the page
owner) to share, hand over or drop page tables, and the tables ask it back for memory through
:meth:`reclaim` (its ``Reclaimer``). The prefix cache (``prefix.py``) is the other object beside it.

Step thread only. Every operation validates all of its input before it mutates anything, so a
rejected call leaves the state untouched. Readers use ``view.PolyKVView`` and ``status.py``.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence as Seq

from ..config import EngineConfig
from ..errors import (CapacityError, InvalidRequestError, PoolBusyError, PoolContractError, SessionBusyError,
                      SessionNotFoundError)
from ..kv.pages import PagePool
from ..kv.pools import Pool, PoolTree, Residency, common_prefix_len, prefix_hashes
from ..kv.tables import KVTables
from ..core.limits import Limits
from ..core.requests import Job, MaterializeJob, Sequence, Session

Listener = Callable[[str, dict], None]


class PolyKV:
    def __init__(self, config: EngineConfig, kv: PagePool, limits: Limits, *, listeners: list[Listener],
                 counters: dict, enqueue: Callable[[MaterializeJob], None]):
        """``enqueue``: queues a materialization (the scheduler's ``add``); ``listeners`` hear
        ``materialized``; ``counters``: the engine's counters (evictions and expiries counted here)."""
        self.config = config
        self.kv = kv
        self.page_size = kv.page_size
        self.limits = limits
        self.listeners = listeners
        self.counters = counters
        self._enqueue = enqueue
        self.sessions: dict[str, Session] = {}
        self.tree = PoolTree(config.max_pools, id_base=config.pool_id_base)
        self.tables = KVTables(kv, reclaim=self.reclaim, prefix_cache=config.prefix_cache)
        self._next_expiry_check = 0.0

    # ======================================================================== reads
    def get_session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            raise SessionNotFoundError(f"session {session_id!r} not found")
        return s

    def session_pool(self, session: Session) -> Pool | None:
        """The pool ``session`` is attached to (live or released), or None."""
        if session.pool_id is None:
            return None
        return self.tree.pools.get(session.pool_id) or self.tree.released.get(session.pool_id)

    def sessions_in_use(self, pool: Pool) -> bool:
        for sid in pool.sessions:
            s = self.sessions.get(sid)
            if s is not None and (s.job is not None or s.seq.num_borrowed_pages):
                return True
        return False

    def auto_pinned(self, pool: Pool, now: float) -> bool:
        """Whether ``pool`` stays resident (not evictable) at ``now``: it has live children, a busy
        attached session or one holding its pages, or is inside its grace TTL."""
        return pool.is_auto_pinned(now, self.sessions_in_use(pool))

    def decoding_on(self, pool: Pool) -> bool:
        """A request is in flight on one of the pool's sessions (idle sessions do not count)."""
        return any(s is not None and s.job is not None for s in map(self.sessions.get, pool.sessions))

    def holders(self) -> list[Sequence]:
        """Every sequence that holds pages: pools (live and released) and sessions."""
        return ([p.seq for p in self.tree.pools.values()] + [p.seq for p in self.tree.released.values()]
                + [s.seq for s in self.sessions.values()])

    # ======================================================================== sessions
    def open_session(self, session_id: str | None, new_id: Callable[[], str]) -> Session:
        """The session ``session_id`` (created when new), or a new anonymous one (``new_id()``)."""
        s = self.sessions.get(session_id) if session_id is not None else None
        if s is None:
            s = Session(session_id or new_id(), anonymous=session_id is None)
            self.sessions[s.session_id] = s
        return s

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
        self._maybe_reap(pool)

    def begin(self, session: Session, job: Job) -> None:
        """``session`` serves ``job`` from now on."""
        session.job = job
        session.last_access = time.monotonic()

    def end(self, session: Session) -> None:
        """``session``'s request ended; its pool was used now."""
        session.job = None
        session.last_access = time.monotonic()
        pool = self.session_pool(session)
        if pool is not None:
            pool.last_access = time.time()

    def adopt_seq(self, session: Session, seq: Sequence) -> None:
        """``seq`` (set up by the KV tables from what the session's request reuses) is the
        session's cache from now on; the old one was handed over or dropped by the caller."""
        session.seq = seq

    def drop_session_kv(self, s: Session, detach: bool = True) -> None:
        """Drop a session's cached KV (its pages fall into the prefix cache); ``detach``: and its pool.
        It keeps the page keys of what it had (``spilled_keys``): its reports say where that KV is now."""
        if s.seq.page_keys:
            s.spilled_keys = list(s.seq.page_keys)
        self.tables.drop(s.seq)
        s.seq = Sequence()
        if detach:
            self.detach(s)

    def remove_session(self, session_id: str) -> None:
        """End an idle session: its KV and its place in the tree go."""
        s = self.get_session(session_id)
        if s.job is not None:
            raise SessionBusyError(f"session {session_id!r} is serving a request")
        self.drop_session_kv(s)
        del self.sessions[session_id]

    def mark_anonymous(self, session_id: str) -> None:
        """Nobody named the session (a view named it for its client): it expires when idle."""
        s = self.sessions.get(session_id)
        if s is not None:
            s.anonymous = True

    def set_tenant(self, pool: Pool | None, tenant: str | None) -> None:
        """Record a new pool's tenant: the one given, else its parent's (a fork stays with its tree)."""
        if pool is not None:
            pool.tenant = tenant if tenant is not None else pool.parent.tenant if pool.parent is not None else None

    def after_request(self, session: Session) -> None:
        """An anonymous session's KV after its request: it ends at once when ``session_ttl_s`` is 0;
        on a released pool its pages fall into the cache (they do not pin the released pool's KV)."""
        if not session.anonymous:
            return
        pool = self.session_pool(session)
        if self.config.session_ttl_s == 0:
            self._expire(session)
        elif pool is not None and pool.residency == Residency.RELEASED:
            self.drop_session_kv(session)

    def _expire(self, s: Session) -> None:
        self.drop_session_kv(s)
        self.sessions.pop(s.session_id, None)
        self.counters["expired_sessions"] += 1

    def expire_sessions(self, now: float | None = None) -> None:
        """End idle anonymous sessions older than the TTL (checked at most once a second)."""
        now = time.monotonic() if now is None else now
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + min(1.0, self.config.session_ttl_s)
        ttl = self.config.session_ttl_s
        for s in [s for s in self.sessions.values() if s.anonymous and s.is_idle and now - s.last_access >= ttl]:
            self._expire(s)

    def next_expiry(self) -> float | None:
        """Seconds until the next idle anonymous session may expire (None: none to expire)."""
        ttl, now = self.config.session_ttl_s, time.monotonic()
        due = [s.last_access + ttl for s in self.sessions.values() if s.anonymous and s.is_idle]
        return max(0.0, min(due) - now, self._next_expiry_check - now) if due else None

    # ======================================================================== pools in requests
    def touch(self, pool: Pool, hit: bool = False) -> None:
        """A request uses ``pool`` now; ``hit``: it reuses some of its KV."""
        pool.last_access = time.time()
        if hit:
            pool.cache_hits += 1

    def ensure_resident(self, pool: Pool) -> list[Pool]:
        """Pools to wait for before using ``pool``; starts re-materialization of evicted ones."""
        if pool.residency == Residency.RESIDENT:
            return []
        waits = []
        if pool.residency == Residency.EVICTED:
            waits = self.ensure_resident(pool.parent) if pool.parent is not None else []
            pool.residency = Residency.MATERIALIZING
            pool.rematerializations += 1
            self._materialize(pool, waits, lambda p: None)
        return waits + [pool]  # ancestors first

    def _materialize(self, pool: Pool, waits: list[Pool], done: Callable) -> MaterializeJob:
        job = MaterializeJob(seq=pool.seq, pool=pool, on_done=done, wait_for=list(waits))
        self._enqueue(job)
        return job

    def start_materialization(self, job: MaterializeJob) -> bool:
        """Share the parent's first ``branch_pos`` tokens into the pool (the scheduler's try_start)."""
        pool = job.pool
        parent = pool.parent
        d = pool.branch_pos if parent is not None else 0
        return not d or self.tables.share_into(pool.seq, parent.seq.page_table, d, d // self.page_size)

    def materialized(self, job: MaterializeJob) -> None:
        pool = job.pool
        pool.residency = Residency.RESIDENT
        pool.last_access = time.time()
        for fn in self.listeners:
            fn("materialized", {"pool": pool})
        job.on_done(pool)

    def materialization_failed(self, job: MaterializeJob, error: Exception) -> None:
        pool = job.pool
        self.tables.drop(pool.seq)
        if pool.rematerializations:
            pool.residency = Residency.EVICTED
        else:
            self._unlink(pool)
        job.on_done(error)

    # ======================================================================== pool operations
    def _tokens_from_session(self, session_id: str) -> tuple[Session, list[int]]:
        s = self.get_session(session_id)
        if s.job is not None:
            raise SessionBusyError(f"session {session_id!r} is serving a request; snapshot it when idle")
        if not s.seq.num_cached:
            raise InvalidRequestError(f"session {session_id!r} has no cached context to snapshot")
        return s, s.seq.cached_tokens

    def create_pool(self, done: Callable, *, tokens: Seq[int] | None = None, from_session: str | None = None,
                    pinned: bool = False, label: str = "", as_root: bool = False) -> Pool | None:
        """Create a root pool. from_session of a session attached to a resident pool forks that pool
        at the page-aligned end of what the session borrows (zero-copy), unless ``as_root``: then the
        snapshot is a root whose borrowed part is computed again (independent of that pool)."""
        if (tokens is None) == (from_session is None):
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        if not isinstance(as_root, bool):
            raise InvalidRequestError(f"as_root must be a boolean, got {as_root!r}")
        if from_session is not None:
            s, toks = self._tokens_from_session(from_session)
            parent = self.session_pool(s)
            if not as_root and parent is not None and parent.residency == Residency.RESIDENT:
                d = s.seq.num_borrowed_pages * self.page_size
                return self.fork_pool(done, parent.pool_id, d, from_session=from_session, pinned=pinned,
                                      label=label, allow_empty=False)
            self.tree.check_budget()
            self.limits.check_fits(len(toks), 0, "pool prefix")
            if s.seq.num_borrowed_pages == 0:
                self._reserve_partial_page(len(toks), s)
            pool = self.tree.add(None, 0, list(toks), label)
            pool.pinned = bool(pinned)
            if s.seq.num_borrowed_pages == 0:
                self._adopt_session_pages(pool, s, 0)
                done(pool)
            else:  # its cache borrows a released pool's pages: compute the copy instead
                self._materialize(pool, [], done)
            return pool
        toks = self.limits.check_tokens(list(tokens or ()), "pool tokens")
        self.limits.check_fits(len(toks), 0, "pool prefix")
        self.tree.check_budget()
        pool = self.tree.add(None, 0, toks, label)
        pool.pinned = bool(pinned)
        self._materialize(pool, [], done)
        return pool

    def fork_pool(self, done: Callable, parent_id: int, branch_pos: int, *, tokens: Seq[int] | None = None,
                  from_session: str | None = None, pinned: bool = False, label: str = "",
                  allow_empty: bool = False) -> Pool:
        """Fork: ``branch_pos == parent.L`` extends, ``< parent.L`` branches. Token-exact contract."""
        parent = self.tree.get(parent_id)
        if (tokens is None) == (from_session is None):
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        d = branch_pos
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise InvalidRequestError(f"branch_pos must be a non-negative integer, got {d!r}")
        if d > parent.prefix_len:
            raise InvalidRequestError(f"branch_pos {d} is beyond pool {parent_id}'s prefix_len {parent.prefix_len}")
        session = None
        if from_session is not None:
            session, toks = self._tokens_from_session(from_session)
            toks = list(toks)
        else:
            toks = self.limits.check_tokens(list(tokens or ()), "pool tokens")
        if len(toks) <= d and not allow_empty:
            raise InvalidRequestError(
                f"the fork's own range is empty: tokens cover [0, {len(toks)}) but branch_pos is {d}; "
                "pass the full prefix [0, L) with L > branch_pos")
        if d and parent.hash_at(d) != prefix_hashes(toks[:d])[-1]:
            at = common_prefix_len(toks[:d], parent.tokens[:d])
            raise PoolContractError(
                f"prefix contract violated: tokens[0:{d}] differ from pool {parent_id}'s tokens at position {at}")
        self.limits.check_fits(len(toks), 0, "pool prefix")
        self.tree.check_budget()
        # ---- commit
        # Zero-copy only when the session borrows exactly the parent's pages below D and owns the
        # rest: then every page keeps exactly one owner after the pool adopts them.
        full = d // self.page_size
        zero_copy = (session is not None and parent.residency == Residency.RESIDENT
                     and session.seq.num_borrowed_pages == full
                     and (full == 0 or session.pool_id == parent.pool_id)
                     and session.seq.page_table[:full] == parent.seq.page_table[:full])
        if zero_copy:
            assert session is not None
            self._reserve_partial_page(len(toks), session)
        waits = self.ensure_resident(parent) if not zero_copy else []
        pool = self.tree.add(parent, d, toks, label)
        pool.pinned = bool(pinned)
        parent.last_access = time.time()
        if zero_copy:
            assert session is not None
            self._adopt_session_pages(pool, session, d)
            done(pool)
        else:
            self._materialize(pool, waits, done)
        return pool

    def _reserve_partial_page(self, n_tokens: int, keep: Session) -> None:
        """Check (before committing) that a snapshot's partial last page can be copied."""
        if not self.tables.can_copy_partial(n_tokens, keep):
            raise CapacityError("no free KV page for the snapshot's partial last page", retry_after=1.0)

    def _adopt_session_pages(self, pool: Pool, s: Session, d: int) -> None:
        """from_session: the pool takes the session's cached pages by refcount (zero-copy) and the
        session becomes a leaf of the new pool."""
        n = pool.prefix_len
        if not self.tables.share_into(pool.seq, s.seq.page_table, n, d // self.page_size, keep=s):
            raise CapacityError("no free KV page for the snapshot's partial page", retry_after=1.0)
        pool.residency = Residency.RESIDENT
        self.detach(s)
        self.attach(s, pool)
        self.tables.hand_over(s.seq, n // self.page_size)
        s.seq.num_shared_tokens = n

    def pin_pool(self, pool_id: int, pinned: bool) -> Pool:
        pool = self.tree.get(pool_id)
        pool.pinned = pinned
        return pool

    def evict_pool(self, pool_id: int) -> Pool:
        pool = self.tree.get(pool_id)
        if pool.pinned:
            raise PoolBusyError(f"pool {pool_id} is pinned; unpin it first")
        if pool.live_children or self.sessions_in_use(pool):
            raise PoolBusyError(f"pool {pool_id} has {len(pool.live_children)} resident child pools and "
                                f"{len(pool.sessions)} sessions attached; it stays resident while they use it")
        if pool.residency == Residency.RESIDENT:
            self._evict_pool(pool)
        elif pool.residency == Residency.MATERIALIZING:
            raise PoolBusyError(f"pool {pool_id} is materializing")
        return pool

    def _evict_pool(self, pool: Pool) -> None:
        self.tables.drop(pool.seq)
        pool.residency = Residency.EVICTED

    def flush_pool(self, pool_id: int) -> int:
        """Remove the idle sessions attached to the pool; returns how many."""
        pool = self.tree.get(pool_id)
        n = 0
        for sid in list(pool.sessions):
            s = self.sessions.get(sid)
            if s is not None and s.is_idle:
                self.remove_session(sid)
                n += 1
        return n

    def holding_sessions(self, pool: Pool) -> list[Session]:
        """Sessions attached to ``pool`` or to any of its descendants, live or released (a released
        pool's KV lives while they read it): what keeps its KV."""
        out, todo = [], [pool]
        while todo:
            p = todo.pop(0)
            out += [self.sessions[sid] for sid in sorted(p.sessions) if sid in self.sessions]
            todo.extend(p.children)
        return out

    def session_expires_in(self, s: Session, now: float) -> float | None:
        """Seconds until an idle anonymous session expires (None: busy, or named: it lives until released)."""
        if not s.anonymous or not s.is_idle:
            return None
        return round(max(0.0, s.last_access + self.config.session_ttl_s - now), 3)

    def release_pool(self, pool_id: int, immediate: bool = False) -> None:
        """Release a pool (leaves first). One rule, whatever happened before: the release waits out
        the grace TTL (``pool_grace_ttl_s``, counted from now, or from the end of the last request in
        flight on the pool) and the pool stays resident and attachable meanwhile (``release_in_s``);
        idle attached sessions neither cancel nor extend it. ``immediate`` releases it now."""
        pool = self.tree.get(pool_id)
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
            due = max([now + self.config.pool_grace_ttl_s, pool.grace_until]
                      + [c.release_at for c in kids if c.release_at is not None])
            if kids or due > now or self.decoding_on(pool):
                pool.release_at = due
                return
        self._unlink(pool)
        self._expire_with_pool(pool)  # idle anonymous sessions do not keep a released pool's pages

    def release_due(self, now: float | None = None) -> float | None:
        """Complete deferred releases whose grace ran out. While a request is in flight on the pool
        the grace starts again (it counts from the end of the last one); a descendant that comes back
        and leaves again extends it. Returns the next due time (monotonic), or None."""
        now = time.monotonic() if now is None else now
        nxt: float | None = None
        # deepest first, so a parent whose children go in this pass goes in the same pass
        for pool in sorted((p for p in self.tree.pools.values() if p.release_at is not None),
                           key=lambda p: -p.depth()):
            due = pool.release_at or 0.0
            if self.decoding_on(pool):
                due = max(due, now + self.config.pool_grace_ttl_s)
            due = pool.release_at = max(due, pool.grace_until)
            # a released child kept by its sessions does not hold the release back (as in release_pool):
            # the pool is released now, its KV lives on while those sessions read it (``released_pools``)
            kids = [c for c in pool.children if c.residency not in (Residency.EVICTED, Residency.RELEASED)]
            busy = kids or self.decoding_on(pool) or pool.residency == Residency.MATERIALIZING
            if now >= due and not busy:
                self._unlink(pool)
                self._expire_with_pool(pool)
            elif not busy:
                nxt = due if nxt is None else min(nxt, due)
        return nxt

    def _unlink(self, pool: Pool) -> None:
        self.tree.pools.pop(pool.pool_id, None)
        pool.residency = Residency.RELEASED
        self.tree.released[pool.pool_id] = pool
        self._maybe_reap(pool)

    def _maybe_reap(self, pool: Pool | None) -> None:
        """A released pool's KV lives until its sessions and released children are gone."""
        while pool is not None and pool.residency == Residency.RELEASED and not pool.sessions and not pool.children:
            self.tables.drop(pool.seq)
            self.tree.released.pop(pool.pool_id, None)
            parent = pool.parent
            if parent is not None and pool in parent.children:
                parent.children.remove(pool)
                if not parent.children and not parent.sessions:
                    parent.grace_until = time.monotonic() + self.config.pool_grace_ttl_s
            pool = parent

    def _expire_with_pool(self, pool: Pool) -> None:
        """A released pool: the idle anonymous sessions on it drop their KV now (it falls into the cache,
        evictable) and leave the pool; the sessions themselves live on until their TTL."""
        for sid in list(pool.sessions):
            s = self.sessions.get(sid)
            if s is not None and s.anonymous and s.is_idle:
                self.drop_session_kv(s)

    def move_session(self, session_id: str, pool_id: int, release_from: int | None, keep: int | None) -> list[int]:
        """Compaction: the session's context is replaced by the new pool's prefix. Its old KV is
        dropped; the pools it leaves behind are released up to (not including) ``keep`` when nothing
        else uses them. Returns the released pool ids."""
        s = self.get_session(session_id)
        if s.job is not None:
            raise SessionBusyError(f"session {session_id!r} is serving a request; compact it when idle")
        pool = self.tree.get(pool_id)
        # from the pool the session leaves (released already, e.g. a snapshot of it, or live) up to
        # ``keep``: every pool nothing else uses goes now (compaction frees the old subtree)
        p = None if release_from is None else self.tree.pools.get(release_from) or self.tree.released.get(release_from)
        self.drop_session_kv(s)
        self.attach(s, pool)
        released = []
        while p is not None and p.pool_id != keep and p is not pool:
            parent = p.parent
            if p.residency != Residency.RELEASED:
                if p.sessions or p.pinned or any(c.residency != Residency.RELEASED for c in p.children):
                    break
                self.release_pool(p.pool_id, immediate=True)
                released.append(p.pool_id)
            p = parent
        return released

    # ======================================================================== memory
    def reclaim(self, num_pages: int, keep: Session | None = None) -> int:
        """The KV tables' ``Reclaimer``: free at least num_pages if possible: cache pages first (LRU,
        leaves first), then idle sessions' KV, then idle pools (LRU). An evicted session stays
        attached to its pool (it recomputes on its next turn)."""
        start = self.kv.num_free

        def short() -> int:
            return num_pages - (self.kv.num_free - start)

        now = time.monotonic()
        idle = sorted((s for s in self.sessions.values() if s.is_idle and s.seq.page_table and s is not keep),
                      key=lambda s: s.last_access)
        # sessions idle for longer than kv_idle_spill_s (waiting on a tool, a sub-agent, a user) go
        # before the prefix cache's pages; those idle for less (about to come back) after them
        waiting = [s for s in idle if now - s.last_access >= self.config.kv_idle_spill_s]
        for s in waiting + [None] + [s for s in idle if s not in waiting]:
            if short() <= 0:
                break
            if s is not None:
                self._spill_session(s)
            self.tables.evict_cache(short())
        while short() > 0:
            cands = [p for p in self.tree.pools.values()
                     if p.residency == Residency.RESIDENT and not p.pinned and not self.auto_pinned(p, now)]
            if not cands:
                break
            self._evict_pool(min(cands, key=lambda p: p.last_access))
            self.tables.evict_cache(short())
            self.counters["evicted_pools"] += 1
        return self.kv.num_free - start

    def _spill_session(self, s: Session) -> None:
        """Reclaim an idle session's KV: its pages fall into the prefix cache (evicted from there to
        the disk tier, when there is one); it stays attached to its pool and keeps the page keys
        of what it had (``drop_session_kv``)."""
        self.drop_session_kv(s, detach=False)
        self.counters["evicted_sessions"] += 1

    # ======================================================================== persistence
    def restore_pool(self, pool_id: int, parent: Pool | None, branch_pos: int, tokens: list[int], *,
                     pinned: bool, label: str, tenant: str | None) -> Pool:
        """A saved pool back in the tree, evicted (its KV is loaded or recomputed on first use)."""
        if pool_id in self.tree.pools or pool_id in self.tree.released:
            raise InvalidRequestError(f"pool {pool_id} exists already")
        pool = Pool(pool_id=pool_id, parent=parent, branch_pos=branch_pos, seq=Sequence(tokens),
                    hashes=prefix_hashes(tokens), pinned=pinned, residency=Residency.EVICTED, label=label,
                    tenant=tenant)
        self.tree.pools[pool_id] = pool
        if parent is not None:
            parent.children.append(pool)
        return pool

    def skip_pool_ids(self, next_id: int) -> None:
        """Pool ids below ``next_id`` are spent (restored, or used before a restart)."""
        self.tree.skip_ids(next_id)

    def restore_session(self, session_id: str, tokens: list[int], pool: Pool | None, tenant: str | None) -> Session:
        """A saved session back, without KV (its next request recomputes what it needs), on its pool."""
        s = Session(session_id)
        s.seq = Sequence(tokens)
        s.tenant = tenant
        if pool is not None:
            self.attach(s, pool)
        self.sessions[session_id] = s
        return s

    def pool_loaded(self, pool: Pool) -> None:
        """A pool's KV was loaded into its page table (persist: a saved KV file)."""
        pool.residency = Residency.RESIDENT
        pool.last_access = time.time()

    def restore_session_kv(self, session_id: str, seq: Sequence) -> Session:
        """Session ``session_id`` (created when new) continues from ``seq``, whose KV was loaded into
        its own pages; its old cache and pool attachment are replaced."""
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = Session(session_id)
        else:
            self.drop_session_kv(s)
        s.seq = seq
        s.last_access = time.monotonic()
        return s
