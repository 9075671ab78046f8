"""The demo graph's state types and small helpers shared by the scenario's parts."""

from __future__ import annotations

from typing import Annotated, Optional, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from ..engine.kv.pool import common_prefix_len
from ..langgraph import PolyKVMessagesState, append_list, keep_latest


class DemoState(TypedDict, total=False):
    root_pool_id: Annotated[Optional[int], keep_latest]
    task_pool_id: Annotated[Optional[int], keep_latest]
    brief: Annotated[Optional[str], keep_latest]
    results: Annotated[list, append_list]
    answer: Annotated[Optional[str], keep_latest]


MAX_GATHERED = 12  # reports quoted to the lead at the end (each ~25 tokens)


class AgentState(PolyKVMessagesState, total=False):
    agent: str
    role: str
    toolset: str
    max_tokens: int
    expected_tokens: Optional[int]
    turns: int
    compactions: int
    results: Annotated[list, append_list]


class GroupState(TypedDict, total=False):
    root_pool_id: Optional[int]
    branch_pool_id: Optional[int]
    results: Annotated[list, append_list]


class AgentOutput(TypedDict, total=False):
    results: Annotated[list, append_list]


class _Empty:
    ctx_used = None


_common_prefix = common_prefix_len  # the engine's own prefix comparison


def _message(d: dict) -> BaseMessage:
    return {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}[d["role"]](d["content"])


def _dicts(messages: list[BaseMessage]) -> list[dict]:
    from ..langgraph import convert_messages
    return [{"role": m["role"], "content": m["content"]} for m in convert_messages(messages)]
