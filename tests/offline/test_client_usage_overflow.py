"""What the clients people already use read from us (issue 50): a streamed Anthropic answer carries
the whole usage in ``message_delta`` (``ChatAnthropic`` reads a stream's usage from it alone); a
context overflow is worded as each API words it, so ``ChatAnthropic`` and ``ChatOpenAI`` (Chat
Completions and Responses) raise LangChain's ``ContextOverflowError``; and ``OpencotiChatModel.profile``
holds the served model's context on both transports, so ``SummarizationMiddleware`` sizes its retry
and takes ``trigger=("fraction", ...)``."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from langchain_core.exceptions import ContextOverflowError
from starlette.testclient import TestClient

from opencoti.server import create_app

MSG = {"model": "m", "max_tokens": 3, "temperature": 0, "system": "You are terse.",
       "messages": [{"role": "user", "content": "Hello there, how are you today?"}]}


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def server(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(10)


def named_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


# ============================================================================ streamed usage
def test_message_delta_carries_the_whole_usage(client):
    whole = client.post("/v1/messages", json=MSG).json()["usage"]
    r = client.post("/v1/messages", json={**MSG, "stream": True})  # the same prompt again: from the cache
    events = dict(named_events(r.text))
    usage = events["message_delta"]["usage"]
    assert set(usage) == {"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens"}
    assert usage["cache_read_input_tokens"] > 0 and usage["output_tokens"] == 3
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == whole["input_tokens"] + whole[
        "cache_read_input_tokens"]
    start = events["message_start"]["message"]["usage"]
    assert {k: start[k] for k in ("input_tokens", "cache_read_input_tokens")} == {
        k: usage[k] for k in ("input_tokens", "cache_read_input_tokens")}


def test_chat_anthropic_stream_reports_input_and_cache_read(server):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(base_url=server, api_key="unused", model="m", max_tokens=3, temperature=0, max_retries=0)
    prompt = [("system", MSG["system"]), ("human", MSG["messages"][0]["content"])]
    first = llm.invoke(prompt)
    total = first.usage_metadata["input_tokens"]
    assert total > 0
    chunks = list(llm.stream(prompt))
    usage = sum(chunks[1:], chunks[0]).usage_metadata
    assert usage["input_tokens"] == total and usage["output_tokens"] == 3  # was 0 input tokens
    assert usage["input_token_details"]["cache_read"] > 0


# ============================================================================ context overflow
def _too_long(engine) -> str:
    return "a b " * engine.max_context


def test_anthropic_route_words_the_overflow_as_anthropic(client, engine):
    r = client.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": _too_long(engine)}]})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"type", "message"}  # Anthropic's shape exactly (no llama.cpp fields)
    n = client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": _too_long(engine)}]})
    n = n.json()["input_tokens"]
    assert body["error"]["message"] == f"prompt is too long: {n} tokens > {engine.max_context} maximum"
    # the prompt alone fits, with max_tokens it does not: the room left for the prompt is the maximum
    short = {"max_tokens": engine.max_context, "messages": [{"role": "user", "content": "Hi"}]}
    n = client.post("/v1/messages/count_tokens", json=short).json()["input_tokens"]
    err = client.post("/v1/messages", json=short).json()["error"]
    assert err["message"].startswith(f"prompt is too long: {n} tokens > 0 maximum")


def test_openai_routes_word_the_overflow_as_openai(client, engine):
    r = client.post("/v1/chat/completions", json={"max_tokens": 4,
                                                  "messages": [{"role": "user", "content": _too_long(engine)}]})
    err = r.json()["error"]
    n = err["n_prompt_tokens"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"] == (f"This model's maximum context length is {engine.max_context} tokens. However, you "
                              f"requested {n + 4} tokens ({n} in the messages, 4 in the completion). Please reduce "
                              f"the length of the messages or completion. (context_length_exceeded)")
    r = client.post("/v1/responses", json={"input": _too_long(engine)})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"].startswith(f"This model's maximum context length is {engine.max_context} tokens.")
    # llama.cpp's routes keep llama.cpp's words
    err = client.post("/completion", json={"prompt": _too_long(engine)}).json()["error"]
    assert "exceeds the context length" in err["message"] and err["type"] == "exceed_context_size_error"


def test_langchain_clients_raise_context_overflow(server, engine):
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    models = [ChatAnthropic(base_url=server, api_key="unused", model="m", max_tokens=4, max_retries=0),
              ChatOpenAI(base_url=server + "/v1", api_key="unused", model="m", max_tokens=4, max_retries=0),
              ChatOpenAI(base_url=server + "/v1", api_key="unused", model="m", max_tokens=4, max_retries=0,
                         use_responses_api=True)]
    for llm in models:
        with pytest.raises(ContextOverflowError):
            llm.invoke(_too_long(engine))
        with pytest.raises(ContextOverflowError):
            list(llm.stream(_too_long(engine)))


# ============================================================================ the model profile
CTX = 512  # a small context, so that a history overflows it quickly


@pytest.fixture
def small_engine(make_engine):
    return make_engine(max_context=CTX)


def _serve(engine, port: int):
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    return srv, t


def _facts(profile) -> dict:
    return {k: profile.get(k) for k in ("name", "max_input_tokens", "tool_calling", "tool_choice", "structured_output")}


def test_profile_holds_the_served_context_on_both_transports(small_engine):
    from opencoti.langgraph import OpencotiChatModel

    want = {"name": small_engine.model_name, "max_input_tokens": CTX, "tool_calling": True, "tool_choice": True,
            "structured_output": True}
    assert _facts(OpencotiChatModel(engine=small_engine).profile) == want
    with TestClient(create_app(small_engine), raise_server_exceptions=False) as tc:
        assert _facts(OpencotiChatModel(base_url="http://testserver", http_client=tc).profile) == want
        assert tc.get("/v1/models").json()["data"][0]["meta"]["n_ctx"] == CTX
    # a server that is not up yet when the model is made: its facts come with the first call
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    model = OpencotiChatModel(base_url=f"http://127.0.0.1:{port}", max_tokens=2)
    assert time.monotonic() - t0 < 2.0 and "max_input_tokens" not in model.profile
    srv, t = _serve(small_engine, port)
    try:
        model.invoke("Hi")
        assert _facts(model.profile) == want
    finally:
        srv.should_exit = True
        t.join(10)


def test_profile_of_a_loading_engine_is_filled_by_the_first_call(small_engine):
    import asyncio

    from opencoti.langgraph import OpencotiChatModel
    from opencoti.langgraph.lazy import LazyEngine

    for use in ("sync", "async"):
        loaded = threading.Event()
        lazy = LazyEngine(lambda: loaded.wait(30) and small_engine, "loading")
        model = OpencotiChatModel(engine=lazy, max_tokens=2)
        assert "max_input_tokens" not in model.profile and model.profile["tool_calling"]  # made at once
        loaded.set()
        if use == "sync":
            model.invoke("Hi")
        else:
            asyncio.run(model.ainvoke("Hi"))
        assert model.profile["max_input_tokens"] == CTX and model.profile["name"] == small_engine.model_name


def _history(n_pairs: int) -> list:
    from langchain_core.messages import AIMessage, HumanMessage

    msgs: list = []
    for i in range(n_pairs):
        msgs += [HumanMessage(f"Note {i}: " + "the quick brown fox jumps over the lazy dog " * 3), AIMessage(f"Ok {i}.")]
    return msgs


@pytest.mark.parametrize("transport", ["in-process", "http"])
def test_summarization_middleware_recovers_an_overflowing_conversation(small_engine, transport):
    """A conversation far beyond the context: the fraction trigger (which needs the profile) fires, the
    summary prompt overflows, and the retry sized by ``max_input_tokens`` fits; the agent answers."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.messages import AIMessage, HumanMessage

    from opencoti.langgraph import OpencotiChatModel

    tc = TestClient(create_app(small_engine), raise_server_exceptions=False)
    with tc:
        model = (OpencotiChatModel(engine=small_engine, temperature=0, max_tokens=8) if transport == "in-process"
                 else OpencotiChatModel(base_url="http://testserver", http_client=tc, temperature=0, max_tokens=8))
        overflows: list[str] = []

        class Watch(SummarizationMiddleware):
            def _overflow_retry_prompt(self, messages):
                overflows.append("summary prompt overflowed")
                return super()._overflow_retry_prompt(messages)

        mw = Watch(model, trigger=("fraction", 0.8), keep=("messages", 2), trim_tokens_to_summarize=None,
                   summary_prompt="Summarize this conversation in one sentence.\n\n{messages}",
                   token_counter=model.get_num_tokens_from_messages)
        msgs = _history(14) + [HumanMessage("What was note 6 about?")]
        n = model.get_num_tokens_from_messages(msgs)
        assert n > 2 * CTX + 100  # half of the history (the retry without a profile) still overflows
        with pytest.raises(ContextOverflowError):
            model.invoke(msgs)
        out = create_agent(model, tools=[], middleware=[mw]).invoke({"messages": msgs})
    assert overflows == ["summary prompt overflowed"]
    first = out["messages"][0]
    assert isinstance(first, HumanMessage) and "summary" in first.text.lower()
    assert isinstance(out["messages"][-1], AIMessage) and out["messages"][-1].usage_metadata["output_tokens"] > 0
    assert len(out["messages"]) == 4  # the summary, the two kept messages and the answer
