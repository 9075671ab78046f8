"""The files of a state directory besides its database: where they live, the header every KV file
starts with, and the pool ids they name (``StateStore`` counts them into the id high-water mark,
so a lost database and mark file cannot make an id come back while a file still names it).

* ``kv/<pool_id>.kv``: a pinned pool's KV (``kvfile``); ``kv/<pool_id>.kv.tmp`` one half-written.
* ``session_kv/<hash>.kv``: a named session's KV (``session_kv``); its header holds the id of the
  pool the session was attached to when it was written (``pool_id``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

KV_DIR = "kv"
SESSION_KV_DIR = "session_kv"
MAGIC = b"OPENCOTI-KV1\n"
HEADER = 4096  # bytes: the magic line, the header's JSON line, zeros


def read_header(path: str | os.PathLike) -> dict | None:
    """The JSON header of a KV file (None: no file, or not a KV file)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER)
    except OSError:
        return None
    if not raw.startswith(MAGIC):
        return None
    try:
        head = json.loads(raw[len(MAGIC):].split(b"\n", 1)[0])
    except ValueError:
        return None
    return head if isinstance(head, dict) else None


def kv_file_pool_id(name: str) -> int | None:
    """The pool id of a file name in ``kv/`` (``<id>.kv``, or ``<id>.kv.tmp`` half-written), else None."""
    stem, _, ext = name.partition(".")
    return int(stem) if stem.isdigit() and ext in ("kv", "kv.tmp") else None


def pool_ids_in_files(directory: Path) -> dict[str, int]:
    """Every pool id a file of the state directory ``directory`` names: its path (relative to the
    directory) -> the id. Names in ``kv/``; the ``pool_id`` in the headers of ``session_kv/``."""
    out: dict[str, int] = {}
    kv = directory / KV_DIR
    if kv.is_dir():
        for f in kv.iterdir():
            pid = kv_file_pool_id(f.name)
            if pid is not None:
                out[f"{KV_DIR}/{f.name}"] = pid
    sessions = directory / SESSION_KV_DIR
    if sessions.is_dir():
        for f in sessions.iterdir():
            pid = (read_header(f) or {}).get("pool_id")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0:
                out[f"{SESSION_KV_DIR}/{f.name}"] = pid
    return out


def fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable (where the platform allows it)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
