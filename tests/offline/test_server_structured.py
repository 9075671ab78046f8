"""OpenAI strict mode (structured outputs) on response_format and tool functions, OpenAI's
token-id-only logit_bias on the /v1 routes, and lists of prompts on /completion and
/v1/completions (empty prompts refused up front; streamed with each event's index).
Tiny random model: every valid output below is the constraint's doing."""

from __future__ import annotations

import copy
import json

import pytest

from long_context_server import client, engine  # noqa: F401 - fixtures

CHAT = [{"role": "user", "content": "Hi"}]
HOT = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 200}
GREEDY = {"temperature": 0, "ignore_eos": True}

# strict-mode valid: every object closed, every property required, optional = a union with null
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "note", "items", "status"],
         "properties": {
             "id": {"type": "integer", "minimum": 0, "maximum": 99},
             "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
             "items": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/item"}},
             "status": {"enum": ["open", "done"]}},
         "$defs": {"item": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string", "maxLength": 4},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}}




def sse_events(text: str) -> list:
    return ["[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
            for line in text.split("\n") if line.startswith("data: ")]


def assert_400(r, match: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and match in err["message"], err
    return err["message"]


def strict_format(schema, name: str = "order", strict=True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def check_order(v: dict) -> None:
    assert list(v) == ["id", "note", "items", "status"]  # every key, no other, in the schema's order
    assert isinstance(v["id"], int) and 0 <= v["id"] <= 99 and v["status"] in ("open", "done")
    assert v["note"] is None or (isinstance(v["note"], str) and len(v["note"]) <= 6)
    assert len(v["items"]) <= 2 and all(set(i) == {"sku", "qty"} and 1 <= i["qty"] <= 9 for i in v["items"])


# ============================================================================ strict: true
def test_strict_response_format_always_gives_the_exact_object(client):
    for seed in range(4):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "response_format": strict_format(ORDER),
                                                      "seed": seed, **HOT})
        assert r.status_code == 200, r.text
        check_order(json.loads(r.json()["choices"][0]["message"]["content"]))


def test_strict_accepts_the_openai_sdk_schema_of_a_pydantic_model(client):
    import pydantic  # a core dependency (through fastapi)
    from openai.lib._pydantic import to_strict_json_schema as strict_schema  # openai: the dev extra

    class Item(pydantic.BaseModel):
        sku: str = pydantic.Field(max_length=4)
        qty: int = pydantic.Field(ge=1, le=9)

    class Order(pydantic.BaseModel):
        id: int = pydantic.Field(ge=0, le=99)
        note: str | None = pydantic.Field(default=None, max_length=6)
        items: list[Item] = pydantic.Field(max_length=2)

    schema = strict_schema(Order)  # what client.chat.completions.parse(response_format=Order) sends
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "response_format": strict_format(schema, "Order"),
                                                  "seed": 3, **HOT})
    assert r.status_code == 200, r.text
    Order.model_validate_json(r.json()["choices"][0]["message"]["content"])


def _drop(path, key):
    def edit(s):
        node = s
        for p in path:
            node = node[p]
        node.pop(key)
    return edit


@pytest.mark.parametrize("edit, message", [
    (_drop([], "additionalProperties"),
     "In context=(), 'additionalProperties' is required to be supplied and to be false."),
    (lambda s: s.update(additionalProperties=True),
     "In context=(), 'additionalProperties' is required to be supplied and to be false."),
    (_drop(["$defs", "item"], "additionalProperties"),
     "In context=('$defs', 'item'), 'additionalProperties' is required to be supplied and to be false."),
    (lambda s: s["required"].remove("note"),
     "In context=(), 'required' is required to be supplied and to be an array including every key in properties. "
     "Missing 'note'."),
    (_drop(["$defs", "item"], "required"),
     "In context=('$defs', 'item'), 'required' is required to be supplied and to be an array including every key "
     "in properties. Missing 'sku'."),
    (lambda s: s["required"].append("ghost"), "Extra required key 'ghost' supplied."),
    (lambda s: s["properties"].update(tags={"type": "array", "items": {"type": "string"}, "uniqueItems": True})
     or s["required"].append("tags"), "In context=('properties', 'tags'), 'uniqueItems' is not permitted."),
    (lambda s: s.update(allOf=[{"type": "object"}]), "In context=(), 'allOf' is not permitted."),
    (lambda s: s["properties"]["id"].update({"not": {"const": 3}}),
     "In context=('properties', 'id'), 'not' is not permitted."),
    (lambda s: (s.clear(), s.update(type="array", items={"type": "integer"})),
     "schema must be a JSON Schema of 'type: \"object\"', got 'type: \"array\"'."),
    (lambda s: (s.clear(), s.update(anyOf=[{"type": "object", "properties": {}, "required": [],
                                            "additionalProperties": False}, {"type": "null"}])),
     "got 'anyOf' at the root"),
])
def test_strict_schemas_breaking_openai_rules_are_400(client, engine, edit, message):
    schema = copy.deepcopy(ORDER)
    edit(schema)
    before = engine.stats()["requests"]
    got = assert_400(client.post("/v1/chat/completions", json={"messages": CHAT,
                                                               "response_format": strict_format(schema)}), message)
    assert got.startswith("Invalid schema for response_format 'order': ")
    assert engine.stats()["requests"] == before
    # without strict the same schema is taken as given (OpenAI: no strict-mode rules)
    if "is required to be supplied" in message:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4,
                                                      "response_format": strict_format(schema, strict=False)})
        assert r.status_code == 200, r.text


