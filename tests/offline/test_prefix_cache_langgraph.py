"""LangGraph continuity without configuration: OpencotiChatModel with its default settings (no pool,
no session id) inside a graph reuses the previous turns of a thread through the automatic prefix
cache, and concurrent calls of one thread never collide on a session.

The model runs on the tiny engine whose tokenizer spells answers with other ids than the model
generated (merge_tokenizer.py), as a BPE tokenizer does: the reuse must hold anyway."""

from __future__ import annotations

import asyncio

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from merge_tokenizer import AB_ONLY, make_merge_engine  # noqa: F401 - the fixture
from opencoti.langgraph import OpencotiChatModel

SYSTEM = "You answer with the letters a and b only."


def default_model(eng) -> OpencotiChatModel:
    """Default PolyKV settings; greedy, short answers of a's and b's."""
    return OpencotiChatModel(engine=eng, temperature=0, max_tokens=9, model_kwargs={"logit_bias": AB_ONLY})


def cache_read(msg: AIMessage) -> int:
    return msg.usage_metadata["input_token_details"]["cache_read"]


def test_a_thread_reuses_its_previous_turns(make_merge_engine):
    eng = make_merge_engine(page_size=4)
    model = default_model(eng)

    def agent(state: MessagesState):
        return {"messages": [model.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    graph = g.compile(checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": "t-1"}}
    other = {"configurable": {"thread_id": "t-2"}}
    prev = None
    for i, q in enumerate(["first question", "second one", "and a third"]):
        new = [SystemMessage(SYSTEM), HumanMessage(q)] if i == 0 else [HumanMessage(q)]
        ai = graph.invoke({"messages": new}, thread)["messages"][-1]
        assert isinstance(ai, AIMessage) and set(ai.content) <= {"a", "b"}
        assert ai.response_metadata["cached_prefix_tokens"] == cache_read(ai)
        u = ai.usage_metadata
        if prev is None:
            assert cache_read(ai) == 0
        else:  # everything the last turn computed: its prompt and its answer (but the answer's last token)
            assert cache_read(ai) == prev["input_tokens"] + prev["output_tokens"] - 1
        prev = u
    # another thread with the same system prompt shares only that prefix
    ai = graph.invoke({"messages": [SystemMessage(SYSTEM), HumanMessage("a new thread")]}, other)["messages"][-1]
    assert 0 < cache_read(ai) < prev["input_tokens"]


async def test_concurrent_calls_in_one_thread(make_merge_engine):
    eng = make_merge_engine(page_size=4)
    model = default_model(eng)

    def branch(name: str):
        async def node(state: MessagesState):
            return {"messages": [await model.ainvoke([*state["messages"], HumanMessage(f"{name}, go")])]}
        return node

    g = StateGraph(MessagesState)
    for name in ("left", "right"):
        g.add_node(name, branch(name))
        g.add_edge(START, name)
        g.add_edge(name, END)
    graph = g.compile(checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": "fan"}}
    out = await graph.ainvoke({"messages": [SystemMessage(SYSTEM), HumanMessage("two views please")]}, thread)
    first = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(first) == 2
    out = await graph.ainvoke({"messages": [HumanMessage("and now?")]}, thread)
    second = [m for m in out["messages"] if isinstance(m, AIMessage)][2:]
    assert len(second) == 2
    # both branches reuse the thread's history up to where their prompts part (the first answer)
    assert all(cache_read(m) > 0 for m in second)
    assert all(m.response_metadata["cached_prefix_tokens"] == cache_read(m) for m in first + second)
    # the same model called concurrently, many times, in one thread: no session is ever busy
    results = await asyncio.gather(*(model.ainvoke([SystemMessage(SYSTEM), HumanMessage(f"q{i}")])
                                     for i in range(6)))
    assert all(isinstance(r, AIMessage) and r.content for r in results)
    assert all(r.response_metadata["cached_prefix_tokens"] == cache_read(r) for r in results)
