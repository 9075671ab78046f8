"""Cluster-wide pool ids: each engine replica allocates ids in its own range.

A replica gets a *tag* (1, 2, 3, ... handed out once by the cluster registry; a restarted
replica gets a new one) and its engine numbers pools ``tag * 2**32 + 1, + 2, ...``. A pool id
therefore says which replica holds the pool, stays unique across the cluster, and stays below
2**53 (exact in JSON numbers everywhere). Clients treat ids as opaque integers.
"""

from __future__ import annotations

TAG_SHIFT = 32
MAX_TAG = 2 ** (53 - TAG_SHIFT) - 1  # ids stay exact in a JavaScript number


def id_base(tag: int) -> int:
    """``EngineConfig.pool_id_base`` for the replica with this tag."""
    if not (isinstance(tag, int) and 1 <= tag <= MAX_TAG):
        raise ValueError(f"replica tag must be in [1, {MAX_TAG}], got {tag!r}")
    return tag << TAG_SHIFT


def tag_of(pool_id) -> int | None:
    """The tag of the replica that allocated ``pool_id`` (None: not a cluster pool id)."""
    if isinstance(pool_id, bool):
        return None
    if isinstance(pool_id, str):
        try:
            pool_id = int(pool_id)
        except ValueError:
            return None
    if not isinstance(pool_id, int) or pool_id <= 0:
        return None
    tag = pool_id >> TAG_SHIFT
    return tag if 1 <= tag <= MAX_TAG and pool_id & (2 ** TAG_SHIFT - 1) else None
