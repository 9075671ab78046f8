"""Speculative decoding by prompt lookup: drafts from the session's own context, verified in one step.

Agents repeat themselves: tool results quoted back, JSON keys and argument names, a restated plan,
lines of the shared brief. For a decoding job the drafter finds the earlier occurrences of its
last ``n`` tokens (``n`` from ``NGRAM_MAX`` down to ``NGRAM_MIN``, the longest that
occurred) in its context -- the prompt, its pool's prefix included, and what it generated -- and
proposes the tokens that followed them there. No second model. Where its own context has no match for an ``n``, the answers
of recently finished requests of the same cache salt are looked up too (:class:`RecentOutputs`:
agents of a team answer in the same shapes -- the same JSON keys, a restated plan, a quoted brief),
within the same namespace as the prefix cache: requests with different salts never draft from each
other, and an engine without the prefix cache drafts from each request's own context only. The
n-gram matcher, :class:`RecentOutputs` and the modes are the engine's lowest layer's
(``engine/speculation.py``: the prefix cache, the config and the metrics use them too).

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
A draft whose positions are accepted with probabilities ``p1, p2, ...`` yields ``1 + p1 + p1*p2
+ ...`` tokens for the job; the step takes the ``k`` that most raises tokens per second of the
whole step (every job in the batch waits for the longer step), and none when no ``k`` gains
:data:`MIN_GAIN`.

The probabilities are per position, not one rate per job (:func:`continuation`): each n-gram
keeps its ``OCCURRENCES`` latest ends, the draft follows the continuation most of them agree
on, and each position's probability is the job's rate times the share of the other occurrences
(still agreeing up to it) that continue the same way. Boilerplate -- JSON keys, a quoted
sentence -- repeats the same way every time and keeps the job's rate; where the occurrences
disagree -- the value after ``{"name": "`` in a tool-calling agent's calls, a new name every
line -- the probability drops (two that differ: a fifth of the rate; three: a ninth), so the
step drafts short or not at all where one rate per job drafted as long there as anywhere and
wasted most of a step's rows (on a 2-core CPU each verify row costs ~1.1 ms of a ~7.3 ms
one-row step). The rate itself is the job's, or lower where the job's drafts matched on as few
tokens as this one were accepted less (:meth:`DraftState.order_rate`: a two-token match of a name
the prompt listed in another format). Replayed by ``.venv/bin/python benchmarks/replay_speculative.py`` (result:
``benchmarks/results/amd-epyc-2c-fb86c92f/speculative_replay.json``; each round's greedy answers to
the prompts of ``benchmarks/bench_speculative.py``, int8 weights as ``auto`` chose them, the cost
line fixed at 6.2 ms + 1.1 ms a row, the engine's own draft counts equal to the replay's; the
constants were tuned on rounds 0-2, these numbers are of the held-out rounds 3-6) against the
drafter as of f30f4c5: the first ``json_tools`` request of a round went from 2.30 tokens per 3.54
rows a step to 2.37 per 2.84 (drafts 51.4 % -> 74.8 % accepted; 1.67x -> 1.86x off's tokens/s by
that line), its later ones (which draft from the first's answer) 3.41x -> 3.66x, ``react_echo``
5.13/7.82 -> 5.89/7.17 (2.53x -> 3.05x), ``summarize_quote`` 3.83x both, and ``novel`` 1.50x ->
1.47x (its first request 1.05x -> 1.00x; on the tuning rounds 1.36x -> 1.37x).
Raising the probability where occurrences agree (a leave-one-out share smoothed toward the rate,
instead of the rate times it), or the rate of an n-gram length above the job's, lost on
``summarize_quote``: a quoted sentence and its source agree because one is a copy, not because
the model is likely to copy it again.
"""

from __future__ import annotations

import functools
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..speculation import NGRAM_MAX, NGRAM_MIN, RecentOutputs, ngram_occurrences

MAX_DRAFT_ROWS = 16  # draft rows in one step at most
MAX_STEP_ROWS = 31  # decode rows whose results do not depend on each other (the native int16 row kernels)
MIN_GAIN = 1.05  # tokens per second of the step must grow by this factor
EXPLORE_EVERY = 8
PROBE_EVERY = 64  # a probe row costs ~1 % of the steps between probes (one job alone or eight)
PRIOR = (1.2, 2.0)  # acceptance prior: 1.2 matches of 2 positions
AGREE_PRIOR = 0.25  # pseudo-occurrences agreeing with a draft position (smooths the share that agree)
ORDER_PRIOR = 4.0  # weight (tested positions) of the job's rate in the rate of drafts matched on n tokens
STOP_BELOW = 0.05  # a draft ends where the chance that all of it is accepted falls below this
DECAY = 0.8
SAMPLES = 9  # step times kept per row count


