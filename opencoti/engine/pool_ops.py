"""Pool lifecycle and tree status, as a mixin of EngineCore (step thread only).

create / fork (extend or copy-free branch, zero-copy from a session) / pin / evict (and
transparent re-materialization) / flush / release (leaves first; KV lives on while sessions use
it) / compaction by re-fork; the pool tree report with KV bytes by ownership; the integrity
check. Every operation validates everything before it mutates anything.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence as Seq

from .errors import CapacityError, InvalidRequestError, PoolBusyError, PoolContractError, SessionBusyError
from .kv.pools import Pool, Residency, common_prefix_len, prefix_hashes
from .results import PoolInfo
from .session import MaterializeJob, Session


class PoolOpsMixin:
    """Needs from EngineCore: kv, tables, tree, sessions, scheduler, config, page_size, max_context,
    listeners, and its helpers (check_tokens, check_fits, reclaim, _detach,
    _session_pool, auto_pinned, _sessions_in_use, get_session, release_session)."""

    def _ensure_resident(self, pool: Pool) -> list[Pool]:
        """Pools to wait for before using ``pool``; starts re-materialization of evicted ones."""
        if pool.residency == Residency.RESIDENT:
            return []
        waits = []
        if pool.residency == Residency.EVICTED:
            waits = self._ensure_resident(pool.parent) if pool.parent is not None else []
            pool.residency = Residency.MATERIALIZING
            pool.rematerializations += 1
            self._enqueue_materialization(pool, waits, lambda p: None)
        return waits + [pool]  # ancestors first

    def _enqueue_materialization(self, pool: Pool, waits: list[Pool], done: Callable) -> MaterializeJob:
        job = MaterializeJob(seq=pool.seq, pool=pool, on_done=done, wait_for=list(waits))
        self.scheduler.add(job)
        return job

    def _start_materialization(self, job: MaterializeJob) -> bool:
        """Share the parent's first ``branch_pos`` tokens into the pool (EngineCore.try_start)."""
        pool = job.pool
        parent = pool.parent
        d = pool.branch_pos if parent is not None else 0
        return not d or self.tables.share_into(pool.seq, parent.seq.page_table, d, d // self.page_size)

    def _on_prefilled(self, job: MaterializeJob) -> None:
        pool = job.pool
        pool.residency = Residency.RESIDENT
        pool.last_access = time.time()
        for fn in self.listeners:
            fn("materialized", {"pool": pool})
        job.on_done(pool)

    def _fail_materialization(self, job: MaterializeJob, error: Exception) -> None:
        pool = job.pool
        self.tables.drop(pool.seq)
        if pool.rematerializations:
            pool.residency = Residency.EVICTED
        else:
            self._unlink(pool)
        job.on_done(error)

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
            parent = self._session_pool(s)
            if not as_root and parent is not None and parent.residency == Residency.RESIDENT:
                d = s.seq.num_borrowed_pages * self.page_size
                return self.fork_pool(done, parent.pool_id, d, from_session=from_session, pinned=pinned,
                                      label=label, allow_empty=False)
            self.tree.check_budget()
            self.check_fits(len(toks), 0, "pool prefix")
            if s.seq.num_borrowed_pages == 0:
                self._reserve_partial_page(len(toks), s)
            pool = self.tree.add(None, 0, list(toks), label)
            pool.pinned = bool(pinned)
            if s.seq.num_borrowed_pages == 0:
                self._adopt_session_pages(pool, s, 0)
                done(pool)
            else:  # its cache borrows a released pool's pages: compute the copy instead
                self._enqueue_materialization(pool, [], done)
            return pool
        toks = self.check_tokens(list(tokens), "pool tokens")
        self.check_fits(len(toks), 0, "pool prefix")
        self.tree.check_budget()
        pool = self.tree.add(None, 0, toks, label)
        pool.pinned = bool(pinned)
        self._enqueue_materialization(pool, [], done)
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
            toks = self.check_tokens(list(tokens), "pool tokens")
        if len(toks) <= d and not allow_empty:
            raise InvalidRequestError(
                f"the fork's own range is empty: tokens cover [0, {len(toks)}) but branch_pos is {d}; "
                "pass the full prefix [0, L) with L > branch_pos")
        if d and parent.hash_at(d) != _hash_prefix(toks, d):
            at = common_prefix_len(toks[:d], parent.tokens[:d])
            raise PoolContractError(
                f"prefix contract violated: tokens[0:{d}] differ from pool {parent_id}'s tokens at position {at}")
        self.check_fits(len(toks), 0, "pool prefix")
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
            self._reserve_partial_page(len(toks), session)
        waits = self._ensure_resident(parent) if not zero_copy else []
        pool = self.tree.add(parent, d, toks, label)
        pool.pinned = bool(pinned)
        parent.last_access = time.time()
        if zero_copy:
            self._adopt_session_pages(pool, session, d)
            done(pool)
        else:
            self._enqueue_materialization(pool, waits, done)
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
        self._detach(s)
        s.pool_id = pool.pool_id
        pool.sessions.add(s.session_id)
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
        if pool.live_children or self._sessions_in_use(pool):
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
        pool = self.tree.get(pool_id)
        n = 0
        for sid in list(pool.sessions):
            s = self.sessions.get(sid)
            if s is not None and s.is_idle:
                self.release_session(sid)
                n += 1
        return n

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
            # after its own grace, and after the deferred releases of its children
            due = max([now + self.config.pool_grace_ttl_s, pool.grace_until] + [c.release_at for c in kids])
            if kids or due > now or self._decoding_on(pool):
                pool.release_at = due
                return
        self._unlink(pool)
        self._expire_with_pool(pool)  # idle anonymous sessions do not keep a released pool's pages

    def _decoding_on(self, pool: Pool) -> bool:
        """A request is in flight on one of the pool's sessions (idle sessions do not count)."""
        return any(s is not None and s.job is not None for s in map(self.sessions.get, pool.sessions))

    def release_due(self, now: float | None = None) -> float | None:
        """Complete deferred releases whose grace ran out. While a request is in flight on the pool
        the grace starts again (it counts from the end of the last one); a descendant that comes back
        and leaves again extends it. Returns the next due time (monotonic), or None."""
        now = time.monotonic() if now is None else now
        nxt = None
        # deepest first, so a parent whose children go in this pass goes in the same pass
        for pool in sorted((p for p in self.tree.pools.values() if p.release_at is not None),
                           key=lambda p: -p.depth()):
            if self._decoding_on(pool):
                pool.release_at = max(pool.release_at, now + self.config.pool_grace_ttl_s)
            pool.release_at = max(pool.release_at, pool.grace_until)
            busy = pool.live_children or self._decoding_on(pool) or pool.residency == Residency.MATERIALIZING
            if now >= pool.release_at and not busy:
                self._unlink(pool)
                self._expire_with_pool(pool)
            elif not busy:
                nxt = pool.release_at if nxt is None else min(nxt, pool.release_at)
        return nxt

    def _unlink(self, pool: Pool) -> None:
        self.tree.pools.pop(pool.pool_id, None)
        pool.residency = Residency.RELEASED
        self.tree.released[pool.pool_id] = pool
        self._maybe_reap(pool)

    def _maybe_reap(self, pool: Pool) -> None:
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
        s.pool_id = pool.pool_id
        pool.sessions.add(s.session_id)
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

    # ======================================================================== status
    def session_info(self, s: Session) -> dict:
        return {
            "session_id": s.session_id,
            "pool_id": s.pool_id,
            "suffix_n_tokens": len(s.seq.tokens) - s.seq.num_shared_tokens,
            "marginal_kv_bytes": len(s.seq.owned_pages) * self.kv.page_bytes,
            "ctx_used": len(s.seq.tokens),
            "ctx_total": self.max_context,
            "state": s.state.value,
        }

    def pool_info(self, pool: Pool) -> PoolInfo:
        now = time.monotonic()
        own = len(pool.seq.owned_pages) * self.kv.page_bytes
        sessions = [self.session_info(self.sessions[sid]) for sid in sorted(pool.sessions) if sid in self.sessions]
        subtree = own + sum(x["marginal_kv_bytes"] for x in sessions)
        kids = [c for c in pool.children if c.residency != Residency.RELEASED]
        for c in pool.children:
            subtree += self.pool_info(c).subtree_kv_bytes
        return PoolInfo(
            pool_id=pool.pool_id, parent=pool.parent.pool_id if pool.parent else None, branch_pos=pool.branch_pos,
            prefix_len=pool.prefix_len, own_len=pool.own_len, own_kv_bytes=own, subtree_kv_bytes=subtree,
            residency=pool.residency.value, pinned=pool.pinned, auto_pinned=self.auto_pinned(pool, now),
            orphaned_pin=pool.pinned and not pool.sessions and not kids,
            last_access_ts=pool.last_access, children=[c.pool_id for c in kids], sessions=sessions,
            rematerialized=pool.rematerializations > 0, cache_hits=pool.cache_hits, label=pool.label,
            release_in_s=None if pool.release_at is None else max(0.0, max(pool.release_at, pool.grace_until) - now))

    def _holders(self) -> list:
        """Every sequence that holds pages: pools (live and released) and sessions."""
        return ([p.seq for p in self.tree.pools.values()] + [p.seq for p in self.tree.released.values()]
                + [s.seq for s in self.sessions.values()])

    def kv_accounting(self) -> tuple[int, int, int]:
        """(pages held by pools and sessions, pages held only by the prefix cache (evicted on demand,
        so reported apart like free pages), pages no pool or session owns: the cache owner's)."""
        cache_only = self.tables.num_cache_only()
        owned = sum(len(s.owned_pages) for s in self._holders())
        return self.kv.num_used - cache_only, cache_only, self.kv.num_used - owned

    def stats(self) -> dict:
        used, cache_only, cache_owned = self.kv_accounting()
        return {**self.counters, "kv_pages_used": used, "kv_pages_cache": cache_only,
                "kv_pages_total": self.kv.num_pages, "sessions": len(self.sessions),
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "prefix_cache": self.cache_status(cache_only, cache_owned)}

    def pools_status(self) -> dict:
        used, cache_only, cache_owned = self.kv_accounting()
        cache = self.cache_status(cache_only, cache_owned)
        return {
            "pools": [self.pool_info(p).as_dict() for p in sorted(self.tree.pools.values(), key=lambda p: p.pool_id)],
            "tree_depth": self.tree.depth(),
            "pools_used": self.tree.num_used,
            "pools_max": self.tree.max_pools,
            # the design's names: a session here is a page table, not a sequence slot, so only pools use ids
            "seq_ids_used": self.tree.num_used,
            "seq_ids_max": self.tree.max_pools,
            "kv_pages_total": self.kv.num_pages,
            "kv_pages_used": used,  # held by pools and sessions (cache-only pages are reported apart)
            "kv_bytes_used": used * self.kv.page_bytes,
            "kv_pages_cache": cache_only,  # held only by the prefix cache: evicted first, on demand
            "cache_kv_bytes": cache_only * self.kv.page_bytes,
            "cache_hit_rate": cache["hit_rate"],
            "page_size": self.page_size,
            "prefix_cache": cache,
        }

    def check_integrity(self) -> None:
        """Refcounts match the page tables (and the prefix index), and every used page has exactly
        one owner: a pool, a session, or else the cache."""
        self.tables.check_integrity(self._holders())
        for s in self.sessions.values():
            pool = self._session_pool(s)
            if s.seq.num_borrowed_pages and pool is not None:  # without a pool it borrows from the cache
                n = s.seq.num_borrowed_pages
                assert s.seq.page_table[:n] == pool.seq.page_table[:n], f"session {s.session_id} borrow mismatch"
        for p in self.tree.pools.values():
            if p.residency == Residency.RESIDENT and p.parent is not None:
                n = p.seq.num_borrowed_pages
                assert p.seq.page_table[:n] == p.parent.seq.page_table[:n], f"pool {p.pool_id} borrow mismatch"



def _hash_prefix(tokens: Seq[int], n: int) -> bytes:
    return prefix_hashes(tokens[:n])[-1]
