"""``PolyKV``: the one owner of the pool tree, the sessions, their attachments and residency.

Everything that changes a pool (create, fork, pin, evict, re-materialize, release, reap), a session's
place (new, attach, detach, move, expire, remove, restore) or which request a session serves goes
through a method of ``PolyKV``; nothing else assigns those fields (``tests/offline/test_owner.py``
walks the source for it). Readers get ``view.PolyKVView``'s read-only views and ``status.py``.

The class is split by concern, composed here: ``TreeState`` (``base.py``: the tree and the sessions,
their reads and the changes the rest is made of; ``PolyKV`` is one), the tree itself (``tree.py``),
``Timers`` (``timers.py``: session TTL, deferred releases), ``Reclaim`` (``reclaim.py``: the memory
policy) and ``Restore`` (``restore.py``: materialization and the restore calls). This module holds
the pool operations (create, fork, pin, evict, flush, move a session) and what a request does to
its session (open, begin, adopt a sequence, end).

Pages are not its business: it asks the KV tables (``kv/tables.py``, the page owner) to share, hand
over or drop page tables, and the tables ask it back for memory through :meth:`reclaim` (their
``Reclaimer``). The prefix cache (``polykv/prefix.py``) is the other object beside it.

Step thread only. Every operation validates all of its input before it mutates anything, so a
rejected call leaves the state untouched.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence as Seq

from ...config import EngineConfig
from ...limits import Limits
from ...requests import Job, MaterializeJob, SeqState, Session
from ...errors import CapacityError, InvalidRequestError, PoolBusyError, PoolContractError, SessionBusyError
from ...kv.pages import PagePool
from ...kv.pool import Pool, Residency, common_prefix_len, prefix_hashes
from ...kv.tables import KVTables
from .base import Listener, TreeState
from .reclaim import AheadTier, Reclaim
from .restore import Restore
from .timers import Timers


class PolyKV(TreeState):
    def __init__(self, config: EngineConfig, kv: PagePool, limits: Limits, *, listeners: list[Listener],
                 counters: dict, enqueue: Callable[[MaterializeJob], None]):
        """``enqueue``: queues a materialization (the scheduler's ``add``); ``listeners`` hear
        ``materialized``; ``counters``: the engine's counters (evictions and expiries counted here)."""
        tables = KVTables(kv, reclaim=self.reclaim, prefix_cache=config.prefix_cache)
        super().__init__(config, kv, limits, tables, listeners=listeners, counters=counters)
        self.timers = Timers(self)
        self.memory = Reclaim(self)
        self.restorer = Restore(self, enqueue)

    # ======================================================================== sessions
    def open_session(self, session_id: str | None, new_id: Callable[[], str]) -> Session:
        """The session ``session_id`` (created when new), or a new anonymous one (``new_id()``)."""
        s = self.sessions.get(session_id) if session_id is not None else None
        if s is None:
            s = Session(session_id or new_id(), anonymous=session_id is None)
            self.sessions[s.session_id] = s
        return s

    def begin(self, session: Session, job: Job) -> None:
        """``session`` serves ``job`` from now on."""
        session.job = job
        session.last_access = time.monotonic()

    def end(self, session: Session) -> None:
        """``session``'s request ended; its pool was used now."""
        session.job = None
        session.last_access = time.monotonic()
        self.memory.ended += 1
        pool = self.session_pool(session)
        if pool is not None:
            pool.last_access_wall = time.time()

    def adopt_seq(self, session: Session, seq: SeqState, shared: int) -> None:
        """``seq`` (set up by the KV tables from what the session's request reuses) is the
        session's cache from now on; the old one was handed over or dropped by the caller. Its
        first ``shared`` tokens are its pool's (none when it has no pool): its suffix is the rest."""
        seq.num_shared_tokens = shared if session.pool_id is not None else 0
        session.seq = seq

    def session_kv_loaded(self, session: Session) -> None:
        """The session's KV of its first ``num_cached`` tokens was loaded into its own pages
        (``persist/session_kv.py``): the tokens it has in common with its (live) pool are shared."""
        seq = session.seq
        pool = self.tree.pools.get(session.pool_id) if session.pool_id is not None else None
        seq.num_shared_tokens = common_prefix_len(seq.tokens[:seq.num_cached], pool.tokens) if pool is not None else 0

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
            self.expire_session(session)
        elif pool is not None and pool.residency == Residency.RELEASED:
            self.drop_session_kv(session)

    # ======================================================================== pools in requests
    def touch(self, pool: Pool, hit: bool = False) -> None:
        """A request uses ``pool`` now; ``hit``: it reuses some of its KV."""
        pool.last_access_wall = time.time()
        if hit:
            pool.cache_hits += 1

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
                self.restorer.materialize(pool, [], done)
            return pool
        toks = self.limits.check_tokens(list(tokens or ()), "pool tokens")
        self.limits.check_fits(len(toks), 0, "pool prefix")
        self.tree.check_budget()
        pool = self.tree.add(None, 0, toks, label)
        pool.pinned = bool(pinned)
        self.restorer.materialize(pool, [], done)
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
        waits = self.restorer.ensure_resident(parent) if not zero_copy else []
        pool = self.tree.add(parent, d, toks, label)
        pool.pinned = bool(pinned)
        parent.last_access_wall = time.time()
        if zero_copy:
            assert session is not None
            self._adopt_session_pages(pool, session, d)
            done(pool)
        else:
            self.restorer.materialize(pool, waits, done)
        return pool

    def _reserve_partial_page(self, n_tokens: int, keep: Session) -> None:
        """Make sure (before committing) that a snapshot's partial last page can be copied: a page
        is free or is freed by reclaiming (which may evict others' idle KV, never ``keep``'s)."""
        if not self.tables.reserve_partial_copy(n_tokens, keep):
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
            self.evict_kv(pool)
        elif pool.residency == Residency.MATERIALIZING:
            raise PoolBusyError(f"pool {pool_id} is materializing")
        return pool

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
                self.timers.release_pool(p.pool_id, immediate=True)
                released.append(p.pool_id)
            p = parent
        return released

    # ======================================================================== persistence

    # ======================================================================== the parts' calls
    # timers.py
    def expire_sessions(self, now: float | None = None) -> None:
        self.timers.expire_sessions(now)

    def next_expiry(self) -> float | None:
        return self.timers.next_expiry()

    def session_expires_in(self, s: Session, now: float) -> float | None:
        return self.timers.session_expires_in(s, now)

    def release_pool(self, pool_id: int, immediate: bool = False) -> None:
        self.timers.release_pool(pool_id, immediate)

    def release_due(self, now: float | None = None) -> float | None:
        return self.timers.release_due(now)

    # reclaim.py: the KV tables' ``Reclaimer``
    def reclaim(self, num_pages: int, keep: Session | None = None) -> int:
        return self.memory.reclaim(num_pages, keep)

    def write_ahead(self, tier: AheadTier, max_pages: int, cache: bool = True) -> tuple[int, bool]:
        return self.memory.write_ahead(tier, max_pages, cache)

    # restore.py
    def ensure_resident(self, pool: Pool) -> list[Pool]:
        return self.restorer.ensure_resident(pool)

    def start_materialization(self, job: MaterializeJob) -> bool:
        return self.restorer.start_materialization(job)

    def materialized(self, job: MaterializeJob) -> None:
        self.restorer.materialized(job)

    def materialization_failed(self, job: MaterializeJob, error: Exception) -> None:
        self.restorer.materialization_failed(job, error)

    def restore_pool(self, pool_id: int, parent: Pool | None, branch_pos: int, tokens: list[int], *,
                     pinned: bool, label: str, tenant: str | None) -> Pool:
        return self.restorer.restore_pool(pool_id, parent, branch_pos, tokens, pinned=pinned, label=label,
                                          tenant=tenant)

    def skip_pool_ids(self, next_id: int) -> None:
        self.restorer.skip_pool_ids(next_id)

    def restore_session(self, session_id: str, tokens: list[int], pool: Pool | None, tenant: str | None) -> Session:
        return self.restorer.restore_session(session_id, tokens, pool, tenant)

    def pool_loaded(self, pool: Pool) -> None:
        self.restorer.pool_loaded(pool)

    def restore_session_kv(self, session_id: str, seq: SeqState) -> Session:
        return self.restorer.restore_session_kv(session_id, seq)
