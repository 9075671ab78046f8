"""Writing idle sessions' KV to the disk tier ahead of the reclaim that will take it.

Why. A reclaim (``PolyKV.reclaim``) frees the pages of the idle sessions (agents waiting on a tool, a
sub-agent, a user) when a request needs room, and the tier copies each page it does not hold yet on the
step thread before the page is freed: the step that needs the room pays ~0.06 ms a page (a 6,000-token
context: ~22 ms, ``bench_kv_tier_steps.py``'s copy rows). Pages the tier holds already are freed without
a copy. So the idle sessions' pages are written while they are still in RAM, when the time is free:

* while the engine is idle (nothing to compute), a run of pages at a time, a request that arrives first;
* while it computes, in the share of the steps' time the tier's writes have (``pacer.StepPacer``: what
  a step lends the writer and no window of a file uses goes to this), sized by the copy's measured cost.

Only when a reclaim is near (fewer than ``PRESSURE`` of the pages free), in the order a reclaim takes the
sessions (``Reclaim.idle_sessions``), into the tier's free budget only (nothing on disk is evicted for a
copy of what is in RAM) and half its queue (the rest stays for reclaims). Pages are immutable once
indexed, and a session's tail is written for its computed slots, so a copy written ahead stays valid for
its key whatever the session does next (a page it changes gets a new key). ``EngineConfig.kv_disk_write_ahead``
turns it off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..kv.pages import PagePool
    from ..polykv.state.polykv import PolyKV
    from .tier import DiskTier

PRESSURE = 0.25
"""Write ahead only when fewer than this share of the KV pages are free (a reclaim is near): with more
free, the pages would be written for nothing (a session's next turn usually finds them in RAM)."""
IDLE_PAGES = 64
"""Pages written ahead at a time while the engine is idle (one segment file; ~4 ms of copying on the
bundled model), so that a request that arrives waits at most that long."""
RETRY_S = 0.05
"""While the tier's queue is too full to take more, how often the idle engine looks again."""


class WriteAhead:
    def __init__(self, tier: DiskTier, polykv: PolyKV, kv: PagePool):
        self.tier, self.polykv, self.kv = tier, polykv, kv
        tier.pacer.filler = self.between_steps

    def _near(self) -> bool:
        return self.kv.num_free < PRESSURE * self.kv.num_pages

    def idle(self) -> float | None:
        """The engine is idle: write a run of pages ahead. Returns when to be called again: 0 at once
        (more to write), ``RETRY_S`` (the queue is full for now), None (nothing to write: at the next idle)."""
        if not self._near():
            return None
        n, left = self.polykv.write_ahead(self.tier, IDLE_PAGES)
        if n:
            return 0.0
        return RETRY_S if left and self.tier.pending_bytes else None

    def between_steps(self, budget_s: float) -> None:
        """A step lent ``budget_s`` of the writer's share that no window used: write as many pages ahead
        as the copy's measured cost fits in it (at least one)."""
        if self._near():
            pages = max(1, min(IDLE_PAGES, int(budget_s / max(self.tier.copy_s_per_page, 1e-6))))
            self.polykv.write_ahead(self.tier, pages)
