"""ModelRunner: executes one scheduled batch — attention metadata, the forward pass, sampling.

It reads the plan (jobs and token counts) and the jobs' page tables, and changes nothing: the
core applies what it returns (cached token counts, sampled tokens, finished materializations).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .attention.base import SeqBatchEntry, build_metadata
from .kv.pages import PagePool
from .session import Job


@dataclass
class RunOutput:
    sampled: list  # the generation jobs that got a token, in order
    token_ids: list[int]
    logprobs: list | None
    top_logprobs: list | None
    num_tokens: int
    model_s: float


class ModelRunner:
    def __init__(self, *, model, backend, sampler, kv: PagePool, device):
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.kv = kv
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: list) -> RunOutput:
        entries, ids, logit_rows, sample_jobs = [], [], [], []
        row = 0
        for job, n in batch:
            seq = job.seq
            entries.append(SeqBatchEntry(seq.page_table, seq.num_cached, n))
            ids.extend(seq.tokens[seq.num_cached:seq.num_cached + n])
            row += n
            if seq.num_cached + n == len(seq.tokens) and isinstance(job, Job):
                logit_rows.append(row - 1)
                sample_jobs.append(job)
        meta = build_metadata(entries, self.kv.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device) if logit_rows else None
        tm = time.perf_counter()
        logits = self.model.forward(input_ids, meta, self.kv.k_cache, self.kv.v_cache, self.backend, rows)
        model_s = time.perf_counter() - tm
        if not sample_jobs:
            return RunOutput([], [], None, None, len(ids), model_s)
        out = self.sample(logits, sample_jobs)
        return RunOutput(sample_jobs, out.token_ids, out.logprobs, out.top_logprobs, len(ids), model_s)

    def sample(self, logits: torch.Tensor, jobs: list[Job]):
        """The one call into the sampler (row i of ``logits`` belongs to ``jobs[i]``)."""
        return self.sampler.sample(logits, [j.params for j in jobs], [j.generator for j in jobs],
                                   [j.sampler_state for j in jobs])
