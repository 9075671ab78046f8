"""Closing a constrained output within its token budget.

A grammar-constrained answer cut by ``max_tokens`` is an unfinished document (a JSON object
missing its closing quote and braces) that no client can parse. A small model can spend its
whole budget inside one string (greedy decoding that repeats a phrase). So when a constrained
request has a ``max_tokens`` budget, the sampler keeps an eye on the shortest way to finish the
document from where the output stands: when the tokens left are about to fall below it, the
output follows that way to the end (close the string, write the required keys that are still
missing with the smallest values the schema allows, close the objects), so the answer parses
and validates. Such an answer reports ``finish_reason: "length"`` (``stop_type: "limit"``): the
budget, not the model, ended it.

``closing_path`` finds that way on a copy of the matcher: the tokens the grammar forces, else
the first allowed of a few short closing / minimal-value tokens (``"``, ``}``, ``]``, ``, ``,
``0``, ``null``, ...), else the first allowed token; it gives up (None) past the budget.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

__all__ = ["closing_path", "CloseWatch", "CLOSE_HORIZON", "CLOSE_MARGIN"]

# plan the closing only in the last CLOSE_HORIZON tokens of the budget; start it while
# CLOSE_MARGIN tokens of slack are left (a free token can lengthen the way out by a few)
CLOSE_HORIZON = 96
CLOSE_MARGIN = 3

# tried in this order: an empty string where a value starts, the end of a string (inside a
# string every other closer is text), the ends of objects and arrays, separators, small values
_PREFERRED = ('""', '"}}', '"}', '"]', '"', '}}', ']}', '}]', '}', ']', ', ', ',', '0', 'null', 'false', '[]',
              '{}', '[', '{')
_pref_cache: dict[int, list[int]] = {}
_pref_lock = threading.Lock()


def _preferred_tokens(lt: Any) -> list[int]:
    key = id(lt)
    with _pref_lock:
        cached = _pref_cache.get(key)
        if cached is None:
            cached = []
            for text in _PREFERRED:
                ids = lt.tokenize_bytes(text.encode())
                if len(ids) == 1 and ids[0] not in cached:
                    cached.append(ids[0])
            _pref_cache[key] = cached
    return cached


def closing_path(matcher: Any, lt: Any, limit: int) -> list[int] | None:
    """Tokens that take ``matcher`` (left unchanged) to an accepting state, at most ``limit`` of
    them; None when this search finds no such way within ``limit``."""
    if matcher.is_accepting():
        return []
    m = matcher.deep_copy()
    prefs = _preferred_tokens(lt)
    path: list[int] = []
    while len(path) < limit:
        forced = m.compute_ff_tokens()
        if forced:
            forced = forced[:limit - len(path)]
            if not m.consume_tokens(forced):
                return None
            path += forced
        else:
            pick = next((t for t in prefs if m.validate_tokens([t]) == 1), None)
            if pick is None:
                bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
                allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
                if not len(allowed):
                    return None
                pick = int(allowed[0])
            if not m.consume_token(pick):
                return None
            path.append(pick)
        if m.is_accepting():
            return path
    return None


class CloseWatch:
    """Per-request budget watch: ``check(remaining)`` before each constrained step returns the
    token the output must take now (the next token of the closing way), or None (free step)."""

    __slots__ = ("path", "engaged", "_next_check")

    def __init__(self) -> None:
        self.path: list[int] = []
        self.engaged = False  # the budget has taken over the end of the output
        self._next_check: int | None = None

    def check(self, matcher: Callable[[], Any], lt: Any, remaining: int) -> int | None:
        """``matcher()``: the matcher to search from (built only when a search runs)."""
        if self.path:
            return self.path[0]
        if self.engaged or remaining > CLOSE_HORIZON:
            return None
        if self._next_check is not None and remaining > self._next_check:
            return None
        path = closing_path(matcher(), lt, remaining)
        if path is None:
            # no way out within the budget (e.g. a minItems the budget cannot reach): a search that
            # fails costs its whole length, so look again only when half of what is left is spent
            self._next_check = remaining // 2
            return None
        slack = remaining - len(path)
        if slack > CLOSE_MARGIN:
            # look again once half the slack is spent (the way out grows by a token or two a step)
            self._next_check = len(path) + CLOSE_MARGIN + (slack - CLOSE_MARGIN) // 2
            return None
        if not path:
            return None
        self.path, self.engaged = path, True
        return path[0]

    def advance(self, token: int) -> None:
        """The token the step took (``check``'s token while closing)."""
        if self.path:
            if token == self.path[0]:
                self.path.pop(0)
            else:
                self.path = []  # another token was forced in (e.g. a ban): plan again
                self.engaged = False
