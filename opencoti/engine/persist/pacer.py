"""Pacing the disk tier's writes between decode steps, so that writing reclaimed KV does not slow them.

Why. On a CPU the engine's step uses every core (its thread team spans them), so any other work that
runs during a step delays the whole team, not a share of it. Measured on a 2-core machine while one
session decoded (``benchmarks/bench_kv_tier_steps.py``): steps beside the tier's writes took ~1.6x a
quiet step at nice 0 and at nice 19 alike, and a bare 90 MiB write into the page cache made the
steps it overlapped 6-12x slower (the kernel's copy is not preempted as a thread is).

How. The I/O thread writes a file a window (``CHUNK_BYTES``) at a time, and hands each window's CPU work
(its checksum and its copy into an aligned buffer, ``body_writer``) to ``run``. While the engine computes,
that work runs *on the step thread, before a step*, when the steps so far have lent it credit: after a
step of ``t`` seconds the writer may work ``share * t`` (a window that runs over is a debt paid from the
next steps' share). So no step waits for another thread to wake up or for a disk: the step runs ~0.1 ms
of memory work and starts, and the window's write itself (``O_DIRECT``: the device copies it) goes on
beside the steps on the I/O thread. While the engine is idle (no step to run) the I/O thread does the
work itself, at the disk's speed; a step that begins meanwhile waits for that window, at most
``GRACE_S``. With ``share=None`` nothing is paced: the I/O thread does everything beside the steps.

An earlier design let the I/O thread work between steps while the step thread waited for it: each waiting
step paid the writer's wake-up on top of its share (0.72 ms a step on average; median 1.09x the quiet
steps, 47 % of steps over 1.1x their local median, ``results/*/kv_tier_steps`` history).

Threads: ``step_begin`` / ``step_end`` / ``idle`` are called by the engine's step loop; ``run`` by the
I/O thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..config import DEFAULT_KV_DISK_WRITE_SHARE

log = logging.getLogger("opencoti.engine.persist")

DEFAULT_SHARE = DEFAULT_KV_DISK_WRITE_SHARE  # (``EngineConfig.kv_disk_write_share``)
"""The writer's time per second of the steps' while the engine computes. Measured one session decoding beside
90 MiB bursts (``bench_kv_tier_steps.py --share``, 2-core AMD EPYC, ``results/*/tier48_share/`` and
``kv_tier_steps.json``): the steps' median over the quiet steps around them was 1.00x and 1.09x at 0.03 (two
runs), 1.06x at 0.05 (a waiting step also pays the writer's wake-up)."""
CHUNK_BYTES = 256 * 1024
"""A window's bytes (its checksum and copy: ~0.15 ms here; a 12 ms step's share is 0.36 ms)."""
MAX_CREDIT_S = 0.05
"""The most one step (a long prefill) lends the writer before the next step."""
GRACE_S = 0.002
"""How long a step that begins waits for a window the I/O thread started while the engine was idle (one
step, once per window)."""


class _Job:
    __slots__ = ("fn", "taken", "done", "error", "result")

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.taken, self.done = fn, False, False
        self.result: object = True
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the thread that asked
            self.error = e


class StepPacer:
    def __init__(self, share: float | None = DEFAULT_SHARE, chunk_bytes: int = CHUNK_BYTES):
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1] or None, got {share!r}")
        self.share = share
        self.chunk_bytes = chunk_bytes
        self._cv = threading.Condition(threading.Lock())
        self._idle = True  # no step to run: the I/O thread works itself
        self._credit = 0.0  # seconds the writer may still work before the next step
        self._job: _Job | None = None  # a window's work waiting for a step to run it
        self._busy = False  # the I/O thread runs a window itself (the engine was idle)
        self._busy_seq = 0  # counts the windows the I/O thread ran itself
        self._waited = 0  # the last of them a step waited for
        # step thread work for a step's unused share when no window waits (``write_ahead``: idle sessions'
        # KV), given the seconds it may take; it returns True (it worked), False (nothing to do: the credit
        # lapses) or None (saving the credit up for a larger piece of work). Its time is charged like a window's
        self.filler: Callable[[float], bool | None] | None = None
        self._saving = False  # the filler's last answer was None: the steps' unused credit is kept for it
        self.stats = {"steps": 0, "turns": 0, "turn_s": 0.0, "step_turns": 0, "step_turn_s": 0.0,
                      "step_waits": 0, "step_wait_s": 0.0,
                      "fills": 0, "fill_s": 0.0}

    # ------------------------------------------------------------------ the step loop
    def step_begin(self) -> None:
        """A step starts: run the writer's waiting window first if the steps lent it the time."""
        with self._cv:
            self._idle = False
            self.stats["steps"] += 1
            if self._busy and self._waited != self._busy_seq:  # a window the I/O thread began while idle:
                self._waited = self._busy_seq  # let it finish, briefly (one step waits for it, once)
                t0 = time.monotonic()
                while self._busy and self._waited == self._busy_seq:
                    left = GRACE_S - (time.monotonic() - t0)
                    if left <= 0:
                        break
                    self._cv.wait(left)
                self.stats["step_waits"] += 1
                self.stats["step_wait_s"] += time.monotonic() - t0
            job = self._job
            credit = self._credit
            filled = False
            if job is None or job.taken or self.share is None or credit <= 0:
                fill = self.filler if self.share is not None and credit > 0 else None
                if fill is None:
                    self._credit = min(credit, MAX_CREDIT_S if self._saving else 0.0)  # unused credit lapses
                    return  # (the common case: one lock a step)
                job, filled = _Job(lambda: fill(credit)), True  # no window waits: the share goes to the filler
            job.taken = True
        t0 = time.perf_counter()
        job.run()
        dt = time.perf_counter() - t0
        if filled and job.error is not None:  # (the filler's own: logged, the step goes on)
            if not isinstance(job.error, Exception):
                raise job.error  # (KeyboardInterrupt, SystemExit)
            log.error("work between steps failed", exc_info=job.error)
        with self._cv:
            job.done = True
            if filled:  # the filler saving the credit up for a run of pages: what is left does not lapse
                self._saving = job.result is None and job.error is None
            # a debt is capped at what one step lends; unused credit lapses (unless the filler saves it up)
            self._credit = min(max(self._credit - dt, -MAX_CREDIT_S), MAX_CREDIT_S if self._saving else 0.0)
            if not filled:
                self.stats["turns"] += 1
                self.stats["turn_s"] += dt
                self.stats["step_turns"] += 1
                self.stats["step_turn_s"] += dt
            elif job.result:  # (a filler with nothing to do, or saving up, is not counted; its check is charged)
                self.stats["fills"] += 1
                self.stats["fill_s"] += dt
            self._cv.notify_all()

    def step_end(self, seconds: float) -> None:
        """A step of ``seconds`` ended: the writer may work its share of them before the next one."""
        with self._cv:
            if self.share is not None:
                self._credit = min(self._credit + seconds * self.share, MAX_CREDIT_S)
            elif self._job is not None:
                self._cv.notify_all()  # pacing switched off: a waiting writer works itself

    def idle(self) -> None:
        """No step to run (the loop waits for requests), or the engine is closing: the writer works itself."""
        with self._cv:
            self._idle, self._credit = True, 0.0
            self._cv.notify_all()

    # ------------------------------------------------------------------ the I/O thread
    def run(self, fn: Callable[[], None]) -> None:
        """Run one window's CPU work: on the step thread between steps while the engine computes, here
        while it is idle (or unpaced). Returns when it ran; raises what it raised."""
        if self.share is None:  # unpaced: beside the steps (not counted)
            fn()
            return
        job = _Job(fn)
        with self._cv:
            while True:
                if job.done:
                    break
                if not job.taken and (self._idle or self.share is None):
                    job.taken, self._busy = True, True
                    self._busy_seq += 1
                    if self._job is job:
                        self._job = None
                    break
                self._job = job
                self._cv.wait(0.1)
            if self._job is job:
                self._job = None
        if not job.done:  # ours to run
            t0 = time.perf_counter()
            job.run()
            dt = time.perf_counter() - t0
            with self._cv:
                self._busy = False
                self.stats["turns"] += 1
                self.stats["turn_s"] += dt
                self._cv.notify_all()
        if job.error is not None:
            raise job.error
