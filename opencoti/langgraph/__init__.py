"""opencoti for LangGraph: a chat model, pool-control tools, capacity-gated spawning, compaction.

    from opencoti.langgraph import OpencotiChatModel, polykv_tools, CapacityGateNode, CompactionNode
    model = OpencotiChatModel(engine=engine)            # or base_url="http://127.0.0.1:8080"

The same graph runs against an in-process ``Engine`` or a remote ``opencoti serve``: only the
model's (or client's) construction changes. See docs/langgraph.md.
"""

from .chat_model import (OpencotiChatModel, convert_message_to_dict, convert_messages, format_tool_choice, model_from_env,
                         response_metadata, usage_metadata)
from .nodes import CapacityGateNode, CompactionNode, SpawnPacer
from .state import (PolyKVMessagesState, PolyKVState, append_list, capacity_update, keep_latest, keep_max, keep_min,
                    polykv_update)
from .tools import polykv_tools

__all__ = [
    "OpencotiChatModel", "model_from_env", "polykv_tools", "CapacityGateNode", "CompactionNode", "SpawnPacer",
    "PolyKVState", "PolyKVMessagesState", "polykv_update", "capacity_update",
    "keep_latest", "keep_min", "keep_max", "append_list",
    "convert_message_to_dict", "convert_messages", "format_tool_choice", "response_metadata", "usage_metadata",
]
