"""Pools: immutable prefix pools arranged in a tree (host-side state; no tensors here).

A pool owns the KV of its own range ``[D, L)`` and borrows ``[0, D)`` from its parent by page
refcount. Pools never change after materialization: "extending" is a fork at ``D = parent.L``,
a branch is a fork at ``D < parent.L``. The data type only: its fields are set by ``PolyKV``
(``polykv/state/``, with the tree itself, ``PoolTree``) and read by everyone else through
``polykv.view.PoolView``, on the engine's step thread.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from ..requests import SeqState


class Residency(str, enum.Enum):
    MATERIALIZING = "materializing"
    RESIDENT = "resident"
    EVICTED = "evicted"  # tokens kept, KV dropped; re-materialized on the next attach/fork
    RELEASED = "released"  # removed from the tree; KV lives on until attached sessions end


def prefix_hashes(tokens: Seq[int]) -> list[bytes]:
    """Cumulative hash per position: ``h[i]`` identifies ``tokens[:i+1]`` (validates any D in O(1))."""
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=8)
    for t in tokens:
        h.update(int(t).to_bytes(4, "little", signed=False))
        out.append(h.copy().digest())
    return out


def common_prefix_len(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in blocks first: prompts share long prefixes, so this is the hot path
    step = 64
    while i + step <= n and list(a[i:i + step]) == list(b[i:i + step]):
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Pool:
    pool_id: int
    parent: "Pool | None"
    branch_pos: int  # D
    seq: SeqState  # tokens [0, L); page table covering them while resident
    hashes: list[bytes]
    pinned: bool = False
    residency: Residency = Residency.MATERIALIZING
    children: list["Pool"] = field(default_factory=list)
    sessions: set = field(default_factory=set)  # session ids attached
    # when a request last used it, wall-clock (time.time(): what the pool reports as last_access_ts);
    # the engine's other times, a session's last_access among them, are time.monotonic()
    last_access_wall: float = field(default_factory=time.time)
    grace_until: float = 0.0  # monotonic deadline of the auto-pin grace TTL
    release_at: float | None = None  # a release deferred by the grace TTL takes effect then (monotonic)
    rematerializations: int = 0
    cache_hits: int = 0
    label: str = ""
    tenant: str | None = None  # the tenant that owns the pool (tenancy.py); None: no tenant's

    @property
    def prefix_len(self) -> int:
        return len(self.seq.tokens)

    @property
    def own_len(self) -> int:
        return self.prefix_len - self.branch_pos

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens

    def hash_at(self, n: int) -> bytes | None:
        """Hash identifying tokens[:n] (None for n == 0)."""
        return self.hashes[n - 1] if n > 0 else None

    @property
    def live_children(self) -> list["Pool"]:
        """Child pools that hold (or are computing) KV borrowed from this pool: all but evicted ones."""
        return [c for c in self.children if c.residency != Residency.EVICTED]

    def is_auto_pinned(self, now: float, sessions_in_use: bool) -> bool:
        """Interior pools stay resident while descendants use them, plus a grace TTL.

        ``sessions_in_use``: some attached session is busy or holds KV borrowed from this pool
        (an idle session whose KV was evicted keeps its place in the tree but pins nothing)."""
        return bool(self.live_children) or sessions_in_use or now < self.grace_until

    def depth(self) -> int:
        d, p = 1, self.parent
        while p is not None:
            d, p = d + 1, p.parent
        return d
