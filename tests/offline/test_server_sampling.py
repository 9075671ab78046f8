"""Constrained decoding and the full sampler through the HTTP routes (tiny random model, so every
valid output below is the constraint's doing): response_format, json_schema, grammar, tool_choice,
logit_bias (OpenAI and llama.cpp forms), penalties, post_sampling_probs, bad input -> 400."""

from __future__ import annotations

import json
import math
import re

import pytest
from starlette.testclient import TestClient

from opencoti.server import ServerConfig, create_app
from long_context_server import client, engine  # noqa: F401 - fixtures

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "Hi"}]
HOT = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 200}




def check_person(v):
    assert set(v) == {"name", "age"} and isinstance(v["name"], str) and len(v["name"]) <= 8
    assert isinstance(v["age"], int) and 0 <= v["age"] <= 99


def assert_400(r, match: str):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and match in err["message"], err


def sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_chat_response_format_json_schema_and_json_object(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "response_format": rf, "seed": seed, **HOT})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        check_person(json.loads(choice["message"]["content"]))
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "response_format": {"type": "json_object"},
                                                  "seed": 1, **HOT, "max_tokens": 400, "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text) if e.get("choices"))
    assert text.startswith("{")
    if sse_events(r.text)[-1]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_completion_json_schema_grammar_and_response_format(client):
    r = client.post("/completion", json={"prompt": "x", "json_schema": PERSON, "seed": 4, **HOT, "n_predict": 200})
    assert r.status_code == 200, r.text
    check_person(json.loads(r.json()["content"]))
    gbnf = 'root ::= "(" [0-9] ("," [0-9])* ")"'
    r = client.post("/completion", json={"prompt": "x", "grammar": gbnf, "seed": 5, **HOT})
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", r.json()["content"]), r.text
    r = client.post("/completion", json={"prompt": "x", "response_format": {"type": "json_object", "schema": PERSON},
                                         "seed": 6, **HOT})
    check_person(json.loads(r.json()["content"]))
    r = client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON}}, "seed": 7, **HOT})
    check_person(json.loads(r.json()["choices"][0]["text"]))


@pytest.mark.parametrize("path, body, match", [
    ("/completion", {"prompt": "x", "grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ("/completion", {"prompt": "x", "grammar": 'start: "a" nope'}, "nope"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "integer", "minimum": 3, "maximum": 1}}, "minimum"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "at most one"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, "strnig"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "yaml"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
        "tool_choice": "required"}, "'f'"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 101}}, "[-100, 100]"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"999999": 1}}, "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 2.5}, "[-2, 2]"),
    ("/completion", {"prompt": "x", "logit_bias": [[1]]}, "pairs"),
    ("/completion", {"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ("/completion", {"prompt": "x", "repeat_last_n": -5}, "repeat_last_n"),
])
def test_bad_constraints_and_sampler_fields_are_400(client, engine, path, body, match):
    before = engine.stats()["requests"]
    assert_400(client.post(path, json=body), match)
    assert engine.stats()["requests"] == before  # rejected before the engine accepted anything


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_are_valid_objects(client, tool_choice):
    for seed in range(3):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER, ADD], "seed": seed,
                                                      "tool_choice": tool_choice, "parallel_tool_calls": False, **HOT})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert isinstance(args, dict)
        if isinstance(tool_choice, dict) or call["function"]["name"] == "add":
            assert call["function"]["name"] == "add" and set(args) == {"a", "b"}
        else:
            assert call["function"]["name"] == "get_weather" and set(args) == {"city"}


