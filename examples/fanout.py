"""Fan out sub-agents under a tps floor (docs/polykv.md, "Admission"; docs/langgraph.md, spawn pacing).

plan: a root pool holds the system prompt (one per process, shared by every run); a child pool
extends it with the task brief (nesting).
Each sub-task is sent (``Send``) to a worker subgraph whose first node is a ``CapacityGateNode``
sharing one ``SpawnPacer``: a worker starts only while the pool admits under its floor and never
while the pool is settling from the previous spawn. gather: the answers are collected, the task
pool released.

    input:  {"brief": "...", "subtasks": ["...", "..."], "floor_tps": 5.0}
    output: {"results": [{"subtask", "answer", "session_tps"}, ...], ...}

Run: ``langgraph dev --config examples/langgraph.json`` (``OPENCOTI_BASE_URL`` for a remote
``opencoti serve``, else an in-process engine on ``OPENCOTI_MODEL``).
"""

import operator
import threading
import uuid
from typing import Annotated, Optional, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from opencoti.langgraph import (CapacityGateNode, PolyKVState, SpawnPacer, ensure_pool, merge_pools,
                                model_from_env, track_pool)

SYSTEM = "You are a research sub-agent. Answer the sub-task in two sentences."

model = model_from_env(temperature=0, max_tokens=48)
client = model.polykv_client
pacer = SpawnPacer(claim_timeout_s=10)


class FanOutState(PolyKVState, total=False):
    brief: str
    subtasks: list[str]
    floor_tps: Optional[float]
    root_pool_id: Optional[int]
    results: Annotated[list, operator.add]


class WorkerState(PolyKVState, total=False):
    brief: str
    subtask: str
    results: Annotated[list, operator.add]


class WorkerOutput(TypedDict):
    results: Annotated[list, operator.add]


def brief_messages(brief: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task brief: {brief}"}]


_SYSTEM_POOL: dict = {}
_LOCK = threading.Lock()


def system_pool() -> dict:
    """The system prompt's pool, made once per process and shared by every run (re-created if the
    engine restarted)."""
    with _LOCK:
        if not _SYSTEM_POOL:
            system = brief_messages("")[:1]
            root = client.create_pool(messages=system, pinned=True, label="system")
            _SYSTEM_POOL.update(root_pool_id=root.pool_id, **track_pool(root, messages=system))
        live, moved = ensure_pool(client, _SYSTEM_POOL, key="root_pool_id")
        _SYSTEM_POOL.update(root_pool_id=live, pools=merge_pools(_SYSTEM_POOL["pools"], moved.get("pools")))
        return dict(_SYSTEM_POOL)


def plan(state: FanOutState) -> dict:
    root = system_pool()
    task = client.fork_pool(root["root_pool_id"], messages=brief_messages(state.get("brief", "")), label="brief")
    if state.get("floor_tps"):
        client.set_admission(task.pool_id, target_tps_per_session=float(state["floor_tps"]), mode="enforced",
                             on_saturation="queue")
    return {"root_pool_id": root["root_pool_id"], "pool_id": task.pool_id}


def fan_out(state: FanOutState) -> list[Send]:
    return [Send("worker", {"brief": state.get("brief", ""), "subtask": s, "pool_id": state["pool_id"]})
            for s in state.get("subtasks") or []]


def work(state: WorkerState) -> dict:
    msgs = [SystemMessage(SYSTEM), HumanMessage(f"Task brief: {state['brief']}"),
            HumanMessage(f"Sub-task: {state['subtask']}")]
    sid = state.get("session_id") or f"sub-{uuid.uuid4().hex[:8]}"
    answer = model.invoke(msgs, pool_id=state["pool_id"], session_id=sid)
    client.release_session(sid)
    return {"results": [{"subtask": state["subtask"], "answer": answer.text,
                         "session_tps": answer.response_metadata.get("session_tps"),
                         "cached_prefix_tokens": answer.response_metadata.get("cached_prefix_tokens")}]}


def skipped(state: WorkerState) -> dict:
    return {"results": [{"subtask": state["subtask"], "answer": None, "skipped": state.get("reason")}]}


worker_builder = StateGraph(WorkerState, output_schema=WorkerOutput)
worker_builder.add_node("gate", CapacityGateNode(client, spawn="work", hold="skipped", on_hold="wait",
                                                 max_wait_s=120, pacer=pacer))
worker_builder.add_node("work", work)
worker_builder.add_node("skipped", skipped)
worker_builder.add_edge(START, "gate")
worker_builder.add_edge("work", END)
worker_builder.add_edge("skipped", END)
worker = worker_builder.compile()


def gather(state: FanOutState) -> dict:
    client.flush_pool(state["pool_id"])  # the run's task pool; the system pool stays for the next run
    client.release_pool(state["pool_id"])
    return {}


builder = StateGraph(FanOutState)
builder.add_node("plan", plan)
builder.add_node("worker", worker)
builder.add_node("gather", gather)
builder.add_edge(START, "plan")
builder.add_conditional_edges("plan", fan_out, ["worker"])
builder.add_edge("worker", "gather")
builder.add_edge("gather", END)
graph = builder.compile()
