"""Errors a careful operator probed for (issue 49): a schema nested deeper than MAX_SCHEMA_DEPTH is a
400 naming the limit on every route that takes one (never a RecursionError 500); an unexpected
exception is a clean 500 in the API's shape and the keep-alive connection stays usable; errors
raised by the middleware take Anthropic's shape on /v1/messages; values the Anthropic and Responses
APIs refuse are refused here too."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.testclient import TestClient

from opencoti.engine.checks import MAX_SCHEMA_DEPTH, json_depth
from opencoti.engine.constraints import ConstraintSpec
from opencoti.server import ServerConfig, create_app

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def nested(levels: int) -> dict:
    """``{"a": {"a": ... {}}}``: ``levels`` objects in all."""
    d: dict = {}
    for _ in range(levels - 1):
        d = {"a": d}
    return d


def anthropic_error(r, status: int, etype: str, match: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == etype, body
    assert isinstance(body["error"]["message"], str) and match in body["error"]["message"], body
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}, body  # exactly Anthropic's
    return body


def openai_error(r, status: int, match: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    assert match in body["error"]["message"], body
    return body


# ============================================================================ 1: schema depth
def test_json_depth_counts_without_recursion():
    assert [json_depth(v) for v in (1, "x", {}, [], {"a": []}, nested(5))] == [0, 0, 1, 1, 2, 5]
    deep = nested(100_000)  # far past Python's recursion limit: counted, only as far as the limit
    assert json_depth(deep) == MAX_SCHEMA_DEPTH + 1 and json_depth(nested(3), limit=2) == 3


def _schema_requests(schema: dict) -> list[tuple[str, dict]]:
    fn = {"name": "f", "parameters": schema}
    return [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tools": [{"type": "function", "function": fn}],
                                  "tool_choice": "required"}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tools": [{"type": "function", "function": fn}],
                                  "tool_choice": "none"}),  # the tools are checked whatever tool_choice is
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/completion", {"prompt": "x", "n_predict": 2, "json_schema": schema}),
        ("/v1/messages", {"messages": USER, "max_tokens": 2, "tools": [{"name": "f", "input_schema": schema}],
                          "tool_choice": {"type": "any"}}),
        ("/v1/messages/count_tokens", {"messages": USER, "tools": [{"name": "f", "input_schema": schema}]}),
        ("/v1/messages", {"messages": USER, "max_tokens": 2, "output_config": {
            "format": {"type": "json_schema", "schema": schema}}}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "tool_choice": "required",
                           "tools": [{"type": "function", **fn}]}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {
            "format": {"type": "json_schema", "name": "x", "schema": schema}}}),
    ]


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH + 1, 400, 500, 900])
def test_a_schema_nested_past_the_limit_is_a_400_naming_it_on_every_route(client, engine, levels):
    before = engine.stats()["requests"]
    for path, body in _schema_requests(nested(levels)):
        r = client.post(path, json=body)
        shape = anthropic_error if path.startswith("/v1/messages") else None
        if shape:
            body = shape(r, 400, "invalid_request_error", f"more than {MAX_SCHEMA_DEPTH} levels deep")
        else:
            body = openai_error(r, 400, f"more than {MAX_SCHEMA_DEPTH} levels deep")
        assert "MAX_SCHEMA_DEPTH" in (body["error"]["message"]), (path, body)
    assert engine.stats()["requests"] == before  # nothing ran


def test_a_schema_at_the_limit_compiles():
    schema = nested(MAX_SCHEMA_DEPTH)
    tools = [{"type": "function", "function": {"name": n, "parameters": schema}} for n in ("f", "g")]
    assert ConstraintSpec.json_schema(schema).grammar and ConstraintSpec.tool_calls(tools).grammar
    with pytest.raises(ValueError, match="MAX_SCHEMA_DEPTH"):
        ConstraintSpec.json_schema('{"a": ' * 5000 + "{}" + "}" * 5000)  # JSON text too deep even to parse


# ============================================================================ 1: a clean 500, the connection kept
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(engine):
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="critical"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    t.join(10)


def test_an_internal_error_is_a_500_and_the_connection_stays_usable(server, engine, monkeypatch):
    import opencoti.server.routes_anthropic as routes_anthropic

    def boom(*a, **kw):
        raise RuntimeError("forced internal error")

    monkeypatch.setattr(engine, "pools", boom)
    monkeypatch.setattr(routes_anthropic, "chat_request", boom)
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    try:
        conn.request("GET", "/polykv/pools")
        r = conn.getresponse()
        body = json.loads(r.read())
        sock = conn.sock
        assert r.status == 500 and body["error"]["code"] == 500 and body["error"]["type"] == "server_error"
        assert "forced internal error" in body["error"]["message"]
        assert (r.getheader("connection") or "").lower() != "close"

        conn.request("POST", "/v1/messages", body=json.dumps({"max_tokens": 2, "messages": USER}),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error"

        monkeypatch.undo()
        conn.request("GET", "/health")  # the same connection: not reset
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and conn.sock is sock
    finally:
        conn.close()


# ============================================================================ 3: middleware errors in Anthropic's shape
def test_middleware_errors_on_anthropic_routes_take_anthropic_shape(engine):
    body = json.dumps({"max_tokens": 2, "messages": USER})
    for config in (ServerConfig(api_key="k"), ServerConfig(tenant_keys={"tk": "team"})):
        with TestClient(create_app(engine, config=config), raise_server_exceptions=False) as c:
            anthropic_error(c.post("/v1/messages", content=body, headers={"content-type": "application/json"}),
                            401, "authentication_error", "missing API key")
            anthropic_error(c.post("/v1/messages", content=body, headers={"content-type": "application/json",
                                                                          "x-api-key": "wrong"}),
                            401, "authentication_error", "Invalid API Key")
            openai_error(c.post("/v1/chat/completions", json={"messages": USER}), 401)  # OpenAI's stays
    config = ServerConfig(max_body_bytes=64, allowed_hosts=["localhost"])
    with TestClient(create_app(engine, config=config), raise_server_exceptions=False,
                    base_url="http://localhost") as c:
        anthropic_error(c.post("/v1/messages", content=body + " " * 64, headers={"content-type": "application/json"}),
                        413, "request_too_large", "exceeds the limit")
        anthropic_error(c.post("/v1/messages/count_tokens", content=body, headers={"content-type": "text/plain"}),
                        415, "invalid_request_error", "must be JSON")
        anthropic_error(c.post("/v1/messages", content=body, headers={"content-type": "application/json",
                                                                      "host": "evil.example"}),
                        400, "invalid_request_error", "is not allowed")
        anthropic_error(c.post("/v1/messages", content=body, headers={"content-type": "application/json",
                                                                      "origin": "https://evil.example"}),
                        403, "permission_error", "cross-site request refused")
        anthropic_error(c.get("/v1/messages"), 405, "invalid_request_error", "not allowed")
        openai_error(c.post("/v1/chat/completions", content=body + " " * 64, headers={"content-type": "application/json"}),
                     413)


# ============================================================================ 3: values the APIs refuse
@pytest.mark.parametrize("extra, match", [
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema: Field required"),
    ({"tools": [{"name": "f", "input_schema": None}]}, "tools[0].input_schema: Field required"),
    ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools[0].input_schema must be a JSON schema object"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "greater than or equal to 1024"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "2048"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "max_tokens must be greater than thinking.budget_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_anthropic_values_anthropic_refuses_are_400(client, engine, extra, match):
    before = engine.stats()["requests"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        anthropic_error(client.post(path, json={"max_tokens": 4, "messages": USER, **extra}), 400,
                        "invalid_request_error", match)
    assert engine.stats()["requests"] == before


def test_anthropic_thinking_accepted_when_valid(client):
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"},
                     {"type": "between_tools"}):
        r = client.post("/v1/messages/count_tokens", json={"max_tokens": 2048, "messages": USER, "thinking": thinking})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra, match", [
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": -5}, "max_output_tokens"),
    ({"include": "x"}, "include"),
    ({"include": ["x"]}, "include"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "object"}]}, "tools[0].parameters"),
])
def test_responses_values_openai_refuses_are_400(client, engine, extra, match):
    before = engine.stats()["requests"]
    openai_error(client.post("/v1/responses", json={"input": "hi", **extra}), 400, match)
    assert engine.stats()["requests"] == before


def test_responses_include_of_known_values_is_accepted(client):
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1,
                                           "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]})
    assert r.status_code == 200, r.text
