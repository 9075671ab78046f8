"""A scripted stand-in for EngineCore: just enough for Metrics and the AdmissionController.

Sessions, a scheduler's job lists, KV page counts and a pool tree: the ``PolyKVView`` they read
(mypy checks that FakeCore has it, tests/offline/test_view.py); every event is emitted by the test
(``emit``), with the test's own clock, so nothing depends on timing.
"""

from __future__ import annotations

from opencoti.engine.config import SamplingParams
from opencoti.engine.polykv.state import PoolTree
from opencoti.engine.requests import Job, SeqState, Session, SessionState
from opencoti.engine.polykv.view import Listener, PoolView
from opencoti.sim.engine import NoPrefixCache, SimPages, SimQueues


class FakeCore:
    def __init__(self, num_pages: int = 100, page_size: int = 4, max_context: int = 200) -> None:
        self.listeners: list[Listener] = []
        self.sessions: dict[str, Session] = {}
        self.tree = PoolTree(8)
        self.page_size = page_size
        self.max_context = max_context
        self.kv = SimPages(num_pages=num_pages, num_free=num_pages, page_bytes=64 * page_size)
        self.tables = NoPrefixCache()  # no prefix-cache-only pages
        self.scheduler = SimQueues()
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0}

    @staticmethod
    def auto_pinned(pool: PoolView, now: float) -> bool:
        return pool.is_auto_pinned(now, bool(pool.sessions))

    def emit(self, event, **data):
        for fn in self.listeners:
            fn(event, data)

    def job(self, sid, n_prompt=10, max_tokens=50, state=SessionState.DECODE):
        s = self.sessions.get(sid) or Session(sid)
        self.sessions[sid] = s
        job = Job(seq=SeqState(list(range(1, n_prompt + 1))), params=SamplingParams.greedy(max_tokens),
                  emit=lambda ev: None, session=s, prompt_len=n_prompt, max_context=self.max_context)
        job.state, job.started = state, state != SessionState.WAITING
        s.job, s.seq = job, job.seq
        (self.scheduler.waiting if state == SessionState.WAITING else self.scheduler.running).append(job)
        return job

    def token(self, job, t):
        job.generated.append(7)
        job.seq.tokens.append(7)
        self.emit("token", job=job, now=t)

    def finish(self, job):
        for q in (self.scheduler.running, self.scheduler.waiting):
            if job in q:
                q.remove(job)
        job.session.job = None
        job.finish_reason = "length"
        self.emit("finish", job=job)
