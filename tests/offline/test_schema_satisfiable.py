"""Schemas that no JSON value satisfies are a 400 (``json_schema``, ``response_format``, a tool's
``parameters``), never a constraint that ends every generation at once."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from opencoti.engine.constraints import ConstraintSpec
from opencoti.engine.constraints.sat import satisfiable
from opencoti.engine.errors import InvalidRequestError
from opencoti.server import create_app

LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SELF_REQUIRED = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
UNSATISFIABLE = [{"$ref": "#"}, LOOP, SELF_REQUIRED, False, {"enum": []}, {"anyOf": [{"$ref": "#"}]},
                 {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
                 {"type": "object", "required": ["x"], "additionalProperties": False}]
SATISFIABLE = [{}, True, {"type": "object"}, {"type": "object", "properties": {"next": {"$ref": "#"}}},  # a list
               {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
               {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {
                   "$ref": "#/$defs/node"}}}, "required": ["kids"]}}, "$ref": "#/$defs/node"},
               {"type": "array", "items": {"$ref": "#"}},
               {"$ref": "https://example.com/s.json"}]  # not local: left to the grammar compiler


@pytest.mark.parametrize("schema", UNSATISFIABLE)
def test_unsatisfiable(schema):
    assert not satisfiable(schema)
    with pytest.raises(InvalidRequestError, match="no JSON value satisfies it|invalid JSON schema"):
        ConstraintSpec.json_schema(schema)


@pytest.mark.parametrize("schema", SATISFIABLE)
def test_satisfiable(schema):
    assert satisfiable(schema)


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def _bad(r) -> None:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and "no JSON value satisfies it" in e["message"], e


@pytest.mark.parametrize("schema", [{"$ref": "#"}, LOOP, SELF_REQUIRED])
def test_http_json_schema_and_tool_parameters(client, schema):
    msgs = [{"role": "user", "content": "hi"}]
    _bad(client.post("/completion", json={"prompt": "x", "json_schema": schema, "n_predict": 4}))
    _bad(client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}))
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):
        _bad(client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "tools": [tool],
                                                       "tool_choice": choice}))
    ok = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}})
    assert ok.status_code == 200, ok.text
