"""``PoolTree``: the pools of one engine, their ids and budget, and the tree's links.

Part of ``PolyKV`` (the one writer of the pool tree): the pools live in ``pools`` (live) and
``released`` (released, their KV still read by sessions), and only the methods here and
``PolyKV``'s add, link or remove one. Readers see it as ``view.TreeView`` (no mutators).
"""

from __future__ import annotations

from ...requests import SeqState
from ...errors import CapacityError, PoolNotFoundError
from ...kv.pool import Pool, Residency, prefix_hashes


class PoolTree:
    """Id allocation, the pool budget and tree links."""

    def __init__(self, max_pools: int, id_base: int = 0):
        self.max_pools = max_pools
        self.pools: dict[int, Pool] = {}  # live pools (not RELEASED)
        self.released: dict[int, Pool] = {}  # released, KV still referenced by sessions
        self._next_id = id_base + 1  # ids are id_base+1, id_base+2, ... (a cluster gives each engine its own range)

    @property
    def num_used(self) -> int:
        return len(self.pools)

    @property
    def next_id(self) -> int:
        """The id the next pool gets."""
        return self._next_id

    def skip_ids(self, next_id: int) -> None:
        """Ids below ``next_id`` are spent (restored, or used before a restart); never moves back."""
        self._next_id = max(self._next_id, int(next_id))

    def get(self, pool_id: int) -> Pool:
        pool = self.pools.get(pool_id) if isinstance(pool_id, int) and not isinstance(pool_id, bool) else None
        if pool is None:
            raise PoolNotFoundError(f"pool {pool_id!r} not found")
        return pool

    def find(self, pool_id: int | None) -> Pool | None:
        """The pool ``pool_id``, live or released (None: no such pool)."""
        if pool_id is None:
            return None
        return self.pools.get(pool_id) or self.released.get(pool_id)

    def check_budget(self) -> None:
        if len(self.pools) >= self.max_pools:
            raise CapacityError(
                f"pool budget exhausted: {len(self.pools)}/{self.max_pools} pools in use; "
                "release a pool or start the engine with a larger max_pools")

    def add(self, parent: Pool | None, branch_pos: int, tokens: list[int], label: str = "") -> Pool:
        """A new pool (materializing) under ``parent``, with the next id."""
        self.check_budget()
        pool = Pool(pool_id=self._next_id, parent=parent, branch_pos=branch_pos,
                    seq=SeqState(tokens), hashes=prefix_hashes(tokens), label=label)
        self._next_id += 1
        self._link(pool)
        return pool

    def restore(self, pool: Pool) -> None:
        """A saved pool (its id given) back in the tree."""
        self._link(pool)

    def _link(self, pool: Pool) -> None:
        self.pools[pool.pool_id] = pool
        if pool.parent is not None:
            pool.parent.children.append(pool)

    def unlink(self, pool: Pool) -> None:
        """``pool`` leaves the live tree: released, its KV lives on while sessions read it."""
        self.pools.pop(pool.pool_id, None)
        pool.residency = Residency.RELEASED
        self.released[pool.pool_id] = pool

    def forget(self, pool: Pool) -> bool:
        """A released pool nothing reads goes; True when its parent has no child or session left."""
        self.released.pop(pool.pool_id, None)
        parent = pool.parent
        if parent is not None and pool in parent.children:
            parent.children.remove(pool)
            return not parent.children and not parent.sessions
        return False

    def depth(self) -> int:
        return max((p.depth() for p in self.pools.values()), default=0)
