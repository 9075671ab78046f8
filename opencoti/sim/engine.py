"""A simulated engine: the real ``Metrics`` and ``AdmissionController`` on a simulated clock.

``SimCore`` stands in for ``EngineCore`` (the scheduler's job lists, KV page counts, ``prepare`` /
``commit``, the listener events) around the engine's own owner of the pool and session state,
``PolyKV``, over pages that do not exist; ``SimEngine`` stands in for
``Engine`` (a command runs at once on the simulated step thread) and runs the step loop:
``AdmissionController.tick`` every iteration, one step of every running and waiting request at a
time, whose duration a ``StepClock`` draws from a profile. Requests go through
``AdmissionController.submit`` exactly as on the real engine: prepare -> decide -> commit.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine.admission import AdmissionController, AdmissionPlan
from ..engine.config import EngineConfig, SamplingParams
from ..engine.errors import SessionBusyError
from ..engine.kv.pool import Pool
from ..engine.limits import Limits
from ..engine.observe.metrics import Metrics
from ..engine.polykv.state import PolyKV
from ..engine.requests import Job, SeqState, Session, SessionState
from ..engine.results import RequestInfo
from ..engine.polykv.view import Listener, PoolView, TreeView
from .profile import StepClock, StepProfile


@dataclass
class _Prepared:
    plan: AdmissionPlan
    prompt: list
    params: SamplingParams
    emit: Callable
    session_id: str | None
    session: Session | None
    pool: Pool | None


@dataclass(kw_only=True)
class SimJob(Job):
    """A simulated request: ``sim_cached`` prompt tokens come from its pool (not prefilled)."""

    sim_cached: int = 0


class _Stats:
    __slots__ = ("num_seqs", "num_decode", "num_prefill_tokens", "num_tokens", "ctx_tokens", "total_s", "model_s")

    def __init__(self, seqs: int, decode: int, prefill: int, total_s: float, ctx: int):
        self.num_seqs, self.num_decode, self.num_prefill_tokens, self.ctx_tokens = seqs, decode, prefill, ctx
        self.num_tokens, self.total_s, self.model_s = decode + prefill, total_s, total_s


@dataclass
class SimPages:
    """KV page counts (``PageCounts``): no pages behind them."""

    num_pages: int
    num_free: int
    page_bytes: int = 1024
    page_size: int = 16

    def decref(self, pages: list[int]) -> None:
        """No pages to give back (a simulated session's page table is always empty)."""
        assert not pages


class NoPrefixCache:
    """KV tables without prefix-cache-only pages (``CacheCounts``)."""

    @staticmethod
    def num_cache_only() -> int:
        return 0

    @staticmethod
    def kv_location(seq, spilled_keys=()) -> dict:
        """Simulated KV is in RAM while a session holds some (no tier)."""
        n = seq.num_cached
        return {"kv_location": "ram" if n else "none", "kv_ram_tokens": n, "kv_disk_tokens": 0}


@dataclass
class SimQueues:
    """The scheduler's job lists (``JobQueues``)."""

    running: list[SimJob] = field(default_factory=list)
    waiting: list[SimJob] = field(default_factory=list)


class SimCore:
    """Enough of EngineCore for Metrics and the AdmissionController (no tensors anywhere): the
    ``PolyKVView`` they read (checked by mypy, tests/offline/test_view.py) and the request path."""

    def __init__(self, *, num_pages: int = 4096, page_size: int = 16, max_context: int = 8192):
        self.listeners: list[Listener] = []
        self.page_size = page_size
        self.max_context = max_context
        self.kv = SimPages(num_pages=num_pages, num_free=num_pages, page_size=page_size)
        self.tables = NoPrefixCache()
        self.scheduler = SimQueues()
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0,
                         "evicted_sessions": 0, "evicted_pools": 0, "expired_sessions": 0}
        pages: Any = self.kv  # page counts only: the simulated sessions never hold a page
        self.polykv = PolyKV(EngineConfig(max_pools=16, prefix_cache=False), pages,
                             Limits(vocab_size=2**31 - 1, max_context=max_context, kv=pages),
                             listeners=self.listeners, counters=self.counters, enqueue=self._no_materialization)

    @staticmethod
    def _no_materialization(job) -> None:
        raise AssertionError("the simulator's pools are resident from the start (add_pool)")

    @property
    def sessions(self) -> dict[str, Session]:
        return self.polykv.sessions

    @property
    def tree(self) -> TreeView:
        return self.polykv.tree

    @staticmethod
    def auto_pinned(pool: PoolView, now: float) -> bool:
        return True

    def add_pool(self, n_tokens: int) -> Pool:
        """A root pool of ``n_tokens`` whose KV is there (no pages to compute): the owner's restore path."""
        kv = self.polykv
        pool = kv.restore_pool(kv.tree.next_id, None, 0, list(range(1, n_tokens + 1)), pinned=False, label="",
                               tenant=None)
        kv.skip_pool_ids(pool.pool_id + 1)
        kv.pool_loaded(pool)
        return pool

    def emit(self, event: str, **data) -> None:
        for fn in self.listeners:
            fn(event, data)

    # ---------------------------------------------------------------- the request path
    def prepare(self, prompt, params, emit, *, session_id=None, pool_id=None, shared_prefix_n_tokens=None,
                overcommit=False) -> _Prepared:
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is not None and session.job is not None:
            raise SessionBusyError(f"session {session_id!r} is serving another request")
        pool = self.polykv.tree.get(pool_id) if pool_id is not None else None
        plan = AdmissionPlan(pool_id=pool_id, session_id=session_id,
                             new_to_pool=pool is not None and (session is None or session.pool_id != pool_id),
                             prompt_len=len(prompt), prefix_len=pool.prefix_len if pool is not None else 0,
                             max_tokens=params.max_tokens, overcommit=overcommit)
        return _Prepared(plan, list(prompt), params, emit, session_id, session, pool)

    def commit(self, req: _Prepared, admission: dict | None = None) -> Job:
        kv = self.polykv
        s = req.session or kv.open_session(req.session_id, lambda: "")  # the simulator names every session
        pool = req.pool
        if pool is not None and s.pool_id != pool.pool_id:
            kv.detach(s)
            kv.attach(s, pool)
        cached = min(pool.prefix_len, len(req.prompt) - 1) if pool is not None else 0
        job = SimJob(seq=SeqState(list(req.prompt)), params=req.params, emit=req.emit, session=s,
                     prompt_len=len(req.prompt), max_context=self.max_context, sim_cached=cached)
        job.info = RequestInfo(request_id="", session_id=s.session_id, pool_id=s.pool_id, prompt_tokens=len(req.prompt),
                               cached_prefix_tokens=cached, admission=admission)
        kv.begin(s, job)
        kv.adopt_seq(s, job.seq, shared=0)
        self.scheduler.waiting.append(job)
        self.counters["requests"] += 1
        self.emit("submit", job=job)
        return job

    def cancel(self, job) -> None:
        self.finish(job, "cancelled")

    def finish(self, job, reason: str = "length") -> None:
        for q in (self.scheduler.running, self.scheduler.waiting):
            if job in q:
                q.remove(job)
        job.finish_reason = reason
        self.polykv.end(job.session)
        self.emit("finish", job=job)

    def release_session(self, session_id: str) -> None:
        s = self.polykv.get_session(session_id)
        if s.job is not None:
            self.cancel(s.job)
        self.polykv.remove_session(session_id)


