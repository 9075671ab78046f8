"""``Reclaim``: the memory policy, a part of ``PolyKV``: which KV goes when the KV tables run short
of pages (it is their ``kv.tables.Reclaimer``, through ``PolyKV.reclaim``). Cache pages first
(least recently used leaves), then idle sessions' KV, then pools neither pinned nor auto-pinned
(least recently used first). So any allocation that may reclaim (``KVTables.extend_reclaiming``
while the scheduler plans, ``share_into``, ``reserve_partial_copy``, ``promote``) may evict."""

from __future__ import annotations

import time
from typing import Protocol

from ...requests import Session
from ...kv.pool import Residency
from ...kv.prefix_index import Entry, Tail
from .base import TreeState


class AheadTier(Protocol):
    """What ``write_ahead`` needs of the disk tier (``persist/tier.py``)."""

    epoch: int  # counts the segments the tier has forgotten (a session all held before may not be now)
    stats: dict  # (its write_errors: a failed write is forgotten, and its pages written again, at the next look)

    def write_ahead(self, kv, chain: list, tail, max_pages: int) -> tuple[int, bool]: ...


class Reclaim:
    def __init__(self, state: TreeState):
        self.state = state
        self.ended = 0  # requests of sessions ended (PolyKV.end): a session may have new KV to write ahead
        self._all_held: tuple = ()  # the stamps as of which write_ahead found nothing left to write

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
        waiting, recent = self.idle_sessions(keep)
        for s in waiting + [None] + recent:
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

    def idle_sessions(self, keep: Session | None = None) -> tuple[list[Session], list[Session]]:
        """The idle sessions holding KV, in the order a reclaim takes them: those idle for longer than
        kv_idle_spill_s (waiting on a tool, a sub-agent, a user: they go before the prefix cache's
        pages), then those idle for less (about to come back: after them); the oldest first in each."""
        now = time.monotonic()
        idle = sorted((s for s in self.state.sessions.values() if s.is_idle and s.seq.page_table and s is not keep),
                      key=lambda s: s.last_access)
        waiting = [s for s in idle if now - s.last_access >= self.state.config.kv_idle_spill_s]
        return waiting, idle[len(waiting):]

    def write_ahead(self, tier: AheadTier, max_pages: int, cache: bool = True) -> tuple[int, bool]:
        """Write the KV a reclaim would take, in its order (idle sessions waiting on a tool, the prefix
        cache's pages, then the sessions idle for less), to the disk tier while it stays in RAM
        (``DiskTier.write_ahead``), so that the reclaim that takes it later frees its pages without
        copying them on the step thread: at most ``max_pages`` pages. ``cache``: the prefix cache's pages
        too (a scan of every cached page: not between steps, where it would lengthen the next step by a
        few ms on a large cache). Returns the pages written and whether some are left to write (no room
        for them now, or past ``max_pages``)."""
        tables = self.state.tables
        if tables.index is None or max_pages <= 0:
            return 0, False
        c = self.state.counters  # (what makes KV newly idle or newly cache-only: a request's end, a session
        # reclaimed or expired, a pool evicted or released; the tier forgetting a file)
        stamp = (tier.epoch, tier.stats["write_errors"], self.ended, len(self.state.sessions),
                 len(tables.index.by_page), c["evicted_sessions"], c["expired_sessions"], c["evicted_pools"],
                 len(self.state.tree.pools), cache)
        if stamp in self._all_held:  # (the common case between steps: nothing new since)
            return 0, False
        waiting, recent = self.idle_sessions()
        done = 0
        for s in waiting + ([None] if cache else []) + recent:
            mark = (tier.epoch, len(s.seq.page_keys), s.seq.num_cached) if s is not None else None
            if s is not None and s.written_ahead == mark:  # all held, and the tier has forgotten nothing since
                continue
            runs, complete = self._session_run(s) if s is not None else (self._cache_runs(), True)
            for chain, tail in runs:
                n, whole = tier.write_ahead(tables.kv, chain, tail, max_pages - done)
                done += n
                if not whole:
                    return done, True
            if s is not None and complete:  # (pages another holder shares were skipped: looked at again later)
                s.written_ahead = mark
        self._all_held = (stamp,) if not cache else (stamp, stamp[:-1] + (False,))  # (all of it: the sessions' too)
        return done, False

    def _session_run(self, s: Session) -> tuple[list[tuple[list[Entry], Tail | None]], bool]:
        """A session's indexed full pages that its reclaim would free (held by it and the index only: not
        a pool's it borrows, nor a prefix another session shares), as runs each page of which is the parent
        of the next, and its tail, if listed; and whether none was skipped for another holder."""
        index, seq, refcount = self.state.tables.index, s.seq, self.state.kv.refcount
        assert index is not None
        entries: list[Entry] = []
        for k in seq.page_keys:
            e = index.entries.get(k)
            if e is None or (entries and e.parent is not entries[-1]):
                break
            entries.append(e)
        runs: list[tuple[list[Entry], Tail | None]] = [([], None)]
        skipped = False
        for e in entries:
            if e.page is not None and refcount[e.page] <= 2:
                runs[-1][0].append(e)
            else:
                skipped = True
                if runs[-1][0]:
                    runs.append(([], None))
        full = len(entries)
        item = index.by_page.get(seq.page_table[full]) if len(seq.page_table) > full else None
        if (isinstance(item, Tail) and full == len(seq.page_keys)
                and (item.parent is entries[-1] if entries else item.parent.page is None)):
            runs.append(([], item))
        return runs, not skipped

    def _cache_runs(self) -> list[tuple[list[Entry], Tail | None]]:
        """The prefix cache's own pages (no table holds them: what is left of a reclaimed session, a
        finished request's), as chains root first (a branch starts a chain of its own), then its tails."""
        index, refcount = self.state.tables.index, self.state.kv.refcount
        assert index is not None
        cache = sorted((e for p, e in index.by_page.items() if isinstance(e, Entry) and refcount[p] == 1),
                       key=lambda e: e.depth)
        seen: set[int] = set()
        runs: list[tuple[list[Entry], Tail | None]] = []
        for e in cache:
            if id(e) in seen:
                continue
            chain = [e]
            seen.add(id(e))
            while (nxt := next((c for c in chain[-1].children.values()
                                if c.page is not None and refcount[c.page] == 1 and id(c) not in seen), None)) is not None:
                chain.append(nxt)
                seen.add(id(nxt))
            runs.append((chain, None))
        runs += [([], t) for p, t in index.by_page.items() if isinstance(t, Tail) and refcount[p] == 1]
        return runs

    def _spill_session(self, s: Session) -> None:
        """Reclaim an idle session's KV: its pages fall into the prefix cache (evicted from there to
        the disk tier, when there is one); it stays attached to its pool and keeps the page keys
        of what it had (``drop_session_kv``)."""
        self.state.drop_session_kv(s, detach=False)
        self.state.counters["evicted_sessions"] += 1
