"""Automatic prefix sharing and memory reclaim, as a mixin of EngineCore (step thread only).

A request that names no pool finds the longest prefix of its prompt whose KV is resident —
pages of pools, of live sessions, or cache left by finished requests — through the prefix index
(kv/prefix_index.py) and shares those pages copy-free; only the rest is computed. Requests that
arrive together compute a shared prefix once: a waiting request whose next uncached page is
being computed by a running request waits for it (a step or two) instead of computing it too.

Memory: cache pages (held by the index alone) are evicted first, least recently used leaves
first; then idle sessions' KV (which falls into the cache and is evicted in turn), then idle
pools. An idle session nobody named expires after ``session_ttl_s``.
"""

from __future__ import annotations

import time

from .kv.pools import Residency
from .kv.prefix_index import salt_root
from .session import Job, Session


class PrefixCacheMixin:
    """Needs from EngineCore: kv, tables, tree, sessions, scheduler, config, counters, page_size,
    and _drop_session_kv, _evict_pool, _auto_pinned, _session_pool."""

    def _init_prefix_cache(self) -> None:
        self._inflight: dict[bytes, Job] = {}  # page key -> the running job computing that page
        self._next_expiry_check = 0.0
        self.scheduler.blocked = self._waits_for_prefix

    # ---- at commit ---------------------------------------------------------------------
    def _plan_auto(self, job: Job, pooled: bool, salt: str | None) -> int:
        """Prepare ``job`` for automatic sharing; returns the prompt tokens it is expected to
        reuse from the index (cached now, or being computed by a running request)."""
        job.seq.salt_root = salt_root(salt)
        index = self.tables.index
        if index is None or pooled:
            return 0
        ps, tokens = self.page_size, job.seq.tokens
        limit = len(tokens) - 1
        job.prompt_keys = index.keys_for(tokens, job.seq.salt_root, limit // ps)
        m = index.match(tokens, job.seq.salt_root, limit, job.prompt_keys)
        n = len(m.pages)
        while n < len(job.prompt_keys) and self._computing(job.prompt_keys[n]) is not None:
            n += 1
        return max(m.num_tokens(ps), n * ps)

    # ---- at start ----------------------------------------------------------------------
    def _auto_start(self, job: Job, p_other: int) -> bool | None:
        """Start ``job`` from the index when that reuses more than ``p_other`` tokens (its pool or
        its own cache). None: not from the index; False: no page for the partial copy yet."""
        if not job.prompt_keys:
            return None
        seq = job.seq
        m = self.tables.match(seq.tokens, seq.salt_root, len(seq.tokens) - 1, job.prompt_keys)
        p = m.num_tokens(self.page_size) if m is not None else 0
        if p <= p_other:
            self._mark_inflight(job, 0)
            return None
        old = job.session.seq
        if not self.tables.share_match(seq, m):
            return False
        if old is not seq:
            self.tables.drop(old)
        seq.num_shared_tokens = 0
        job.session.seq = seq
        if not job.num_preemptions:
            self._recount_cache_n(job, p)
        self.counters["auto_prefix_tokens"] += p
        self._mark_inflight(job, len(m.pages))
        return True

    def _recount_cache_n(self, job: Job, p: int) -> None:
        delta = p - job.timings.cache_n
        if delta:
            job.timings.cache_n = p
            job.info.cached_prefix_tokens = p
            self.counters["cached_prompt_tokens"] += delta

    def _mark_inflight(self, job: Job, start: int) -> None:
        index = self.tables.index
        for k in job.prompt_keys[start:]:
            if k not in index.entries and self._computing(k) is None:
                self._inflight[k] = job

    def _computing(self, key: bytes) -> Job | None:
        j = self._inflight.get(key)
        if j is not None and (not j.started or j.finish_reason is not None):
            del self._inflight[key]
            j = None
        return j

    def _waits_for_prefix(self, job) -> bool:
        """A waiting request whose next uncached prompt page a running request is computing."""
        if not self._inflight or not getattr(job, "prompt_keys", None):
            return False
        k = self.tables.index.pending_key(job.prompt_keys, 0)
        if k is None:
            return False
        r = self._computing(k)
        return r is not None and r is not job

    # ---- at finish ---------------------------------------------------------------------
    def _after_request(self, session: Session) -> None:
        self.tables.cache_tail(session.seq)
        if not session.anonymous:
            return
        pool = self._session_pool(session)
        if self.config.session_ttl_s == 0:
            self._expire(session)
        elif pool is not None and pool.residency == Residency.RELEASED:
            self._drop_session_kv(session)  # its pages fall into the cache: the released pool's KV is not pinned

    def _expire(self, s: Session) -> None:
        self._drop_session_kv(s)
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

    def _expire_with_pool(self, pool) -> None:
        """A released pool: the idle anonymous sessions on it drop their KV now (it falls into the cache,
        evictable) and leave the pool; the sessions themselves live on until their TTL."""
        for sid in list(pool.sessions):
            s = self.sessions.get(sid)
            if s is not None and s.anonymous and s.is_idle:
                self._drop_session_kv(s)

    # ---- memory ------------------------------------------------------------------------
    def reclaim(self, num_pages: int, keep: Session | None = None) -> int:
        """Free at least num_pages if possible: cache pages first (LRU, leaves first), then idle
        sessions' KV, then idle pools (LRU). An evicted session stays attached to its pool (it
        recomputes on its next turn)."""
        start = self.kv.num_free

        def short() -> int:
            return num_pages - (self.kv.num_free - start)

        self.tables.evict_cache(short())
        if short() <= 0:
            return self.kv.num_free - start
        idle = sorted((s for s in self.sessions.values() if s.is_idle and s.seq.page_table and s is not keep),
                      key=lambda s: s.last_access)
        for s in idle:
            if short() <= 0:
                break
            self._drop_session_kv(s, detach=False)
            self.tables.evict_cache(short())
            self.counters["evicted_sessions"] += 1
        now = time.monotonic()
        while short() > 0:
            cands = [p for p in self.tree.pools.values()
                     if p.residency == Residency.RESIDENT and not p.pinned and not self._auto_pinned(p, now)]
            if not cands:
                break
            self._evict_pool(min(cands, key=lambda p: p.last_access))
            self.tables.evict_cache(short())
            self.counters["evicted_pools"] += 1
        return self.kv.num_free - start

    def cache_status(self, cache_only: int, cache_owned: int) -> dict:
        """The prefix cache: pages only it holds (evictable), pages it owns (those plus pages sessions
        still read after their owner ended), hits."""
        c, pb = self.counters, self.kv.page_bytes
        return {
            "enabled": self.tables.index is not None,
            "cache_pages": cache_only,
            "cache_kv_bytes": cache_only * pb,
            "owned_pages": cache_owned,
            "indexed_pages": len(self.tables.index) if self.tables.index is not None else 0,
            "evicted_pages": self.tables.evicted_pages,
            "prompt_tokens": c["prompt_tokens"],
            "cached_prompt_tokens": c["cached_prompt_tokens"],
            "auto_prefix_tokens": c["auto_prefix_tokens"],
            # prompt tokens reused (pools, sessions and the automatic index) / prompt tokens
            "hit_rate": c["cached_prompt_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
        }
