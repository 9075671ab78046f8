"""Compaction of a long conversation by re-fork (docs/polykv.md, "Compaction").

A chat graph whose model calls attach to a working pool. Before each model call a
``CompactionNode`` checks the last answer's ``compaction_pressure``: past the threshold it
summarizes the old turns, forks the stable system pool with system + summary + recent tail,
moves the graph's ``pool_id`` there and releases the old working pool, and replaces the messages.

    input:  {"messages": [{"role": "user", "content": "..."}], "threshold": 0.5}
    (send more user messages on the same thread to continue; compaction kicks in as it grows)

The pools are recorded in the state (``track_pool``), so a thread resumed after the engine or the
server restarted re-creates them (``ensure_pool``; the compaction node does it for the root).
"""

import uuid
from typing import Optional

from langchain_core.messages import RemoveMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from opencoti.langgraph import (CompactionNode, PolyKVMessagesState, ensure_pool, model_from_env, polykv_update,
                                track_pool)

SYSTEM = "You are a friendly assistant. Keep answers short and remember what the user told you."

model = model_from_env(temperature=0, max_tokens=64)
client = model.polykv_client


class ChatState(PolyKVMessagesState, total=False):
    threshold: Optional[float]
    compact_now: Optional[bool]
    compactions: Optional[int]


def setup(state: ChatState) -> dict:
    update: dict = {}
    if state.get("root_pool_id") is None:
        system = [{"role": "system", "content": SYSTEM}]
        root = client.create_pool(messages=system, pinned=True, label="system")
        update.update(root_pool_id=root.pool_id, pool_id=root.pool_id, **track_pool(root, messages=system))
    if not state.get("session_id"):
        update["session_id"] = f"chat-{uuid.uuid4().hex[:8]}"
    msgs = state.get("messages") or []
    if not msgs or not isinstance(msgs[0], SystemMessage):  # the system prompt leads (it is the root pool)
        update["messages"] = [RemoveMessage(id=REMOVE_ALL_MESSAGES), SystemMessage(SYSTEM), *msgs]
    return update


def compact(state: ChatState) -> dict:
    node = CompactionNode(model, pressure_threshold=state.get("threshold") or 0.8, keep_last=2,
                          summary_max_tokens=96)
    out = node(state)
    if out:
        out["compactions"] = (state.get("compactions") or 0) + 1
    return out


def agent(state: ChatState) -> dict:
    pool_id, moved = ensure_pool(client, state)  # re-created if the engine restarted since the last turn
    answer = model.invoke(state["messages"], pool_id=pool_id, session_id=state.get("session_id"))
    return {**moved, "messages": [answer], **polykv_update(answer)}


builder = StateGraph(ChatState)
builder.add_node("setup", setup)
builder.add_node("compact", compact)
builder.add_node("agent", agent)
builder.add_edge(START, "setup")
builder.add_edge("setup", "compact")
builder.add_edge("compact", "agent")
builder.add_edge("agent", END)
graph = builder.compile()
