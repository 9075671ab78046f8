"""Anthropic Messages (/v1/messages, /v1/messages/count_tokens) and OpenAI Responses (/v1/responses)
over the tiny model: the translation onto the chat operation (the same prompt as the equivalent
chat request), answers and event sequences, tools, structured output, previous_response_id through
the prefix cache, pools by header, errors in each API's shape; and the llama.cpp details (CORS
preflights and localhost origins, ignore_eos in generation_settings, timings on prompt progress,
/chat/completions/input_tokens, n with id_slot, verbose, /props seed)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from test_server import CHAT, WEATHER, script, sse_events

from opencoti.server import ServerConfig, create_app

A_WEATHER = {"name": "get_weather", "description": "Weather in a city.",
             "input_schema": WEATHER["function"]["parameters"]}
R_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def named_events(text: str) -> list[tuple[str, dict]]:
    """(event line, data) of each server-sent event."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def input_tokens(client, messages, tools=None) -> int:
    r = client.post("/v1/chat/completions/input_tokens", json={"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


# ============================================================================ Anthropic Messages
def test_messages_answer_and_its_prompt_is_the_chat_prompt(client, engine, monkeypatch):
    seen = script(monkeypatch, engine, ["Hi", " there"])
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "You are "},
                                                                                  {"type": "text", "text": "terse."}],
                                          "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                                    {"type": "text", "text": " there"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant" and body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": "Hi there"}] and body["stop_reason"] == "end_turn"
    assert body["usage"]["output_tokens"] == 2 and "timings" not in body
    assert set(body["usage"]) >= {"input_tokens", "cache_read_input_tokens", "output_tokens"}
    assert seen[0][0] == engine.tokenize(engine.apply_chat_template(CHAT))  # system blocks + text parts joined
    assert seen[0][1]["params"].max_tokens == 9
    assert r.headers["x-session-id"] == "scripted"


def test_messages_tool_history_renders_as_the_openai_one(client):
    anthropic = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_2", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_2", "is_error": True,
                                      "content": [{"type": "text", "text": "no forecast"}]}]}]
    openai = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "Error: no forecast"}]
    r = client.post("/v1/messages/count_tokens", json={"messages": anthropic, "tools": [A_WEATHER]})
    assert r.status_code == 200 and set(r.json()) == {"input_tokens"}
    assert r.json()["input_tokens"] == input_tokens(client, openai, [WEATHER])
    r = client.post("/v1/messages", json={"max_tokens": 2, "messages": anthropic[:3]})
    assert r.status_code == 200, r.text


def test_messages_forced_tool_streams_a_tool_use_block(client, engine, monkeypatch):
    seen = script(monkeypatch, engine, ['{"city": "Rome"}', "}\n</tool_call>"])
    r = client.post("/v1/messages", json={"max_tokens": 50, "stream": True, "tools": [A_WEATHER],
                                          "tool_choice": {"type": "tool", "name": "get_weather"},
                                          "messages": [{"role": "user", "content": "Rome?"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = named_events(r.text)
    assert all(name == data["type"] for name, data in events)
    kinds = [name for name, _ in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    start = events[2][1]
    assert start["index"] == 0 and start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["name"] == "get_weather" and start["content_block"]["id"].startswith("toolu_")
    assert json.loads(events[3][1]["delta"]["partial_json"]) == {"city": "Rome"}
    assert events[5][1]["delta"]["stop_reason"] == "tool_use" and events[5][1]["usage"]["output_tokens"] == 2
    assert engine.detokenize(seen[0][0]).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_messages_stream_text_then_stop_sequence(client, engine, monkeypatch):
    script(monkeypatch, engine, ["One", ", two"], stop_reason="stop")
    r = client.post("/v1/messages", json={"max_tokens": 20, "stream": True, "stop_sequences": ["three"],
                                          "messages": [{"role": "user", "content": "Count"}]})
    events = named_events(r.text)
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["input_tokens"] > 0
    deltas = [d for k, d in events if k == "content_block_delta"]
    assert [d["delta"] for d in deltas] == [{"type": "text_delta", "text": "One"}, {"type": "text_delta", "text": ", two"}]
    assert all(d["index"] == 0 for d in deltas)
    assert [k for k, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("body, status, match", [
    ({"max_tokens": 5, "messages": []}, 400, "at least one message"),
    ({"max_tokens": 5}, 400, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        {"type": "text", "text": "What is this?"}]}]}, 400, "image input is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                  "content": [{"type": "image", "source": {}}]}]}]},
     400, "image input is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "'user' or 'assistant'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                 "name": "web_search"}]},
     400, "server tool"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}}, 400,
     "tool_choice"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
])
def test_messages_bad_requests_in_anthropic_shape(client, engine, body, status, match):
    before = engine.stats()["requests"]
    r = client.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert match in err["error"]["message"], err["error"]["message"]
    assert engine.stats()["requests"] == before  # nothing ran


