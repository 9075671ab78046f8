"""Anthropic's Messages API in the details its clients meet (issue 50, 5): ``max_tokens`` is required
on /v1/messages (not on count_tokens), ``thinking`` blocks in the history are part of the prompt
(rendered before the answer, as a reasoning template renders them, and counted), and every error body
has exactly Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from test_server import script
from test_server_messages_responses import named_events

from opencoti.server import ServerConfig, create_app

USER = [{"role": "user", "content": "hi"}]
THOUGHT = "The user greets me; a greeting back is enough."


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def exactly_anthropic(r, status: int, etype: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == etype, body
    return body["error"]


# ============================================================================ max_tokens
def test_a_missing_max_tokens_is_anthropics_400(client, engine):
    before = engine.stats()["requests"]
    for stream in (False, True):
        err = exactly_anthropic(client.post("/v1/messages", json={"messages": USER, "stream": stream}), 400,
                                "invalid_request_error")
        assert err["message"] == "max_tokens: Field required"
    assert engine.stats()["requests"] == before  # nothing ran
    r = client.post("/v1/messages/count_tokens", json={"messages": USER})  # counting needs none
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    r = client.post("/v1/messages", json={"messages": USER, "max_tokens": 1})
    assert r.status_code == 200, r.text
    schemas = client.get("/openapi.json").json()["components"]["schemas"]  # the document says so
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    assert "max_tokens" not in schemas["CountTokensRequest"].get("required", [])


# ============================================================================ thinking in the history
def _turns(thinking: bool, tool: bool = False) -> list[dict]:
    answer: list[dict] = [{"type": "thinking", "thinking": THOUGHT, "signature": "sig"}] if thinking else []
    answer.append({"type": "text", "text": "Hello!"})
    if tool:
        answer.append({"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}})
    out = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    if tool:
        out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"}]})
    else:
        out.append({"role": "user", "content": "and now?"})
    return out


def test_thinking_blocks_are_rendered_and_counted(client, engine, monkeypatch):
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    for tool in (False, True):
        extra = {"tools": tools} if tool else {}
        counts = [client.post("/v1/messages/count_tokens", json={"messages": _turns(t, tool), **extra}).json()
                  ["input_tokens"] for t in (False, True)]
        thought = len(engine.tokenize("<think>\n" + THOUGHT + "\n</think>\n\n"))
        assert counts[1] - counts[0] >= thought - 2, counts  # (a token may merge at each edge)
        seen = script(monkeypatch, engine, ["ok"])
        r = client.post("/v1/messages", json={"messages": _turns(True, tool), "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
        prompt = engine.detokenize(seen[-1][0])
        assert "<think>\n" + THOUGHT + "\n</think>\n\nHello!" in prompt  # before the answer, as the model's text
        assert len(seen[-1][0]) == counts[1]  # count_tokens counts what runs
        assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] == counts[1]
    # a redacted block has no text: nothing is added
    redacted = _turns(False)
    redacted[1]["content"].insert(0, {"type": "redacted_thinking", "data": "opaque"})
    n = client.post("/v1/messages/count_tokens", json={"messages": redacted}).json()["input_tokens"]
    assert n == client.post("/v1/messages/count_tokens", json={"messages": _turns(False)}).json()["input_tokens"]


# ============================================================================ error shape
def test_error_bodies_have_exactly_anthropics_shape(client, engine, monkeypatch):
    exactly_anthropic(client.post("/v1/messages", json={"messages": [], "max_tokens": 2}), 400,
                      "invalid_request_error")
    exactly_anthropic(client.post("/v1/messages", json={"messages": USER, "max_tokens": "x"}), 400,
                      "invalid_request_error")
    exactly_anthropic(client.post("/v1/messages/count_tokens", json={"messages": USER, "tools": [{"name": "f"}]}),
                      400, "invalid_request_error")
    exactly_anthropic(client.post("/v1/messages", json={"messages": USER, "max_tokens": 2, "pool_id": 987654}),
                      404, "not_found_error")
    long = [{"role": "user", "content": "a b " * engine.max_context}]
    err = exactly_anthropic(client.post("/v1/messages", json={"messages": long, "max_tokens": 2}), 400,
                            "invalid_request_error")
    assert err["message"].startswith("prompt is too long: ")
    exactly_anthropic(client.get("/v1/messages"), 405, "invalid_request_error")
    with TestClient(create_app(engine, config=ServerConfig(api_key="k")), raise_server_exceptions=False) as c:
        exactly_anthropic(c.post("/v1/messages", json={"messages": USER, "max_tokens": 2}), 401,
                          "authentication_error")
    # mid-stream: the error event's data has the same shape
    script(monkeypatch, engine, ["a", "b", "c"], fail_after=1)
    r = client.post("/v1/messages", json={"max_tokens": 9, "stream": True, "messages": USER})
    name, data = named_events(r.text)[-1]
    assert name == "error" and set(data) == {"type", "error"} and set(data["error"]) == {"type", "message"}, data
    # the other APIs keep llama.cpp's shape with its code
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
