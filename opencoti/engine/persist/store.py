"""StateStore: the engine's durable state in one SQLite database (WAL, one transaction per change).

What is kept: the pool tree (tokens, parent, branch position, label, pin, owner, admission
policy), named sessions (tokens, pool, owner) and the id high-water mark, so ids are never handed
out twice, across restarts too. KV is not kept here (see ``kvfile``). SQLite's atomic commit makes
the database consistent at any instant: a process killed mid-write (kill -9) leaves either the
whole transaction or none of it. ``synchronous=FULL`` makes every acknowledged change survive a
power loss too.

One process at a time: the directory is locked (``flock``) while a store is open.

The database is created whole (under a temporary name, then renamed), so a database that exists
but is empty (0 bytes) or holds no opencoti tables was damaged: it is an error, never a fresh
start, and nothing in the directory is touched. The id high-water mark is also kept in a file of
its own (``next_pool_id``, written before the database), so even a lost database cannot make ids
come back: a new one continues above the mark. At every open the mark is the highest of every
source: the database's mark and the ids in its tables, the mark file, and the pool ids the files
of the directory name (``files.pool_ids_in_files``: KV files, session KV files); it is written
back to the database and the mark file before anything else runs (before any file is removed).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from ..errors import OpencotiError
from .files import fsync_dir, pool_ids_in_files
from ..paths import cache_root

SCHEMA_VERSION = 1
DB_NAME = "state.sqlite3"
LOCK_NAME = "lock"
MARK_NAME = "next_pool_id"  # the id high-water mark, beside the database
_TABLES = {"meta", "pools", "sessions"}

log = logging.getLogger("opencoti.engine.persist")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pools (
    pool_id INTEGER PRIMARY KEY,
    parent INTEGER REFERENCES pools(pool_id),
    branch_pos INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    label TEXT NOT NULL DEFAULT '',
    pinned INTEGER NOT NULL DEFAULT 0,
    tenant TEXT,
    admission TEXT,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    tenant TEXT,
    pool_id INTEGER,
    tokens BLOB NOT NULL,
    updated REAL NOT NULL
);
"""


class StateDirError(OpencotiError):
    """The state directory cannot be used (locked by another process, another model, unreadable)."""

    status_code = 500
    error_type = "server_error"


def resolve_state_dir(value: str | None, port: int | None = None) -> str | None:
    """The state directory of ``opencoti serve``: ``value`` ("none" = keep nothing), else
    ``$OPENCOTI_STATE_DIR``, else ``state/port-<port>`` under the cache directory (each server its
    own; a server on a random port, ``--port 0``, keeps nothing by default)."""
    if value is None:
        value = os.environ.get("OPENCOTI_STATE_DIR") or None
    if value is not None:
        return None if value.strip().lower() in ("none", "") else str(Path(value).expanduser())
    if not port:
        return None
    return str(cache_root() / "state" / f"port-{int(port)}")