def test_strict_flag_must_be_a_boolean(client):
    assert_400(client.post("/v1/chat/completions", json={"messages": CHAT,
                                                         "response_format": strict_format(ORDER, strict="yes")}),
               "strict must be a boolean")


def _tool(params, strict=True) -> dict:
    return {"type": "function", "function": {"name": "place", "strict": strict, "parameters": params}}


def test_strict_tool_functions(client, engine):
    open_params = {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
    before = engine.stats()["requests"]
    for choice in ("none", "auto", "required"):  # OpenAI checks the schema whatever tool_choice is
        got = assert_400(client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [_tool(open_params)],
                                                                    "tool_choice": choice}),
                         "Invalid schema for function 'place': In context=(), 'additionalProperties' is required")
        assert "response_format" not in got
    assert engine.stats()["requests"] == before
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [_tool(open_params, strict=False)],
                                                  "max_tokens": 4})
    assert r.status_code == 200, r.text  # not strict: taken as given
    # parameters with $defs / $ref (pydantic's nested models), one tool or several
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/small"}}, "required": ["x"],
        "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 5}}}}}
    for tools in ([_tool(ORDER)], [_tool(ORDER), other]):
        for seed in range(2):
            r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": tools, "seed": seed,
                                                          "tool_choice": "required", "parallel_tool_calls": False,
                                                          **HOT})
            assert r.status_code == 200, r.text
            (call,) = r.json()["choices"][0]["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "place":
                check_order(args)
            else:
                assert list(args) == ["x"] and 0 <= args["x"] <= 5


# ============================================================================ logit_bias on /v1: token ids only
@pytest.mark.parametrize("path, extra", [("/v1/chat/completions", {"messages": CHAT}),
                                         ("/v1/completions", {"prompt": "x"})])
def test_v1_logit_bias_keys_are_token_ids(client, engine, path, extra):
    before = engine.stats()["requests"]
    assert_400(client.post(path, json={**extra, "logit_bias": {"hello": 5}}), "logit_bias keys must be token ids")
    assert_400(client.post(path, json={**extra, "logit_bias": {"65": 1, " a": -1}}), "logit_bias keys must be token ids")
    assert_400(client.post(path, json={**extra, "logit_bias": [[65, 1.0]]}), "logit_bias must be an object")
    assert_400(client.post(path, json={**extra, "logit_bias": [["a", 1.0]]}), "logit_bias must be an object")
    assert engine.stats()["requests"] == before
    r = client.post(path, json={**extra, "logit_bias": {"65": 100, "-0": 0}, "max_tokens": 3, **GREEDY})
    assert r.status_code == 200, r.text


def test_completion_keeps_llama_cpp_logit_bias_forms(client):
    base = {"prompt": "x", "n_predict": 4, **GREEDY}
    for bias in ([["b", 1000]], {"b": 1000}, [[ord("b"), 1000]], {str(ord("b")): 1000}):
        r = client.post("/completion", json={**base, "logit_bias": bias})
        assert r.status_code == 200 and r.json()["content"] == "bbbb", (bias, r.text)


# ============================================================================ lists of prompts
def test_completion_prompt_list_streams_with_indexes(client, engine):
    base = {"n_predict": 4, "return_tokens": True, **GREEDY}
    prompts = ["ab", [99, 100], {"prompt_string": "xyz"}]
    whole = client.post("/completion", json={"prompt": prompts, **base})
    assert whole.status_code == 200, whole.text
    outs = whole.json()
    assert [o["index"] for o in outs] == [0, 1, 2] and len({o["session_id"] for o in outs}) == 3
    r = client.post("/completion", json={"prompt": prompts, "stream": True, "return_progress": True, **base})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    for i, o in enumerate(outs):
        mine = [e for e in events if e["index"] == i]
        progress = [e["prompt_progress"] for e in mine if "prompt_progress" in e]
        tokens = [e for e in mine if "prompt_progress" not in e and not e["stop"]]
        (final,) = [e for e in mine if e["stop"]]
        assert progress and progress[-1]["processed"] == progress[-1]["total"] == o["tokens_evaluated"]
        assert "".join(e["content"] for e in tokens) == o["content"]
        assert [t for e in tokens for t in e["tokens"]] == o["tokens"]
        assert [e["tokens_predicted"] for e in tokens] == [1, 2, 3, 4]
        assert final["content"] == "" and final["tokens_predicted"] == 4 and final["timings"]["predicted_n"] == 4
        assert mine[-1] is final
    assert events[-1]["stop"] and "[DONE]" not in events  # llama.cpp's /completion stream has no [DONE]


@pytest.mark.parametrize("prompt, match", [
    (["a", ""], "prompt[1]: prompt is empty"),
    ([[97], []], "prompt[1]"),
    ([{"prompt_string": ""}, "b"], "prompt[0]: prompt is empty"),
    ([], "prompt"),
    (["a"] * 65, "at most 64 prompts"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_empty_prompts_in_a_list_are_refused_before_anything_runs(client, engine, prompt, match, stream):
    before = engine.stats()
    assert_400(client.post("/completion", json={"prompt": prompt, "n_predict": 2, "stream": stream}), match)
    after = engine.stats()
    assert after["requests"] == before["requests"] and after["sessions"] == before["sessions"]


@pytest.mark.parametrize("extra", [{"session_id": "s"}, {"id_slot": 3}])
def test_a_prompt_list_cannot_share_one_session(client, engine, extra):
    before = engine.stats()
    assert_400(client.post("/completion", json={"prompt": ["a", "b"], "n_predict": 2, **extra}),
               "several prompts cannot share one session")
    assert engine.stats()["requests"] == before["requests"]


def test_v1_completions_prompt_list_and_n(client, engine):
    single = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 4, **GREEDY}).json()
              for p in ("ab", "xyz")]
    sessions = engine.stats()["sessions"]
    r = client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 4, "echo": True,
                                             **GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]  # choice p * n + j: choice j of prompt p (greedy: equal)
    assert texts == ["ab" + single[0]["choices"][0]["text"]] * 2 + ["xyz" + single[1]["choices"][0]["text"]] * 2
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 16
    assert engine.stats()["sessions"] == sessions and engine.pools()["pools"] == []  # all temporary

    r = client.post("/v1/completions", json={"prompt": [[97, 98], [120, 121, 122]], "max_tokens": 4, "stream": True,
                                             "stream_options": {"include_usage": True}, **GREEDY})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 5
    assert usage["usage"]["completion_tokens"] == 8 and len(usage["timings"]) == 2
    for i in range(2):
        mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == single[i]["choices"][0]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"] and mine[-1]["finish_reason"]
    assert engine.stats()["sessions"] == sessions


@pytest.mark.parametrize("body, match", [
    ({"prompt": ["a", ""]}, "prompt[1]: prompt is empty"),
    ({"prompt": ["a", "b"], "session_id": "s"}, "session_id"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
])
def test_v1_completions_bad_prompt_lists(client, engine, body, match):
    before = engine.stats()
    assert_400(client.post("/v1/completions", json={**body, "max_tokens": 2}), match)
    assert engine.stats()["requests"] == before["requests"] and engine.stats()["sessions"] == before["sessions"]


def test_openapi_prompt_schemas_refuse_empty_prompts(client):
    props = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "OpenAICompletionRequest"):
        options = props[name]["properties"]["prompt"]["anyOf"]
        assert {"type": "string", "minLength": 1} in options
        lists = [o for o in options if o["type"] == "array"]
        assert all(o["minItems"] == 1 for o in lists) and any(o.get("maxItems") == 64 for o in lists)
        for o in lists:  # the members of a list of prompts are not empty either
            inner = o["items"].get("anyOf", [o["items"]])
            assert all(i.get("minLength", 1) == 1 and i.get("minItems", 1) == 1 for i in inner)
            assert all(i["type"] != "string" or i["minLength"] == 1 for i in inner)
