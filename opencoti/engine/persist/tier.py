"""The disk tier: KV pages reclaimed from RAM are written to disk and read back instead of recomputed.

Where it sits. Every page that leaves RAM under memory pressure leaves through one door: the
prefix cache's eviction (``KVTables.evict_cache``). A session's KV that ``PolyKV.reclaim`` drops,
an evicted pool's pages and plain cache pages all become cache-only pages first (they stay listed
in the prefix index by their chained page key) and are then evicted LRU, leaves first. The tier
hooks that door: the pages of each evicted chain (a run of pages where each is the parent of the
next) are copied on the step thread (a memory copy into buffers used again, ``staging``) and
written by an I/O thread as one *segment* file. An evicted *tail* (a finished request's partial last
page, which a session's next turn continues) is a segment of its own, its valid slots only, found by
the key of the page before it and its tokens; it comes back as a tail and is copied, not recomputed.
A later request whose prompt continues a resident prefix with keys the tier holds gets those pages
back into RAM as cache pages (``KVTables.promote``) before the index is matched, so every path that
reuses cached KV (a session's next turn, a prefix shared by another request) reads them instead of
recomputing them. Pages the tier holds already are not copied again: the KV a reclaim would take next
is written ahead while it is still in RAM (``write_ahead``, driven by ``write_ahead.py``), so that its
reclaim copies nothing in the step that needs the room.

Format. A segment is a KV file (``kvfile``: 4 KiB header, K then V as ``[layers, tokens, heads,
dim]``, CRC-32 of the body, the tokens appended), written to a temporary name and renamed, so a
kill -9 leaves a whole file or a ``.tmp`` one. Its header names the engine identity (model, weight
format, KV dtype), the digest of its tokens, its position and the key of the page before it.

What can go wrong degrades to a recompute, never to wrong KV: a write that fails (a full disk)
loses that segment; a read verifies the header's identity and token digest and the checksum, and a
missing, cut-short, swapped or corrupt file is forgotten and logged, and the request computes the
pages it could not read. The snapshots waiting for the I/O thread are bounded (``max_pending_bytes``);
past that, pages are dropped. Files go a 256 KiB window at a time, ``O_DIRECT`` (``body_writer``): each
window's checksum and copy run on the step thread before a step, within 3 % of the steps' time
(``pacer.StepPacer``), its write beside the steps (a step waits at most 2 ms, for a window begun idle).

Budget. The files stay within ``budget_bytes``: the least recently used segments (written or
read) are removed first. The directory is emptied at start: the tier is a cache of this process's
pages (named sessions' KV survives restarts through ``session_kv``).

Threads: everything here runs on the engine's step thread except ``_run`` (the I/O thread), which
touches only the segments handed to it and the pending byte count.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from ..kv.prefix_index import common_prefix, tail_key
from .files import HEADER
from .pacer import StepPacer
from .staging import AVAILABLE as STAGING, DEFAULT_KEEP_MIB, Staging
from .tier_prefetch import Prefetch
from .tier_files import DROPPED, FAILED, PENDING, WRITTEN, Segment, kv_layout, read_segment, write_segment

log = logging.getLogger("opencoti.engine.persist")

TIER_DIR = "kv_tier"
MAX_SEGMENT_PAGES = 64  # pages per file at most (1,024 tokens at the default page size; ~23 MiB for the bundled model)
DEFAULT_PENDING_MIB = 256.0  # snapshots waiting for the I/O thread at most (memory); past it, pages are dropped

class DiskTier(Prefetch):
    """The disk tier of one engine's KV pages (see the module docstring). ``spill``, ``has`` and
    ``fetch`` are what the KV tables call (``kv.tables.Tier``)."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, identity: dict | None, *,
                 max_pending_bytes: int = int(DEFAULT_PENDING_MIB * 2**20)):
        self.dir = Path(directory)
        self.budget = max(0, int(budget_bytes))
        self.identity = identity
        self.max_pending = max(0, int(max_pending_bytes))
        self.dir.mkdir(parents=True, exist_ok=True)
        stale = [f for f in self.dir.iterdir() if f.name.endswith((".kv", ".kv.tmp"))]
        for f in stale:  # the tier is this process's cache; a .tmp is a write a kill -9 cut short
            f.unlink(missing_ok=True)
        if stale:
            log.info("KV tier: removed %d files of an earlier run from %s", len(stale), self.dir)
        self.pages: dict[bytes, tuple[Segment, int]] = {}  # page key (or a tail's) -> (segment, index in it)
        self.tails: dict[bytes, dict[bytes, Segment]] = {}  # parent page key -> tail key -> its segment
        self.segments: OrderedDict[str, Segment] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.copy_s_per_page = 1e-4  # a snapshot's copy on the step thread (a running mean; write_ahead sizes by it)
        self.epoch = 0  # counts the segments forgotten (what was all written ahead may not be any more)
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._failed: list[Segment] = []  # segments whose write failed (I/O thread), to forget (step thread)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._warned: dict[str, float] = {}
        self.pacer = StepPacer()  # the writes' turns between steps (the engine's step loop drives it)
        self.staging = Staging(min(self.max_pending, DEFAULT_KEEP_MIB * 2**20))  # the snapshots' buffers
        # prefetches: segments a queued request will read, read and checked by a thread of their own
        # (not behind the writes), so the step that starts the request only copies them into pages
        self._rq: queue.SimpleQueue = queue.SimpleQueue()
        self._readers: list[threading.Thread] = []
        self._prefetched_bytes = 0  # of the segments in _fetched (step thread only)
        self._fetched: set[Segment] = set()  # prefetched (or being read), not consumed yet
        self.wake: Callable[[], None] | None = None  # called (reader thread) when a prefetch is done
        self._layout: tuple | None = None  # (kv page geometry) for the reader thread
        self.stats = {"spilled_pages": 0, "spilled_segments": 0, "dropped_pages_queue_full": 0,
                      "spilled_tails": 0, "written_ahead_pages": 0, "reclaimed_held_pages": 0,
                      "skipped_pages_over_budget": 0, "evicted_segments": 0, "read_pages": 0,
                      "read_segments": 0, "read_tails": 0, "read_from_memory": 0, "faults": 0, "write_errors": 0,
                      "direct_writes": 0, "write_seconds": 0.0, "read_seconds": 0.0, "prefetched_segments": 0,
                      "prefetch_seconds": 0.0}

    # ------------------------------------------------------------------ reads of the state
    def has(self, key: bytes) -> bool:
        return (e := self.pages.get(key)) is not None and e[0].state in (PENDING, WRITTEN)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def status(self) -> dict:
        return {"enabled": True, "dir": str(self.dir), "budget_bytes": self.budget, "used_bytes": self.used_bytes,
                "pages": len(self.pages), "segments": len(self.segments), "pending_bytes": self._pending_bytes,
                "prefetched_bytes": self._prefetched_bytes, "max_pending_bytes": self.max_pending, **self.stats,
                **self.staging.stats, "staging_kept_bytes": self.staging.kept_bytes,
                "pacing": {"share": self.pacer.share, **self.pacer.stats}}  # (the writes' turns, the steps' waits)

    # ------------------------------------------------------------------ writes
    def spill(self, kv, chains: list[list]) -> None:
        """Pages leave RAM: ``chains`` are runs of prefix-index entries (``key``, ``page``,
        ``tokens``, ``parent``, ``depth``), each the parent of the next. Pages whose key the tier
        holds already (written ahead, or earlier) are not copied again."""
        self._sweep_failed()
        for chain in chains:
            for run in self._runs(chain, touch=True):
                self._write(kv, run)

    def spill_tails(self, kv, tails: list) -> None:
        """Tails (``page``, ``tokens``, ``parent``: partial last pages) leave RAM: a file each, unless held."""
        self._sweep_failed()
        for t in tails:
            key = tail_key(t.parent.key, t.tokens)
            if not self._touch(key):
                self._write(kv, [t], tail=key)
            else:
                self.stats["reclaimed_held_pages"] += 1

    def write_ahead(self, kv, chain: list, tail, max_pages: int) -> tuple[int, bool]:
        """Write pages that stay in RAM (an idle session's ``chain`` of entries, then its ``tail`` or
        None) so that their reclaim later frees them without a copy: at most ``max_pages``, only into
        the tier's free budget (nothing is evicted for them) and half its queue (the rest stays for
        reclaims). Returns the pages written and whether everything asked is held now."""
        self._sweep_failed()
        done = 0
        for run in self._runs(chain, touch=False):
            take = run[:max_pages - done]
            if not take or not self._write(kv, take, ahead=True):
                return done, False
            done += len(take)
            if len(take) < len(run):  # (cut short by max_pages: the rest is left)
                return done, False
        if tail is not None and not self.has(key := tail_key(tail.parent.key, tail.tokens)):
            if done >= max_pages or not self._write(kv, [tail], tail=key, ahead=True):
                return done, False
            done += 1
        return done, True

    def _runs(self, chain: list, touch: bool):
        """The runs of ``chain`` the tier does not hold (``MAX_SEGMENT_PAGES`` at most each); ``touch``:
        those it holds are used now (LRU) and counted as reclaimed without a copy."""
        run: list = []
        for e in chain:
            if self._touch(e.key) if touch else self.has(e.key):
                self.stats["reclaimed_held_pages"] += touch
                if run:
                    yield run
                run = []
                continue
            run.append(e)
            if len(run) >= MAX_SEGMENT_PAGES:
                yield run
                run = []
        if run:
            yield run

    def _touch(self, key: bytes) -> bool:
        """Whether the tier holds ``key``'s page already (written or queued); if so it is used now (LRU)."""
        name = self.pages[key][0].name if self.has(key) else ""
        if name in self.segments:
            self.segments.move_to_end(name)
            self.segments[name].ahead = False
        return name in self.segments

    def _write(self, kv, run: list, tail: bytes | None = None, ahead: bool = False) -> bool:
        """Snapshot ``run`` and queue its file; False when it was not (``ahead``: no room without evicting,
        or the queue half full; otherwise dropped, counted)."""
        n, ps = len(run), kv.page_size
        slots = len(run[0].tokens) if tail is not None else ps  # a tail's valid slots only
        size = HEADER + n * kv.page_bytes * slots // ps + 4 * n * slots
        if ahead and (not self.queue_takes_ahead(size) or not self._room_ahead(size)):
            return False
        if size > self.budget:
            self.stats["skipped_pages_over_budget"] += n
            return False
        if self._pending_bytes + size > self.max_pending:  # the I/O thread is behind: drop, never wait
            self.stats["dropped_pages_queue_full"] += n
            self._warn("queue", "KV tier: %d MiB of pages wait for the disk already; %d pages are dropped "
                       "(recomputed if needed again)", self.max_pending >> 20, n)
            return False
        self._make_room(size)
        index = torch.tensor([e.page for e in run], dtype=torch.long, device=kv.k_cache.device)
        if tail is None and kv.k_cache.device.type == "cpu" and STAGING:  # into buffers used again
            t0 = time.perf_counter()
            k, v, bufs = self.staging.snapshot(kv.k_cache, kv.v_cache, index)  # [L, n, ps, H, D]
            self.copy_s_per_page += 0.25 * ((time.perf_counter() - t0) / n - self.copy_s_per_page)
        else:
            bufs = None
            k = kv.k_cache.index_select(1, index)[:, :, :slots].cpu()  # (a tail: its slots)
            v = kv.v_cache.index_select(1, index)[:, :, :slots].cpu()
        tokens = [t for e in run for t in e.tokens]
        parent = run[0].parent
        if tail is not None:
            seg = Segment(f"{next(self._names)}.kv", [tail], tokens, parent.depth * ps, parent.key, size, k, v,
                          tail=True)
            self.tails.setdefault(parent.key, {})[tail] = seg
        else:
            seg = Segment(f"{next(self._names)}.kv", [e.key for e in run], tokens, (run[0].depth - 1) * ps,
                          parent.key, size, k, v)
            seg.bufs = bufs
        seg.ahead = ahead  # (a copy of pages still in RAM, until a reclaim takes them: _touch)
        for i, key in enumerate(seg.keys):
            self.pages[key] = (seg, i)
        self.segments[seg.name] = seg
        self.used_bytes += size
        with self._lock:
            self._pending_bytes += size
        self.stats["spilled_pages"] += n
        self.stats["spilled_segments"] += 1
        self.stats["spilled_tails"] += tail is not None
        self.stats["written_ahead_pages"] += n if ahead else 0
        self._put(("save", seg))
        return True

    def queue_takes_ahead(self, size: int) -> bool:
        """Whether ``size`` more bytes written ahead keep the pending snapshots within half the queue (the
        rest stays for reclaims)."""
        return 2 * (self._pending_bytes + size) <= self.max_pending

    def _room_ahead(self, size: int) -> bool:
        """Whether a write-ahead of ``size`` bytes fits, evicting only the least recently used files a
        reclaim wrote (as the reclaim it anticipates would), never a copy written ahead: so two sessions'
        copies never push each other out."""
        need = self.used_bytes + size - self.budget
        for seg in self.segments.values():
            if need <= 0:
                break
            if seg.ahead:
                return False
            need -= seg.nbytes
        return need <= 0

    def _make_room(self, size: int) -> None:
        while self.segments and self.used_bytes + size > self.budget:
            _, seg = self.segments.popitem(last=False)
            self._forget(seg)
            self.stats["evicted_segments"] += 1

    def _forget(self, seg: Segment) -> None:
        """The segment's pages are no longer served; its file goes."""
        self.epoch += 1
        self._drop_loaded(seg)
        self.segments.pop(seg.name, None)
        if seg.tail:
            under = self.tails.get(seg.parent_key, {})
            if under.get(seg.keys[0]) is seg:
                del under[seg.keys[0]]
                if not under:
                    del self.tails[seg.parent_key]
        for key in seg.keys:
            if self.pages.get(key, (None,))[0] is seg:
                del self.pages[key]
        if seg.state != DROPPED:
            self.used_bytes -= seg.nbytes
            seg.state = DROPPED
            self._put(("drop", seg))

    def _sweep_failed(self) -> None:
        """Forget the segments whose write failed (their bytes no longer count)."""
        while self._failed:
            with self._lock:
                failed, self._failed = self._failed, []
            for seg in failed:
                if seg.state == FAILED:
                    self._forget(seg)

    # ------------------------------------------------------------------ reads
    def fetch(self, keys: Seq[bytes], page_tokens: Seq[tuple], parent_key: bytes, kv
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The K and V (``[L, n, ps, H, D]`` each, a part per file: never copied into one) of the
        longest run of ``keys`` (each page's tokens ``page_tokens``, the first one's parent
        ``parent_key``) the tier can deliver, checked; empty when it has none. A file that cannot be
        used is forgotten (logged): the caller computes what is not returned."""
        t0 = time.perf_counter()
        ks, vs = [], []
        i, prev = 0, parent_key
        while i < len(keys):
            held = self.pages.get(keys[i])
            if held is None:
                break
            seg, at = held
            if (seg.parent_key if at == 0 else seg.keys[at - 1]) != prev:
                break
            if seg.reading:  # being read ahead for another request: this one computes those pages
                break
            data = self._data(seg, kv)
            if data is None:
                self._forget(seg)
                break
            j = i
            while (j < len(keys) and at + j - i < len(seg.keys) and seg.keys[at + j - i] == keys[j]
                   and tuple(seg.tokens[(at + j - i) * kv.page_size:(at + j - i + 1) * kv.page_size]) == tuple(page_tokens[j])):
                j += 1
            if j == i:
                break
            ks.append(data[0][:, at:at + j - i])
            vs.append(data[1][:, at:at + j - i])
            if seg.name in self.segments:
                self.segments.move_to_end(seg.name)
            prev = keys[j - 1]
            i = j
        self.stats["read_pages"] += i
        self.stats["read_seconds"] += time.perf_counter() - t0
        return list(zip(ks, vs))

    def tail(self, parent_key: bytes, rest: Seq[int]) -> tuple[bytes, int] | None:
        """The tail under the page ``parent_key`` sharing the most leading tokens with ``rest``:
        ``(its key, how many)``; None when none shares any."""
        best, best_n = None, 0
        for key, seg in self.tails.get(parent_key, {}).items():
            if seg.state in (PENDING, WRITTEN):
                n = common_prefix(tuple(seg.tokens), rest)
                if n > best_n:
                    best, best_n = key, n
        return None if best is None else (best, best_n)

    def fetch_tail(self, key: bytes, kv) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """The K and V (``[L, len(tokens), H, D]`` each) and tokens of the tail ``key``, checked;
        None when it cannot deliver it (a file that cannot be used is forgotten, logged)."""
        held = self.pages.get(key)
        if held is None or not held[0].tail or held[0].reading:
            return None
        seg = held[0]
        t0 = time.perf_counter()
        data = self._data(seg, kv)
        if data is None:
            self._forget(seg)
            return None
        if seg.name in self.segments:
            self.segments.move_to_end(seg.name)
        self.stats["read_pages"] += 1
        self.stats["read_tails"] += 1
        self.stats["read_seconds"] += time.perf_counter() - t0
        return data[0][:, 0], data[1][:, 0], seg.tokens

    def _data(self, seg: Segment, kv) -> tuple[torch.Tensor, torch.Tensor] | None:
        k, v = seg.k, seg.v  # (the I/O thread marks it written before it lets these go)
        if k is not None and v is not None:
            self.stats["read_from_memory"] += 1
            return k, v
        if seg.state != WRITTEN or seg.reading:
            return None  # (a prefetch still reading: the caller computes instead of waiting)
        got: tuple | str
        if seg.loaded is not None:
            got = seg.loaded
            self._drop_loaded(seg)
        elif seg.load_error is not None:
            got, seg.load_error = seg.load_error, None
            self._drop_loaded(seg)
        else:
            got = read_segment(self.dir / seg.name, seg, self.identity, kv_layout(kv))
        if isinstance(got, str):
            self.stats["faults"] += 1
            log.warning("KV tier: %s not used: %s; those pages are recomputed", self.dir / seg.name, got)
            return None
        self.stats["read_segments"] += 1
        return got

    # ------------------------------------------------------------------ the I/O thread
    def _put(self, item) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="opencoti-kv-tier", daemon=True)
            self._thread.start()
        self._q.put(item)

    def flush(self) -> None:
        """Wait until every write asked for so far is done (tests, benchmarks, shutdown)."""
        if self._thread is not None:
            done = threading.Event()
            self._q.put(("flush", done))
            done.wait()

    def close(self) -> None:
        """Stop the I/O threads; writes still queued are not done (the files are emptied at the next
        start anyway)."""
        for seg in self.segments.values():
            if seg.state == PENDING:
                seg.state = DROPPED
        self.wake = None
        for _ in self._readers:
            self._rq.put(None)
        for t in self._readers:
            t.join()
        self._readers = []
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, seg = item
            if kind == "flush":
                seg.set()
                continue
            path = self.dir / seg.name
            if kind == "drop":
                try:
                    path.unlink(missing_ok=True)
                except OSError as e:
                    log.warning("KV tier: cannot remove %s: %s", path, e)
                continue
            t0 = time.perf_counter()
            try:
                if seg.state == PENDING and seg.k is not None:
                    if write_segment(path, seg, self.identity, self.pacer):
                        self.stats["direct_writes"] += 1  # (O_DIRECT: the filesystem took it)
                    if seg.state == PENDING:
                        seg.state = WRITTEN
            except OSError as e:
                if seg.state == PENDING:
                    seg.state = FAILED
                    with self._lock:
                        self._failed.append(seg)
                self.stats["write_errors"] += 1
                self._warn("write", "KV tier: writing %s failed (%s); those pages are recomputed if needed again",
                           path, e)
                try:
                    path.with_name(path.name + ".tmp").unlink(missing_ok=True)
                except OSError:
                    pass
            finally:
                seg.k = seg.v = None
                for buf in seg.bufs or ():
                    self.staging.give(buf)  # (used again once no reader's view of it is alive)
                seg.bufs = None
                with self._lock:
                    self._pending_bytes -= seg.nbytes
                self.stats["write_seconds"] += time.perf_counter() - t0

    def _warn(self, what: str, msg: str, *args) -> None:
        """Log a warning at most every 10 s per kind (a full disk fails every write)."""
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:
            self._warned[what] = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

