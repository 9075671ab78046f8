"""ModelRunner: executes one scheduled batch — attention metadata, the forward pass, sampling.

It reads the plan (jobs and token counts) and the jobs' page tables and changes no page table,
token list or request state the core keeps: the forward writes the new tokens' K/V into pages the
plan holds, and the sampler advances each request's random generator and ``SamplerState``. The
core applies what it returns (cached token counts, sampled tokens, finished materializations, the
tokens a speculative draft's verification emits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention.base import SeqBatchEntry, build_metadata
from ..kv.pages import PagePool
from ..requests import Job


@dataclass
class RunOutput:
    sampled: list  # the generation jobs that got a token, in order
    token_ids: list[int]
    logprobs: list | None
    top_logprobs: list | None
    num_tokens: int
    model_s: float
    # jobs that ran a speculative draft: (job, emitted tokens, their logprobs, their top logprobs);
    # every emitted token but the last equals the draft token at its place
    verified: list = field(default_factory=list)


class ModelRunner:
    def __init__(self, *, model, backend, sampler, kv: PagePool, device):
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.kv = kv
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: list) -> RunOutput:
        entries: list[SeqBatchEntry] = []
        logit_rows: list[int] = []
        ids, sample_at, sample_jobs, drafted = [], [], [], []
        row = 0
        for job, n in batch:
            seq = job.seq
            ids.extend(seq.tokens[seq.num_cached:seq.num_cached + n])
            if getattr(job, "draft", None):
                # the last token and its draft as decode rows over one page table: row i attends to
                # the positions before it (their KV is written first in every layer) and itself
                entries.extend(SeqBatchEntry(seq.page_table, seq.num_cached + i, 1, same_seq=i > 0) for i in range(n))
                drafted.append((job, len(logit_rows)))
                logit_rows.extend(range(row, row + n))
                row += n
                continue
            entries.append(SeqBatchEntry(seq.page_table, seq.num_cached, n))
            row += n
            if seq.num_cached + n == len(seq.tokens) and isinstance(job, Job):
                sample_at.append(len(logit_rows))
                logit_rows.append(row - 1)
                sample_jobs.append(job)
        meta = build_metadata(entries, self.kv.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device) if logit_rows else None
        tm = time.perf_counter()
        logits = self.model.forward(input_ids, meta, self.kv.k_cache, self.kv.v_cache, self.backend, rows)
        model_s = time.perf_counter() - tm
        verified = [self.verify(logits, at, job) for job, at in drafted]
        if not sample_jobs:
            return RunOutput([], [], None, None, len(ids), model_s, verified)
        if drafted:
            logits = logits.index_select(0, torch.tensor(sample_at, dtype=torch.int64, device=logits.device))
        out = self.sample(logits, sample_jobs)
        return RunOutput(sample_jobs, out.token_ids, out.logprobs, out.top_logprobs, len(ids), model_s, verified)

    def sample(self, logits: torch.Tensor, jobs: list[Job]):
        """The one call into the sampler (row i of ``logits`` belongs to ``jobs[i]``)."""
        return self.sampler.sample(logits, [j.params for j in jobs], [j.generator for j in jobs],
                                   [j.sampler_state for j in jobs])

    def verify(self, logits: torch.Tensor, at: int, job: Job) -> tuple:
        """Sample row after row of a drafted job (rows ``at`` ...) as decoding would, while each
        sample equals the draft token at its place: (job, tokens, logprobs, top logprobs)."""
        draft = job.draft
        n = len(draft) + 1
        p = job.params
        if p.is_greedy and job.sampler_state is None and p.logprobs is None:  # one argmax for every row
            tokens = []
            for i, t in enumerate(logits[at:at + n].float().argmax(dim=-1).tolist()):
                tokens.append(t)
                if i == n - 1 or t != draft[i]:
                    break
            return job, tokens, None, None
        tokens, lps, tops = [], [], []
        for i in range(n):
            out = self.sample(logits[at + i:at + i + 1], [job])
            t = out.token_ids[0]
            tokens.append(t)
            lps.append(out.logprobs[0] if out.logprobs is not None else None)
            tops.append(out.top_logprobs[0] if out.top_logprobs is not None else None)
            if i == n - 1 or t != draft[i]:
                break
        return job, tokens, lps, tops
