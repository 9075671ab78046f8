"""Writing idle sessions' KV to the disk tier ahead of the reclaim that will take it.

Why. A reclaim (``PolyKV.reclaim``) frees the pages of the idle sessions (agents waiting on a tool, a
sub-agent, a user) when a request needs room, and the tier copies each page it does not hold yet on the
step thread before the page is freed: the step that needs the room pays ~0.06 ms a page (a 6,000-token
context: ~22 ms, ``bench_kv_tier_steps.py``'s copy rows). Pages the tier holds already are freed without
a copy. So the idle sessions' pages are written while they are still in RAM, when the time is free:

* while the engine is idle (nothing to compute), ``IDLE_PAGES`` at a time, a request that arrives first;
* while it computes, idle sessions' KV only (the prefix cache's pages would need a scan of the cache:
  a few ms, in the step it ran before, measured in the team benchmark), in the share of the steps' time
  the tier's writes have (``pacer.StepPacer``: what a step lends the writer and no window of a file uses
  comes here), saved up until it pays for ``MIN_STEP_PAGES`` at the copy's measured cost, that many at a time.

Only when a reclaim is near (fewer than ``PRESSURE`` of the pages free), in the order a reclaim takes the
KV (``Reclaim.write_ahead``: idle sessions waiting on a tool, the prefix cache's own pages, then sessions
idle for less), and only what a reclaim would free (a pool's pages a session borrows are not). The copies
take at most half the tier's queue (the rest stays for reclaims) and room in its budget: they may push out
the least recently used files a reclaim wrote, as the reclaim they anticipate would, never another copy
written ahead (``DiskTier._room_ahead``), and they stay marked as copies until a reclaim takes their pages.
Pages are immutable once indexed, and a tail is written for its computed slots under a key of its tokens,
so a copy written ahead stays valid for its key whatever the session does next. A write that fails (a full
disk) or an error stops it for ``PAUSE_S``. ``EngineConfig.kv_disk_write_ahead`` turns it off.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..kv.pages import PagePool
    from ..polykv.state.polykv import PolyKV
    from .tier import DiskTier

log = logging.getLogger("opencoti.engine.persist")

PRESSURE = 0.25
"""Write ahead only when fewer than this share of the KV pages are free (a reclaim is near): with more
free, the pages would be written for nothing (a session's next turn usually finds them in RAM)."""
IDLE_PAGES = 64
"""Pages written ahead at a time while the engine is idle (one segment file; ~4 to 6 ms of copying on the
bundled model), so that a request that arrives waits at most that long."""
MIN_STEP_PAGES = 16
"""Between steps, the share no window uses is saved up until it pays for this many pages, then that many
are written in one step: a file of 16 pages, not one a step. Measured (``bench_kv_tier_reclaim.py``,
2-core Intel Xeon): 1.50 ms a run of 16 (0.09 ms a page; a reclaim's copy into buffers used again is
0.057 ms a page)."""
RETRY_S = 0.05
"""While the tier's queue is too full to take more, how often the idle engine looks again."""
PAUSE_S = 10.0
"""After a write failed (a full disk, a directory gone) or writing ahead raised, how long it stops."""


class WriteAhead:
    def __init__(self, tier: DiskTier, polykv: PolyKV, kv: PagePool):
        self.tier, self.polykv, self.kv = tier, polykv, kv
        # what a run written ahead between steps costs a page (its copy, the scan, the files' bookkeeping),
        # a running mean; from the snapshot's copy alone until measured
        self.fill_s_per_page = tier.copy_s_per_page
        self._errors = 0  # the tier's write errors seen
        self._paused_until = 0.0
        self._blocked: tuple | None = None  # (the tier's bytes, epoch, queue, held) when it last had no room
        tier.pacer.filler = self.between_steps

    def _wanted(self) -> bool:
        """A reclaim is near and no write failed lately."""
        tier = self.tier
        if tier.stats["write_errors"] != self._errors:  # (a full disk: the same pages would fail again)
            self._errors = tier.stats["write_errors"]
            self._paused_until = time.monotonic() + PAUSE_S
        return self.kv.num_free < PRESSURE * self.kv.num_pages and time.monotonic() >= self._paused_until

    def _queue_full(self) -> bool:
        return not self.tier.queue_takes_ahead(1)

    def _room_key(self) -> tuple:
        """What changes when the tier may have room again for a copy it had none for."""
        tier = self.tier
        return tier.used_bytes, tier.epoch, tier.pending_bytes, tier.stats["reclaimed_held_pages"]

    def _write(self, max_pages: int, cache: bool = True) -> tuple[int, bool]:
        try:
            return self.polykv.write_ahead(self.tier, max_pages, cache)
        except Exception:  # noqa: BLE001 - never the step loop's end: the reclaims copy instead
            log.exception("KV tier: writing ahead failed; it stops for %g s", PAUSE_S)
            self._paused_until = time.monotonic() + PAUSE_S
            return 0, False

    def idle(self) -> float | None:
        """The engine is idle: write a run of pages ahead. Returns when to be called again: 0 at once
        (more to write), ``RETRY_S`` (the queue is full for now), None (nothing to write: at the next idle)."""
        if not self._wanted():  # (paused: it resumes at the next idle moment after the pause)
            return None
        if self._queue_full():
            return RETRY_S
        n, left = self._write(IDLE_PAGES)
        if n:
            return 0.0
        return RETRY_S if left and self.tier.pending_bytes else None

    def between_steps(self, budget_s: float) -> bool | None:
        """A step lent ``budget_s`` of the writer's share (its credit, which the pacer keeps while this
        saves it up) that no window used: once it pays for ``MIN_STEP_PAGES`` at the measured cost of a
        run written ahead between steps, that many pages are written ahead. True: it wrote some; None:
        saving up; False: nothing to write (the credit lapses)."""
        if not self._wanted() or self._queue_full():
            return False
        if self._blocked == self._room_key():
            return False  # no room last time, none freed since
        if budget_s < MIN_STEP_PAGES * self.fill_s_per_page:
            return None
        t0 = time.perf_counter()
        n, left = self._write(MIN_STEP_PAGES, cache=False)  # (the idle sessions' only: their marks make it cheap)
        if n:
            self.fill_s_per_page += 0.25 * ((time.perf_counter() - t0) / n - self.fill_s_per_page)
        self._blocked = self._room_key() if left and not n else None
        return n > 0
