"""Pools that outlive their pools (ensure_pool re-creates them from state["pools"] after an engine
restart, in nodes and tools), keep_latest reset with Overwrite, nodes and tools with sync and
async clients in sync and async graphs, and SpawnPacer without a floor."""

from __future__ import annotations

import asyncio
import operator
import time
from typing import Annotated

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Overwrite, Send

from opencoti.client import AsyncPolyKVClient, PolyKVClient, PoolNotFoundError
from opencoti.langgraph import (CapacityGateNode, CompactionNode, OpencotiChatModel, PolyKVMessagesState, PolyKVState,
                                SpawnPacer, aensure_pool, ensure_pool, merge_pools, polykv_tools, track_pool)

SYSTEM = [{"role": "system", "content": "You are a terse assistant."}]


def tracked_tree(client: PolyKVClient) -> dict:
    """root (system) -> child (system + brief), recorded in a state."""
    root = client.create_pool(messages=SYSTEM, pinned=True, label="system")
    brief = [*SYSTEM, {"role": "user", "content": "Task brief: be precise."}]
    child = client.fork_pool(root.pool_id, messages=brief, label="brief")
    state = {"root_pool_id": root.pool_id, "pool_id": child.pool_id}
    state["pools"] = {**track_pool(root, messages=SYSTEM)["pools"], **track_pool(child, messages=brief)["pools"]}
    return state


def test_ensure_pool_recreates_after_a_restart(make_engine):
    first = PolyKVClient(engine=make_engine())
    state = tracked_tree(first)
    live, update = ensure_pool(first, state)
    assert live == state["pool_id"] and update == {}  # there: one pool() call, nothing moves
    first.engine.shutdown()

    engine = make_engine()  # "the engine restarted"
    client = PolyKVClient(engine=engine)
    other = client.create_pool(text="another thread's pool takes id 1 " * 3)  # the old ids now name other pools
    assert other.pool_id == state["root_pool_id"]
    live, update = ensure_pool(client, state)
    root_new = update["root_pool_id"]
    assert live == update["pool_id"] != state["pool_id"] and root_new not in (state["root_pool_id"], other.pool_id)
    got = client.pool(live)
    assert got.parent == root_new and got.label == "brief" and client.pool(root_new).pinned
    assert got.prefix_len == state["pools"][str(state["pool_id"])]["prefix_len"]
    assert [(r["old_pool_id"], r["pool_id"]) for r in update["pools_recreated"]] == [
        (state["root_pool_id"], root_new), (state["pool_id"], live)]
    # the record moved with them (old ids removed, parent re-pointed; new ids may be old ones reused)
    record = merge_pools(state["pools"], update["pools"])
    assert set(record) == {str(root_new), str(live)} and record[str(live)]["parent"] == root_new
    assert record[str(root_new)]["label"] == "system" and record[str(live)]["pool_id"] == live
    # asked again with the old state (e.g. by a parallel branch): re-created once, not twice
    n_pools = len(client.pools().pools)
    assert ensure_pool(client, state)[0] == live and len(client.pools().pools) == n_pools
    # the chat request attaches to the re-created pool as it did to the old one
    r = client.chat([*SYSTEM, {"role": "user", "content": "Task brief: be precise."},
                     {"role": "user", "content": "hi"}], pool_id=live, max_tokens=2)
    assert r.info.cached_prefix_tokens == got.prefix_len


def test_ensure_pool_untracked_and_unrecreatable(engine):
    client = PolyKVClient(engine=engine)
    with pytest.raises(PoolNotFoundError, match="does not record"):
        ensure_pool(client, {"pool_id": 77})
    snap = {"pool_id": 78, "pools": {"78": {"pool_id": 78, "parent": None, "prefix_len": 5, "label": "",
                                            "from_session": "s1"}}}
    with pytest.raises(PoolNotFoundError, match="snapshot of session"):
        ensure_pool(client, snap)
    with pytest.raises(ValueError, match="no pool"):
        ensure_pool(client, {})
    with pytest.raises(TypeError, match="aensure_pool"):
        ensure_pool(AsyncPolyKVClient(engine=engine), {"pool_id": 1})


