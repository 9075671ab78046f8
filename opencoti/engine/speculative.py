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

The draft length adapts per job to what it accepted (doubling after a full accept, the accepted
length plus one after a miss), and a job stops drafting after :data:`MISSES_TO_PAUSE` drafts in a
row rejected at their first token, for :data:`PAUSE_STEPS` steps. Draft rows in one step are bounded
by :data:`MAX_DRAFT_ROWS` less the decoding jobs (many sessions decoding at once already fill the
projections; more rows cost more than they save there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_MAX = 4  # longest context suffix matched
NGRAM_MIN = 2  # shortest (one token matches too often to be worth a row)
MAX_DRAFT_ROWS = 8  # draft rows in a step, less one per decoding job
MISSES_TO_PAUSE = 3
PAUSE_STEPS = 8
MODES = ("ngram", "off")


@dataclass
class DraftState:
    """One job's drafter: an index of its context's n-grams and its adaptive draft length."""

    k_max: int
    k: int = 0
    indexed: int = 0  # tokens of the context indexed so far
    last: dict = field(default_factory=dict)  # n-gram (tuple) -> end position of its latest occurrence
    misses: int = 0
    paused: int = 0
    drafted: int = 0  # draft tokens proposed (llama.cpp: draft_n)
    accepted: int = 0  # of them accepted (draft_n_accepted)

    def __post_init__(self) -> None:
        self.k = self.k_max

    def _index(self, tokens: list[int], upto: int) -> None:
        """Record the n-grams ending before position ``upto`` (each maps to where it ends)."""
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

    def want(self) -> int:
        """Draft tokens to propose this step (0 while paused)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        self.drafted += proposed
        self.accepted += accepted
        if accepted == proposed:
            self.k = min(self.k_max, max(1, self.k) * 2)
            self.misses = 0
            return
        self.k = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES_TO_PAUSE:
            self.paused, self.misses = PAUSE_STEPS, 0


def rows_for_drafts(num_decoding: int) -> int:
    """Draft rows a step may add with ``num_decoding`` jobs decoding."""
    return max(0, MAX_DRAFT_ROWS - num_decoding)


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
