"""The OpenAPI document says what validation does: requests the server refuses are refused by the
schema too (the cases schemathesis found, one by one), and a bounded schemathesis run over the
control-plane routes finds no disagreement, no server error and no undocumented answer."""

from __future__ import annotations

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks as st_checks
from starlette.testclient import TestClient

from opencoti.server import create_app

SYS = list(range(20, 52))
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def app(make_engine, tmp_path):
    return create_app(make_engine(state_dir=str(tmp_path / "state")))


@pytest.fixture
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _validator(doc: dict, schema: dict):
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def schema_accepts(doc: dict, method: str, path: str, body=None, query: dict | None = None) -> bool:
    op = doc["paths"][path][method.lower()]
    if body is not None and "requestBody" in op:
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        if not _validator(doc, schema).is_valid(body):
            return False
    for p in op.get("parameters", []):
        if p["in"] == "query" and query is not None:
            if p["name"] in query and not _validator(doc, p["schema"]).is_valid(query[p["name"]]):
                return False
            if p.get("required") and p["name"] not in query:
                return False
    return True


# (method, OpenAPI path, concrete path, body, query): each refused by the server (400) and now by the schema
REFUSED = [
    ("POST", "/polykv/pools", "/polykv/pools", {"messages": [None]}, None),
    ("POST", "/polykv/pools", "/polykv/pools", {"messages": None}, None),
    ("POST", "/polykv/pools", "/polykv/pools", {"tokens": None}, None),
    ("POST", "/polykv/pools/{pool_id}/fork", "/polykv/pools/{pid}/fork", {"messages": [None]}, None),
    ("POST", "/polykv/pools/{pool_id}/fork", "/polykv/pools/{pid}/fork", {"tokens": None}, None),
    ("POST", "/apply-template", "/apply-template", {"messages": [None]}, None),
    ("POST", "/apply-template", "/apply-template", {"messages": [{"role": "robot", "content": "x"}]}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": [None], "max_tokens": 1}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 1},
     None),
    ("POST", "/polykv/sessions/{session_id}/compact", "/polykv/sessions/s/compact",
     {"ancestor_pool_id": "{pid}", "messages": None}, None),
    ("POST", "/polykv/sessions/{session_id}/compact", "/polykv/sessions/s/compact",
     {"ancestor_pool_id": "{pid}", "messages": [None]}, None),
    ("POST", "/completion", "/completion", {"prompt": "x", "stop": "", "n_predict": 1}, None),
    ("POST", "/completion", "/completion", {"prompt": "x", "stop": ["a"] * 17, "n_predict": 1}, None),
    ("POST", "/slots/{slot_id}", "/slots/s", {"filename": "f.bin"}, {"action": ""}),
    ("POST", "/polykv/pools/{pool_id}/admission", "/polykv/pools/{pid}/admission",
     {"guarantee_min_sessions": 10**12}, None),
    ("POST", "/polykv/pools/{pool_id}/admission", "/polykv/pools/{pid}/admission",
     {"target_tps_per_session": 6.5e16}, None),
    ("POST", "/polykv/pools/{pool_id}/admission", "/polykv/pools/{pid}/admission", {"settle_max_ms": 0}, None),
    ("GET", "/polykv/events", "/polykv/events", None, {"pool_id": "null"}),  # a query value, never null
    ("GET", "/polykv/tps", "/polykv/tps", None, {"once": "1", "interval_ms": "10"}),
    ("POST", "/polykv/pools", "/polykv/pools", {"from_session": "s", "tools": []}, None),  # tools need messages
    ("POST", "/detokenize", "/detokenize", {"tokens": [1, 100_000]}, None),  # beyond the model's vocabulary
    ("POST", "/v1/completions", "/v1/completions", {"prompt": [1, -1], "max_tokens": 1}, None),
    ("POST", "/v1/messages", "/v1/messages", {"messages": [], "max_tokens": 1}, None),
    ("GET", "/v1/stream", "/v1/stream", None, {}),  # conv_id is required
    ("DELETE", "/v1/stream", "/v1/stream", None, {"conv_id": ""}),
]


