"""LangChain's own recovery paths on the bundled model, in-process, over HTTP and through
``ChatOpenAI`` against the server: ``SummarizationMiddleware`` catches the context overflow of a
summary prompt (a ``ContextOverflowError``) and summarizes a shorter history instead; a forced
tool choice yields one call with the schema's arguments and no markup in the content."""

from __future__ import annotations

import copy
import socket
import threading
import time

import pytest
import uvicorn
from langchain.agents import create_agent
from langchain.agents.middleware import SummarizationMiddleware
from langchain_core.exceptions import ContextOverflowError
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

pytestmark = pytest.mark.bundled

CTX = 640  # a small context, so that a history overflows it quickly
SUMMARY_PROMPT = "Summarize this conversation in one sentence.\n\n{messages}"


@pytest.fixture(scope="module")
def small_engine(bundled_model):
    from opencoti.engine import Engine, EngineConfig

    loaded = copy.copy(bundled_model)
    loaded.state_dict = dict(bundled_model.state_dict)
    eng = Engine(EngineConfig(page_size=16, kv_budget_tokens=4096, max_context=CTX, pool_grace_ttl_s=0.0,
                              weights="int4"), loaded=loaded)
    yield eng
    eng.check_integrity()
    eng.shutdown()


@pytest.fixture(scope="module")
def server(small_engine):
    from opencoti.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(small_engine), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(10)


@pytest.fixture(params=["in-process", "http", "ChatOpenAI"])
def model(request, small_engine, server):
    from opencoti.langgraph import OpencotiChatModel

    if request.param == "in-process":
        return OpencotiChatModel(engine=small_engine, temperature=0, max_tokens=32)
    if request.param == "http":
        return OpencotiChatModel(base_url=server, temperature=0, max_tokens=32)
    return ChatOpenAI(base_url=server + "/v1", api_key="unused", model="opencoti", temperature=0, max_tokens=32,
                      max_retries=0)


def history(n_pairs: int) -> list:
    msgs = []
    for i in range(n_pairs):
        msgs += [HumanMessage(f"Note {i}: " + "the quick brown fox jumps over the lazy dog " * 10),
                 AIMessage(f"Noted {i}.")]
    return msgs


def test_context_overflow_is_langchains(model):
    with pytest.raises(ContextOverflowError):
        model.invoke("word " * (CTX + 50))
    if not isinstance(model, ChatOpenAI):  # the profile holds the served context, on both transports
        assert model.profile["max_input_tokens"] == CTX
        SummarizationMiddleware(model, trigger=("fraction", 0.8))  # needs the profile


def test_summarization_middleware_recovers_from_an_overflowing_summary(model):
    """The summary prompt of this history overflows the context: the middleware catches the
    ContextOverflowError, cuts the middle out of the history and summarizes that; the agent answers."""
    seen: list[str] = []

    class Watch(SummarizationMiddleware):
        def _create_summary(self, messages):
            try:
                return super()._create_summary(messages)
            except Exception as e:  # noqa: BLE001 - recorded for the assertion below
                seen.append(type(e).__name__)
                raise

    mw = Watch(model, trigger=("messages", 6), keep=("messages", 2), summary_prompt=SUMMARY_PROMPT,
               trim_tokens_to_summarize=None)
    agent = create_agent(model, tools=[], middleware=[mw])
    msgs = history(7) + [HumanMessage("What was note 6 about?")]
    # the summary prompt of everything but the kept tail is beyond the context
    text = "\n".join(m.content for m in msgs[:-2])
    assert len(text.split()) > CTX
    out = agent.invoke({"messages": msgs})
    assert not seen, seen
    summary = [m for m in out["messages"] if isinstance(m, HumanMessage) and "summary" in m.text.lower()]
    assert summary, [m.text[:60] for m in out["messages"]]
    assert isinstance(out["messages"][-1], AIMessage) and out["messages"][-1].text.strip()


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


@pytest.mark.parametrize("choice", ["any", "get_weather"])
def test_a_forced_choice_is_one_call(model, choice):
    bound = model.bind_tools([get_weather], tool_choice=choice)
    msg = bound.invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1, msg.tool_calls
    assert set(msg.tool_calls[0]["args"]) == {"city"}, msg.tool_calls
    assert "<" not in (msg.text or ""), msg.text
