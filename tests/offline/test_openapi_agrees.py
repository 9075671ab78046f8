"""The OpenAPI document says what validation does: requests the server refuses are refused by the
schema too (the cases schemathesis found, one by one), and a bounded schemathesis run over every
route, with all its checks, finds no disagreement, no server error and no undocumented answer."""

from __future__ import annotations

import re

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
    # the positive_data_acceptance run on the generation routes (issue 49, 4): each a 400 the schema allowed
    ("POST", "/v1/chat/completions", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]}], "max_tokens": 1}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": MSG, "tool_choice": ")"}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": MSG, "n": 2, "session_id": "s"}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, None),
    ("POST", "/v1/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
     {"messages": MSG, "tools": [{"function": {"name": ""}}]}, None),
    ("POST", "/apply-template", "/apply-template", {"messages": MSG, "tools": [1]}, None),
    ("POST", "/polykv/sessions/{session_id}/compact", "/polykv/sessions/s/compact",
     {"ancestor_pool_id": "{pid}", "tokens": SYS, "tools": []}, None),
    ("POST", "/completion", "/completion", {"prompt": "x", "repeat_penalty": -3.4}, None),
    ("POST", "/completion", "/completion", {"prompt": "x", "session_id": "\u00c5"}, None),
    ("POST", "/completion", "/completion", {"prompt": "x", "shared_prefix_n_tokens": 2}, None),
    ("POST", "/completion", "/completion", {"prompt": "x", "n_predict": 0}, None),
    ("POST", "/v1/completions", "/v1/completions", {"prompt": "x", "suffix": "y"}, None),
    ("POST", "/v1/completions", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, None),
    ("POST", "/v1/completions", "/v1/completions", {"prompt": "x", "best_of": 2}, None),
    ("POST", "/slots/{slot_id}", "/slots/s", {"filename": "a..b"}, {"action": "save"}),
    ("POST", "/v1/messages", "/v1/messages", {"messages": [False], "max_tokens": 1}, None),
    ("POST", "/v1/messages", "/v1/messages", {"messages": [{"content": "x"}], "max_tokens": 1}, None),
    ("POST", "/v1/messages", "/v1/messages", {"messages": MSG, "system": [{}], "max_tokens": 1}, None),
    ("POST", "/v1/messages", "/v1/messages", {"messages": MSG, "tool_choice": {"type": "any"}, "max_tokens": 1},
     None),
    ("POST", "/v1/messages/count_tokens", "/v1/messages/count_tokens", {"messages": [{}]}, None),
    ("POST", "/v1/responses", "/v1/responses", {"input": []}, None),
    ("POST", "/v1/responses", "/v1/responses", {"input": ["x"]}, None),
    ("POST", "/v1/responses", "/v1/responses", {"input": [{"role": None}]}, None),
    ("POST", "/v1/responses", "/v1/responses", {"input": [{"type": "reasoning"}]}, None),
    ("POST", "/v1/responses", "/v1/responses", {"input": "x", "tools": [{"type": "function"}]}, None),
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
        # a conversation of one assistant message is continued (was a 400 "'messages' must be a non-empty list")
        ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": [{"role": "assistant"}],
                                                                  "max_tokens": 1}, None),
        ("POST", "/v1/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
         {"messages": [{"role": "assistant", "content": "Hel"}]}, None),
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
# with every check schemathesis has (its default: all registered checks), positive_data_acceptance
# (a request the schema accepts must not be refused) included on every operation. It is narrowed
# only by the rules JSON Schema cannot state, each described in the document where it applies: a
# 400 that names one of them is not a disagreement (any other 400 for a schema-valid request is).
# /infill answers 501 on a model without fill-in-the-middle tokens (as llama.cpp's server does):
# not a server error here.
_CHAT = ("POST /v1/chat/completions", "POST /v1/chat/completions/input_tokens", "POST /apply-template",
         "POST /polykv/pools", "POST /polykv/pools/{pool_id}/fork", "POST /polykv/sessions/{session_id}/compact",
         "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses")
UNSTATABLE = [
    # the served model's chat template has rules of its own (its raise_exception calls: per model)
    (_CHAT, r"^the chat template rejected the messages: "),
    # continuing a message depends on the roles of the last messages (JSON Schema cannot address an
    # array's last items)
    (_CHAT, r"two or more assistant messages|^continue_final_message needs|final assistant message with tool_calls "
            r"cannot be continued|^continuing the final assistant message cannot|^add_generation_prompt false cannot"),
    # one field's value must be among another's (a forced tool among the tools; id_slot and session_id
    # naming one session; pool_id and its legacy name equal; thinking's budget below max_tokens)
    (None, r"^tool_choice names function|^id_slot -?\d+ is the session|is the legacy name of pool_id|"
           r"^max_tokens must be greater than thinking\.budget_tokens"),
    # state: a stored response; explicit P against the pool's tokens; a slot file saved before; the
    # prompt's length (in tokens) plus the tokens asked for against the model's context
    (None, r"^Previous response with id|^shared_prefix_n_tokens|^no slot file named"),
    (None, r"maximum context length|^prompt is too long: "),
    # a grammar's syntax (GBNF / Lark: a language of its own)
    (None, r"^(prompt\[\d+\]: )?invalid grammar: "),
    # a rule across the query and the body (the document's x-required-when): save / restore need a filename
    (("POST /slots/{slot_id}",), r'^the body must be \{"filename"'),
]


def _unstatable(label: str, response) -> bool:
    if response.status_code != 400:
        return False
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False
    return any((ops is None or label in ops) and re.search(rule, message) for ops, rule in UNSTATABLE)


def positive_data_acceptance(ctx, response, case):
    """schemathesis's check, but a 400 naming a rule the schema cannot state is no disagreement."""
    try:
        return st_checks.positive_data_acceptance(ctx, response, case)
    except AssertionError:
        if _unstatable(case.operation.label, response):
            return None
        raise


EXAMPLES = 3  # cases per operation: ~40 operations, 40-90 s depending on the machine's load


def test_schemathesis_finds_no_disagreement(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 35
    failures: list[str] = []
    for op in ops:
        excluded = [st_checks.positive_data_acceptance] + ([not_a_server_error] if op.label == "POST /infill" else [])

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy())
        def run(case):
            # every registered check, positive_data_acceptance narrowed by UNSTATABLE
            case.call_and_validate(excluded_checks=excluded, additional_checks=[positive_data_acceptance])

        try:
            run()
        except BaseException as e:  # noqa: BLE001 - collected: one report for every operation
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"{op.label}: {str(e)[:1500]}")
    assert not failures, "\n\n".join(failures)
