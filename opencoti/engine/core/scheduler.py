"""Continuous batching: which jobs compute how many tokens this step (the plan, nothing else).

Every job computes ``seq.tokens[num_cached:]``; a decoding job has exactly one token left (the
last sampled one), a prefilling job many. Each step takes every decoding job (one token each)
and fills the rest of the token budget with prefill chunks, in arrival order. Pages are
allocated check-then-commit through the KV tables; when they run out the engine reclaims (idle
sessions, then idle pools, LRU), then new work waits, and as a last resort the newest running
job is preempted (its pages dropped, recomputed later — results unchanged).

The scheduler only plans: it moves jobs between its queues and sizes their page tables through
the KV tables. What it needs of its owner is one declared object, ``SchedulerHooks``, given at
construction: ``try_start`` sets up a waiting job's shared prefix (its page table), and
``waits_for_prefix`` says whether a waiting job waits for a page another job computes. A job that
cannot get pages even alone is left in ``stuck`` for the owner to end. It sends no event: the model
runner (runner.py) executes the plan, and the core (core.py) applies its results (and tells the
client a request started when its first step's results are applied).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from ..kv.tables import KVTables
from ..requests import SessionState, Work

Batch = list  # [(job, number of tokens to compute this step)]


class StepStats:
    __slots__ = ("num_tokens", "num_seqs", "num_decode", "num_draft", "num_drafted", "num_prefill_tokens", "ctx_tokens",
                 "model_s", "total_s")

    def __init__(self):
        self.num_tokens = self.num_seqs = self.num_decode = self.num_draft = self.num_prefill_tokens = 0
        self.num_drafted = 0  # sequences that verified a draft in the step
        self.ctx_tokens = 0
        self.model_s = self.total_s = 0.0


class SchedulerHooks(Protocol):
    """What the scheduler asks of its owner (the core) while it plans; nothing else is called."""

    def try_start(self, job: Work) -> bool:
        """Set up a waiting job's page table from the KV it reuses (its session's cache, its pool,
        the prefix index, a pool's parent). False: not enough pages yet, the job keeps waiting."""
        ...

    def waits_for_prefix(self, job: Work) -> bool:
        """True while a waiting job's next uncached page is being computed by another job."""
        ...


class Scheduler:
    def __init__(self, *, tables: KVTables, hooks: SchedulerHooks, max_batch_tokens: int, max_running: int):
        self.tables = tables
        self.hooks = hooks
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.stuck: Work | None = None  # after ``schedule``: a job that cannot get pages even alone (the owner ends it)
        self.waiting: deque[Work] = deque()
        self.running: list[Work] = []
        self._admit_counter = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(self._deps_ready(j) for j in self.waiting)

    def add(self, job: Work) -> None:
        self.waiting.append(job)

    def remove(self, job: Work) -> None:
        if job in self.running:
            self.running.remove(job)
        elif job in self.waiting:
            self.waiting.remove(job)

    def _pages_or_reclaim(self, job: Work, num_tokens: int) -> bool:
        """Pages for ``job`` to cover ``num_tokens``; when too few are free the KV tables reclaim
        first, which may evict cache pages, idle sessions' KV and idle pools (``PolyKV.reclaim``)."""
        return self.tables.extend_reclaiming(job.seq, num_tokens)

    def preempt(self, job: Work) -> None:
        """Drop a running job's KV and requeue it at the front; it recomputes from its tokens."""
        self.running.remove(job)
        self._unstart(job)
        self.waiting.appendleft(job)

    def _release_waiting(self) -> bool:
        """Drop the pages of waiting jobs that started (got their shared prefix) but could not get
        pages to compute: they hold memory a running job needs. True when any was released."""
        held = [j for j in self.waiting if j.started and j.seq.page_table]
        for job in held:
            self._unstart(job)
        return bool(held)

    def _unstart(self, job: Work) -> None:
        self.tables.drop(job.seq)
        job.started = False
        job.state = SessionState.WAITING
        job.num_preemptions += 1

    def _deps_ready(self, job: Work) -> bool:
        return all(p.residency == "resident" for p in job.wait_for) and not self.hooks.waits_for_prefix(job)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, retry: bool = True) -> Batch:
        """The jobs to compute this step and how many tokens each (their pages are allocated).
        An empty plan may leave a job in ``stuck``: it cannot get pages even alone."""
        self.stuck = None
        batch: Batch = []
        budget = self.max_batch_tokens
        # 1. decode: every running job with one token left
        for job in sorted((j for j in self.running if j.num_remaining == 1), key=lambda j: j.admit_seq):
            if job not in self.running:
                continue  # preempted below
            while not self._pages_or_reclaim(job, job.seq.num_cached + 1):
                if self._release_waiting():
                    continue
                victims = [j for j in self.running if j is not job and j.admit_seq > job.admit_seq]
                if not victims:
                    victims = [j for j in self.running if j is not job]
                if not victims:
                    break
                victim = max(victims, key=lambda j: j.admit_seq)
                batch = [(j, n) for j, n in batch if j is not victim]
                self.preempt(victim)
            else:
                batch.append((job, 1))
                budget -= 1
        # 2. prefill chunks of running jobs, then start waiting jobs
        for job in sorted((j for j in self.running if j.num_remaining > 1), key=lambda j: j.admit_seq):
            if budget <= 0:
                break
            n = min(job.num_remaining, budget)
            if self._pages_or_reclaim(job, job.seq.num_cached + n):
                batch.append((job, n))
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            ready = next((j for j in self.waiting if self._deps_ready(j)), None)
            if ready is None:
                break
            if not ready.started:
                if not self.hooks.try_start(ready):
                    break  # not enough pages to set up its shared prefix: wait (FIFO)
                ready.started = True
                ready.t_start = time.perf_counter()
            n = min(ready.num_remaining, budget)
            if not self._pages_or_reclaim(ready, ready.seq.num_cached + n):
                break
            self.waiting.remove(ready)
            self._admit_counter += 1
            ready.admit_seq = self._admit_counter
            self.running.append(ready)
            ready.state = SessionState.PREFILL if ready.num_remaining > 1 else SessionState.DECODE
            batch.append((ready, n))
            budget -= n
        if not batch and self.running:
            if retry and self._release_waiting():
                return self.schedule(retry=False)
            if len(self.running) > 1:
                self.preempt(max(self.running, key=lambda j: j.admit_seq))
                return self.schedule()
            self.stuck = self.running[0]
        elif not batch and not self.running:
            self.stuck = next((j for j in self.waiting if self._deps_ready(j)), None)
        return batch