def _fill(value, pid: int):
    if value == "{pid}":
        return pid
    if isinstance(value, dict):
        return {k: _fill(v, pid) for k, v in value.items()}
    return value


def test_what_the_server_refuses_the_schema_refuses(client):
    doc = client.get("/openapi.json").json()
    pid = client.post("/polykv/pools", json={"tokens": SYS}).json()["pool_id"]
    for method, path, concrete, body, query in REFUSED:
        body = _fill(body, pid)
        r = client.request(method, concrete.replace("{pid}", str(pid)), json=body, params=query)
        assert r.status_code == 400, (concrete, body, r.status_code, r.text[:300])
        assert not schema_accepts(doc, method, path, body, query), ("the schema accepts", path, body, query)
    msg = client.post(f"/polykv/pools/{pid}/admission", json={"guarantee_min_sessions": 10**12}).json()
    assert "from 0 to 1,000,000" in msg["error"]["message"]  # not "must be a non-negative integer"


def test_what_the_schema_accepts_the_server_accepts(client):
    doc = client.get("/openapi.json").json()
    pid = client.post("/polykv/pools", json={"tokens": SYS}).json()["pool_id"]
    assert client.post("/completion", json={"prompt": "x", "session_id": "s", "n_predict": 1}).status_code == 200
    for method, path, concrete, body, query in [
        ("POST", "/polykv/pools", "/polykv/pools", {"messages": MSG, "tokens": None}, None),
        ("POST", "/polykv/pools/{pool_id}/fork", f"/polykv/pools/{pid}/fork", {"tokens": SYS + [3], "text": None},
         None),
        ("POST", "/apply-template", "/apply-template", {"messages": [*MSG, {"role": "assistant", "content": None,
                                                                            "tool_calls": None}]}, None),
        ("POST", "/completion", "/completion", {"prompt": "x", "stop": ["a"] * 16, "n_predict": 1}, None),
        ("POST", "/polykv/pools/{pool_id}/admission", f"/polykv/pools/{pid}/admission",
         {"guarantee_min_sessions": 1_000_000, "target_tps_per_session": 1e6, "settle_tokens": 1}, None),
        ("POST", "/slots/{slot_id}", "/slots/s", None, {"action": "erase"}),
    ]:
        assert schema_accepts(doc, method, path, body, query), (path, body, query)
        r = client.request(method, concrete, json=body, params=query)
        assert r.status_code == 200, (concrete, body, r.status_code, r.text[:300])


# numbers without a fraction are integers in JSON Schema (the document says "integer"): 19.0 is taken
INTEGRAL = [
    ("/completion", {"prompt": "x", "n_predict": 1.0, "n_probs": 19.0, "seed": 3.0}),
    ("/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 1.0, "logprobs": 2.0}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1.0, "logprobs": True, "top_logprobs": 2.0, "n": 1.0}),
    ("/v1/messages", {"model": "m", "messages": MSG, "max_tokens": 1.0, "top_k": 3.0}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 16.0}),
    ("/polykv/pools", {"tokens": [float(t) for t in SYS]}),
    ("/detokenize", {"tokens": [1.0, 2.0]}),
]


def test_integral_numbers_are_integers_as_the_document_says(client):
    doc = client.get("/openapi.json").json()
    for path, body in INTEGRAL:
        assert schema_accepts(doc, "POST", path, body), (path, body)
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, body, r.status_code, r.text[:300])
    r = client.post("/completion", json={"prompt": "x", "n_predict": 1, "n_probs": 19.5})
    assert r.status_code == 400 and "n_probs" in r.text  # a fraction is still refused (as by the schema)
    assert not schema_accepts(doc, "POST", "/completion", {"prompt": "x", "n_probs": 19.5})
    assert client.post("/completion", json={"prompt": "x", "n_predict": True}).status_code == 400  # a bool is no number


