"""Continuous batching: which jobs compute how many tokens this step, then run and sample.

Every job computes ``seq.tokens[num_cached:]``; a decoding job has exactly one token left (the
last sampled one), a prefilling job many. Each step takes every decoding job (one token each)
and fills the rest of the token budget with prefill chunks, in arrival order. Pages are
allocated check-then-commit; when they run out the engine reclaims (idle sessions, then idle
pools, LRU), then new work waits, and as a last resort the newest running job is preempted
(its pages dropped, recomputed later — results unchanged).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from .attention.base import SeqBatchEntry, build_metadata
from .kv.pages import PagePool
from .session import Job, SessionState


class StepStats:
    __slots__ = ("num_tokens", "num_seqs", "num_decode", "num_prefill_tokens", "model_s", "total_s")

    def __init__(self):
        self.num_tokens = self.num_seqs = self.num_decode = self.num_prefill_tokens = 0
        self.model_s = self.total_s = 0.0


class Scheduler:
    def __init__(self, *, kv: PagePool, model, backend, sampler, max_batch_tokens: int, max_running: int,
                 reclaim: Callable[[int], int], on_token: Callable[[Job, int, float, list], None],
                 on_prefilled: Callable[[Job], None], device):
        self.kv = kv
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.reclaim = reclaim  # frees at least n pages if it can; returns pages freed
        self.on_token = on_token  # (job, token, logprob, top_logprobs) after sampling
        self.on_prefilled = on_prefilled  # prefill-only job done
        self.device = device
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._admit_counter = 0
        self.last_step = StepStats()
        self.on_stuck: Callable[[Job], None] | None = None  # a job that cannot get pages even alone

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(self._deps_ready(j) for j in self.waiting)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def remove(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
        elif job in self.waiting:
            self.waiting.remove(job)

    # ---- page helpers ------------------------------------------------------------------
    def _ensure_pages(self, job: Job, num_tokens: int) -> bool:
        """Make the job's page table cover num_tokens; check-then-commit with reclaim."""
        seq = job.seq
        need = self.kv.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return True
        if not self.kv.can_allocate(need):
            self.reclaim(need - self.kv.num_free)
            if not self.kv.can_allocate(need):
                return False
        seq.page_table.extend(self.kv.allocate(need))
        return True

    def preempt(self, job: Job) -> None:
        """Drop a running job's KV and requeue it at the front; it recomputes from its tokens."""
        self.running.remove(job)
        self.kv.decref(job.seq.page_table)
        job.seq.page_table = []
        job.seq.num_cached = 0
        job.seq.num_borrowed_pages = 0
        job.started = False
        job.state = SessionState.WAITING
        job.num_preemptions += 1
        self.waiting.appendleft(job)

    @staticmethod
    def _deps_ready(job: Job) -> bool:
        return all(p.residency == "resident" for p in job.wait_for)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Job, int]]:
        batch: list[tuple[Job, int]] = []
        budget = self.max_batch_tokens
        # 1. decode: every running job with one token left
        for job in sorted((j for j in self.running if j.num_remaining == 1), key=lambda j: j.admit_seq):
            if job not in self.running:
                continue  # preempted below
            while not self._ensure_pages(job, job.seq.num_cached + 1):
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
            if self._ensure_pages(job, job.seq.num_cached + n):
                batch.append((job, n))
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            job = next((j for j in self.waiting if self._deps_ready(j)), None)
            if job is None:
                break
            if not job.started:
                if job.start_plan is not None and not job.start_plan():
                    break  # not enough pages to set up its shared prefix: wait (FIFO)
                job.started = True
                job.t_start = time.perf_counter()
            n = min(job.num_remaining, budget)
            if not self._ensure_pages(job, job.seq.num_cached + n):
                break
            self.waiting.remove(job)
            self._admit_counter += 1
            job.admit_seq = self._admit_counter
            self.running.append(job)
            job.state = SessionState.PREFILL if job.num_remaining > 1 else SessionState.DECODE
            batch.append((job, n))
            budget -= n
        if not batch and self.running:
            if len(self.running) > 1:
                self.preempt(max(self.running, key=lambda j: j.admit_seq))
                return self.schedule()
            self.on_stuck(self.running[0])
        elif not batch and not self.running:
            job = next((j for j in self.waiting if self._deps_ready(j)), None)
            if job is not None:
                self.on_stuck(job)
        return batch

    @torch.inference_mode()
    def step(self) -> StepStats:
        t0 = time.perf_counter()
        stats = StepStats()
        batch = self.schedule()
        if not batch:
            self.last_step = stats
            return stats
        entries, ids, logit_rows, sample_jobs = [], [], [], []
        row = 0
        for job, n in batch:
            seq = job.seq
            entries.append(SeqBatchEntry(seq.page_table, seq.num_cached, n))
            ids.extend(seq.tokens[seq.num_cached:seq.num_cached + n])
            row += n
            if seq.num_cached + n == len(seq.tokens) and job.params is not None:
                logit_rows.append(row - 1)
                sample_jobs.append(job)
        meta = build_metadata(entries, self.kv.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device) if logit_rows else None
        tm = time.perf_counter()
        logits = self.model.forward(input_ids, meta, self.kv.k_cache, self.kv.v_cache, self.backend, rows)
        stats.model_s = time.perf_counter() - tm
        for job, n in batch:
            job.seq.num_cached += n
            if job.params is None and job.num_remaining == 0:
                self.running.remove(job)
                self.on_prefilled(job)
        if sample_jobs:
            out = self.sampler.sample(logits, [j.params for j in sample_jobs], [j.generator for j in sample_jobs])
            for i, job in enumerate(sample_jobs):
                lp = out.logprobs[i] if out.logprobs is not None else None
                top = out.top_logprobs[i] if out.top_logprobs is not None else None
                job.state = SessionState.DECODE
                self.on_token(job, out.token_ids[i], lp, top)
        stats.num_seqs = len(batch)
        stats.num_tokens = len(ids)
        stats.num_decode = sum(1 for _, n in batch if n == 1)
        stats.num_prefill_tokens = stats.num_tokens - stats.num_decode
        stats.total_s = time.perf_counter() - t0
        self.last_step = stats
        return stats