def test_keep_latest_resets_with_overwrite():
    g = StateGraph(PolyKVState)
    g.add_node("a", lambda s: {"pool_id": None, "session_id": "x"})  # None never erases
    g.add_node("b", lambda s: {"pool_id": Overwrite(None)})  # ... Overwrite does
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", END)
    app = g.compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    assert app.invoke({"pool_id": 3}, cfg, interrupt_after=["a"])["pool_id"] == 3
    out = app.invoke(None, cfg)
    assert out.get("pool_id") is None and out["session_id"] == "x"


class GateState(PolyKVState, total=False):
    route: str


def gate_graph(gate, checkpointer=None):
    g = StateGraph(GateState)
    g.add_node("gate", gate)
    g.add_node("spawn", lambda s: {"route": "spawn"})
    g.add_node("hold", lambda s: {"route": "hold"})
    g.add_edge(START, "gate")
    g.add_edge("spawn", END)
    g.add_edge("hold", END)
    return g.compile(checkpointer=checkpointer)


def test_gate_and_tools_recreate_a_checkpointed_pool(make_engine):
    """A thread checkpointed with a pool is resumed after a restart, in another graph."""
    old = PolyKVClient(engine=make_engine())
    state = tracked_tree(old)
    saver = InMemorySaver()
    cfg = {"configurable": {"thread_id": "t1"}}
    gate_graph(CapacityGateNode(old, spawn="spawn", hold="hold"), saver).invoke(state, cfg)
    old.engine.shutdown()

    engine = make_engine()
    client = PolyKVClient(engine=engine)
    client.create_pool(text="someone else's pool " * 4)  # ids move on
    out = gate_graph(CapacityGateNode(client, spawn="spawn", hold="hold"), saver).invoke({"route": "again"}, cfg)
    assert out["route"] == "spawn" and out["pool_id"] != state["pool_id"]
    assert client.pool(out["pool_id"]).label == "brief" and len(out["pools_recreated"]) == 2

    # a tool run by a ToolNode re-creates a pool the model names by its old id, records what it makes
    fresh = make_engine()
    tools = polykv_tools(fresh)
    g = StateGraph(PolyKVMessagesState)
    g.add_node("tools", ToolNode(tools))
    g.add_edge(START, "tools")
    msgs = [AIMessage("", tool_calls=[{"name": "fork_pool", "id": "c1", "args": {
        "parent_pool_id": state["root_pool_id"], "label": "sub",
        "messages": [*SYSTEM, {"role": "user", "content": "Sub-task: list three colours."}]}}])]
    res = g.compile().invoke({"messages": msgs, "pools": state["pools"], "root_pool_id": state["root_pool_id"]})
    answer = res["messages"][-1].content
    assert '"recreated"' in answer and res["pools_recreated"][0]["old_pool_id"] == state["root_pool_id"]
    root_new = res["root_pool_id"]
    sub = [s for s in res["pools"].values() if s["label"] == "sub"]
    assert len(sub) == 1 and sub[0]["parent"] == root_new and PolyKVClient(engine=fresh).pool(sub[0]["pool_id"])


def test_compaction_recreates_its_ancestor_and_records_the_new_pool(make_engine):
    old = PolyKVClient(engine=make_engine())
    state = tracked_tree(old)
    old.engine.shutdown()
    engine = make_engine()
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=4)
    model.polykv_client.create_pool(text="someone else's pool " * 4)  # ids move on
    convo = [SystemMessage(SYSTEM[0]["content"]), HumanMessage("one"), AIMessage("two"), HumanMessage("three"),
             AIMessage("four"), HumanMessage("five")]
    out = CompactionNode(model, keep_last=2)({**state, "messages": convo, "compact_now": True})
    new = out["pool_id"]
    root = out["root_pool_id"]
    assert root != state["root_pool_id"] and model.polykv_client.pool(new).parent == root
    assert out["pools"][str(new)]["parent"] == root and out["pools"][str(new)]["messages"][0] == SYSTEM[0]
    assert out["pools_recreated"][0]["old_pool_id"] == state["root_pool_id"]


