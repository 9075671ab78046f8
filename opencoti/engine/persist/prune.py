"""``opencoti state prune``: remove pools that nobody released from a state directory.

Pools live in the state directory until they are released; agents that end without releasing
theirs leave them there, run after run. ``prune`` removes every pool that is **unpinned**, was
created more than ``older_than_s`` ago, and has no stored session and no remaining child pool
(leaves first, so a chain of such pools goes whole), with its KV file. Ids are never handed out
again (the high-water mark stays). It opens the directory like a server does, so it refuses a
directory that a running server holds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .files import KV_DIR
from .store import StateStore

log = logging.getLogger("opencoti.engine.persist")


def prune(state_dir: str | Path, *, older_than_s: float, dry_run: bool = False) -> dict:
    """Remove the stale pools of ``state_dir`` (see the module docstring); returns what was (or,
    with ``dry_run``, would be) removed and what stays."""
    if older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s!r}")
    store = StateStore(state_dir)  # locked: refused while a server uses the directory
    try:
        snap = store.load()
        now = time.time()
        used = {s.pool_id for s in snap.sessions if s.pool_id is not None}
        children: dict[int, set[int]] = {p.pool_id: set() for p in snap.pools}
        for p in snap.pools:
            if p.parent in children:
                children[p.parent].add(p.pool_id)
        removed: list[int] = []
        for p in sorted(snap.pools, key=lambda r: -r.pool_id):  # a child's id is above its parent's
            if p.pinned or p.pool_id in used or children[p.pool_id] or now - p.created < older_than_s:
                continue
            removed.append(p.pool_id)
            if p.parent in children:
                children[p.parent].discard(p.pool_id)
        if removed and not dry_run:
            with store.transaction():
                for pid in removed:
                    store.delete_pool(pid)
            for pid in removed:
                path = store.dir / KV_DIR / f"{pid}.kv"
                if path.exists():
                    log.info("state: removing %s/%s: pool %d was pruned (unpinned, unused, created more than %g s "
                             "ago)", KV_DIR, path.name, pid, older_than_s)
                path.unlink(missing_ok=True)
        return {"state_dir": str(store.dir), "dry_run": dry_run, "pools_removed": sorted(removed),
                "pools_kept": sorted(set(children) - set(removed)), "sessions": len(snap.sessions)}
    finally:
        store.close()


def add_arguments(p) -> None:
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="the state directory (default: the one `opencoti serve --port PORT` uses)")
    p.add_argument("--port", type=int, default=8080, help="with no --state-dir: the server's port (default 8080)")
    p.add_argument("--older-than", type=float, default=24.0, metavar="HOURS",
                   help="remove only pools created more than HOURS ago (default 24; 0: every stale pool)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def run(args) -> int:
    import json
    import sys

    from .store import StateDirError, resolve_state_dir

    state_dir = resolve_state_dir(args.state_dir, args.port)
    if state_dir is None or not Path(state_dir).is_dir():
        print(f"no state directory {state_dir or '(none)'}", file=sys.stderr)
        return 2
    try:
        out = prune(state_dir, older_than_s=args.older_than * 3600.0, dry_run=args.dry_run)
    except (StateDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0
