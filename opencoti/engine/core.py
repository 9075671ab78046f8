"""EngineCore: everything that runs on the step thread — requests, sessions, pools, memory.

Nothing here is thread-safe by itself: the Engine facade (engine.py) calls these methods only
from its single step-loop thread (DESIGN decision 6). Every public operation validates all of
its input before it mutates anything, so a rejected call leaves the state untouched.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Callable, Sequence as Seq

from .config import EngineConfig, SamplingParams
from .errors import (CapacityError, ContextLengthError, InvalidRequestError, PoolBusyError,
                     PoolContractError, SessionBusyError, SessionNotFoundError)
from .kv.pages import PagePool
from .kv.pools import Pool, PoolTree, Residency, common_prefix_len
from .results import GenerationResult, PoolInfo, RequestInfo, TokenDelta
from .sampling import IncrementalDetokenizer, Sampler, StopStringMatcher, make_generator
from .scheduler import Scheduler
from .session import Job, Sequence, Session, SessionState

Emit = Callable[[tuple], None]
_MAX_SESSION_ID = 128


class EngineCore:
    def __init__(self, config: EngineConfig, *, model, tokenizer, backend, kv: PagePool, max_context: int,
                 device):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.page_size = kv.page_size
        self.max_context = max_context
        self.vocab_size = model.dims.vocab_size
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.sessions: dict[str, Session] = {}
        self.tree = PoolTree(config.max_pools)
        self.sampler = Sampler()
        self.scheduler = Scheduler(
            kv=kv, model=model, backend=backend, sampler=self.sampler,
            max_batch_tokens=config.max_batch_tokens, max_running=config.max_running,
            reclaim=self.reclaim, on_token=self._on_token, on_prefilled=self._on_prefilled,
            device=device)
        self.scheduler.on_stuck = self._on_stuck
        self._request_ids = itertools.count(1)
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0,
                         "evicted_sessions": 0, "evicted_pools": 0, "preemptions": 0}
        # Observability hooks, called on the step thread: (event, data) with events
        # submit {job}, token {job, now}, finish {job}, materialized {pool}, step {stats}.
        self.listeners: list[Callable[[str, dict], None]] = []
        # Admission hook, called after a request is validated and before anything is committed:
        # gate(pool, session_id, is_new_session, prompt_len, params, overcommit); raising rejects it.
        self.admission_gate: Callable[..., None] | None = None

    # ======================================================================== validation
    def _check_tokens(self, tokens, what: str = "prompt") -> list[int]:
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise InvalidRequestError(f"{what} is empty")
        out = []
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"{what} contains token id {t!r} outside the vocabulary [0, {self.vocab_size})")
            out.append(t)
        return out

    def _capacity_tokens(self) -> int:
        return self.kv.num_pages * self.page_size

    def _check_fits(self, n_tokens: int, max_tokens: int | None, what: str = "prompt") -> None:
        total = n_tokens + (max_tokens or 0)
        if total > self.max_context:
            raise ContextLengthError(
                f"{what} ({n_tokens} tokens) + max_tokens ({max_tokens or 0}) = {total} exceeds the context "
                f"length {self.max_context}")
        if self.kv.pages_for(total - 1) > self.kv.num_pages:  # the last sampled token never needs KV
            raise ContextLengthError(
                f"{what} ({n_tokens} tokens) + max_tokens ({max_tokens or 0}) does not fit the KV cache "
                f"({self._capacity_tokens()} tokens)")

    def get_session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            raise SessionNotFoundError(f"session {session_id!r} not found")
        return s

    @staticmethod
    def _check_session_id(session_id) -> None:
        if not isinstance(session_id, str) or not session_id or len(session_id) > _MAX_SESSION_ID:
            raise InvalidRequestError(f"session_id must be a non-empty string of at most {_MAX_SESSION_ID} characters")

    # ======================================================================== requests
    def submit(self, prompt: list[int], params: SamplingParams, emit: Emit, *, session_id: str | None = None,
               pool_id: int | None = None, shared_prefix_n_tokens: int | None = None,
               overcommit: bool = False) -> Job:
        """Accept a generation request (validate everything, then commit)."""
        prompt = self._check_tokens(prompt)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids contains an id outside the vocabulary")
        self._check_fits(len(prompt), params.max_tokens)
        session = None
        if session_id is not None:
            self._check_session_id(session_id)
            session = self.sessions.get(session_id)
            if session is not None and session.job is not None:
                raise SessionBusyError(f"session {session_id!r} is serving another request")
        pool = self.tree.get(pool_id) if pool_id is not None else None
        if shared_prefix_n_tokens is not None:
            n = shared_prefix_n_tokens
            if pool is None:
                raise InvalidRequestError("shared_prefix_n_tokens needs a pool_id")
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= min(pool.prefix_len, len(prompt)):
                raise InvalidRequestError(
                    f"shared_prefix_n_tokens must be in [0, min(pool prefix_len {pool.prefix_len}, prompt length "
                    f"{len(prompt)})], got {n!r}")
            if n and common_prefix_len(prompt[:n], pool.tokens[:n]) < n:
                raise PoolContractError(
                    f"shared_prefix_n_tokens={n} but the prompt differs from pool {pool.pool_id}'s tokens at "
                    f"position {common_prefix_len(prompt[:n], pool.tokens[:n])}")
        if self.admission_gate is not None:
            self.admission_gate(pool, session_id, session is None, len(prompt), params, overcommit)
        # ---- everything validated: commit
        if session is None:
            session = Session(session_id or f"s-{uuid.uuid4().hex[:12]}")
            self.sessions[session.session_id] = session
        limit = len(prompt) - 1  # the last prompt token is always computed (its logits are needed)
        cur = self._session_pool(session)
        if pool is not None and cur is not None and cur is not pool:
            self._drop_session_kv(session)  # moving to another pool: its cache borrows the old pool's pages
            cur = None
        if pool is None and cur is not None and cur.residency != Residency.RELEASED:
            pool = cur  # a later turn stays on its pool
        pool_p = 0
        if pool is not None:
            pool_p = shared_prefix_n_tokens if shared_prefix_n_tokens is not None else common_prefix_len(prompt, pool.tokens)
            pool_p = min(pool_p, limit)
        own_p = min(common_prefix_len(prompt, session.seq.cached_tokens), limit) if session.seq.num_cached else 0
        if shared_prefix_n_tokens is not None:
            own_p = min(own_p, pool_p)  # an explicit P is what the caller asked for
        waits = self._ensure_resident(pool) if pool is not None and own_p < pool_p else []
        if pool is not None and session.pool_id is None:
            session.pool_id = pool.pool_id
            pool.sessions.add(session.session_id)
        if pool is not None:
            pool.last_access = time.time()
            if max(pool_p, own_p) > 0:
                pool.cache_hits += 1
        job = Job(seq=Sequence(prompt), params=params, emit=emit, session=session, wait_for=waits,
                  prompt_len=len(prompt), max_context=self.max_context)
        job.generator = make_generator(params.seed, self.config.seed) if not params.is_greedy else None
        job.detok = IncrementalDetokenizer(self.tokenizer.decode)
        job.stopper = StopStringMatcher(params.stop)
        cache_n = max(pool_p, own_p)
        job.timings.cache_n = cache_n
        use_own = own_p >= pool_p and own_p > 0
        job.start_plan = lambda: self._start_session_job(job, use_own, cache_n)
        session.job = job
        session.last_access = time.monotonic()
        info = RequestInfo(request_id=f"req-{next(self._request_ids)}", session_id=session.session_id,
                           pool_id=session.pool_id, cached_prefix_tokens=cache_n, prompt_tokens=len(prompt),
                           rematerialized_pools=[p.pool_id for p in waits])
        job.info = info
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cached_prompt_tokens"] += cache_n
        self.scheduler.add(job)
        for fn in self.listeners:
            fn("submit", {"job": job})
        emit(("start", info))
        return job

    def _session_pool(self, session: Session) -> Pool | None:
        if session.pool_id is None:
            return None
        return self.tree.pools.get(session.pool_id) or self.tree.released.get(session.pool_id)

    def _share_prefix(self, src_table: list[int], n_tokens: int, keep: Session | None = None) -> list[int] | None:
        """A new page table sharing ``[0, n_tokens)`` of ``src_table``: full pages by refcount,
        the partial last page copied (a shared page is never written by two owners).
        ``keep``: a session whose pages are the source and must survive reclaim."""
        full, part = divmod(n_tokens, self.page_size)
        if part and not self.kv.can_allocate(1):
            self.reclaim(1, keep=keep)
            if not self.kv.can_allocate(1):
                return None
        table = list(src_table[:full])
        self.kv.incref(table)
        if part:
            page = self.kv.allocate(1)[0]
            self.kv.copy_page(src_table[full], page)
            table.append(page)
        return table

    def _start_session_job(self, job: Job, use_own: bool, cache_n: int) -> bool:
        session = job.session
        old = session.seq
        pool = self._session_pool(session)
        if job.num_preemptions or not use_own:
            # from the pool (or from nothing); after a preemption the old cache is gone
            if pool is not None and pool.residency == Residency.RESIDENT:
                p = min(common_prefix_len(job.seq.tokens, pool.tokens), len(job.seq.tokens) - 1)
                if not job.num_preemptions:
                    p = min(p, cache_n)
                src, borrowed = pool.seq.page_table, p // self.page_size
            else:
                p, src, borrowed = 0, [], 0
        else:
            p, src = cache_n, old.page_table
            borrowed = min(old.num_borrowed_pages, p // self.page_size)
        from_own = src is old.page_table
        full, part = divmod(p, self.page_size)
        if (from_own and part and full >= old.num_borrowed_pages
                and self.kv.refcount[src[full]] == 1):
            # its own cache, and the partial page is its own: truncate in place, no copy, no new page
            table = src[:full + 1]
            self.kv.decref(src[full + 1:])
            old.page_table = []
        else:
            table = self._share_prefix(src, p)
            if table is None:
                return False
        if old is not job.seq:
            self.kv.decref(old.page_table)
            old.page_table = []
            old.num_cached = 0
        job.seq.page_table = table
        job.seq.num_cached = p
        job.seq.num_borrowed_pages = borrowed
        # tokens shared with the pool (the suffix is [shared, len)): P from the pool, or as before
        job.seq.num_shared_tokens = min(old.num_shared_tokens, p) if from_own else p
        if session.pool_id is None:
            job.seq.num_shared_tokens = 0
        session.seq = job.seq
        return True

    def _on_token(self, job: Job, token: int, logprob, top) -> None:
        now = time.perf_counter()
        if not job.generated:
            job.t_first_token = now
            job.timings.prompt_ms = (now - job.t_start) * 1e3
            job.timings.prompt_n = job.prompt_len - job.timings.cache_n
        job.t_last_token = now
        job.generated.append(token)
        job.seq.tokens.append(token)
        self.counters["generated_tokens"] += 1
        p = job.params
        finish = None
        text = ""
        if token in self.eos_ids and not p.ignore_eos:
            finish = "eos"
        elif token in p.stop_token_ids:
            finish = "stop"
        else:
            piece = job.detok.push(token)
            text, hit = job.stopper.feed(piece)
            if hit:
                finish = "stop"
                job.stopping_word = job.stopper.matched if hasattr(job.stopper, "matched") else ""
        if finish is None:
            if p.max_tokens is not None and len(job.generated) >= p.max_tokens:
                finish = "length"
            elif len(job.seq.tokens) >= job.max_context:
                finish, job.truncated = "length", True
        if finish is not None and finish != "stop":
            text += job.stopper.feed(job.detok.flush())[0] if finish == "length" else ""
            text += job.stopper.flush()
        job.text += text
        delta = TokenDelta(token_id=token, text=text, logprob=logprob, top_logprobs=top)
        if p.logprobs is not None:
            job.logprobs.append(delta)
        job.emit(("token", delta))
        for fn in self.listeners:
            fn("token", {"job": job, "now": now})
        if finish is not None:
            self._finish(job, finish)

    def _finish(self, job: Job, reason: str, error: Exception | None = None) -> None:
        self.scheduler.remove(job)
        job.finish_reason = reason
        t = job.timings
        t.predicted_n = max(len(job.generated) - 1, 0)
        t.predicted_ms = (job.t_last_token - job.t_first_token) * 1e3 if job.generated else 0.0
        session = job.session
        if session is not None:
            session.job = None
            session.last_access = time.monotonic()
            pool = self._session_pool(session)
            if pool is not None:
                pool.last_access = time.time()
        self.counters["preemptions"] += job.num_preemptions
        for fn in self.listeners:
            fn("finish", {"job": job})
        if error is not None:
            job.emit(("error", error))
            return
        result = GenerationResult(
            text=job.text, token_ids=list(job.generated), stop_reason=reason, stopping_word=job.stopping_word,
            truncated=job.truncated, timings=t.as_dict(), info=job.info,
            logprobs=job.logprobs if job.params.logprobs is not None else None)
        job.emit(("done", result))

    def cancel(self, job: Job) -> None:
        """Stop a request (client went away). Its session keeps what was computed."""
        if job.finish_reason is not None:
            return
        if job.params is None:
            return  # materializations run to completion
        if not job.started and job.session is not None and job.seq is not job.session.seq:
            job.seq.page_table = []
        self._finish(job, "cancelled")

    def _on_stuck(self, job: Job) -> None:
        """The scheduler cannot give this job a page even alone: end it cleanly."""
        if job.params is None:
            self.scheduler.remove(job)
            self._fail_materialization(job, CapacityError("KV cache too small to materialize this pool"))
        elif job.generated:
            job.truncated = True
            self._finish(job, "length")
        else:
            self._finish(job, "error", CapacityError("KV cache too small for this request", retry_after=1.0))

    # ======================================================================== memory
    def reclaim(self, num_pages: int, keep: Session | None = None) -> int:
        """Free at least num_pages if possible: idle sessions' KV first, then idle pools (LRU).
        An evicted session stays attached to its pool (it recomputes on its next turn)."""
        start = self.kv.num_free
        idle = sorted((s for s in self.sessions.values() if s.is_idle and s.seq.page_table and s is not keep),
                      key=lambda s: s.last_access)
        for s in idle:
            if self.kv.num_free - start >= num_pages:
                break
            self._drop_session_kv(s, detach=False)
            self.counters["evicted_sessions"] += 1
        now = time.monotonic()
        while self.kv.num_free - start < num_pages:
            cands = [p for p in self.tree.pools.values()
                     if p.residency == Residency.RESIDENT and not p.pinned and not self._auto_pinned(p, now)]
            if not cands:
                break
            self._evict_pool(min(cands, key=lambda p: p.last_access))
            self.counters["evicted_pools"] += 1
        return self.kv.num_free - start

    def _sessions_in_use(self, pool: Pool) -> bool:
        for sid in pool.sessions:
            s = self.sessions.get(sid)
            if s is not None and (s.job is not None or s.seq.num_borrowed_pages):
                return True
        return False

    def _auto_pinned(self, pool: Pool, now: float) -> bool:
        return pool.is_auto_pinned(now, self._sessions_in_use(pool))

    def _drop_session_kv(self, s: Session, detach: bool = True) -> None:
        self.kv.decref(s.seq.page_table)
        s.seq = Sequence()
        if detach:
            self._detach(s)

    def _detach(self, s: Session) -> None:
        pool = self._session_pool(s)
        s.pool_id = None
        if pool is None:
            return
        pool.sessions.discard(s.session_id)
        if not pool.sessions and not pool.children:
            pool.grace_until = time.monotonic() + self.config.pool_grace_ttl_s
        self._maybe_reap(pool)

    def release_session(self, session_id: str) -> None:
        s = self.get_session(session_id)
        if s.job is not None:
            self.cancel(s.job)
        self._drop_session_kv(s)
        del self.sessions[session_id]

    # ======================================================================== pools
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

    def _enqueue_materialization(self, pool: Pool, waits: list[Pool], done: Callable) -> Job:
        job = Job(seq=pool.seq, params=None, emit=lambda ev: None, pool=pool, wait_for=list(waits),
                  prompt_len=pool.prefix_len, max_context=self.max_context)
        job.on_done = done

        def start() -> bool:
            parent = pool.parent
            d = pool.branch_pos if parent is not None else 0
            table = self._share_prefix(parent.seq.page_table, d) if d else []
            if table is None:
                return False
            pool.seq.page_table = table
            pool.seq.num_cached = d
            pool.seq.num_borrowed_pages = d // self.page_size
            return True

        job.start_plan = start
        self.scheduler.add(job)
        return job

    def _on_prefilled(self, job: Job) -> None:
        pool = job.pool
        pool.residency = Residency.RESIDENT
        pool.last_access = time.time()
        for fn in self.listeners:
            fn("materialized", {"pool": pool})
        job.on_done(pool)

    def _fail_materialization(self, job: Job, error: Exception) -> None:
        pool = job.pool
        self.kv.decref(pool.seq.page_table)
        pool.seq.page_table = []
        pool.seq.num_cached = 0
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
                    pinned: bool = False, label: str = "") -> Pool | None:
        """Create a root pool (from_session of a pooled session forks that pool, zero-copy)."""
        if (tokens is None) == (from_session is None):
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        if from_session is not None:
            s, toks = self._tokens_from_session(from_session)
            parent = self._session_pool(s)
            if parent is not None and parent.residency == Residency.RESIDENT:
                d = s.seq.num_borrowed_pages * self.page_size
                return self.fork_pool(done, parent.pool_id, d, from_session=from_session, pinned=pinned,
                                      label=label, allow_empty=False)
            self.tree.check_budget()
            self._check_fits(len(toks), 0, "pool prefix")
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
        toks = self._check_tokens(list(tokens), "pool tokens")
        self._check_fits(len(toks), 0, "pool prefix")
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
            toks = self._check_tokens(list(tokens), "pool tokens")
        if len(toks) <= d and not allow_empty:
            raise InvalidRequestError(
                f"the fork's own range is empty: tokens cover [0, {len(toks)}) but branch_pos is {d}; "
                "pass the full prefix [0, L) with L > branch_pos")
        if d and parent.hash_at(d) != _hash_prefix(toks, d):
            at = common_prefix_len(toks[:d], parent.tokens[:d])
            raise PoolContractError(
                f"prefix contract violated: tokens[0:{d}] differ from pool {parent_id}'s tokens at position {at}")
        self._check_fits(len(toks), 0, "pool prefix")
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
        if n_tokens % self.page_size and not self.kv.can_allocate(1):
            self.reclaim(1, keep=keep)
            if not self.kv.can_allocate(1):
                raise CapacityError("no free KV page for the snapshot's partial last page", retry_after=1.0)

    def _adopt_session_pages(self, pool: Pool, s: Session, d: int) -> None:
        """from_session: the pool takes the session's cached pages by refcount (zero-copy) and the
        session becomes a leaf of the new pool."""
        n = pool.prefix_len
        table = self._share_prefix(s.seq.page_table, n, keep=s)
        if table is None:
            raise CapacityError("no free KV page for the snapshot's partial page", retry_after=1.0)
        pool.seq.page_table = table
        pool.seq.num_cached = n
        pool.seq.num_borrowed_pages = d // self.page_size
        pool.residency = Residency.RESIDENT
        self._detach(s)
        s.pool_id = pool.pool_id
        pool.sessions.add(s.session_id)
        s.seq.num_borrowed_pages = n // self.page_size
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
        self.kv.decref(pool.seq.page_table)
        pool.seq.page_table = []
        pool.seq.num_cached = 0
        pool.seq.num_borrowed_pages = 0
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

    def release_pool(self, pool_id: int) -> None:
        pool = self.tree.get(pool_id)
        live = [c.pool_id for c in pool.children if c.residency != Residency.RELEASED]
        if live:
            raise PoolBusyError(f"pool {pool_id} has child pools {live}; release them first (leaves first)")
        if pool.residency == Residency.MATERIALIZING:
            raise PoolBusyError(f"pool {pool_id} is materializing")
        self._unlink(pool)

    def _unlink(self, pool: Pool) -> None:
        self.tree.pools.pop(pool.pool_id, None)
        pool.residency = Residency.RELEASED
        self.tree.released[pool.pool_id] = pool
        self._maybe_reap(pool)

    def _maybe_reap(self, pool: Pool) -> None:
        """A released pool's KV lives until its sessions and released children are gone."""
        while pool is not None and pool.residency == Residency.RELEASED and not pool.sessions and not pool.children:
            self.kv.decref(pool.seq.page_table)
            pool.seq.page_table = []
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
        self._drop_session_kv(s)
        s.pool_id = pool.pool_id
        pool.sessions.add(s.session_id)
        released = []
        p = self.tree.pools.get(release_from) if release_from is not None else None
        while (p is not None and p.pool_id != keep and p is not pool and not p.sessions and not p.pinned
               and not any(c.residency != Residency.RELEASED for c in p.children)):
            parent = p.parent
            self.release_pool(p.pool_id)
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
            residency=pool.residency.value, pinned=pool.pinned, auto_pinned=self._auto_pinned(pool, now),
            orphaned_pin=pool.pinned and not pool.sessions and not kids,
            last_access_ts=pool.last_access, children=[c.pool_id for c in kids], sessions=sessions,
            rematerialized=pool.rematerializations > 0, cache_hits=pool.cache_hits, label=pool.label)

    def pools_status(self) -> dict:
        return {
            "pools": [self.pool_info(p).as_dict() for p in sorted(self.tree.pools.values(), key=lambda p: p.pool_id)],
            "tree_depth": self.tree.depth(),
            "pools_used": self.tree.num_used,
            "pools_max": self.tree.max_pools,
            "kv_pages_total": self.kv.num_pages,
            "kv_pages_used": self.kv.num_used,
            "kv_bytes_used": self.kv.num_used * self.kv.page_bytes,
            "page_size": self.page_size,
        }

    def check_integrity(self) -> None:
        """Refcounts match the page tables, and every used page has exactly one owner."""
        holders = [p.seq.page_table for p in self.tree.pools.values()]
        holders += [p.seq.page_table for p in self.tree.released.values()]
        holders += [s.seq.page_table for s in self.sessions.values()]
        self.kv.check_integrity(holders)
        owned: list[int] = []
        for p in list(self.tree.pools.values()) + list(self.tree.released.values()):
            owned += p.seq.owned_pages
        for s in self.sessions.values():
            owned += s.seq.owned_pages
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert len(owned) == self.kv.num_used, (
            f"ownership: {len(owned)} owned pages != {self.kv.num_used} pages in use")
        for s in self.sessions.values():
            pool = self._session_pool(s)
            if s.seq.num_borrowed_pages:
                assert pool is not None, f"session {s.session_id} borrows pages without a pool"
                n = s.seq.num_borrowed_pages
                assert s.seq.page_table[:n] == pool.seq.page_table[:n], f"session {s.session_id} borrow mismatch"
        for p in self.tree.pools.values():
            if p.residency == Residency.RESIDENT and p.parent is not None:
                n = p.seq.num_borrowed_pages
                assert p.seq.page_table[:n] == p.parent.seq.page_table[:n], f"pool {p.pool_id} borrow mismatch"


def _hash_prefix(tokens: Seq[int], n: int) -> bytes:
    from .kv.pools import prefix_hashes
    return prefix_hashes(tokens[:n])[-1]
