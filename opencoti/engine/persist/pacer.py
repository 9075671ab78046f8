"""Pacing the disk tier's writes between decode steps, so that writing reclaimed KV does not slow them.

Why. On a CPU the engine's step uses every core (its thread team spans them), so any other work that
runs during a step delays the whole team, not a share of it. Measured on a 2-core machine while one
session decoded (``benchmarks/bench_kv_tier_steps.py``): steps beside the tier's writes took ~1.6x a
quiet step at nice 0 and at nice 19 alike, and a bare 90 MiB write into the page cache made the
steps it overlapped 6-12x slower (the kernel's copy is not preempted as a thread is).

How. The I/O thread writes a file in chunks (``CHUNK_BYTES``, checksummed as it goes), and each chunk
takes a *turn*. Turns run only between steps: after a step of ``t`` seconds the writer may work
``share * t`` seconds before the next step starts (a chunk that runs over is a debt paid from the
next steps' share); the step thread waits for a chunk in flight, at most that long plus ``GRACE_S``
(a disk that blocks a write never holds a step longer). While the engine is idle (no step to run)
turns are free. So a decode step's gap grows by about ``share``, and the writes go at ``share`` of
the engine's time while it computes and at the disk's speed while it waits (agents waiting on tools).
With ``share=None`` nothing is paced: the writer runs beside the steps.

Threads: ``step_begin`` / ``step_end`` / ``idle`` are called by the engine's step loop; ``writing``
and ``turn`` by the I/O thread.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ..config import DEFAULT_KV_DISK_WRITE_SHARE

DEFAULT_SHARE = DEFAULT_KV_DISK_WRITE_SHARE  # (``EngineConfig.kv_disk_write_share``)
"""The writer's time per second of the steps' while the engine computes. Measured one session decoding beside
90 MiB bursts (``bench_kv_tier_steps.py --share``, 2-core AMD EPYC, ``results/*/tier48_share/`` and
``kv_tier_steps.json``): the steps' median over the quiet steps around them was 1.00x and 1.09x at 0.03 (two
runs), 1.06x at 0.05 (a waiting step also pays the writer's wake-up)."""
CHUNK_BYTES = 256 * 1024
"""A turn's bytes (0.24-0.83 ms of checksum and page-cache copy here; a 12 ms step's share is 0.36 ms)."""
MAX_CREDIT_S = 0.05
"""The most one step (a long prefill) lends the writer before the next step."""
GRACE_S = 0.002
"""How much longer than its credit a step waits for a chunk in flight before it starts anyway."""


class StepPacer:
    def __init__(self, share: float | None = DEFAULT_SHARE, chunk_bytes: int = CHUNK_BYTES):
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1] or None, got {share!r}")
        self.share = share
        self.chunk_bytes = chunk_bytes
        self._cv = threading.Condition(threading.Lock())
        self._idle = True  # no step to run: turns are free
        self._stepping = False
        self._credit = 0.0  # seconds the writer may still work before the next step
        self._busy = False  # a chunk in flight
        self._charged_at = 0.0  # when its time was last charged to the credit
        self._writers = 0  # files being written (the writer wants turns)
        self.stats = {"steps": 0, "turns": 0, "turn_s": 0.0, "step_waits": 0, "step_wait_s": 0.0,
                      "step_wait_timeouts": 0}

    # ------------------------------------------------------------------ the step loop
    def step_begin(self) -> None:
        """A step starts: wait for a chunk in flight (or one the writer is owed), then hold turns."""
        with self._cv:
            if self._idle and self._busy:  # a chunk begun while idle: its time so far was free
                self._charged_at = time.monotonic()
            self._idle = False
            self.stats["steps"] += 1
            if self.share is not None and (self._busy or (self._writers and self._credit > 0)):
                t0 = time.monotonic()
                deadline = t0 + max(self._credit, 0.0) + GRACE_S
                while self._busy or (self._writers and self._credit > 0):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.stats["step_wait_timeouts"] += 1
                        break
                    self._cv.wait(left)
                self.stats["step_waits"] += 1
                self.stats["step_wait_s"] += time.monotonic() - t0
            if self._busy:  # a chunk runs on into the step (a blocked disk): charge its time so far
                now = time.monotonic()
                self._charge(now - self._charged_at)
                self._charged_at = now
            self._credit = min(self._credit, 0.0)  # unused credit lapses; a debt stays
            self._stepping = True

    def step_end(self, seconds: float) -> None:
        """A step of ``seconds`` ended: the writer may work its share of them now."""
        with self._cv:
            self._stepping = False
            if self.share is not None:
                self._credit = min(self._credit + seconds * self.share, MAX_CREDIT_S)
            if self._writers:
                self._cv.notify_all()

    def _charge(self, seconds: float) -> None:
        """The writer worked ``seconds`` while the engine computes. The debt is capped at what one step
        lends: a write the disk held up used no CPU, and should not hold the writes back for long."""
        self._credit = max(self._credit - seconds, -MAX_CREDIT_S)

    def idle(self) -> None:
        """No step to run (the loop waits for requests), or the engine is closing: turns are free."""
        with self._cv:
            self._idle, self._stepping, self._credit = True, False, 0.0
            self._cv.notify_all()

    # ------------------------------------------------------------------ the I/O thread
    @contextmanager
    def writing(self) -> Iterator[None]:
        """A file is being written: a step owes the writer its turn until it is done."""
        with self._cv:
            self._writers += 1
        try:
            yield
        finally:
            with self._cv:
                self._writers -= 1
                self._cv.notify_all()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """One chunk's work, when the engine is idle or between steps with credit left."""
        if self.share is None:
            yield
            return
        with self._cv:
            while self.share is not None and (self._stepping or (not self._idle and self._credit <= 0)):
                self._cv.wait(0.1)
            self._busy = True
            t0 = self._charged_at = time.monotonic()
        try:
            yield
        finally:
            with self._cv:
                now = time.monotonic()
                self._busy = False
                if not self._idle:
                    self._charge(now - self._charged_at)
                self.stats["turns"] += 1
                self.stats["turn_s"] += now - t0
                self._cv.notify_all()