def continuation(tokens: list[int], ends: Sequence[int], k: int, rate: float) -> tuple[list[int], list[float]]:
    """The draft that the continuations of an n-gram's earlier occurrences (``ends``: where each
    ended, oldest first) most agree on, and each draft position's probability of acceptance.

    Token by token, the occurrences that agreed with the draft so far vote; the draft takes the
    token most of them continue with (ties: the latest occurrence's), and its probability is the
    job's ``rate`` times the share of the other voters that agree, smoothed toward 1:
    ``rate * (c - 1 + w) / (m - 1 + w)`` for ``c`` of ``m`` voters agreeing (``w`` =
    :data:`AGREE_PRIOR`). The occurrence the draft is copied from always agrees with itself, so it
    is left out: one occurrence, or any number that agree, give the job's rate; two that differ
    give a fifth of it, three that all differ (a name, a number: new each time) a ninth. The
    draft ends where the product of its probabilities falls below :data:`STOP_BELOW`."""
    end = len(tokens)
    alive = list(ends)
    draft: list[int] = []
    probs: list[float] = []
    run = 1.0
    for j in range(k):
        votes: dict[int, list[int]] = {}  # next token -> the occurrences continuing with it (oldest first)
        for e in alive:
            if e + j < end:
                votes.setdefault(tokens[e + j], []).append(e)
        if not votes:
            break
        m = sum(len(v) for v in votes.values())
        tok, agree = max(votes.items(), key=lambda kv: (len(kv[1]), kv[1][-1]))
        p = rate * (len(agree) - 1 + AGREE_PRIOR) / (m - 1 + AGREE_PRIOR)
        run *= p
        if run < STOP_BELOW:
            break
        draft.append(tok)
        probs.append(p)
        alive = agree
    return draft, probs


@dataclass
class DraftState:
    """One job's drafter: an index of its context's n-grams, its acceptance rate, and the
    acceptance probability of each position of its latest draft."""

    k_max: int
    indexed: int = 0  # tokens of the context indexed so far
    ends: dict = field(default_factory=dict)  # n-gram (tuple) -> where it ended (int), or its latest ends (list)
    probs: list = field(default_factory=list)  # the latest proposal's probability per position
    source: int = 0  # the n-gram length the latest proposal matched in the context (0: none / a recent answer)
    by_order: dict = field(default_factory=dict)  # n-gram length -> [hits, tried] of its drafts (decayed)
    hits: float = PRIOR[0]
    tried: float = PRIOR[1]
    idle: int = 0  # steps since its last draft
    drafted: int = 0  # draft tokens proposed (llama.cpp: draft_n)
    accepted: int = 0  # of them accepted (draft_n_accepted)

    @property
    def rate(self) -> float:
        return self.hits / self.tried

    def _index(self, tokens: list[int], upto: int) -> None:
        """Record the n-grams ending at positions up to ``upto``."""
        ngram_occurrences(tokens, self.indexed, upto, self.ends)
        self.indexed = max(self.indexed, upto + 1)

    def propose(self, tokens: list[int], k: int,
                recent: Callable[[tuple, int], list[int]] | None = None) -> list[int]:
        """Up to ``k`` tokens that followed earlier occurrences of the context's last n-gram (the
        longest that occurred before: in the context first, then through ``recent``, e.g.
        :meth:`RecentOutputs.lookup` bound to the job's salt); [] when none did. In the context the
        draft is the continuation most of the n-gram's latest occurrences agree on (:func:`continuation`);
        :attr:`probs` gets each position's probability of acceptance (a recent answer's tokens: the
        job's rate each), which :meth:`StepCosts.plan` weighs."""
        self.probs = []
        self.source = 0
        if k <= 0 or len(tokens) < NGRAM_MIN + 1:
            return []
        end = len(tokens)
        self._index(tokens, end - 1)  # every n-gram ending before the last token (whose followers are known)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            key = tuple(tokens[end - n:])
            ends = self.ends.get(key)
            if ends is not None:
                self.source = n
                ends = [ends] if isinstance(ends, int) else ends
                draft, self.probs = continuation(tokens, ends, k, self.order_rate(n))
                return draft
            if recent is not None:
                draft = recent(key, k)
                if draft:
                    self.probs = [self.rate] * len(draft)
                    return draft
        return []

    def expected(self, k: int) -> float:
        """Tokens a step yields for this job drafting the first ``k`` tokens of its latest proposal:
        ``1 + p1 + p1*p2 + ...`` (the job's rate where :attr:`probs` has no entry)."""
        return self.expected_upto(k)[k]

    def expected_upto(self, k: int) -> list[float]:
        """:meth:`expected` for every length ``0 .. k`` at once."""
        totals, run = [1.0], 1.0
        for i in range(k):
            run *= self.probs[i] if i < len(self.probs) else self.rate
            totals.append(totals[-1] + run)
        return totals

    def order_rate(self, n: int) -> float:
        """The acceptance rate of the job's drafts matched on ``n`` context tokens, smoothed toward
        the job's rate (:data:`ORDER_PRIOR`) and never above it: a short match can say less than
        the job's drafts in general (a two-token match of a name the prompt spelled in another
        format), and where it says more the job's rate stands (raising it lost a few draft rows)."""
        hits, tried = self.by_order.get(n, (0.0, 0.0))
        return min((hits + ORDER_PRIOR * self.rate) / (tried + ORDER_PRIOR), self.rate)

    def update(self, proposed: int, accepted: int) -> None:
        """A verified draft: ``accepted`` of its ``proposed`` tokens matched (positions after the
        first mismatch were not tested)."""
        self.drafted += proposed
        self.accepted += accepted
        self.hits = DECAY * self.hits + accepted
        self.tried = DECAY * self.tried + min(accepted + 1, proposed)
        if self.source:
            order = self.by_order.setdefault(self.source, [0.0, 0.0])
            order[0] = DECAY * order[0] + accepted
            order[1] = DECAY * order[1] + min(accepted + 1, proposed)
        self.idle = 0