def test_streamed_forced_tool_call(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [ADD], "tool_choice": "required",
                                                  "stream": True, "seed": 3, **HOT})
    events = sse_events(r.text)
    calls = [tc for e in events if e.get("choices") for tc in e["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and all(set(json.loads(c["function"]["arguments"])) == {"a", "b"} for c in calls)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_logit_bias_forms(client, engine):
    ban_all_but_a = {str(t): -100 for t in range(engine.tokenizer.vocab_size) if t != ord("a")}
    r = client.post("/v1/completions", json={"prompt": "x", "logit_bias": ban_all_but_a, "max_tokens": 6,
                                             "temperature": 1.0, "ignore_eos": True, "seed": 1})
    assert r.json()["choices"][0]["text"] == "aaaaaa", r.text
    r = client.post("/completion", json={"prompt": "x", "n_predict": 6, "temperature": 0, "ignore_eos": True,
                                         "logit_bias": [["b", 1000]]})
    assert r.json()["content"] == "bbbbbb"
    greedy = {"prompt": "x", "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    first = client.post("/completion", json=greedy).json()["tokens"][0]
    r = client.post("/completion", json={**greedy, "logit_bias": [[first, False]]})
    assert first not in r.json()["tokens"], r.text


def test_penalties_change_greedy_output(client):
    base = {"prompt": "xy", "n_predict": 24, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    plain = client.post("/completion", json=base).json()["tokens"]
    # llama.cpp semantics: the window covers prompt + output, so nothing seen there comes again
    seen = client.post("/completion", json={**base, "presence_penalty": 100.0, "repeat_last_n": -1}).json()["tokens"]
    assert len(set(seen)) == 24 and not set(seen) & {ord("x"), ord("y")}
    rep = client.post("/completion", json={**base, "repeat_penalty": 5.0}).json()["tokens"]
    freq = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                                "frequency_penalty": 2.0}).json()["choices"][0]["text"]
    plain_text = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True}).json()["choices"][0]["text"]
    assert len(set(plain)) < 24 and rep != plain and freq != plain_text
def test_post_sampling_probs(client):
    body = {"prompt": "x", "n_predict": 3, "temperature": 0.7, "top_k": 3, "n_probs": 5, "seed": 2,
            "post_sampling_probs": True}
    out = client.post("/completion", json=body).json()
    for p in out["completion_probabilities"]:
        assert 0 < p["prob"] <= 1 and "logprob" not in p
        tops = p["top_probs"]
        assert 1 <= len(tops) <= 3 and math.isclose(sum(t["prob"] for t in tops), 1.0, rel_tol=1e-4)
        assert p["id"] in {t["id"] for t in tops}
    raw = client.post("/completion", json={**body, "post_sampling_probs": False}).json()
    assert all(len(p["top_logprobs"]) == 5 for p in raw["completion_probabilities"])


def test_n_choices_chat_and_completions(client, engine):
    body = {"messages": CHAT, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in out["choices"]}) > 1  # choice i samples with seed + i
    assert out["usage"]["completion_tokens"] == 15 and out["system_fingerprint"]
    assert out["opencoti"]["cached_prefix_tokens"] == out["usage"]["prompt_tokens"] - 1  # prompt computed once
    assert engine.pools()["pools"] == [] and engine.stats()["sessions"] == 0  # temporary pool and sessions gone
    r = client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    firsts = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
    assert [e["choices"][0]["index"] for e in firsts] == [0, 1, 2]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in firsts)
    finals = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1, 2] and all(c["finish_reason"] == "length" for c in finals)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 15
    texts = ["".join(e["choices"][0]["delta"].get("content") or "" for e in events
                     if e["choices"] and e["choices"][0]["index"] == i) for i in range(3)]
    assert texts == [c["message"]["content"] for c in out["choices"]]  # same seeds, same choices
    r = client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True})
    ch = r.json()["choices"]
    assert [c["index"] for c in ch] == [0, 1] and ch[0]["text"] == ch[1]["text"]  # greedy: identical choices
    assert_400(client.post("/v1/completions", json={"prompt": "x", "n": 0}), "n must be")
    assert_400(client.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "session_id": "s"}), "session_id")


