"""PolyKVMiddleware with create_agent on the tiny model: the prompt pool, a session per thread whose
second turn reuses the first turn's KV, the pool re-created after an engine restart; sync and async."""

from __future__ import annotations

import asyncio

import pytest
from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from starlette.testclient import TestClient

from opencoti.langgraph import OpencotiChatModel
from opencoti.langgraph.agent import PolyKVMiddleware
from opencoti.server import create_app

SYSTEM = "Be brief."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def agent_for(model, checkpointer, **kw):
    return create_agent(model, tools=[add], system_prompt=SYSTEM, middleware=[PolyKVMiddleware(**kw)],
                        checkpointer=checkpointer)


def cache_read(msg) -> int:
    return msg.usage_metadata["input_token_details"]["cache_read"]


@pytest.fixture(params=["engine", "http"])
def model(request, engine):
    if request.param == "engine":
        yield OpencotiChatModel(engine=engine, temperature=0, max_tokens=3)
    else:
        with TestClient(create_app(engine), raise_server_exceptions=False) as tc:
            yield OpencotiChatModel(base_url="http://testserver", http_client=tc, temperature=0, max_tokens=3)


def test_second_turn_reuses_the_first(model):
    agent = agent_for(model, InMemorySaver())
    cfg = {"configurable": {"thread_id": "t1"}}
    out1 = agent.invoke({"messages": [{"role": "user", "content": "hello there"}]}, cfg)
    first = out1["messages"][-1]
    pool = model.polykv_client.pool(out1["root_pool_id"])
    assert out1["session_id"] == "thread-t1" and first.response_metadata["session_id"] == "thread-t1"
    assert pool.label == "agent prompt" and cache_read(first) == pool.prefix_len  # the prompt pool
    out2 = agent.invoke({"messages": [{"role": "user", "content": "and again"}]}, cfg)
    second = out2["messages"][-1]
    # turn 2 reads the whole of turn 1 (prompt + answer) from the session's KV, beyond the pool
    assert cache_read(second) >= first.usage_metadata["input_tokens"] > pool.prefix_len
    assert out2["root_pool_id"] == out1["root_pool_id"]
    # another thread shares the prompt pool, in its own session
    out3 = agent.invoke({"messages": [{"role": "user", "content": "hi"}]}, {"configurable": {"thread_id": "t2"}})
    assert out3["root_pool_id"] == out1["root_pool_id"] and out3["session_id"] == "thread-t2"
    assert cache_read(out3["messages"][-1]) == pool.prefix_len


def test_no_session_mode_and_async(engine):
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=3)
    agent = agent_for(model, InMemorySaver(), session=None)
    cfg = {"configurable": {"thread_id": "t3"}}

    async def run():
        return await agent.ainvoke({"messages": [{"role": "user", "content": "hello"}]}, cfg)

    out = asyncio.run(run())
    msg = out["messages"][-1]
    pool = model.polykv_client.pool(out["root_pool_id"])
    assert not any(s["session_id"] == "thread-t3" for s in pool.sessions)
    assert cache_read(msg) >= pool.prefix_len  # the prompt came from the pool
    with pytest.raises(ValueError, match="session must be"):
        PolyKVMiddleware(session="always")


def test_prompt_pool_recreated_after_a_restart(make_engine):
    saver = InMemorySaver()
    cfg = {"configurable": {"thread_id": "t4"}}
    old = make_engine()
    agent_for(OpencotiChatModel(engine=old, temperature=0, max_tokens=3), saver).invoke(
        {"messages": [{"role": "user", "content": "hello"}]}, cfg)
    old.shutdown()
    new = make_engine()
    model = OpencotiChatModel(engine=new, temperature=0, max_tokens=3)
    model.polykv_client.create_pool(text="an unrelated pool " * 4)  # ids move on
    out = agent_for(model, saver).invoke({"messages": [{"role": "user", "content": "again"}]}, cfg)
    assert out["pools_recreated"] and out["pools_recreated"][-1]["label"] == "agent prompt"
    pool = model.polykv_client.pool(out["root_pool_id"])
    assert pool.label == "agent prompt" and cache_read(out["messages"][-1]) >= pool.prefix_len