def expected_tokens(p: float, k: int) -> float:
    """Tokens a step yields for a job drafting ``k`` tokens accepted with probability ``p`` each."""
    return sum(p ** i for i in range(k + 1))


def _weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The value at half of the total weight of ``(value, weight)`` pairs."""
    pairs = sorted(pairs)
    half, acc = sum(w for _, w in pairs) / 2, 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


class StepCosts:
    """Seconds of the engine's decode steps by row count (the median of the last :data:`SAMPLES`
    at each count), and a robust line through them: the per-row cost is the weighted median of
    the slopes between row counts (Theil-Sen, each pair weighted by its samples), the fixed cost
    the weighted median of what is left. One stalled step (a page fault, a neighbour's burst) does
    not tilt it: a single 107 ms six-row step among 16 ms one-row steps fitted a least-squares line
    through the origin, which said no draft ever pays, and drafting stopped."""

    def __init__(self) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.steps = 0
        self._line: tuple[float, float] | None = None
        self._dirty = False

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        self.samples.setdefault(rows, deque(maxlen=SAMPLES)).append(seconds)
        self._dirty = True

    @property
    def seconds(self) -> dict[int, float]:
        return {r: statistics.median(v) for r, v in self.samples.items()}

    def line(self) -> tuple[float, float] | None:
        """(fixed, per row) seconds of a step; None before two row counts."""
        if self._dirty:
            self._dirty = False
            pts = [(r, statistics.median(v), len(v)) for r, v in sorted(self.samples.items())]
            if len(pts) < 2:
                return None
            slopes = [((t2 - t1) / (r2 - r1), n1 * n2)
                      for i, (r1, t1, n1) in enumerate(pts) for r2, t2, n2 in pts[i + 1:]]
            b = max(_weighted_median(slopes), 0.0)
            a = max(_weighted_median([(t - b * r, n) for r, t, n in pts]), 1e-6)
            self._line = (a, b)
        return self._line

    def plan(self, jobs: list, rows: int, limits: list[int]) -> list[int]:
        """Draft lengths for ``jobs`` (their ``DraftState``: the probabilities of its latest proposal,
        else its rate) in a step of ``rows`` decode rows: each job in turn takes the length that
        most raises the step's tokens per second."""
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
            gains = st.expected_upto(limits[i])
            for k in range(1, limits[i] + 1):
                v = (tokens - 1 + gains[k]) / (a + b * (total + k))
                if v > best:
                    best, best_k = v, k
            if best_k and best >= MIN_GAIN * tokens / (a + b * total):
                out[i] = best_k
                tokens += gains[best_k] - 1
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


# This module imports nothing of the engine but ``speculation.py`` (benchmarks/replay_speculative.py
# loads it, and that, from any commit, on their own): a job and its sequence are ``Any`` here, as in
# ``draft_limit`` (``requests.Job`` and ``SeqState``).
AnyJob = Any  # a requests.Job


class DraftPages(Protocol):
    """What drafts need of the KV tables (``KVTables``): pages for the draft rows that displace no
    one's KV, and the rows given back (``seq``: a ``requests.SeqState``)."""

    def extend_free(self, seq: Any, num_tokens: int, from_cache: bool = False) -> bool: ...

    def trim(self, seq: Any, num_tokens: int) -> None: ...


class Drafter:
    """The drafts of one engine's steps: which decoding jobs verify a draft and how long
    (``add_drafts``), the draft rows given back when a step fails (``drop_drafts``) or after its
    verification (``verified``), and the step times the choice is made from (``costs``).

    ``shared``: drafts may come from other requests' answers (``recent``; only where the prefix
    cache shares KV across requests). ``max_batch_tokens``: the step's token budget."""

    def __init__(self, pages: DraftPages, recent: RecentOutputs, *, shared: bool, max_batch_tokens: int):
        self.pages = pages
        self.recent = recent
        self.shared = shared
        self.max_batch_tokens = max_batch_tokens
        self.costs = StepCosts()  # decode step seconds by row count

    def add_drafts(self, batch: list) -> list:
        """Give decoding jobs a prompt-lookup draft where the step cost model says it pays:
        ``(job, 1)`` becomes ``(job, 1 + k)`` with the draft appended to its tokens (free pages, then
        cache-only pages; never a session's or a pool's: ``KVTables.extend_free(from_cache=True)``)."""
        cand = [job for job, n in batch if n == 1 and getattr(job, "draft_state", None) is not None
                and job.num_remaining == 1]  # (a pool's materialization has no draft state)
        if not cand or any(n > 1 for _, n in batch):  # a step with prefill rows is not a decode step
            return batch
        budget = min(MAX_DRAFT_ROWS, MAX_STEP_ROWS - len(batch), self.max_batch_tokens - len(batch))
        drafts = []
        for job in cand:
            st = job.draft_state
            st.idle += 1
            k = draft_limit(job, min(st.k_max, budget))
            recent = functools.partial(self.recent.lookup, job.seq.salt_root) if self.shared else None
            drafts.append(st.propose(job.seq.tokens, k, recent) if k > 0 else [])
        ks = self.costs.plan([j.draft_state for j in cand], len(batch), [len(d) for d in drafts])
        chosen = {}
        for job, draft, k in zip(cand, drafts, ks):
            k = min(k, budget)
            if k > 0 and self.pages.extend_free(job.seq, job.seq.num_cached + 1 + k, from_cache=True):
                job.draft = draft[:k]
                job.seq.tokens.extend(job.draft)
                chosen[id(job)] = k
                budget -= k
        if not chosen:
            return batch
        return [(job, n + chosen.get(id(job), 0)) for job, n in batch]

    def drop_drafts(self, batch: list) -> None:
        """A failed step: the drafts leave the jobs' tokens (and their pages go)."""
        for job, _ in batch:
            if getattr(job, "draft", None):
                del job.seq.tokens[len(job.seq.tokens) - len(job.draft):]
                job.draft = []
                self.pages.trim(job.seq, job.seq.num_cached + 1)

    def verified(self, job: AnyJob, accepted: int) -> None:
        """``job``'s draft was verified and its first ``accepted`` tokens matched: the draft leaves
        its tokens (the sampled ones are appended as they are emitted), the rejected rows' pages go,
        the accepted rows' KV stays; its acceptance rate learns from it."""
        seq, draft = job.seq, job.draft
        del seq.tokens[seq.num_cached + 1:]
        job.draft = []
        self.pages.trim(seq, seq.num_cached + 1 + accepted)
        job.draft_state.update(len(draft), accepted)
