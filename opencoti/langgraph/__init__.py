"""opencoti for LangGraph: a chat model, pool-control tools, capacity-gated spawning, compaction,
pools that survive restarts, and middleware for ``create_agent``.

    from opencoti.langgraph import OpencotiChatModel, polykv_tools, CapacityGateNode, CompactionNode
    model = OpencotiChatModel(engine=engine)            # or base_url="http://127.0.0.1:8080"

The same graph runs against an in-process ``Engine`` or a remote ``opencoti serve``: only the
model's (or client's) construction changes. See docs/langgraph.md.
"""

from .chat_model import DEFAULT_MAX_TOKENS, OpencotiChatModel
from .convert import (convert_message_to_dict, convert_messages, format_tool_choice, response_metadata,
                      usage_metadata)
from .lazy import LazyEngine, model_from_env, shared_engine
from .nodes import CapacityGateNode, CompactionNode, SpawnPacer
from .resume import ainvoke_until_done, invoke_until_done, resume_command
from .pools import PoolSpec, aensure_pool, ensure_pool, merge_pools, pool_spec, track_pool
from .state import (PolyKVMessagesState, PolyKVState, append_list, capacity_update, keep_latest, keep_max, keep_min,
                    polykv_update)
from .tools import polykv_tools

__all__ = [
    "OpencotiChatModel", "DEFAULT_MAX_TOKENS", "model_from_env", "shared_engine", "LazyEngine",
    "polykv_tools", "CapacityGateNode", "CompactionNode", "SpawnPacer",
    "resume_command", "invoke_until_done", "ainvoke_until_done",
    "PolyKVState", "PolyKVMessagesState", "polykv_update", "capacity_update",
    "keep_latest", "keep_min", "keep_max", "append_list",
    "PoolSpec", "pool_spec", "track_pool", "ensure_pool", "aensure_pool", "merge_pools",
    "convert_message_to_dict", "convert_messages", "format_tool_choice", "response_metadata", "usage_metadata",
    "PolyKVMiddleware", "PolyKVAgentState",
]


def __getattr__(name: str):
    if name in ("PolyKVMiddleware", "PolyKVAgentState"):  # imports langchain.agents: only when asked for
        from . import agent
        return getattr(agent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
