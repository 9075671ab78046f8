"""Named sessions' KV on disk: a session's next turn after a restart reads its cache instead of
recomputing it.

After each request of a named session (a session id the client chose) the Persister hands the
session here: the KV of its computed tokens ``[0, num_cached)`` is copied (on the step thread) and
written in the background to ``<state_dir>/session_kv/<hash of the id>.kv`` (the pool KV files'
format: header with the tokens' digest, the engine identity and a checksum). A released session's
file is removed. The files together stay within a disk budget (``session_kv_budget_mib``): when a
write would exceed it, the least recently written files go first; a session larger than the whole
budget is not written.

At a restart the stored sessions come back idle (``Persister.restore``); here, most recently used
first and only into free KV pages, each one with a file whose tokens are a prefix of its stored
tokens (a crash between a turn and its file's write leaves the previous turn's file: still a
prefix) gets that KV back in pages of its own. Its next request then continues from its own cache,
as before the restart. A file of another model, weight format or KV dtype, or a corrupt one, is
not loaded (the session recomputes, as without a file) and is removed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from ..requests import Session
from . import kvfile

log = logging.getLogger("opencoti.engine.persist")

DEFAULT_BUDGET_MIB = 1024.0


def file_name(session_id: str) -> str:
    return hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest() + ".kv"


class SessionKv:
    """The session KV files of one state directory (step thread only; writes go to ``writer``)."""

    def __init__(self, directory: Path, core, writer: kvfile.KvWriter, identity: dict | None,
                 budget_bytes: int):
        self.dir = Path(directory)
        self.core = core
        self.writer = writer
        self.identity = identity
        self.budget = max(0, int(budget_bytes))
        self.files: dict[str, list] = {}  # file name -> [bytes, last written (monotonic), session id]
        self._written: dict[str, tuple] = {}  # session id -> key of the KV last written
        self.stats = {"written": 0, "evicted": 0, "skipped_over_budget": 0}
        if self.budget:
            self.dir.mkdir(exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def used_bytes(self) -> int:
        return sum(f[0] for f in self.files.values())

    def _path(self, name: str) -> Path:
        return self.dir / name

    # ------------------------------------------------------------------ writes
    def save(self, s: Session) -> None:
        """After a request of ``s`` (idle now): write its KV when it changed since the last write."""
        if not self.enabled or s.job is not None:
            return
        seq = s.seq
        n = seq.num_cached
        key = (n, id(seq), len(seq.tokens))
        if n <= 0 or self._written.get(s.session_id) == key:
            return
        kv = self.core.kv
        size = kvfile.HEADER + 2 * n * kv.num_layers * kv.num_kv_heads * kv.k_cache.shape[-1] * kv.k_cache.element_size()
        name = file_name(s.session_id)
        if size > self.budget:
            self.stats["skipped_over_budget"] += 1
            self.drop(s.session_id)
            return
        self.files.pop(name, None)
        self._make_room(size)
        k, v = kvfile.snapshot_kv(kv, seq.page_table, 0, n)
        # the header names the session's pool: its id counts into the high-water mark (files.py)
        self.writer.save(self._path(name), k, v, 0, seq.tokens[:n], self.identity,
                         extra=None if s.pool_id is None else {"pool_id": s.pool_id})
        self.files[name] = [size, time.monotonic(), s.session_id]
        self._written[s.session_id] = key
        self.stats["written"] += 1

    def _make_room(self, size: int) -> None:
        used = self.used_bytes
        for name, (nbytes, _, sid) in sorted(self.files.items(), key=lambda kv: kv[1][1]):
            if used + size <= self.budget:
                break
            log.debug("state: removing the session KV file of %r: the files are over their disk budget "
                      "(%.0f MiB), the least recently written go first", sid, self.budget / 2**20)
            self.writer.drop(self._path(name))
            del self.files[name]
            self._written.pop(sid, None)
            used -= nbytes
            self.stats["evicted"] += 1

    def drop(self, session_id: str) -> None:
        """The session ended (or no longer fits): its file goes."""
        self._written.pop(session_id, None)
        name = file_name(session_id)
        if self.files.pop(name, None) is not None or self._path(name).exists():
            self.writer.drop(self._path(name))

    # ------------------------------------------------------------------ restart
    def restore(self, sessions: list[Session]) -> int:
        """Load the files of the restored ``sessions`` (most recently used first, into free pages
        only); remove files no session has. Returns the number of sessions given their KV back."""
        if not self.dir.is_dir():
            return 0
        by_name = {file_name(s.session_id): s for s in sessions}
        for f in self.dir.iterdir():
            if f.suffix != ".kv" or f.name not in by_name:  # half-written, or its session is gone
                why = "half-written (the process stopped while writing it)" if f.suffix != ".kv" else \
                    "no stored session has it (the session was released, or the database was lost)"
                log.warning("state: removing the session KV file %s: %s", f.name, why)
                f.unlink(missing_ok=True)
                continue
            self.files[f.name] = [f.stat().st_size, f.stat().st_mtime - time.time() + time.monotonic(),
                                  by_name[f.name].session_id]
        if not self.enabled:
            if self.files:
                log.info("state: removing %d session KV files: session KV files are off (a budget of 0 MiB)",
                         len(self.files))
            for name in list(self.files):
                self._path(name).unlink(missing_ok=True)
            self.files.clear()
            return 0
        self._make_room(0)  # a smaller budget than last time
        loaded = 0
        for name, (_, _, sid) in sorted(self.files.items(), key=lambda kv: -kv[1][1]):
            s = by_name[name]
            if self._load(s, self._path(name)):
                loaded += 1
        return loaded

    def _load(self, s: Session, path: Path) -> bool:
        head = kvfile.read_header(path)
        n = head.get("end") if isinstance(head, dict) else None
        tokens = s.seq.tokens
        if not isinstance(n, int) or not 0 < n <= len(tokens) or \
                not kvfile.header_matches(head, 0, tokens[:n], self.identity):
            log.info("state: the KV file of session %r does not match it; the session recomputes", s.session_id)
            self.drop(s.session_id)
            return False
        core = self.core
        kv, tables = core.kv, core.tables
        seq = s.seq
        if seq.page_table or not tables.extend_free(seq, n):
            return False  # no free pages for it now: recomputed on its next turn, like a session without a file
        tables.keep_out_of_index(seq)  # its next request moves these pages into a sequence that indexes them
        if not kvfile.load_kv(path, kv, seq.page_table, 0, n, tokens[:n], identity=self.identity):
            tables.drop(seq)
            self.drop(s.session_id)
            return False
        tables.advance(seq, n)
        core.polykv.session_kv_loaded(s)
        self._written[s.session_id] = (n, id(seq), len(tokens))
        return True
