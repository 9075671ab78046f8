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
    n = body["error"]["n_prompt_tokens"]
    assert body["error"]["message"] == f"prompt is too long: {n} tokens > {engine.max_context} maximum"
    # the prompt alone fits, with max_tokens it does not: the room left for the prompt is the maximum
    short = {"max_tokens": engine.max_context, "messages": [{"role": "user", "content": "Hi"}]}
    err = client.post("/v1/messages", json=short).json()["error"]
    assert err["message"].startswith(f"prompt is too long: {err['n_prompt_tokens']} tokens > 0 maximum")


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