def test_messages_api_key_by_x_api_key_and_pool_by_header(engine):
    with TestClient(create_app(engine, config=ServerConfig(api_key="k")), raise_server_exceptions=False) as c:
        r = c.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        pool = c.post("/polykv/pools", json={"messages": CHAT[:1]}, headers={"x-api-key": "k"}).json()
        body = {"max_tokens": 2, "system": CHAT[0]["content"], "messages": [{"role": "user", "content": "Hi"}]}
        for path, payload in (("/v1/messages", body), ("/v1/responses", {"instructions": CHAT[0]["content"],
                                                                         "input": "Hi", "max_output_tokens": 2})):
            r = c.post(path, json=payload, headers={"x-api-key": "k", "x-pool-id": str(pool["pool_id"])})
            assert r.status_code == 200, r.text
            assert r.headers["x-pool-id"] == str(pool["pool_id"]) and int(r.headers["x-cached-prefix-tokens"]) > 0
            bad = c.post(path, json=payload, headers={"x-api-key": "k", "x-pool-id": "first"})
            assert bad.status_code == 400 and "x-pool-id" in bad.text
        metrics = c.get("/metrics", headers={"x-api-key": "k"}).text
        assert 'handler="/v1/messages"' in metrics and 'handler="/v1/responses"' in metrics
        for s in c.get("/slots", headers={"x-api-key": "k"}).json():
            c.delete(f"/polykv/sessions/{s['session_id']}", headers={"x-api-key": "k"})
        engine.release_pool(pool["pool_id"], immediate=True)