def encode_tokens(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def decode_tokens(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<u4").astype(np.int64).tolist()


@dataclass
class PoolRecord:
    pool_id: int
    parent: int | None
    branch_pos: int
    tokens: list[int]
    label: str = ""
    pinned: bool = False
    tenant: str | None = None
    admission: dict | None = None  # the policy fields set on the pool (None = defaults)
    created: float = field(default_factory=time.time)


@dataclass
class SessionRecord:
    session_id: str
    tokens: list[int]
    pool_id: int | None = None
    tenant: str | None = None


@dataclass
class Snapshot:
    pools: list[PoolRecord]  # ascending ids: every parent comes before its children
    sessions: list[SessionRecord]
    next_pool_id: int


class StateStore:
    """The SQLite file of one state directory. Not thread-safe: the engine's step thread owns it."""

    def __init__(self, directory: str | os.PathLike, *, identity: dict | None = None):
        self.dir = Path(directory).expanduser()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StateDirError(f"cannot create the state directory {self.dir}: {e}") from e
        self._lock_fd: int | None = self._lock()
        self.db: sqlite3.Connection | None = None
        try:
            self._mark = read_mark(self.dir)
            in_files = pool_ids_in_files(self.dir)
            path = self.dir / DB_NAME
            created = not path.exists()
            if created:
                self._create(path, in_files)
            elif path.stat().st_size == 0:
                raise StateDirError(f"the state database {path} exists but is empty (0 bytes): it was damaged. "
                                    "Starting from zero would hand out pool ids again; restore it from a backup, "
                                    "or move the state directory away to start afresh")
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._check_tables(path)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self._durable = True
            self.conn.execute("PRAGMA foreign_keys=ON")
            with self.transaction():
                for stmt in _SCHEMA.strip().split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
                self._check_meta(identity or {})
                self._raise_mark(in_files, created)
        except sqlite3.Error as e:
            self.close()
            raise StateDirError(f"cannot open the state database in {self.dir}: {e}; nothing in it was changed. "
                                "Restore it from a backup, or move the state directory away to start afresh") from e
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- open / close
    def _create(self, path: Path, in_files: dict[str, int]) -> None:
        """A new database, whole or not at all: built under a temporary name, then renamed."""
        if self._mark > 1 or in_files or (self.dir / "kv").is_dir():
            start = max(self._mark, max(in_files.values(), default=0) + 1)
            log.warning("state: %s has no database but %s: the database was lost; starting with no pools, pool "
                        "ids continue from %d (above every id the mark file and the files name)", self.dir,
                        _describe_sources(self._mark, in_files), start)
        tmp = path.with_name(path.name + ".new")
        tmp.unlink(missing_ok=True)
        db = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            db.execute("BEGIN")
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    db.execute(stmt)
            db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            db.execute("INSERT INTO meta VALUES ('next_pool_id', ?)", (str(self._mark),))
            db.execute("COMMIT")
        finally:
            db.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.dir)

    def _raise_mark(self, in_files: dict[str, int], created: bool) -> None:
        """Make the high-water mark (the database's and the mark file) the highest of every source:
        the database's mark, the ids in its tables, the mark file, the ids ``in_files`` (inside the
        open transaction)."""
        db = self.conn
        stored = int(db.execute("SELECT value FROM meta WHERE key = 'next_pool_id'").fetchone()[0])
        in_tables = max(db.execute("SELECT COALESCE(MAX(pool_id), 0) FROM pools").fetchone()[0],
                        db.execute("SELECT COALESCE(MAX(pool_id), 0) FROM sessions").fetchone()[0]) + 1
        top = max(stored, self._mark, in_tables, max(in_files.values(), default=0) + 1)
        if top > max(stored, self._mark) and not created:  # (a new database: _create said why already)
            where = "its tables" if in_tables == top else _describe_sources(0, in_files)
            log.warning("state: %s: %s name pool id %d, above the id marks (database %d, mark file %d): pool ids "
                        "continue from %d", self.dir, where, top - 1, stored, self._mark, top)
        if top > stored or top > self._mark:
            self.reserve_pool_ids(top)

    def _check_tables(self, path: Path) -> None:
        names = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        mark = self.conn.execute("SELECT value FROM meta WHERE key = 'next_pool_id'").fetchone() \
            if "meta" in names else None
        if not _TABLES <= names or mark is None:
            raise StateDirError(f"the state database {path} holds no opencoti state (tables "
                                f"{sorted(_TABLES - names) or 'meta.next_pool_id'} missing): it was damaged or is "
                                "not ours. Restore it from a backup, or move the state directory away to start afresh")

    def _lock(self) -> int:
        import fcntl

        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StateDirError(f"the state directory {self.dir} is in use by another process"
                                + (f" (pid {other})" if other else "")
                                + "; give each server its own --state-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _check_meta(self, identity: dict) -> None:
        meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        version = int(meta.get("schema_version", SCHEMA_VERSION))
        if version != SCHEMA_VERSION:
            raise StateDirError(f"the state directory {self.dir} has schema version {version}; this opencoti "
                                f"reads version {SCHEMA_VERSION}")
        stored = json.loads(meta["identity"]) if "identity" in meta else None
        if stored is not None and identity and stored != identity:
            raise StateDirError(
                f"the state directory {self.dir} holds pools of another model ({stored}, this engine is "
                f"{identity}); their tokens mean nothing to this model: use another --state-dir")
        self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        if identity:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('identity', ?)", (json.dumps(identity, sort_keys=True),))

    def close(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            try:
                db.close()
            finally:
                self.db = None
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)  # releases the flock
            self._lock_fd = None

    @property
    def conn(self) -> sqlite3.Connection:
        """The open database (as sqlite3 says of a closed one: ProgrammingError once closed)."""
        db = self.db
        if db is None:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        return db

    @property
    def closed(self) -> bool:
        return self.db is None

    def set_durable(self, durable: bool) -> None:
        """FULL: the next commits survive a power loss; NORMAL: a crash of the process only (WAL)."""
        if durable != self._durable:
            self.conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._durable = durable

    # ---------------------------------------------------------------- transactions
    class _Tx:
        def __init__(self, db: sqlite3.Connection):
            self.db = db

        def __enter__(self) -> "StateStore._Tx":
            self.db.execute("BEGIN IMMEDIATE")
            return self

        def __exit__(self, exc_type, exc, tb) -> Literal[False]:
            if exc_type is None:
                self.db.execute("COMMIT")
            else:
                self.db.execute("ROLLBACK")
            return False

    def transaction(self) -> "_Tx":
        """``with store.transaction(): ...``: all or nothing (BEGIN IMMEDIATE ... COMMIT)."""
        return StateStore._Tx(self.conn)

    # ---------------------------------------------------------------- reads
    def load(self) -> Snapshot:
        rows = self.conn.execute("SELECT pool_id, parent, branch_pos, tokens, label, pinned, tenant, admission, created "
                               "FROM pools ORDER BY pool_id").fetchall()
        pools = [PoolRecord(pool_id=r[0], parent=r[1], branch_pos=r[2], tokens=decode_tokens(r[3]), label=r[4],
                            pinned=bool(r[5]), tenant=r[6], admission=json.loads(r[7]) if r[7] else None,
                            created=r[8]) for r in rows]
        srows = self.conn.execute("SELECT session_id, tenant, pool_id, tokens FROM sessions ORDER BY session_id").fetchall()
        sessions = [SessionRecord(session_id=r[0], tenant=r[1], pool_id=r[2], tokens=decode_tokens(r[3]))
                    for r in srows]
        return Snapshot(pools=pools, sessions=sessions, next_pool_id=self.next_pool_id())

    def next_pool_id(self) -> int:
        """The id high-water mark: the database's, or the mark file's when that is higher."""
        db = int(self.conn.execute("SELECT value FROM meta WHERE key = 'next_pool_id'").fetchone()[0])
        return max(db, self._mark)

    # ---------------------------------------------------------------- writes (call inside a transaction)
    def reserve_pool_ids(self, next_id: int) -> None:
        """Ids below ``next_id`` are spent for good (the mark only moves up). The mark file is
        written first: a mark that gets ahead of the database only skips ids."""
        if next_id > self._mark:
            write_mark(self.dir, int(next_id))
            self._mark = int(next_id)
        self.conn.execute("UPDATE meta SET value = ? WHERE key = 'next_pool_id' AND CAST(value AS INTEGER) < ?",
                        (str(int(next_id)), int(next_id)))

    def put_pool(self, rec: PoolRecord) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO pools (pool_id, parent, branch_pos, tokens, label, pinned, tenant, admission, "
            "created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (rec.pool_id, rec.parent, rec.branch_pos, encode_tokens(rec.tokens), rec.label, int(rec.pinned),
             rec.tenant, json.dumps(rec.admission, sort_keys=True) if rec.admission else None, rec.created))
        self.reserve_pool_ids(rec.pool_id + 1)

    def update_pool(self, pool_id: int, *, pinned: bool, label: str, admission: dict | None) -> None:
        self.conn.execute("UPDATE pools SET pinned = ?, label = ?, admission = ? WHERE pool_id = ?",
                        (int(pinned), label, json.dumps(admission, sort_keys=True) if admission else None, pool_id))

    def delete_pool(self, pool_id: int) -> None:
        self.conn.execute("UPDATE sessions SET pool_id = NULL WHERE pool_id = ?", (pool_id,))
        self.conn.execute("DELETE FROM pools WHERE pool_id = ?", (pool_id,))

    def put_session(self, rec: SessionRecord) -> None:
        self.conn.execute("INSERT OR REPLACE INTO sessions (session_id, tenant, pool_id, tokens, updated) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (rec.session_id, rec.tenant, rec.pool_id, encode_tokens(rec.tokens), time.time()))

    def delete_session(self, session_id: str) -> None:
        self.conn.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))