class SimEngine:
    """The step loop of a simulated engine on a simulated clock (deterministic under ``seed``)."""

    def __init__(self, profile: StepProfile, seed: int, *, adaptive: bool = True, **core_kw):
        self.t = 0.0
        self.profile = profile
        self.steps = StepClock(profile, seed)
        self.core = SimCore(**core_kw)
        clock = lambda: self.t  # noqa: E731
        self.metrics = Metrics(self.core, clock=clock, wall_clock=clock)
        self.admission = AdmissionController(self.core, self.post_to_step_thread, self.metrics, clock=clock)
        self.on_token: Callable | None = None  # (job, t) after every generated token
        self.on_finish: Callable | None = None  # (job, t) when a request ends
        self.step_log: list[tuple] = []  # (t_end, b, prefill_tokens, duration)

    def post_to_step_thread(self, fn, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    @property
    def has_work(self) -> bool:
        return bool(self.core.scheduler.running or self.core.scheduler.waiting)

    def step(self) -> None:
        """One engine step: every waiting request is prefilled (and samples its first token),
        every running one decodes a token."""
        sch = self.core.scheduler
        new = list(sch.waiting)
        run = list(sch.running)
        prefill = sum(max(j.prompt_len - j.sim_cached, 1) for j in new)
        batch = run + new
        ctx = sum(len(j.seq.tokens) for j in batch)
        dt = self.steps.step(self.t, len(batch), prefill, ctx)
        self.t += dt
        self.step_log.append((self.t, len(batch), prefill, dt))
        for j in new:
            sch.waiting.remove(j)
            sch.running.append(j)
            j.state, j.started = SessionState.DECODE, True
        for j in batch:
            j.generated.append(1)
            j.seq.tokens.append(1)
            self.core.counters["generated_tokens"] += 1
            self.core.emit("token", job=j, now=self.t)
            if self.on_token is not None:
                self.on_token(j, self.t)
        for j in batch:
            if j.params.max_tokens is not None and len(j.generated) >= j.params.max_tokens:
                self.core.finish(j)
                if self.on_finish is not None:
                    self.on_finish(j, self.t)
        self.core.emit("step", stats=_Stats(len(batch), len(run), prefill, dt, ctx))

    def run_until(self, t_end: float) -> None:
        """Run the loop until the clock reaches ``t_end`` (the last step may end after it)."""
        adm = self.admission
        while self.t < t_end:
            adm.tick(self.t)
            if self.has_work:
                self.step()
                continue
            wake = adm.next_deadline()
            nxt = t_end if wake is None else min(t_end, max(wake, self.t + 1e-6))
            self.t = max(self.t, nxt)