# ============================================================================ OpenAI Responses
def test_responses_answer_and_previous_response_id_reuses_the_cache(client, engine):
    r = client.post("/v1/responses", json={"instructions": "You are terse.", "input": "Hello there",
                                           "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["object"] == "response" and first["id"].startswith("resp_")
    (item,) = first["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_") and item["content"][0]["type"] == "output_text"
    assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
    assert first["usage"]["output_tokens"] == 4
    r = client.post("/v1/responses", json={"instructions": "You are terse.", "previous_response_id": first["id"],
                                           "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                 "text": "More"}]}],
                                           "max_output_tokens": 2})
    second = r.json()
    history = [*CHAT, {"role": "assistant", "content": item["content"][0]["text"]}, {"role": "user", "content": "More"}]
    assert second["usage"]["input_tokens"] == input_tokens(client, history)
    # the first turn's prompt and answer were in the prefix cache
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]
    assert client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    r = client.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 400 and "resp_nope" in r.json()["error"]["message"]
    assert client.get("/v1/responses/resp_nope").status_code == 404


def test_responses_function_tools_round_trip(client, engine, monkeypatch):
    seen = script(monkeypatch, engine, ['{"city": "Rome"}', "}\n</tool_call>"])
    r = client.post("/v1/responses", json={"input": "Rome?", "tools": [R_WEATHER],
                                           "tool_choice": {"type": "function", "name": "get_weather"}})
    (call,) = r.json()["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Rome"} and call["call_id"].startswith("call_")
    seen.clear()
    script(monkeypatch, engine, ["Sunny."])
    items = [{"role": "user", "content": "Rome?"}, {k: call[k] for k in ("type", "call_id", "name", "arguments")},
             {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    r = client.post("/v1/responses", json={"input": items, "tools": [R_WEATHER]})
    assert r.json()["output"][0]["content"][0]["text"] == "Sunny." and r.json()["status"] == "completed"


def test_responses_stream_event_sequence(client, engine, monkeypatch):
    script(monkeypatch, engine, ["Hi", "!"])
    r = client.post("/responses", json={"input": "Hello", "stream": True, "timings_per_token": True,
                                        "return_progress": True})
    events = named_events(r.text)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    kinds = [k for k, _ in events]
    assert kinds == ["response.created", "response.in_progress", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert "prompt_progress" in events[2][1] and "prompt_per_second" in events[5][1]["timings"]
    done = events[-1][1]
    assert done["response"]["output"][0]["content"][0]["text"] == "Hi!" and "timings" in done
    assert done["response"]["id"] == events[0][1]["response"]["id"]


def test_responses_json_schema_format_is_enforced(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.post("/v1/responses", json={"input": "A number", "max_output_tokens": 40, "temperature": 1.0,
                                           "text": {"format": {"type": "json_schema", "name": "num",
                                                               "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    text = r.json()["output"][0]["content"][0]["text"]
    if r.json()["status"] == "completed":  # the random model may run out of tokens inside the number
        assert set(json.loads(text)) == {"n"}
    else:
        assert text.startswith('{"n"') or text.startswith("{")


@pytest.mark.parametrize("body, match", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]}, "image input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools"),
    ({"input": []}, "at least one input item"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
])
def test_responses_bad_requests(client, engine, body, match):
    before = engine.stats()["requests"]
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    assert engine.stats()["requests"] == before


# ============================================================================ llama.cpp details
def test_preflights_answered_and_localhost_origins_echoed_by_default(client, engine):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    for origin in ("http://localhost", "http://127.0.0.1:3000", "http://[::1]:3000"):
        r = client.options("/completions", headers={"Origin": origin, **pre})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        # in llama.cpp's spelling: clients that read headers into a plain dict look them up so
        names = {k for k, _ in r.headers.raw}
        assert {b"Access-Control-Allow-Origin", b"Access-Control-Allow-Credentials",
                b"Access-Control-Allow-Methods", b"Access-Control-Allow-Headers"} <= names, names
    for origin in ("http://evil.com", "http://localhost.evil.com", "http://notlocalhost"):
        r = client.options("/completions", headers={"Origin": origin, **pre})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert client.post("/completion", json={"prompt": "a", "n_predict": 1},
                           headers={"Origin": origin}).status_code == 403
    r = client.post("/completion", json={"prompt": "a", "n_predict": 1}, headers={"Origin": "http://localhost:5173"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "x-session-id" in r.headers["access-control-expose-headers"]


def test_llama_cpp_generation_details(client):
    gs = client.post("/completion", json={"prompt": "ab", "n_predict": 2, "ignore_eos": True}).json()
    assert gs["generation_settings"]["logit_bias"] and all(
        e["bias"] is None for e in gs["generation_settings"]["logit_bias"])
    gs = client.post("/completion", json={"prompt": "ab", "n_predict": 2}).json()
    assert gs["generation_settings"]["logit_bias"] == []
    events = sse_events(client.post("/completion", json={"prompt": "abc abc abc abc", "n_predict": 2, "stream": True,
                                                         "return_progress": True}).text)
    progress = [e for e in events if "prompt_progress" in e]
    assert len(progress) == 2 and progress[0]["timings"]["prompt_n"] == 0 and progress[0]["timings"]["prompt_ms"] == 0
    assert progress[-1]["timings"]["prompt_ms"] > 0 and progress[-1]["timings"]["predicted_n"] == 0
    # chat streams report it too (chunks with no choices), the cached part done at once
    chat = {"messages": [{"role": "user", "content": "This is a test " * 10}], "max_tokens": 3, "stream": True,
            "return_progress": True}
    for _ in range(2):  # the second time most of the prompt comes from the prefix cache
        events = sse_events(client.post("/v1/chat/completions", json=chat).text)
        progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
        chunks = -(-(progress[0]["total"] - progress[0]["cache"]) // 64)  # the engine's batch: 64 tokens
        assert len(progress) == 1 + chunks and progress[0]["cache"] == progress[0]["processed"]  # one per chunk
        assert progress[-1]["processed"] == progress[-1]["total"] > progress[0]["processed"]
        assert all(e["choices"] == [] for e in events if "prompt_progress" in e)
    assert progress[0]["cache"] > 0
    msgs = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    r = client.post("/chat/completions", json={"messages": msgs, "n": 2, "id_slot": 0, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = client.post("/chat/completions", json={"messages": msgs, "n": 2, "session_id": "s", "max_tokens": 2})
    assert r.status_code == 400  # a named session holds one conversation
    assert "Book" in client.post("/chat/completions", json={"messages": msgs, "verbose": True, "max_tokens": 1}
                                 ).json()["__verbose"]["prompt"]
    assert "__verbose" not in client.post("/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert client.post("/chat/completions/input_tokens", json={"messages": msgs}).json()["input_tokens"] > 5
    assert client.post("/chat/completions/input_tokens", json={"messages": []}).status_code == 400


def test_props_reports_the_default_seed(make_engine):
    eng = make_engine(seed=42)
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        assert c.get("/props").json()["default_generation_settings"]["params"]["seed"] == 42


def test_server_seed_makes_a_request_repeatable_as_llama_cpp(engine):
    """``--seed N``: every request that gives no seed samples with N (the same request, the same
    answer); without it each request draws a fresh seed."""
    body = {"prompt": "abc", "n_predict": 12, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "ignore_eos": True, "return_tokens": True}
    with TestClient(create_app(engine, config=ServerConfig(default_seed=42)), raise_server_exceptions=False) as c:
        a, b = (c.post("/completion", json=body).json() for _ in range(2))
        assert a["tokens"] == b["tokens"] and a["generation_settings"]["seed"] == 42
        fresh = {tuple(c.post("/completion", json={**body, "seed": -1}).json()["tokens"]) for _ in range(3)}
        assert len(fresh) > 1  # -1: a fresh seed each time, as llama.cpp
        assert c.post("/completion", json={**body, "seed": 7}).json()["generation_settings"]["seed"] == 7
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        outs = [tuple(c.post("/completion", json=body).json()["tokens"]) for _ in range(4)]
        assert len(set(outs)) > 1  # fresh seeds


def test_resumable_stream_replays_and_stops(client):
    conv = "conv-1::ggml-org/tinygemma3-GGUF:Q8_0"  # a model name with slashes: the id goes in the query
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "stream": True}
    live = client.post("/chat/completions", json=body, headers={"X-Conversation-Id": conv})
    assert live.status_code == 200 and "data: " in live.text
    qs = {"conv_id": conv}
    replay = client.get("/v1/stream", params={**qs, "from": 0})
    assert replay.status_code == 200 and replay.text == live.text
    assert client.get("/v1/stream", params={**qs, "from": 10}).text == live.text[10:]
    assert client.get("/v1/stream", params={"conv_id": "other"}).status_code == 404
    assert client.get("/v1/stream").status_code == 400
    assert client.delete("/v1/stream", params=qs).status_code == 204
    assert client.get("/v1/stream", params={**qs, "from": 0}).status_code == 404
    assert client.delete("/v1/stream", params=qs).status_code == 204  # idempotent
    # without the header a stream is not kept
    client.post("/chat/completions", json=body)
    assert client.get("/v1/stream", params={"conv_id": ""}).status_code == 400


def test_errors_mid_stream_take_each_apis_event_shape(client, engine, monkeypatch):
    script(monkeypatch, engine, ["a", "b", "c"], fail_after=1)
    r = client.post("/v1/messages", json={"max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "x"}]})
    name, data = named_events(r.text)[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/responses", json={"input": "x", "stream": True})
    name, data = named_events(r.text)[-1]
    assert name == "error" and data["type"] == "error" and "scripted failure" in data["message"]
