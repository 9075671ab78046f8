"""EngineCore: a request's way through the step thread — prepare -> commit -> step -> apply -> finish.

It composes the parts that do the work: the ``Scheduler`` plans each step, the ``ModelRunner``
executes it, ``PolyKV`` (``polykv/state/``) owns the pool tree and the sessions, the
``PrefixCache`` (``polykv/prefix.py``) shares prefixes automatically, and the KV tables (held by
``PolyKV``) own the pages. The core keeps the requests themselves (their jobs, tokens, events).

Nothing here is thread-safe by itself: the Engine facade (api/engine.py) calls these methods only
from its single step-loop thread. Every public operation validates all of
its input before it mutates anything, so a rejected call leaves the state untouched.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Mapping

from ..admission.decide import AdmissionPlan
from ..config import EngineConfig, SamplingParams
from ..errors import CapacityError, InvalidRequestError, PoolContractError, SessionBusyError
from ..kv.pages import PagePool
from ..kv.pool import Pool, Residency, common_prefix_len
from ..kv.prefix_index import salt_root
from ..kv.tables import KVTables
from ..limits import Limits
from ..polykv.prefix import PrefixCache
from ..polykv.state import PolyKV
from ..polykv.view import PoolView, SessionView, TreeView
from ..results import GenerationResult, PromptProgress, RequestInfo, TokenDelta
from .runner import ModelRunner
from ..sampling import Sampler, make_generator
from ..sampling.text import TextOutput
from ..sampling.state import SamplerState
from .scheduler import Scheduler, StepStats
from ..requests import Job, MaterializeJob, SeqState, Session, SessionState, Work
from ..speculation import RecentOutputs
from .speculative import DraftState, Drafter

Emit = Callable[[tuple], None]


@dataclass(frozen=True)
class PreparedRequest:
    """A validated generation request and its admission plan (``EngineCore.prepare``)."""

    plan: AdmissionPlan
    prompt: list
    params: SamplingParams
    emit: Emit
    session_id: str | None
    session: Session | None
    pool: Pool | None
    shared_prefix_n_tokens: int | None
    sampler_state: SamplerState | None = None  # constraint / penalties / bias (sampling/state.py)
    cache_salt: str | None = None  # prefix-cache namespace (requests share cached KV only within one)


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
        self.limits = Limits(vocab_size=self.vocab_size, max_context=max_context, kv=kv)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0,
                         "evicted_sessions": 0, "evicted_pools": 0, "preemptions": 0,
                         "auto_prefix_tokens": 0, "expired_sessions": 0, "tier_read_pages": 0}
        # Observability hooks, called on the step thread: (event, data) with events
        # submit {job}, token {job, now}, finish {job}, materialized {pool}, step {stats}.
        self.listeners: list[Callable[[str, dict], None]] = []
        self.polykv = PolyKV(config, kv, self.limits, listeners=self.listeners, counters=self.counters,
                             enqueue=lambda job: self.scheduler.add(job))
        self.sampler = Sampler()
        self.scheduler = Scheduler(tables=self.polykv.tables, hooks=self, max_batch_tokens=config.max_batch_tokens,
                                   max_running=config.max_running)  # self: its SchedulerHooks
        self.runner = ModelRunner(model=model, backend=backend, sampler=self.sampler, kv=kv, device=device)
        self.last_step = StepStats()
        self.recent_outputs = RecentOutputs()  # finished answers later requests of their salt draft from
        self.prefix_cache = PrefixCache(self.polykv, self.limits, tokenizer, self.counters, self.recent_outputs)
        # speculative drafts: other requests' answers only where caching shares across requests
        self.drafter = Drafter(self.tables, self.recent_outputs, shared=self.tables.index is not None,
                               max_batch_tokens=config.max_batch_tokens)
        self._request_ids = itertools.count(1)

    # ---- the read surface (view.PolyKVView): the state is PolyKV's
    @property
    def sessions(self) -> Mapping[str, SessionView]:
        return self.polykv.sessions

    @property
    def tree(self) -> TreeView:
        return self.polykv.tree

    @property
    def tables(self) -> KVTables:
        return self.polykv.tables

    def auto_pinned(self, pool: PoolView, now: float) -> bool:
        return self.polykv.auto_pinned(pool, now)

    # ======================================================================== the step
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> StepStats:
        """Plan a batch (scheduler), execute it (model runner), apply the results (here)."""
        t0 = time.perf_counter()
        stats = StepStats()
        batch = self.scheduler.schedule()
        if self.scheduler.stuck is not None:
            self._on_stuck(self.scheduler.stuck)
        if batch:
            batch = self.drafter.add_drafts(batch)
            try:
                out = self.runner.execute(batch)
            except BaseException:
                self.drafter.drop_drafts(batch)
                raise
            decoding = [n for job, n in batch if n == 1 or (isinstance(job, Job) and job.draft)]
            if len(decoding) == len(batch):
                self.drafter.costs.observe(out.num_tokens, out.model_s)
            self._apply(batch, out)
            stats.model_s = out.model_s
            stats.num_seqs = len(batch)
            stats.num_tokens = out.num_tokens
            stats.num_decode = len(decoding)
            stats.num_draft = sum(decoding) - len(decoding)
            stats.num_drafted = sum(1 for n in decoding if n > 1)
            stats.num_prefill_tokens = stats.num_tokens - sum(decoding)
            stats.ctx_tokens = sum(len(job.seq.tokens) for job, _ in batch)  # attended over (after the step)
        stats.total_s = time.perf_counter() - t0
        self.last_step = stats
        return stats

    # ---- speculative decoding (speculative.py: the Drafter) ---------------------------------
    def _apply_verified(self, job: Job, tokens: list, lps, tops) -> None:
        """Emit what a draft's verification sampled; the KV of the accepted draft tokens stays,
        the rejected rows' pages go."""
        seq = job.seq
        accepted = len(tokens) - 1
        self.drafter.verified(job, accepted)
        self.tables.advance(seq, 1)
        job.state = SessionState.DECODE
        for j, t in enumerate(tokens):
            self._on_token(job, t, lps[j] if lps else None, tops[j] if tops else None)
            if job.finish_reason is not None:
                self.tables.trim(seq, seq.num_cached)  # ended inside the draft: its later rows' pages go
                break
            if j < accepted:
                self.tables.advance(seq, 1)  # its KV was computed by the next row

    def _apply(self, batch: list, out) -> None:
        for job, n in batch:  # (nothing below emits a token before this loop has announced every job)
            if isinstance(job, Job):
                if not job.announced:
                    self._announce(job)
                if job.draft:
                    continue  # applied with its verification below
            prefill = isinstance(job, Job) and not job.generated and job.seq.num_cached < job.prompt_len
            self.tables.advance(job.seq, n)
            if prefill:  # a chunk of its prompt (the streams that asked for it report the progress)
                job.emit(("progress", PromptProgress(job.seq.num_cached)))
            if isinstance(job, MaterializeJob) and job.num_remaining == 0:
                self.scheduler.remove(job)
                self.polykv.materialized(job)
        for i, job in enumerate(out.sampled):
            lp = out.logprobs[i] if out.logprobs is not None else None
            top = out.top_logprobs[i] if out.top_logprobs is not None else None
            job.state = SessionState.DECODE
            self._on_token(job, out.token_ids[i], lp, top)
        for job, tokens, lps, tops in out.verified:
            self._apply_verified(job, tokens, lps, tops)

    # ======================================================================== requests
    def submit(self, prompt: list[int], params: SamplingParams, emit: Emit, **kw) -> Job:
        """Prepare and commit at once, without admission (the Engine goes through its admission
        controller: prepare -> decide -> commit)."""
        return self.commit(self.prepare(prompt, params, emit, **kw))

    def prepare(self, prompt: list[int], params: SamplingParams, emit: Emit, *, session_id: str | None = None,
                pool_id: int | None = None, shared_prefix_n_tokens: int | None = None,
                overcommit: bool = False, cache_salt: str | None = None) -> PreparedRequest:
        """Validate a generation request and plan its admission. No side effect: nothing changes
        until ``commit`` (called on the same step-thread turn, so the checks still hold)."""
        prompt = self.limits.check_tokens(prompt)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids contains an id outside the vocabulary")
        self.limits.check_fits(len(prompt), params.max_tokens)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string")
        session = None
        if session_id is not None:
            self.limits.check_session_id(session_id)
            session = self.polykv.sessions.get(session_id)
            if session is not None and session.job is not None:
                raise SessionBusyError(f"session {session_id!r} is serving another request")
        pool = self.polykv.tree.get(pool_id) if pool_id is not None else None
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
        # the model's own ids for the text of recent answers the prompt repeats (never inside a pool's prefix)
        on_pool = pool or (self.polykv.session_pool(session) if session is not None else None)
        prompt = self.prefix_cache.realign(prompt, cache_salt, params, on_pool.prefix_len if on_pool is not None else 0)
        plan = AdmissionPlan(
            pool_id=pool.pool_id if pool is not None else None, session_id=session_id,
            new_to_pool=pool is not None and (session is None or session.pool_id != pool.pool_id),
            prompt_len=len(prompt), prefix_len=pool.prefix_len if pool is not None else 0,
            max_tokens=params.max_tokens, overcommit=bool(overcommit))
        # grammar, logit bias and penalties checked against the model (no side effect)
        sampler_state = SamplerState.for_request(params, prompt, self.tokenizer, self.vocab_size)
        return PreparedRequest(plan, prompt, params, emit, session_id, session, pool, shared_prefix_n_tokens,
                               sampler_state=sampler_state, cache_salt=cache_salt)

    def commit(self, req: PreparedRequest, admission: dict | None = None) -> Job:
        """Commit a prepared request: create/attach its session and queue its job.
        ``admission``: the admission decision the request carries (``info.admission``)."""
        prompt, params, emit, session, pool = req.prompt, req.params, req.emit, req.session, req.pool
        session_id, shared_prefix_n_tokens = req.session_id, req.shared_prefix_n_tokens
        polykv = self.polykv
        if session is None:
            session = polykv.open_session(session_id, lambda: f"s-{uuid.uuid4().hex[:12]}")
        limit = len(prompt) - 1  # the last prompt token is always computed (its logits are needed)
        cur = polykv.session_pool(session)
        if pool is not None and cur is not pool and (cur is not None or session.seq.num_borrowed_pages):
            polykv.drop_session_kv(session)  # moving to a pool: its cache borrows another pool's (or the cache's) pages
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
        waits = polykv.ensure_resident(pool) if pool is not None and own_p < pool_p else []
        if pool is not None and session.pool_id is None:
            polykv.attach(session, pool)
        if pool is not None:
            polykv.touch(pool, hit=max(pool_p, own_p) > 0)
        job = Job(seq=SeqState(prompt, salt_root=salt_root(req.cache_salt)), params=params, emit=emit,
                  session=session, wait_for=waits, prompt_len=len(prompt), max_context=self.max_context)
        job.generator = make_generator(params.seed, self.config.seed) if not params.is_greedy else None
        job.text_out = TextOutput(self.tokenizer.decode, params.stop)
        job.sampler_state = req.sampler_state
        k = params.speculative_max
        if k is None:
            k = self.config.speculative_max if self.config.speculative == "ngram" else 0
        job.draft_state = DraftState(k) if k > 0 else None
        cache_n = max(pool_p, own_p)
        auto_p = self.prefix_cache.plan_auto(job, session.pool_id is not None)
        job.timings.cache_n = max(cache_n, auto_p)
        job.start_from_own, job.start_prefix = own_p >= pool_p and own_p > 0, cache_n  # for try_start
        polykv.begin(session, job)
        info = RequestInfo(request_id=f"req-{next(self._request_ids)}", session_id=session.session_id,
                           pool_id=session.pool_id, cached_prefix_tokens=job.timings.cache_n, prompt_tokens=len(prompt),
                           rematerialized_pools=[p.pool_id for p in waits], admission=admission)
        job.info = info
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cached_prompt_tokens"] += job.timings.cache_n
        self.scheduler.add(job)
        for fn in self.listeners:
            fn("submit", {"job": job})
        emit(("start", info))
        return job

    # ---- SchedulerHooks (scheduler.py): what the scheduler asks while it plans
    def try_start(self, job: Work) -> bool:
        """Set up a waiting job's page table from the KV it reuses. False: not enough pages yet."""
        if isinstance(job, MaterializeJob):
            if not self.polykv.start_materialization(job):
                return False
            self.prefix_cache.continue_from_tier(job.seq, len(job.seq.tokens) - 1)  # an evicted pool's KV, back from disk
            return True
        assert isinstance(job, Job)
        return self._start_session_job(job)

    def waits_for_prefix(self, job: Work) -> bool:
        """A waiting request whose next uncached prompt page a running request computes (the prefix cache's)."""
        return self.prefix_cache.waits_for_prefix(job)

    def _announce(self, job: Job) -> None:
        """Tell the client once that its request started (its reuse of cached KV is counted by
        then): when the results of its first step are applied, or when it ends having started."""
        if not job.announced:
            job.announced = True
            job.emit(("started", job.info))

    def _start_session_job(self, job: Job) -> bool:
        use_own, cache_n = job.start_from_own, job.start_prefix
        session = job.session
        assert session is not None  # a generation request always has its session
        old = session.seq
        pool = self.polykv.session_pool(session)
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
        auto = self.prefix_cache.auto_start(job, p)  # the prefix index, when it has more
        if auto is not None:
            return auto
        from_own = src is old.page_table
        if from_own:  # its own cache: in place when its partial page is its own
            if not self.tables.continue_from(old, job.seq, p, borrowed):
                return False
        else:
            if not self.tables.share_into(job.seq, src, p, borrowed):
                return False
            if old is not job.seq:
                self.tables.drop(old)
            if pool is not None and src is pool.seq.page_table:  # its own suffix, back from the disk tier
                self.prefix_cache.continue_pooled(job)
        # tokens shared with the pool (the suffix is [shared, len)): P from the pool, or as before
        self.polykv.adopt_seq(session, job.seq, min(old.num_shared_tokens, p) if from_own else p)
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
            # a constrained output the budget closed (sampling.state.budget_closed) ended by length
            st = job.sampler_state
            finish = "length" if st is not None and st.budget_closed else "eos"
        elif token in p.stop_token_ids:
            finish = "stop"
        else:
            text, hit = job.text_out.push(token)
            if hit:
                finish = "stop"
                job.stopping_word = job.text_out.matched or ""
        if finish is None:
            if p.max_tokens is not None and len(job.generated) >= p.max_tokens:
                finish = "length"
            elif len(job.seq.tokens) >= job.max_context:
                finish, job.truncated = "length", True
        if finish is not None and finish != "stop":
            text += job.text_out.finish(finish)
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
        if job.t_start:  # it started (set up its prefix) at some point: "started" comes before its end
            self._announce(job)
        self.scheduler.remove(job)
        job.finish_reason = reason
        t = job.timings
        t.predicted_n = len(job.generated)  # = tokens_predicted (llama.cpp)
        if job.draft_state is not None:
            t.draft_n, t.draft_n_accepted = job.draft_state.drafted, job.draft_state.accepted
        t.predicted_ms = (job.t_last_token - job.t_first_token) * 1e3 if job.generated else 0.0
        session = job.session
        if session is not None:
            self.polykv.end(session)
            self.prefix_cache.on_request_end(session, job)
            self.polykv.after_request(session)
        self.counters["preemptions"] += job.num_preemptions
        for fn in self.listeners:
            fn("finish", {"job": job})
        if error is not None:
            job.emit(("error", error))
            return
        assert job.info is not None  # (set when it was accepted: a request that ends was)
        result = GenerationResult(
            text=job.text, token_ids=list(job.generated), stop_reason=reason, stopping_word=job.stopping_word,
            truncated=job.truncated, timings=t.as_dict(), info=job.info,
            logprobs=job.logprobs if job.params.logprobs is not None else None)
        job.emit(("done", result))

    def cancel(self, job: Job) -> None:
        """Stop a request (client went away). Its session keeps what was computed."""
        if job.finish_reason is not None:
            return
        if not isinstance(job, Job):
            return  # materializations run to completion
        self._finish(job, "cancelled")

    def fail_all(self, error: Exception) -> None:
        """End every queued and running job with ``error`` (a failed step, or shutdown)."""
        for job in list(self.scheduler.running) + list(self.scheduler.waiting):
            if isinstance(job, MaterializeJob):
                self.scheduler.remove(job)
                self.polykv.materialization_failed(job, error)
            elif isinstance(job, Job):
                self._finish(job, "error", error)

    def _on_stuck(self, job: Work) -> None:
        """The scheduler cannot give this job a page even alone: end it cleanly."""
        if isinstance(job, MaterializeJob):
            self.scheduler.remove(job)
            self.polykv.materialization_failed(job, self._kv_short(job, "materializing this pool"))
            return
        assert isinstance(job, Job)
        if job.generated:
            job.truncated = True
            self._finish(job, "length")
        else:
            self._finish(job, "error", self._kv_short(job, "this request"))

    def _kv_short(self, job, what: str) -> CapacityError:
        """'too small' only when the whole cache could not hold the job; else the cache is occupied."""
        need, total = self.kv.pages_for(len(job.seq.tokens)), self.kv.num_pages
        if need > total:
            return CapacityError(f"KV cache too small: {what} needs {need} pages, the cache has {total}")
        return CapacityError(f"KV cache full: {what} needs {need} pages, {self.kv.num_free} of {total} are free "
                             "(the rest hold pinned pools and running requests)", retry_after=1.0)


    # ======================================================================== sessions
    def release_session(self, session_id: str) -> None:
        """End a session: its request in flight is cancelled, its KV and place in the tree go."""
        s = self.polykv.get_session(session_id)
        if s.job is not None:
            self.cancel(s.job)  # an anonymous session may end with its request (session_ttl_s == 0)
        if session_id in self.polykv.sessions:
            self.polykv.remove_session(session_id)
