"""Speculative decoding by prompt lookup: drafts from the session's own context, verified in one step.

Agents repeat themselves: tool results quoted back, JSON keys and argument names, a restated plan,
lines of the shared brief. For a decoding job the drafter finds the latest earlier occurrence of
its last ``n`` tokens (``n`` from :data:`NGRAM_MAX` down to :data:`NGRAM_MIN`) in its context --
the prompt, its pool's prefix included, and what it generated -- and proposes the tokens that
followed it there. No second model.

Verification: the job's last token and its ``k`` draft tokens run in one step as ``k + 1`` decode
rows over the session's page table (row ``i`` attends to the positions before it and itself, so
the fused native decode layer and the paged attention backends serve it unchanged). Row ``i``'s
logits are sampled exactly as a decode step would sample them (same sampler, state and random
stream); while the sampled token equals draft ``i + 1`` the next row is used too. Sampling from the
target distribution and accepting a deterministic draft token only when the sample equals it is
the rejection rule for a one-point draft distribution: every emitted token has the distribution
plain decoding gives it, and a seeded request emits the same tokens (each emitted token draws one
number from the request's generator, as in plain decoding). Rejected positions are rolled back in
the session's own pages (``KVTables.trim``); pool pages are never written (a draft's positions lie
past everything shared).

How many draft tokens a job verifies is a cost decision. A step's time grows with its rows -- on a
CPU whose projections are compute-bound almost linearly, on a GPU hardly at all -- so the engine
keeps the time of its own decode steps by row count (:class:`StepCosts`, a line fitted to them)
and each job its acceptance rate (the share of drafted positions whose sample matched, decayed).
A draft of ``k`` tokens with acceptance ``p`` yields ``1 + p + ... + p^k`` tokens for the job; the
step takes the ``k`` that most raises tokens per second of the whole step (every job in the batch
waits for the longer step), and none when no ``k`` gains :data:`MIN_GAIN`. Until the engine has
seen steps of two row counts it explores: one short draft every :data:`EXPLORE_EVERY` steps. A
job that stops drafting probes with one token every :data:`PROBE_EVERY` steps so that its rate can
recover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_MAX = 4  # longest context suffix matched
NGRAM_MIN = 2  # shortest (one token matches too often to be worth a row)
MAX_DRAFT_ROWS = 16  # draft rows in one step at most
MAX_STEP_ROWS = 31  # decode rows whose results do not depend on each other (the native int16 row kernels)
MIN_GAIN = 1.05  # tokens per second of the step must grow by this factor
EXPLORE_EVERY = 8
PROBE_EVERY = 64  # a probe row costs ~1 % of the steps between probes (one job alone or eight)
PRIOR = (1.2, 2.0)  # acceptance prior: 1.2 matches of 2 positions
DECAY = 0.8
MODES = ("ngram", "off")


@dataclass
class DraftState:
    """One job's drafter: an index of its context's n-grams and its acceptance rate."""

    k_max: int
    indexed: int = 0  # tokens of the context indexed so far
    last: dict = field(default_factory=dict)  # n-gram (tuple) -> end position of its latest occurrence
    hits: float = PRIOR[0]
    tried: float = PRIOR[1]
    idle: int = 0  # steps since its last draft
    drafted: int = 0  # draft tokens proposed (llama.cpp: draft_n)
    accepted: int = 0  # of them accepted (draft_n_accepted)

    @property
    def rate(self) -> float:
        return self.hits / self.tried

    def _index(self, tokens: list[int], upto: int) -> None:
        """Record the n-grams ending at positions up to ``upto`` (each maps to where it ends)."""
        last = self.last
        for end in range(max(self.indexed, 1), upto + 1):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end - n < 0:
                    break
                last[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last
        n-gram (the longest that occurred before); [] when none did."""
        if k <= 0 or len(tokens) < NGRAM_MIN + 1:
            return []
        end = len(tokens)
        self._index(tokens, end - 1)  # every n-gram ending before the last token (whose followers are known)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            pos = self.last.get(tuple(tokens[end - n:]))
            if pos is not None and pos < end:
                return tokens[pos:pos + k]
        return []

    def update(self, proposed: int, accepted: int) -> None:
        """A verified draft: ``accepted`` of its ``proposed`` tokens matched (positions after the
        first mismatch were not tested)."""
        self.drafted += proposed
        self.accepted += accepted
        self.hits = DECAY * self.hits + accepted
        self.tried = DECAY * self.tried + min(accepted + 1, proposed)
        self.idle = 0


def expected_tokens(p: float, k: int) -> float:
    """Tokens a step yields for a job drafting ``k`` tokens accepted with probability ``p`` each."""
    return sum(p ** i for i in range(k + 1))


class StepCosts:
    """Seconds of the engine's decode steps by row count (decayed means), and a line through them."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed, per row) seconds of a step, fitted by least squares; None before two row counts."""
        pts = list(self.seconds.items())
        if len(pts) < 2:
            return None
        n = len(pts)
        mx = sum(r for r, _ in pts) / n
        my = sum(t for _, t in pts) / n
        var = sum((r - mx) ** 2 for r, _ in pts)
        b = max(sum((r - mx) * (t - my) for r, t in pts) / var, 0.0)
        a = max(my - b * mx, 1e-6)
        return a, b

    def plan(self, jobs: list, rows: int, limits: list[int]) -> list[int]:
        """Draft lengths for ``jobs`` (their ``DraftState`` rates) in a step of ``rows`` decode rows:
        each job in turn takes the length that most raises the step's tokens per second."""
        self.steps += 1
        fit = self.line()
        out = [0] * len(jobs)
        if fit is None:  # explore: a short draft now and then, to see a step of more rows
            if self.steps % EXPLORE_EVERY == 0 and limits and limits[0] > 0:
                out[0] = min(2, limits[0])
            return out
        a, b = fit
        tokens, total = float(rows), rows
        for i, st in enumerate(jobs):
            best, best_k = tokens / (a + b * total), 0
            for k in range(1, limits[i] + 1):
                v = (tokens - 1 + expected_tokens(st.rate, k)) / (a + b * (total + k))
                if v > best:
                    best, best_k = v, k
            if best_k and best >= MIN_GAIN * tokens / (a + b * total):
                out[i] = best_k
                tokens += expected_tokens(st.rate, best_k) - 1
                total += best_k
            elif st.idle >= PROBE_EVERY and limits[i] > 0:
                out[i] = 1  # a probe: its rate may have recovered
                total += 1
        return out


def draft_limit(job, k: int) -> int:
    """``k`` bounded so that the draft and the token after it fit ``max_tokens`` and the context."""
    p = job.params
    left = (p.max_tokens - len(job.generated) if p.max_tokens is not None else k + 1) - 1
    room = job.max_context - len(job.seq.tokens) - 1
    return max(0, min(k, left, room))


def acceptance(state: DraftState | None) -> dict:
    """llama.cpp's timings fields for a request's drafts."""
    if state is None or not state.drafted:
        return {}
    return {"draft_n": state.drafted, "draft_n_accepted": state.accepted}
