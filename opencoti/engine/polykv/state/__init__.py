"""``PolyKV`` (``polykv.py``), the one owner of the pool tree and the sessions, split by concern:
the state and its primitive changes (``base.py``), the tree (``tree.py``), timers (``timers.py``),
the memory policy (``reclaim.py``), materialization and restore (``restore.py``)."""

from .polykv import PolyKV
from .tree import PoolTree

__all__ = ["PolyKV", "PoolTree"]
