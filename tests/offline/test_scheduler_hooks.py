"""The scheduler only plans: it asks its owner through one declared hooks object (``SchedulerHooks``),
sends no event and ends no job; the core tells the client a request started when the results of its
first step are applied (docs/architecture.md, "No call back up: declared dependencies, and private
names")."""

from __future__ import annotations

import torch

from opencoti.engine import SamplingParams
from opencoti.engine.core.core import EngineCore
from opencoti.engine.kv.pages import PagePool
from opencoti.engine.kv.tables import KVTables
from opencoti.engine.polykv import status
from opencoti.engine.core.scheduler import Scheduler
from opencoti.engine.requests import Job, SeqState, SessionState


class Hooks:
    """Scripted answers, with a record of every question asked."""

    def __init__(self):
        self.start_ok = True
        self.waiting_on = set()
        self.asked: list[tuple[str, int]] = []

    def try_start(self, job) -> bool:
        self.asked.append(("try_start", id(job)))
        return self.start_ok

    def waits_for_prefix(self, job) -> bool:
        self.asked.append(("waits_for_prefix", id(job)))
        return id(job) in self.waiting_on


def _scheduler(num_pages: int, hooks: Hooks, page_size: int = 4) -> Scheduler:
    kv = PagePool(num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32)
    return Scheduler(tables=KVTables(kv), hooks=hooks, max_batch_tokens=64, max_running=4)


def _job(n_tokens: int, events: list) -> Job:
    return Job(seq=SeqState(list(range(1, n_tokens + 1))), params=SamplingParams.greedy(4), emit=events.append)


def test_a_job_starts_only_when_the_hooks_say_it_may():
    hooks, events = Hooks(), []
    sch = _scheduler(8, hooks)
    job = _job(10, events)
    sch.add(job)
    hooks.start_ok = False  # not enough pages for its shared prefix yet
    assert sch.schedule() == [] and list(sch.waiting) == [job] and not job.started
    assert ("try_start", id(job)) in hooks.asked
    hooks.start_ok = True
    assert sch.schedule() == [(job, 10)]
    assert sch.running == [job] and job.started and job.state == SessionState.PREFILL and job.t_start > 0
    assert len(job.seq.page_table) == 3  # its pages are allocated by the plan
    assert events == []  # planning tells the client nothing


def test_a_job_waiting_for_a_prefix_is_not_planned():
    hooks, events = Hooks(), []
    sch = _scheduler(8, hooks)
    job = _job(6, events)
    sch.add(job)
    hooks.waiting_on.add(id(job))
    assert not sch.has_work and sch.schedule() == [] and ("try_start", id(job)) not in hooks.asked
    hooks.waiting_on.clear()
    assert sch.has_work and sch.schedule() == [(job, 6)]


def test_a_stuck_job_is_left_to_the_owner():
    """A job that cannot get pages even alone is named in ``stuck``; the scheduler ends nothing."""
    hooks, events = Hooks(), []
    sch = _scheduler(2, hooks)  # 8 tokens of KV
    job = _job(20, events)
    sch.add(job)
    assert sch.schedule() == [] and sch.stuck is job
    assert list(sch.waiting) == [job] and job.finish_reason is None and events == []
    small = _job(3, events)
    sch.remove(job)
    sch.add(small)
    assert sch.schedule() == [(small, 3)] and sch.stuck is None


def _core(engine, num_pages: int) -> EngineCore:
    """A core of the engine's model on its own small KV cache, stepped by the test."""
    d = engine.model.dims
    kv = PagePool(num_layers=d.num_layers, num_pages=num_pages, page_size=4, num_kv_heads=d.num_kv_heads,
                  head_dim=d.head_dim, dtype=engine.kv.k_cache.dtype)
    return EngineCore(engine.config, model=engine.model, tokenizer=engine.tokenizer, backend=engine.backend,
                      kv=kv, max_context=engine.core.max_context, device=engine.device)


def _run(core: EngineCore, limit: int = 500) -> None:
    for _ in range(limit):
        if not core.has_work:
            return
        core.step()
    raise AssertionError("the core did not finish its work")


def test_started_is_sent_when_the_first_step_is_applied(engine):
    core = _core(engine, 64)
    events: list = []
    seen_at_execute: list[list] = []
    execute = core.runner.execute

    def recording(batch):
        seen_at_execute.append([e[0] for e in events])
        return execute(batch)

    core.runner.execute = recording
    core.submit(list(range(1, 30)), SamplingParams.greedy(5, ignore_eos=True), events.append)
    _run(core)
    kinds = [e[0] for e in events]
    # the prompt's computed chunk is reported ("progress", issue 50) after "started", before the first token
    assert kinds == ["start", "started", "progress"] + ["token"] * 5 + ["done"]
    assert seen_at_execute[0] == ["start"]  # not yet when its first step runs: sent with its results
    status.check_integrity(core.polykv)


def test_pages_short_keeps_the_order_and_admits_the_waiting_request(engine):
    """Two requests that do not fit together: the second waits, then runs; each sees
    start, started, tokens, done, and "started" once."""
    core = _core(engine, 12)  # 48 tokens of KV: one 30-token request with its answer at a time
    a, b = [], []
    ja = core.submit(list(range(1, 31)), SamplingParams.greedy(8, ignore_eos=True), a.append)
    jb = core.submit(list(range(100, 130)), SamplingParams.greedy(8, ignore_eos=True), b.append)
    _run(core)
    for ev in (a, b):
        kinds = [e[0] for e in ev]
        assert [k for k in kinds if k != "progress"] == ["start", "started"] + ["token"] * 8 + ["done"], kinds
        assert kinds.count("progress") >= 1 and kinds.index("progress") > kinds.index("started")
        assert max(i for i, k in enumerate(kinds) if k == "progress") < kinds.index("token")
    assert ja.t_first_token < jb.t_first_token  # FIFO
    status.check_integrity(core.polykv)


def test_a_request_ended_before_its_first_results_was_still_told_it_started(engine):
    """Started (its prefix set up) but its step failed: ending it sends "started" first, as when
    it was sent from the plan."""
    core = _core(engine, 64)
    events: list = []

    def failing(batch):
        raise RuntimeError("the step failed")

    execute, core.runner.execute = core.runner.execute, failing
    job = core.submit(list(range(1, 30)), SamplingParams.greedy(5), events.append)
    try:
        core.step()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the step should have failed")
    assert [e[0] for e in events] == ["start"]
    core.cancel(job)
    assert [e[0] for e in events] == ["start", "started", "done"]
    never = core.submit(list(range(1, 9)), SamplingParams.greedy(5), events.append)
    core.cancel(never)  # never started: no "started"
    assert [e[0] for e in events[3:]] == ["start", "done"]
    core.runner.execute = execute
    status.check_integrity(core.polykv)
