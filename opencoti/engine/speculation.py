"""The parts of speculative decoding the engine's lower layers share (the drafter itself is
``core/speculative.py``): its modes, the n-gram matcher, the answers of recent requests
(:class:`RecentOutputs`, which the prefix cache keeps and the drafter looks up), and a request's
draft counts as llama.cpp reports them (:func:`acceptance`).

This module imports nothing of the engine: ``config.py`` and ``observe/metrics.py`` import it, and
``benchmarks/replay_speculative.py`` loads the drafter (which imports it) from any commit."""

from __future__ import annotations

from collections import deque
from typing import Protocol

MODES = ("ngram", "off")  # EngineConfig.speculative
NGRAM_MAX = 4  # longest context suffix matched
NGRAM_MIN = 2  # shortest (one token matches too often to be worth a row)
OCCURRENCES = 8  # latest occurrences kept per n-gram of a job's context (their continuations vote)
RECENT_OUTPUTS = 64  # finished answers (per engine, all salts) other requests may draft from


def ngrams(tokens: list[int], start: int, stop: int):
    """The n-grams (``NGRAM_MIN`` .. ``NGRAM_MAX`` tokens) ending at positions ``start .. stop``, as
    (n-gram, end) in order of their ends."""
    for end in range(max(start, 1), stop + 1):
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            if end - n < 0:
                break
            yield tuple(tokens[end - n:end]), end


def ngram_ends(tokens: list[int], start: int, stop: int, last: dict) -> None:
    """Record in ``last`` the n-grams ending at positions ``start .. stop`` (each maps to where it ends)."""
    for key, end in ngrams(tokens, start, stop):
        last[key] = end


def ngram_occurrences(tokens: list[int], start: int, stop: int, ends: dict) -> None:
    """Record in ``ends`` the n-grams ending at positions ``start .. stop``: each n-gram maps to
    where it ended, an int while it occurred once (most n-grams: half the memory of a list), then
    a list of the :data:`OCCURRENCES` latest positions, oldest first."""
    for key, end in ngrams(tokens, start, stop):
        seen = ends.get(key)
        if seen is None:
            ends[key] = end
        elif isinstance(seen, int):
            ends[key] = [seen, end]
        else:
            seen.append(end)
            if len(seen) > OCCURRENCES:
                del seen[0]


class RecentOutputs:
    """The answers of recently finished requests, with one n-gram index over all of them: a lookup
    is one dict read, however many answers are kept."""

    def __init__(self, size: int = RECENT_OUTPUTS):
        self.size = size
        self._answers: deque[tuple[int, bytes, dict]] = deque()  # (serial, salt root, its n-gram ends)
        # (salt root, n-gram) -> (serial, tokens, end) of the latest kept answer holding it
        self._index: dict[tuple[bytes, tuple], tuple[int, list[int], int]] = {}
        self._serial = 0

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def ngrams(self) -> int:
        """N-grams indexed (each of a kept answer; an answer that left took its own with it)."""
        return len(self._index)

    def add(self, root: bytes, answer: list[int]) -> None:
        if len(answer) <= NGRAM_MIN:
            return
        tokens = list(answer)
        last: dict = {}
        ngram_ends(tokens, NGRAM_MIN, len(tokens) - 1, last)  # n-grams with a token after them
        self._serial += 1
        for key, end in last.items():
            self._index[(root, key)] = (self._serial, tokens, end)
        self._answers.append((self._serial, root, last))
        while len(self._answers) > self.size:  # the oldest answer leaves: its entries no later answer took
            serial, old_root, old = self._answers.popleft()
            for key in old:
                entry = self._index.get((old_root, key))
                if entry is not None and entry[0] == serial:
                    del self._index[(old_root, key)]

    def lookup(self, root: bytes, key: tuple, k: int) -> list[int]:
        """Up to ``k`` tokens that followed ``key`` in the latest answer of salt ``root`` holding it."""
        entry = self._index.get((root, key))
        if entry is None:
            return []
        _serial, tokens, end = entry
        return tokens[end:end + k]


class DraftCounts(Protocol):
    """A request's draft counts (the drafter's ``DraftState``)."""

    @property
    def drafted(self) -> int: ...  # draft tokens proposed (llama.cpp: draft_n)

    @property
    def accepted(self) -> int: ...  # of them accepted (draft_n_accepted)


def acceptance(state: DraftCounts | None) -> dict:
    """llama.cpp's timings fields for a request's drafts."""
    if state is None or not state.drafted:
        return {}
    return {"draft_n": state.drafted, "draft_n_accepted": state.accepted}
