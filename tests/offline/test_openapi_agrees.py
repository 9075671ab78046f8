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


def test_tps_events_are_declared_as_snapshots(client):
    ok = client.get("/openapi.json").json()["paths"]["/polykv/tps"]["get"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/TpsSnapshot"}
    assert ok["text/event-stream"]["schema"]["x-item-schema"] == {"$ref": "#/components/schemas/TpsSnapshot"}


# ============================================================================ a bounded schemathesis run
# The control plane and the text utilities (the generation routes take seconds per case: their
# schema cases are the explicit ones above). Every check schemathesis has for a response, plus:
# a request the schema refuses must be refused (400), one it accepts on these routes must not be.
FUZZED = ("/health", "/v1/models", "/props", "/slots", "/tokenize", "/detokenize", "/polykv/")
POSITIVE = {"GET /polykv/pools", "GET /polykv/pools/{pool_id}", "GET /polykv/events", "GET /polykv/tps/history",
            "GET /polykv/pools/{pool_id}/admission", "POST /polykv/pools/{pool_id}/admission",
            "GET /polykv/pools/{pool_id}/capacity", "GET /polykv/integrity", "POST /polykv/pools/{pool_id}/pin",
            "GET /props", "GET /health", "GET /v1/models", "GET /slots"}
CHECKS = [not_a_server_error, st_checks.status_code_conformance, st_checks.content_type_conformance,
          st_checks.response_schema_conformance, st_checks.negative_data_rejection]
EXAMPLES = 3  # cases per operation: ~30 operations, 15-80 s depending on the machine's load


def test_schemathesis_finds_no_disagreement(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path.startswith(FUZZED) and op.label != "GET /polykv/tps"]  # (an SSE stream)
    assert len(ops) >= 20
    failures: list[str] = []
    for op in ops:
        checks = CHECKS + ([st_checks.positive_data_acceptance] if op.label in POSITIVE else [])

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(checks=checks)

        try:
            run()
        except BaseException as e:  # noqa: BLE001 - collected: one report for every operation
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"{op.label}: {str(e)[:1500]}")
    assert not failures, "\n\n".join(failures)
