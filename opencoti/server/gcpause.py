"""Automatic garbage collection paused while a large request is handled.

CPython's cyclic collector walks every element of every list in the generations it collects, and
holds the GIL while it does: one collection that meets a list of 3 M token ids takes 30-60 ms on a
2-core EPYC, in which no other thread runs - the event loop included. A large body (megabytes of
ids or text) makes such lists (the ids parsed, a text's tokens, their checks) and they live for
seconds, so every young and full collection in that time would stall ``/health`` and the streams.

``paused()`` turns automatic collection off while any large request is in flight and back on when
the last one ends. The lists of ints it protects hold no reference cycles: reference counting frees
them when their request ends, and the collections that were due then run on what is left (the
counts of new objects are kept). Other requests' cyclic garbage waits meanwhile; a pause that
lasts longer than ``MAX_PAUSE_S`` (large requests overlapping without end) is lifted.
Collection that was already off (``gc.disable()`` by the embedding program) is left alone.
"""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from typing import Iterator

MAX_PAUSE_S = 60.0

_lock = threading.Lock()
_active = 0  # large requests in flight
_since = 0.0  # when the current pause began
_paused = False  # whether collection is off because of this module


@contextmanager
def paused() -> Iterator[None]:
    """No automatic garbage collection until the last of the overlapping ``paused()`` blocks ends
    (or ``MAX_PAUSE_S`` after the pause began)."""
    enter()
    try:
        yield
    finally:
        leave()


def enter() -> None:
    global _active, _since, _paused
    with _lock:
        now = time.monotonic()
        if _active == 0 and gc.isenabled():
            gc.disable()
            _since, _paused = now, True
        elif _paused and now - _since > MAX_PAUSE_S:
            gc.enable()
            _paused = False
        _active += 1


def leave() -> None:
    global _active, _paused
    with _lock:
        _active -= 1
        if _paused and (_active == 0 or time.monotonic() - _since > MAX_PAUSE_S):
            gc.enable()
            _paused = False