def test_context_exceeded_error_reports_n_prompt_tokens_and_n_ctx(client, engine):
    # an explicit max_tokens past the context on an OpenAI route (llama.cpp's /completion runs to the
    # context instead: test_llamacpp_details.py), and a prompt longer than the context anywhere
    for path, body, n in [("/v1/completions", {"prompt": "x" * 100, "max_tokens": 5000}, 100),
                          ("/completion", {"prompt": "x" * (engine.max_context + 1), "n_predict": 1},
                           engine.max_context + 1)]:
        r = client.post(path, json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error"
        assert err["n_prompt_tokens"] == n and err["n_ctx"] == engine.max_context


def test_timings_predicted_n_equals_tokens_predicted(client):
    out = client.post("/completion", json={"prompt": "x", "n_predict": 5, "temperature": 0, "ignore_eos": True}).json()
    assert out["timings"]["predicted_n"] == out["tokens_predicted"] == 5
    events = sse_events(client.post("/completion", json={"prompt": "x", "n_predict": 4, "temperature": 0,
                                                         "ignore_eos": True, "stream": True}).text)
    assert all(len(e["tokens"]) == 1 for e in events[:-1])  # stream chunks carry their token
    assert events[-1]["timings"]["predicted_n"] == events[-1]["tokens_predicted"] == 4
    out = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0}).json()
    assert out["system_fingerprint"].startswith("opencoti-")


def test_infill_is_501_without_fim_tokens(client):
    r = client.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):\n", "prompt": ""})
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["code"] == 501 and "fill-in-the-middle" in err["message"] and "/completion" in err["message"]


def test_cors_any_origin_is_echoed_with_preflight(engine):
    with TestClient(create_app(engine, config=ServerConfig(cors_origins=["*"])), raise_server_exceptions=False) as c:
        origin = "http://tool.example:5173"
        r = c.options("/completion", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "content-type, authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "content-type" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/health", headers={"Origin": origin})
        assert r.headers["access-control-allow-origin"] == origin  # echoed, not '*'


