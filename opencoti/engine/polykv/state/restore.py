"""``Restore``: how a pool's KV becomes resident, a part of ``PolyKV``: computed (materialization,
queued to the scheduler through ``enqueue`` and set up by ``start_materialization``), or brought
back by persistence (the restore calls: saved pools and sessions back in the tree, a pool's or a
session's KV loaded from its file)."""

from __future__ import annotations

import time
from typing import Callable

from ...requests import MaterializeJob, SeqState, Session
from ...errors import InvalidRequestError
from ...kv.pool import Pool, Residency, prefix_hashes
from .base import TreeState

Done = Callable[[object], None]  # called with the Pool once resident, or the error of a failed materialization


class Restore:
    def __init__(self, state: TreeState, enqueue: Callable[[MaterializeJob], None]):
        self.state = state
        self._enqueue = enqueue

    # ======================================================================== materialization
    def ensure_resident(self, pool: Pool) -> list[Pool]:
        """Pools to wait for before using ``pool``; starts re-materialization of evicted ones."""
        if pool.residency == Residency.RESIDENT:
            return []
        waits = []
        if pool.residency == Residency.EVICTED:
            waits = self.ensure_resident(pool.parent) if pool.parent is not None else []
            pool.residency = Residency.MATERIALIZING
            pool.rematerializations += 1
            self.materialize(pool, waits, lambda p: None)
        return waits + [pool]  # ancestors first

    def materialize(self, pool: Pool, waits: list[Pool], done: Done) -> MaterializeJob:
        """Queue the computation of ``pool``'s prefix (after ``waits`` are resident)."""
        job = MaterializeJob(seq=pool.seq, pool=pool, on_done=done, wait_for=list(waits))
        self._enqueue(job)
        return job

    def start_materialization(self, job: MaterializeJob) -> bool:
        """Share the parent's first ``branch_pos`` tokens into the pool (the scheduler's try_start)."""
        pool = job.pool
        parent = pool.parent
        d = pool.branch_pos if parent is not None else 0
        return not d or self.state.tables.share_into(pool.seq, parent.seq.page_table, d, d // self.state.page_size)

    def materialized(self, job: MaterializeJob) -> None:
        pool = job.pool
        pool.residency = Residency.RESIDENT
        pool.last_access_wall = time.time()
        for fn in self.state.listeners:
            fn("materialized", {"pool": pool})
        job.on_done(pool)

    def materialization_failed(self, job: MaterializeJob, error: Exception) -> None:
        pool = job.pool
        self.state.tables.drop(pool.seq)
        if pool.rematerializations:
            pool.residency = Residency.EVICTED
        else:
            self.state.unlink(pool)
        job.on_done(error)

    # ======================================================================== persistence
    def restore_pool(self, pool_id: int, parent: Pool | None, branch_pos: int, tokens: list[int], *,
                     pinned: bool, label: str, tenant: str | None) -> Pool:
        """A saved pool back in the tree, evicted (its KV is loaded or recomputed on first use)."""
        tree = self.state.tree
        if pool_id in tree.pools or pool_id in tree.released:
            raise InvalidRequestError(f"pool {pool_id} exists already")
        pool = Pool(pool_id=pool_id, parent=parent, branch_pos=branch_pos, seq=SeqState(tokens),
                    hashes=prefix_hashes(tokens), pinned=pinned, residency=Residency.EVICTED, label=label,
                    tenant=tenant)
        tree.restore(pool)
        return pool

    def skip_pool_ids(self, next_id: int) -> None:
        """Pool ids below ``next_id`` are spent (restored, or used before a restart)."""
        self.state.tree.skip_ids(next_id)

    def restore_session(self, session_id: str, tokens: list[int], pool: Pool | None, tenant: str | None) -> Session:
        """A saved session back, without KV (its next request recomputes what it needs), on its pool."""
        s = Session(session_id)
        s.seq = SeqState(tokens)
        s.tenant = tenant
        if pool is not None:
            self.state.attach(s, pool)
        self.state.sessions[session_id] = s
        return s

    def pool_loaded(self, pool: Pool) -> None:
        """A pool's KV was loaded into its page table (persist: a saved KV file)."""
        pool.residency = Residency.RESIDENT
        pool.last_access_wall = time.time()

    def restore_session_kv(self, session_id: str, seq: SeqState) -> Session:
        """Session ``session_id`` (created when new) continues from ``seq``, whose KV was loaded into
        its own pages; its old cache and pool attachment are replaced."""
        state = self.state
        s = state.sessions.get(session_id)
        if s is None:
            s = state.sessions[session_id] = Session(session_id)
        else:
            state.drop_session_kv(s)
        s.seq = seq
        s.last_access = time.monotonic()
        return s