def test_an_unknown_query_parameter_is_refused_where_a_route_takes_parameters(client):
    pid = client.post("/polykv/pools", json={"tokens": SYS}).json()["pool_id"]
    for method, path in [("GET", "/polykv/events"), ("GET", "/polykv/tps/history"),
                         ("GET", f"/polykv/pools/{pid}/capacity"), ("DELETE", f"/polykv/pools/{pid}")]:
        r = client.request(method, path, params={"immediat": "true"})
        assert r.status_code == 400 and "unknown query parameter 'immediat'" in r.text, (path, r.text)
    assert client.get(f"/polykv/pools/{pid}").status_code == 200  # (the DELETE above changed nothing)


def test_each_stream_ends_as_its_document_says(client):
    """llama.cpp's /completion (and /infill) end with the "stop": true chunk, OpenAI's with data: [DONE]."""
    doc = client.get("/openapi.json").json()
    for path, body in [("/completion", {"prompt": "x", "n_predict": 2, "stream": True}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
                       ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "stream": True})]:
        sse = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        text = client.post(path, json=body).text
        assert text.endswith("data: [DONE]\n\n") == sse["example"].endswith("data: [DONE]\n\n"), (path, text[-80:])
    assert "[DONE]" not in doc["paths"]["/infill"]["post"]["responses"]["200"]["content"]["text/event-stream"]["example"]


def test_tps_events_are_declared_as_snapshots(client):
    ok = client.get("/openapi.json").json()["paths"]["/polykv/tps"]["get"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/TpsSnapshot"}
    assert ok["text/event-stream"]["schema"]["x-item-schema"] == {"$ref": "#/components/schemas/TpsSnapshot"}


# ============================================================================ a bounded schemathesis run
# Every operation of the document (the generation routes too: a tiny model answers in milliseconds)
# with every check schemathesis has (its default: all registered checks). positive_data_acceptance
# (a request the schema accepts must not be refused) holds on the operations in POSITIVE; on the
# others validity depends on more than a schema can say (token ids within this model's vocabulary,
# what its chat template accepts (pools made of messages too), a grammar's syntax, a stored response or stream id), so there a 400
# is allowed for a schema-valid request, and every other check still holds. /infill answers 501 on
# a model without fill-in-the-middle tokens (as llama.cpp's server does): not a server error here.
POSITIVE = {"GET /polykv/pools", "GET /polykv/pools/{pool_id}", "GET /polykv/events", "GET /polykv/tps/history",
            "GET /polykv/pools/{pool_id}/admission", "POST /polykv/pools/{pool_id}/admission",
            "GET /polykv/pools/{pool_id}/capacity", "GET /polykv/integrity", "POST /polykv/pools/{pool_id}/pin",
            "POST /polykv/pools/{pool_id}/unpin", "POST /polykv/pools/{pool_id}/evict",
            "POST /polykv/pools/{pool_id}/flush", "DELETE /polykv/pools/{pool_id}",
            "DELETE /polykv/sessions/{session_id}",
            "POST /tokenize", "GET /props", "GET /health", "GET /v1/models", "GET /slots", "GET /metrics",
            "GET /polykv/tps", "GET /v1/responses/{response_id}", "POST /detokenize", "GET /v1/stream",
            "DELETE /v1/stream"}
EXAMPLES = 3  # cases per operation: ~40 operations, 40-90 s depending on the machine's load


def test_schemathesis_finds_no_disagreement(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 35
    failures: list[str] = []
    for op in ops:
        excluded = ([] if op.label in POSITIVE else [st_checks.positive_data_acceptance]) + (
            [not_a_server_error] if op.label == "POST /infill" else [])

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(excluded_checks=excluded)  # every registered check but those

        try:
            run()
        except BaseException as e:  # noqa: BLE001 - collected: one report for every operation
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"{op.label}: {str(e)[:1500]}")
    assert not failures, "\n\n".join(failures)