# ============================================================================ async
def test_nodes_and_tools_with_an_async_client_in_sync_and_async_graphs(engine):
    aio = AsyncPolyKVClient(engine=engine)
    sync = PolyKVClient(engine=engine)
    pool = sync.create_pool(messages=SYSTEM)
    for client in (aio, sync):
        gate = CapacityGateNode(client, spawn="spawn", hold="hold")
        app = gate_graph(gate)
        assert app.invoke({"pool_id": pool.pool_id})["route"] == "spawn"
        assert asyncio.run(app.ainvoke({"pool_id": pool.pool_id}))["route"] == "spawn"
        tools = {t.name: t for t in polykv_tools(client)}
        assert tools["capacity"].invoke({"pool_id": pool.pool_id})["can_admit"]
        assert asyncio.run(tools["capacity"].ainvoke({"pool_id": pool.pool_id}))["can_admit"]
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=3)
    convo = [SystemMessage(SYSTEM[0]["content"]), HumanMessage("a"), AIMessage("b"), HumanMessage("c"),
             AIMessage("d"), HumanMessage("e")]
    state = {"messages": convo, "root_pool_id": pool.pool_id, "compact_now": True}
    node = CompactionNode(model, client=aio, keep_last=2)

    class ChatState(PolyKVMessagesState, total=False):
        compact_now: bool

    g = StateGraph(ChatState)
    g.add_node("compact", node)
    g.add_edge(START, "compact")
    app = g.compile()
    out_sync = app.invoke(state)
    out_async = asyncio.run(app.ainvoke(state))
    for out in (out_sync, out_async):
        assert out["messages"][1].content.startswith("Summary of the conversation so far:")
        assert sync.pool(out["pool_id"]).parent == pool.pool_id


def test_aensure_pool(make_engine):
    old = PolyKVClient(engine=make_engine())
    state = tracked_tree(old)
    old.engine.shutdown()
    aio = AsyncPolyKVClient(engine=make_engine())

    async def run():
        return await asyncio.gather(aensure_pool(aio, state), aensure_pool(aio, state))

    (a, ua), (b, ub) = asyncio.run(run())
    assert a == b  # two concurrent branches: one re-creation, reported by the branch that made it
    assert len(PolyKVClient(engine=aio.engine).pools().pools) == 2
    assert sorted(len(u.get("pools_recreated", [])) for u in (ua, ub)) == [0, 2]


# ============================================================================ pacing without a floor
class FanState(PolyKVState, total=False):
    tasks: list[str]
    started: Annotated[list, operator.add]


def test_pacer_does_not_serialize_a_pool_without_a_floor(engine):
    """Four gated workers on a pool with no tps floor all spawn at once (none waits for another's
    session to arrive or settle)."""
    client = PolyKVClient(engine=engine)
    pool = client.create_pool(messages=SYSTEM)
    pacer = SpawnPacer(claim_timeout_s=10)

    def work(state):
        time.sleep(0.3)  # a worker that holds its session a while
        return {"started": [time.monotonic()]}

    w = StateGraph(FanState)
    w.add_node("gate", CapacityGateNode(client, spawn="work", hold=END, on_hold="wait", pacer=pacer))
    w.add_node("work", work)
    w.add_edge(START, "gate")
    w.add_edge("work", END)
    g = StateGraph(FanState)
    g.add_node("worker", w.compile())
    g.add_conditional_edges(START, lambda s: [Send("worker", {"pool_id": s["pool_id"]}) for _ in s["tasks"]],
                            ["worker"])
    g.add_edge("worker", END)
    t0 = time.monotonic()
    out = g.compile().invoke({"tasks": [1, 2, 3, 4], "pool_id": pool.pool_id})
    assert len(out["started"]) == 4
    spawns = [e for e in pacer.log if e["decision"] == "spawn"]
    assert len(spawns) == 4 and not any(e["paced"] for e in spawns)
    assert not [e for e in pacer.log if e["decision"] == "wait"]
    assert max(out["started"]) - t0 < 0.3 * 4  # concurrent, not one after another
