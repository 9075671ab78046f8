"""The disk tier's reads ahead: the segments a queued request will read are read and checked by
threads of their own (not behind the writes), so the step that starts the request only copies them
into pages. A part of ``DiskTier`` (``tier.py``); everything here but ``_read_ahead`` runs on the step
thread."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Callable, Sequence as Seq

from .tier_files import DROPPED, WRITTEN, Segment, kv_layout, read_segment

READERS = 3  # threads reading ahead (files at once): one left the disk idle between small files


class Prefetch:
    """The read-ahead half of ``DiskTier`` (its state is set up by ``DiskTier.__init__``)."""

    dir: Path
    identity: dict | None
    max_pending: int
    pages: dict[bytes, tuple[Segment, int]]
    stats: dict
    wake: Callable[[], None] | None
    _lock: threading.Lock
    _rq: queue.SimpleQueue
    _readers: list[threading.Thread]
    _prefetched_bytes: int
    _fetched: set[Segment]
    _layout: tuple | None

    def prefetch(self, keys: Seq[bytes], kv) -> int:
        """A queued request will read the pages of ``keys`` (in order): read and check their
        segment files now, on the reader thread. Returns how many segments are being read (the
        request waits for them: ``reading``). Within the pending-bytes bound; past it, the request
        reads them itself when it starts."""
        self._layout = kv_layout(kv)
        self._settle()
        started = 0
        seen: set[str] = set()
        for key in keys:
            held = self.pages.get(key)
            if held is None:
                break
            seg = held[0]
            if seg.name in seen:
                continue
            seen.add(seg.name)
            if seg.state != WRITTEN or seg.k is not None or seg.reading or seg.loaded is not None:
                continue
            if self._prefetched_bytes + seg.nbytes > self.max_pending:
                break
            seg.reading = True
            self._fetched.add(seg)
            self._prefetched_bytes += seg.nbytes
            if not self._readers:  # several: a turn's pages are often many small files (evicted a chunk at a time)
                self._readers = [threading.Thread(target=self._read_ahead, name=f"opencoti-kv-tier-read-{i}", daemon=True)
                                 for i in range(READERS)]
                for t in self._readers:
                    t.start()
            self._rq.put(seg)
            started += 1
        self.stats["prefetched_segments"] += started
        return started

    def reading(self, keys: Seq[bytes]) -> bool:
        """Whether a prefetch of one of ``keys``' segments is still in flight."""
        for key in keys:
            held = self.pages.get(key)
            if held is None or held[0].reading:
                return held is not None
        return False

    def _drop_loaded(self, seg: Segment) -> None:
        """Its prefetched data goes (used, or the segment is forgotten); one still being read is
        settled when its read ends (``_settle``)."""
        seg.loaded = None
        if seg in self._fetched and not seg.reading:
            self._fetched.discard(seg)
            self._prefetched_bytes -= seg.nbytes

    def _settle(self) -> None:
        """Count out the prefetches that ended without data to use (a fault, or a forgotten segment)."""
        for seg in [x for x in self._fetched if not x.reading and (x.loaded is None or x.state == DROPPED)]:
            self._drop_loaded(seg)

    def _read_ahead(self) -> None:
        while True:
            seg = self._rq.get()
            if seg is None:
                return
            t0 = time.perf_counter()
            try:
                layout = self._layout
                assert layout is not None  # prefetch sets it before it queues a read
                got = read_segment(self.dir / seg.name, seg, self.identity, layout)
            except Exception as e:  # noqa: BLE001 - a read that fails is a recompute, never a crash
                got = f"cannot read it: {e}"
            if isinstance(got, str):
                seg.load_error = got
            elif seg.state != DROPPED:
                seg.loaded = got
            seg.reading = False  # (after loaded: the step thread reads ``reading`` first)
            with self._lock:  # (several readers)
                self.stats["prefetch_seconds"] += time.perf_counter() - t0
            if self.wake is not None:
                try:
                    self.wake()
                except Exception:  # noqa: BLE001 - the engine is shutting down
                    pass