def test_infill_builds_the_fim_prompt_when_the_model_has_fim_tokens(client, monkeypatch):
    import opencoti.server.routes_generate as rg

    monkeypatch.setattr(rg, "fim_tokens", lambda ctx: (259, 260, 261))  # reserved specials stand in
    r = client.post("/infill", json={"input_prefix": "ab", "input_suffix": "c", "prompt": "d", "n_predict": 2,
                                     "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] == 3 + 2 + 1 + 1
    assert_400(client.post("/infill", json={"input_prefix": 5}), "input_prefix")


def test_completion_prompt_forms_response_fields_and_progress(client):
    base = {"n_predict": 3, "temperature": 0, "ignore_eos": True}
    one = client.post("/completion", json={"prompt": "ab", **base}).json()
    many = client.post("/completion", json={"prompt": ["ab", [97, 98], {"prompt_string": "ab"}], **base})
    assert many.status_code == 200, many.text
    outs = many.json()
    assert [o["index"] for o in outs] == [0, 1, 2] and all(o["content"] == one["content"] for o in outs)
    obj = client.post("/completion", json={"prompt": {"prompt_string": "ab"}, **base}).json()
    assert obj["content"] == one["content"]
    assert_400(client.post("/completion", json={"prompt": {"prompt_string": "ab", "multimodal_data": ["x"]}}),
               "multimodal")
    streamed = sse_events(client.post("/completion", json={"prompt": ["ab", "ab"], "stream": True, **base}).text)
    assert ["".join(e["content"] for e in streamed if e["index"] == i) for i in (0, 1)] == [one["content"]] * 2
    picked = client.post("/completion", json={"prompt": "ab", **base,
                                              "response_fields": ["content", "generation_settings/n_predict", "nope"]})
    assert picked.json() == {"content": one["content"], "generation_settings/n_predict": 3}
    events = sse_events(client.post("/completion", json={"prompt": "ab", **base, "stream": True,
                                                         "return_progress": True}).text)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress[0]["total"] == 2 and progress[-1]["processed"] == 2 and progress[0]["processed"] <= 2
    assert "".join(e["content"] for e in events) == one["content"]


def test_models_list_aliases_and_props_reports_the_model_path(engine):
    with TestClient(create_app(engine, config=ServerConfig(model_alias="my-model")),
                    raise_server_exceptions=False) as c:
        (m,) = c.get("/v1/models").json()["data"]
        assert m["id"] == "my-model" and set(m["aliases"]) == {"my-model", engine.model_name}
        props = c.get("/props").json()
        assert props["model_path"] == str(engine.loaded.model_dir) and props["model_alias"] == "my-model"


def test_continue_final_message_and_add_generation_prompt(client, engine):
    prefix = [{"role": "user", "content": "Count"}]
    cont = prefix + [{"role": "assistant", "content": "1, 2"}]
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    tmpl = engine.apply_chat_template(prefix)  # ends with the opened assistant turn
    want = client.post("/completion", json={"prompt": tmpl + "1, 2", "n_predict": 4, "temperature": 0,
                                            "ignore_eos": True}).json()["content"]
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
        r = client.post("/v1/chat/completions", json={"messages": cont, **greedy, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want  # only the continuation
        assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenize(tmpl + "1, 2"))
    r = client.post("/v1/chat/completions", json={"messages": prefix, "add_generation_prompt": False, **greedy})
    assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenize(
        engine.apply_chat_template(prefix, add_generation_prompt=False)))
    new_turn = client.post("/v1/chat/completions", json={"messages": cont, "continue_final_message": False,
                                                         "add_generation_prompt": True, **greedy}).json()
    assert new_turn["usage"]["prompt_tokens"] == len(engine.tokenize(engine.apply_chat_template(cont)))
    for body, match in (({"messages": cont, "continue_final_message": True, "add_generation_prompt": True},
                         "cannot both be true"),
                        ({"messages": prefix, "continue_final_message": True}, "end with an assistant"),
                        ({"messages": cont + [{"role": "assistant", "content": "3"}]}, "two or more assistant")):
        assert_400(client.post("/v1/chat/completions", json=body), match)


def test_serve_seed_flag():
    import argparse

    from opencoti.server.serve import add_arguments, engine_seed

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).seed == -1 and p.parse_args(["--seed", "42"]).seed == 42
    assert engine_seed(42) == 42 and engine_seed(-1) != engine_seed(-1)  # -1: random per start


def test_slot_actions_map_onto_session_persistence(engine, make_engine, tmp_path):
    # without a state directory: 501, like llama.cpp without --slot-save-path
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        sid = c.post("/completion", json={"prompt": "hello", "n_predict": 2}).headers["x-session-id"]
        r = c.post(f"/slots/{sid}?action=save", json={"filename": "a.bin"})
        assert r.status_code == 501 and "--state-dir" in r.json()["error"]["message"]
        assert_400(c.post(f"/slots/{sid}?action=frob", json={}), "save, restore or erase")
    eng = make_engine(state_dir=str(tmp_path))
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        sid = c.post("/completion", json={"prompt": "hello there", "n_predict": 2}).headers["x-session-id"]
        saved = c.post(f"/slots/{sid}?action=save", json={"filename": "a.bin"})
        assert saved.status_code == 200, saved.text
        assert saved.json()["id_slot"] == sid and saved.json()["n_saved"] > 0
        erased = c.post(f"/slots/{sid}?action=erase")
        assert erased.status_code == 200 and erased.json()["n_erased"] > 0
        restored = c.post(f"/slots/{sid}?action=restore", json={"filename": "a.bin"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == saved.json()["n_saved"]
        assert_400(c.post(f"/slots/{sid}?action=save", json={}), "filename")


def test_chat_stream_wire_shape(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [e["choices"][0]["delta"] for e in events[1:] if e["choices"]]
    assert all(d.get("content") != "" for d in deltas)  # no empty-content deltas
    assert all(e["system_fingerprint"].startswith("opencoti-") for e in events)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["timings"]["predicted_n"] == 6
