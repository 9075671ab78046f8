"""Graph nodes that act on live PolyKV state (kept importable from here):

* ``CapacityGateNode`` / ``SpawnPacer`` (``gate``): spawn a sub-agent only while its pool has room,
  paced per pool on pools with a tps floor (docs/langgraph.md, "CapacityGateNode and spawn pacing").
* ``CompactionNode`` (``compaction``): compaction by re-fork (docs/polykv.md, "Compaction") as a
  node / pre-model hook.

Each runs natively in sync and async graphs, with a sync or an async client, and re-creates a
pool that is gone from ``state["pools"]`` (``opencoti.langgraph.pools.ensure_pool``).
"""

from .compaction import DEFAULT_SUMMARY_PROMPT, CompactionNode
from .gate import CapacityGateNode, HoldMode, SpawnPacer

__all__ = ["CapacityGateNode", "SpawnPacer", "HoldMode", "CompactionNode", "DEFAULT_SUMMARY_PROMPT"]