def read_mark(directory: Path) -> int:
    """The id high-water mark of the mark file (1 when there is none)."""
    try:
        text = (directory / MARK_NAME).read_text().strip()
    except FileNotFoundError:
        return 1
    except OSError as e:
        raise StateDirError(f"cannot read the id mark {directory / MARK_NAME}: {e}") from None
    if not text.isdigit() or int(text) < 1:
        raise StateDirError(f"the id mark {directory / MARK_NAME} is damaged ({text[:40]!r}): restore it, or write "
                            "an id above every pool id ever handed out")
    return int(text)


def write_mark(directory: Path, next_id: int) -> None:
    """Write the mark file atomically and durably (temporary file, fsync, rename, fsync the directory)."""
    tmp = directory / (MARK_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{next_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MARK_NAME)
    fsync_dir(directory)


def _describe_sources(mark: int, in_files: dict[str, int], most: int = 4) -> str:
    """``an id mark (5) and files naming pool ids (kv/7.kv: 7, ...)`` for a log line (``mark`` 1: none)."""
    parts = [f"an id mark ({mark})"] if mark > 1 else []
    if in_files:
        named = sorted(in_files.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name}: {pid}" for name, pid in named[:most])
        parts.append(f"files naming pool ids ({shown}{', ...' if len(named) > most else ''})")
    return " and ".join(parts) or "a KV directory"
