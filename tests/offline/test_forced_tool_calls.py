"""A forced tool choice (``required`` / a named function) yields each distinct call once, arguments
that follow the tool's schema (no invented keys), and no tool-call markup in the content."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from test_constraints import run, sp, TOK  # the random-logit decoder over the byte-level tokenizer
from test_server import CHAT, script, sse_events

from opencoti.engine.constraints import ConstraintSpec
from opencoti.engine.chat.tool_calls import ToolCall, distinct_calls, parse_tool_calls
from opencoti.server import create_app

# no "additionalProperties": what convert_to_openai_tool makes of a plain function without strict
CITY = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
PAIRS = {"type": "function", "function": {"name": "set_tags", "parameters": {
    "type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "integer"}},
                                     "where": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    "required": ["tags", "where"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_arguments_follow_the_schema_no_invented_keys():
    spec = ConstraintSpec.tool_calls([CITY], name="get_weather", parallel=False)
    outs = run([sp(constraint=spec) for _ in range(6)], seed=21, steps=600)
    for ids in outs:
        _, calls = parse_tool_calls(TOK.decode(ids), {"get_weather"})
        assert len(calls) == 1 and set(json.loads(calls[0].arguments)) == {"city"}, TOK.decode(ids)
    # an explicit additionalProperties (a dict argument) is kept; nested objects with properties are closed
    spec = ConstraintSpec.tool_calls([PAIRS], name="set_tags", parallel=False)
    for ids in run([sp(constraint=spec) for _ in range(4)], seed=22, steps=900):
        args = json.loads(parse_tool_calls(TOK.decode(ids), {"set_tags"})[1][0].arguments)
        assert set(args) == {"tags", "where"} and set(args["where"]) <= {"x"}
        assert all(isinstance(v, int) for v in args["tags"].values())


def test_distinct_calls():
    a, b = ToolCall("f", '{"x": 1, "y": 2}'), ToolCall("f", '{"y": 2, "x": 1}')
    c, d = ToolCall("f", '{"x": 2}'), ToolCall("g", '{"x": 1, "y": 2}')
    assert distinct_calls([a, b, c, d]) == [a, c, d]


@pytest.mark.parametrize("text,content", [
    (CALL + "\n<", ""),
    (CALL + "\n<tool", ""),
    (CALL + '\n<tool_call>\n{"name": "get_weather", "argu', ""),  # a second call cut by max_tokens
    ("Checking. " + CALL + "\n<tool_ca", "Checking."),
])
def test_no_markup_in_the_content_beside_calls(text, content):
    got, calls = parse_tool_calls(text, {"get_weather"})
    assert got == content and len(calls) == 1 and calls[0].name == "get_weather"


def test_text_without_calls_is_left_alone():
    assert parse_tool_calls("a < b", {"get_weather"}) == ("a < b", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>", {"get_weather"})[0] == "<tool_call>not json</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_choice_written_twice_is_one_call(engine, monkeypatch, stream, choice):
    # what the model wrote after the forced prefill (one tool: the prefill names it either way): the
    # call, the same call again, the start of a third
    prefill_rest = '{"city": "Paris"}}\n</tool_call>\n'
    script(monkeypatch, engine, [prefill_rest, CALL, "\n<tool"], stop_reason="length")
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        body = {"messages": CHAT, "tools": [CITY], "tool_choice": choice, "stream": stream}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            events = [e for e in sse_events(r.text) if isinstance(e, dict)]
            deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
            calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
            content = "".join(d.get("content") or "" for d in deltas)
        else:
            msg = r.json()["choices"][0]["message"]
            calls, content = msg["tool_calls"], msg["content"] or ""
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert content == ""
    # two distinct calls stay two (parallel calls are allowed)
    other = CALL.replace("Paris", "Rome")
    script(monkeypatch, engine, [prefill_rest, other], stop_reason="eos")
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [CITY], "tool_choice": choice})
        cities = [json.loads(c["function"]["arguments"])["city"] for c in r.json()["choices"][0]["message"]["tool_calls"]]
    assert cities == ["Paris", "Rome"]


ANTHROPIC_CITY = {"name": "get_weather", "description": "Weather in a city.",
                  "input_schema": CITY["function"]["parameters"]}
RESPONSES_CITY = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
                  "parameters": CITY["function"]["parameters"]}


def _calls_of(api: str, r) -> list[dict]:
    """(name, arguments as a JSON value) of each tool call in an answer of ``api``."""
    body = r.json()
    if api == "chat":
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in body["choices"][0]["message"]["tool_calls"] or []]
    if api == "messages":
        return [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"]
    return [(o["name"], json.loads(o["arguments"])) for o in body["output"] if o["type"] == "function_call"]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_repeated_call_is_one_call_on_every_api(engine, monkeypatch, api, choice):
    # a turn where the model wrote the same call twice (its arguments laid out differently) and then
    # another one: with the default parallel_tool_calls the repeat is dropped, the distinct call kept
    twice = CALL + "\n" + CALL.replace('{"city": "Paris"}', '{"city":"Paris"}') + "\n" + CALL.replace("Paris", "Rome")
    script(monkeypatch, engine, [twice], stop_reason="eos")
    if api == "chat":
        url, body = "/v1/chat/completions", {"messages": CHAT, "tools": [CITY], "tool_choice": choice}
    elif api == "messages":
        url, body = "/v1/messages", {"messages": CHAT[1:], "system": CHAT[0]["content"], "max_tokens": 64,
                                     "tools": [ANTHROPIC_CITY], "tool_choice": {"type": choice.replace("required", "any")}}
    else:
        url, body = "/v1/responses", {"input": CHAT[1]["content"], "instructions": CHAT[0]["content"],
                                      "tools": [RESPONSES_CITY], "tool_choice": choice}
    if choice == "required":  # the forced prefill is already written: the script is what follows it
        script(monkeypatch, engine, ['{"city": "Paris"}}\n</tool_call>\n' + twice], stop_reason="eos")
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    assert _calls_of(api, r) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
