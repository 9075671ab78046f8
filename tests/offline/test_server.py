"""The HTTP server on the tiny model, in-process (Starlette TestClient / raw ASGI, no sockets):
compatibility routes, generation routes (llama.cpp and OpenAI shapes, SSE), tool calls through a
scripted generation, errors, API key, body limit, CORS, loading state, client disconnects."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from opencoti.engine import SamplingParams
from opencoti.engine.errors import ContextLengthError, PoolSaturatedError
from opencoti.engine.results import GenerationResult, RequestInfo, TokenDelta
from opencoti.server import ServerConfig, create_app

GREEDY = {"temperature": 0, "ignore_eos": True}
# ChatML that ignores tools and tool calls (like SmolLM2's template)
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def sse_events(text: str) -> list:
    out = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def make_client(engine, **config):
    return TestClient(create_app(engine, config=ServerConfig(**config)), raise_server_exceptions=False)


def assert_error(r, status: int, etype: str | None = None, match: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"code", "message", "type"} <= set(err) and err["code"] == status
    assert set(err) - {"code", "message", "type"} <= {"n_prompt_tokens", "n_ctx"}  # llama.cpp's context error
    if etype:
        assert err["type"] == etype
    if match:
        assert match in err["message"], err["message"]
    return err


class StepBlocker:
    """Hold the engine's step thread (a command that waits) so a test controls when it runs again."""

    def __init__(self, engine):
        self.release = threading.Event()
        self.started = threading.Event()

        def block():
            self.started.set()
            self.release.wait(30)

        engine.post_to_step_thread(block)
        assert self.started.wait(30)


# ============================================================================ compatibility routes
def test_health_models_props_slots(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == engine.model_name
    props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == engine.max_context
    polykv = props["opencoti"]["polykv"]
    assert polykv["max_pools"] == engine.config.max_pools and polykv["page_size"] == 4
    assert polykv["admission_defaults"]["mode"] == "advisory" and polykv["tps"]["window_tokens"] > 0
    assert polykv["pin_policy"]["grace_ttl_s"] == engine.config.pool_grace_ttl_s
    kv = engine.kv  # K and V of one token over all layers, in the KV dtype
    assert polykv["kv_dtype"] == str(kv.dtype).removeprefix("torch.")
    assert polykv["kv_bytes_per_token"] == 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * kv.k_cache.element_size()
    assert client.get("/slots").json() == []
    r = client.post("/completion", json={"prompt": "hi", "n_predict": 3, "session_id": "slot-a", **GREEDY})
    assert r.status_code == 200
    slots = client.get("/slots").json()
    assert len(slots) == 1
    s = slots[0]
    assert s["session_id"] == "slot-a" and s["pool_id"] is None and s["is_processing"] is False
    assert s["ctx_used"] == 5 and s["ctx_total"] == engine.max_context
    assert s["ctx_headroom_tokens"] == engine.max_context - 5 and s["tps_ewma"] >= 0


def test_openapi_document(client):
    doc = client.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/completion", "/polykv/pools/{pool_id}/fork", "/polykv/tps", "/metrics"):
        assert path in doc["paths"], path
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"pool_id", "session_id", "shared_prefix_n_tokens", "overcommit", "tools", "messages"} <= set(schema)


def test_tokenize_detokenize_apply_template(client, engine):
    toks = client.post("/tokenize", json={"content": "Hello, world"}).json()["tokens"]
    assert toks == engine.tokenize("Hello, world")
    assert client.post("/detokenize", json={"tokens": toks}).json() == {"content": "Hello, world"}
    pieces = client.post("/tokenize", json={"content": "Hi", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": 72, "piece": "H"}, {"id": 105, "piece": "i"}]
    prompt = client.post("/apply-template", json={"messages": CHAT}).json()["prompt"]
    assert prompt == engine.apply_chat_template(CHAT)
    assert client.post("/detokenize", json={"tokens": []}).json() == {"content": ""}
    assert_error(client.post("/detokenize", json={"tokens": [1, 99999]}), 400, match="99999")
    assert_error(client.post("/tokenize", json={"content": 5}), 400, match="content")
    assert_error(client.post("/apply-template", json={"messages": [{"role": "user"}]}), 400, match="messages[0].content")


# ============================================================================ /completion (llama.cpp)
def test_completion_fields_and_timings(client):
    r = client.post("/completion", json={"prompt": "The sky is", "n_predict": 6, "n_probs": 2, "return_tokens": True,
                                         **GREEDY})
    assert r.status_code == 200
    body = r.json()
    assert body["stop"] is True and body["tokens_predicted"] == 6 and len(body["tokens"]) == 6
    assert body["tokens_evaluated"] == len("The sky is") and body["stop_type"] == "limit"
    assert body["truncated"] is False and body["prompt"] == "The sky is"
    assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
                                    "prompt_per_second", "cache_n"}
    assert body["generation_settings"]["n_predict"] == 6 and body["generation_settings"]["temperature"] == 0
    probs = body["completion_probabilities"]
    assert len(probs) == 6 and all(len(p["top_logprobs"]) == 2 and p["logprob"] <= 0 for p in probs)
    assert [p["id"] for p in probs] == body["tokens"]
    assert r.headers["x-session-id"] == body["session_id"] and r.headers["x-cached-prefix-tokens"] == "0"
    assert "x-pool-id" not in r.headers


def test_completion_stream_matches_non_stream(client):
    req = {"prompt": [72, 101, 108, 108, 111], "n_predict": 8, **GREEDY}
    whole = client.post("/completion", json=req).json()
    r = client.post("/completion", json={**req, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    # the same prompt again: all but its last token come from the prefix cache
    assert r.headers["x-session-id"] and r.headers["x-cached-prefix-tokens"] == str(len(req["prompt"]) - 1)
    events = sse_events(r.text)
    assert "[DONE]" not in events  # llama.cpp's /completion stream ends with stop: true, not [DONE]
    assert [e["stop"] for e in events] == [False] * 8 + [True]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["timings"]["predicted_n"] == 8 and events[-1]["tokens_predicted"] == 8


def test_session_reuse_over_http(client):
    first = client.post("/completion", json={"prompt": "abcdefghij", "n_predict": 4, **GREEDY})
    sid = first.headers["x-session-id"]
    again = client.post("/completion", json={"prompt": "abcdefghij" + first.json()["content"] + "k", "n_predict": 2,
                                             "session_id": sid, **GREEDY})
    assert again.headers["x-session-id"] == sid
    assert int(again.headers["x-cached-prefix-tokens"]) >= 10 and again.json()["tokens_cached"] >= 10


# ============================================================================ OpenAI routes
def test_v1_completions(client):
    r = client.post("/v1/completions", json={"model": "x", "prompt": "Once", "max_tokens": 5, "logprobs": 1,
                                             "echo": True, **GREEDY})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    ch = body["choices"][0]
    assert ch["text"].startswith("Once") and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == 5 and ch["logprobs"]["text_offset"][0] == 4
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    r = client.post("/v1/completions", json={"prompt": ["Once"], "max_tokens": 5, "stream": True,
                                             "stream_options": {"include_usage": True}, **GREEDY})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert events[-3]["choices"][0]["finish_reason"] == "length" and "timings" in events[-3]
    assert all(e["usage"] is None for e in events[:-2])
    assert "Once" + "".join(e["choices"][0]["text"] for e in events[:-3]) == ch["text"]


def test_chat_completion_and_stream(client):
    req = {"messages": CHAT, "max_tokens": 6, **GREEDY}
    r = client.post("/v1/chat/completions", json=req)
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str) and "tool_calls" not in msg
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 6
    assert body["timings"]["predicted_n"] == 6 and body["opencoti"]["session_id"] == r.headers["x-session-id"]
    r = client.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True},
                                                  "logprobs": True, "top_logprobs": 2})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[-1] == "[DONE]" and events[-2]["usage"]["total_tokens"] == body["usage"]["total_tokens"]
    assert events[-2]["choices"] == [] and events[-2]["timings"]["predicted_n"] == 6  # the usage chunk: timings too
    final = events[-3]
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert "timings" in final
    deltas = [e["choices"][0] for e in events[1:-3]]
    assert "".join(d["delta"].get("content", "") for d in deltas) == msg["content"]
    assert len(deltas) == 6 and all(len(d["logprobs"]["content"][0]["top_logprobs"]) == 2 for d in deltas)


def test_chat_finish_reason_stop_on_eos(client, engine, monkeypatch):
    script(monkeypatch, engine, ["Hi", " there"], stop_reason="eos")
    r = client.post("/v1/chat/completions", json={"messages": CHAT})
    assert r.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hi there"},
                                      "logprobs": None, "finish_reason": "stop"}


# ============================================================================ tool calls (scripted generation)
class ScriptedStream:
    """Stands in for AsyncTokenStream: yields the scripted pieces, then a GenerationResult."""

    def __init__(self, pieces, prompt, stop_reason, fail_after=None):
        self.pieces, self.stop_reason, self.fail_after = list(pieces), stop_reason, fail_after
        self.info = RequestInfo(request_id="req-s", session_id="scripted", pool_id=None, cached_prefix_tokens=0,
                                prompt_tokens=len(prompt))
        self.result = None
        self.closed = False
        self._i = 0

    def __aiter__(self):
        return self

    def report_progress(self) -> None:
        """(AsyncTokenStream's: the scripted stream computes no prompt, so it yields no PromptProgress)"""

    async def __anext__(self):
        if self.fail_after is not None and self._i == self.fail_after:
            raise ContextLengthError("scripted failure mid-stream")
        if self._i == len(self.pieces):
            text = "".join(self.pieces)
            self.result = GenerationResult(text=text, token_ids=[65] * len(self.pieces), stop_reason=self.stop_reason,
                                           stopping_word="", truncated=False,
                                           timings={"prompt_n": 1, "predicted_n": len(self.pieces), "cache_n": 0},
                                           info=self.info)
            raise StopAsyncIteration
        self._i += 1
        return TokenDelta(token_id=65, text=self.pieces[self._i - 1])

    async def aclose(self):
        self.closed = True

    async def started(self):  # a scripted generation starts at once
        pass


def script(monkeypatch, engine, pieces, stop_reason="eos", fail_after=None):
    """Replace the engine's generation with a scripted one; returns the list of (prompt, kwargs) seen."""
    seen = []

    async def astream(prompt, **kw):
        seen.append((prompt, kw))
        return ScriptedStream(pieces, prompt, stop_reason, fail_after)

    monkeypatch.setattr(engine, "astream", astream)
    return seen


def test_tool_call_non_streaming(client, engine, monkeypatch):
    seen = script(monkeypatch, engine, ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
                                        "\n</tool_call>"])
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt_text = engine.detokenize(seen[0][0])
    assert "get_weather" in prompt_text  # the tool definitions reached the prompt


def test_tool_call_streaming_deltas(client, engine, monkeypatch):
    script(monkeypatch, engine, ["Sure. ", "<tool_", 'call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                                 "</tool_call>"])
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER], "stream": True})
    events = sse_events(r.text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


def test_named_tool_choice_prefills_the_call(client, engine, monkeypatch):
    seen = script(monkeypatch, engine, ['{"city": "Rome"}', "}\n</tool_call>"])
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert engine.detokenize(seen[0][0]).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_tool_round_trip_renders_the_history(client, engine, monkeypatch):
    seen = script(monkeypatch, engine, ["It is ", "sunny."])
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "It is sunny." and body["choices"][0]["finish_reason"] == "stop"
    prompt = engine.detokenize(seen[0][0])
    assert "sunny, 21 C" in prompt and '"city": "Paris"' in prompt


def test_templates_without_tools_get_them_in_the_system_prompt(client, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", PLAIN_TEMPLATE)  # as SmolLM2's: it ignores tools
    seen = script(monkeypatch, engine, ['{"name": "get_weather", "arguments": {"city": "Lima"}}'])
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]})
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    prompt = engine.detokenize(seen[0][0])
    assert prompt.startswith("system\nYou are terse.\n\n# Tools")  # (specials are not detokenized)
    assert json.dumps(WEATHER) in prompt


def test_error_during_a_stream_is_an_sse_event(client, engine, monkeypatch):
    stream_seen = script(monkeypatch, engine, ["a", "b", "c"], fail_after=2)
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == {"error": {"code": 400, "message": "scripted failure mid-stream",
                                    "type": "exceed_context_size_error"}}
    assert "[DONE]" not in events and len(stream_seen) == 1


def test_streams_end_with_an_error_event_on_shutdown(client, engine):
    client.app.state.server.begin_stop(0.0)  # as on SIGTERM once the grace period has passed
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "max_tokens": 400,
                                                  "session_id": "late", **GREEDY})
    events = sse_events(r.text)
    assert events[-1] == {"error": {"code": 503, "message": "the server is shutting down", "type": "unavailable_error"}}
    row = wait_idle(engine, "late")
    assert row["generated_tokens"] < 400  # its request was cancelled
    with client.stream("GET", "/polykv/tps") as s:  # an endless stream ends at once when stopping
        assert sse_events("".join(s.iter_text())) == []


# ============================================================================ errors
@pytest.mark.parametrize("path,body,match", [
    ("/completion", {"prompt": "x", "n_predict": "ten"}, "n_predict"),
    ("/completion", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/completion", {"prompt": 12}, "prompt"),
    ("/completion", {"n_predict": 3}, "prompt"),
    ("/completion", {"prompt": ""}, "prompt is empty"),
    ("/completion", {"prompt": "x", "n_predict": 0}, "max_tokens"),
    ("/completion", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/completion", {"prompt": [1, 99999]}, "outside the vocabulary"),
    ("/completion", {"prompt": "x", "session_id": "caf\u00e9"}, "session_id"),
    ("/completion", {"prompt": "x", "shared_prefix_n_tokens": 2}, "needs a pool_id"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]: prompt is empty"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n must be an integer"),
    ("/v1/completions", {"prompt": "a", "suffix": "z"}, "suffix"),
    ("/v1/chat/completions", {"messages": []}, "non-empty list"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 5.0}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
])
def test_bad_requests_are_400(client, engine, path, body, match):
    before = engine.stats()
    assert_error(client.post(path, json=body), 400, match=match)
    after = engine.stats()
    assert after["requests"] == before["requests"] and after["sessions"] == before["sessions"]  # nothing half-done


def test_malformed_json_and_non_object_bodies(client):
    json_type = {"content-type": "application/json"}
    for body in (b"{not json", b"[1, 2]", b"", b'"text"'):
        assert_error(client.post("/v1/chat/completions", content=body, headers=json_type), 400, "invalid_request_error")
    # a body must say it is JSON: a web page can send text/plain or a form cross-site, never JSON
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        assert_error(client.post("/completion", content=b'{"prompt": "hi", "n_predict": 1}', headers=headers), 415,
                     "invalid_request_error", "application/json")
    r = client.post("/completion", content=b'{"prompt": "hi", "n_predict": 1}',
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 1
    assert client.post("/polykv/pools/999/pin").status_code == 404  # no body: no Content-Type needed


def test_prompt_beyond_context_is_400(client, engine):
    err = assert_error(client.post("/completion", json={"prompt": "x" * (engine.max_context + 5)}), 400,
                       "exceed_context_size_error")
    assert "exceeds the context length" in err["message"]
    # the OpenAI routes: OpenAI's error code (what its SDKs and langchain-openai map to a context overflow)
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10_000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"].endswith("(context_length_exceeded)")  # the SDKs' exception text is the message
    assert err["n_ctx"] == engine.max_context and err["n_prompt_tokens"] > 0


def test_unknown_ids_and_routes(client):
    assert_error(client.post("/completion", json={"prompt": "x", "pool_id": 77}), 404, "not_found_error", "pool 77")
    assert_error(client.get("/no/such/route"), 404, "not_found_error")
    assert_error(client.delete("/polykv/sessions/nobody"), 404, "not_found_error", "nobody")
    assert client.put("/health").status_code == 405


def test_busy_session_is_409(client, engine):
    s = engine.stream([5] * 8, params=SamplingParams.greedy(400, ignore_eos=True), session_id="busy")
    blocker = StepBlocker(engine)  # the first request cannot finish before the second one is checked
    timer = threading.Timer(0.2, blocker.release.set)
    timer.start()
    try:
        assert_error(client.post("/completion", json={"prompt": "x", "session_id": "busy"}), 409, "conflict_error",
                     "busy")
    finally:
        blocker.release.set()
        timer.join()
        s.close()


def test_admission_reject_maps_to_429_with_retry_after(client, engine, monkeypatch):
    async def saturated(prompt, **kw):
        raise PoolSaturatedError("pool 1 cannot admit a new session: projected mean tps below floor", retry_after=2.3,
                                 pool_id=1, reason="projected mean tps below floor",
                                 capacity={"sessions_remaining": 0})

    monkeypatch.setattr(engine, "astream", saturated)
    r = client.post("/v1/chat/completions", json={"messages": CHAT})
    assert_error(r, 429, "pool_saturated_error", "below floor")
    assert r.headers["retry-after"] == "3" and r.headers["x-sessions-remaining"] == "0"


# ============================================================================ API key, body limit, CORS
def test_api_key(engine):
    with make_client(engine, api_key="s3cret") as c:
        assert c.get("/health").status_code == 200  # public
        assert_error(c.get("/v1/models"), 401, "authentication_error", "missing API key")
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
        assert_error(c.post("/completion", json={"prompt": "x"}, headers={"X-Api-Key": "nope"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/polykv/pools", headers={"X-Api-Key": "s3cret"}).status_code == 200
        assert engine.stats()["requests"] == 0


def test_body_limit(engine):
    with make_client(engine, max_body_bytes=200) as c:
        assert_error(c.post("/completion", json={"prompt": "x" * 500}), 413, match="exceeds the limit")

        def chunks():  # no Content-Length: counted while reading
            for _ in range(10):
                yield b" " * 50

        assert_error(c.post("/completion", content=chunks(), headers={"content-type": "application/json"}), 413)
        assert c.post("/completion", json={"prompt": "ok", "n_predict": 1}).status_code == 200


def test_cors_off_by_default_on_when_asked(client, engine):
    r = client.options("/v1/chat/completions", headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    with make_client(engine, cors_origins=["http://ui.example"], api_key="k") as c:
        r = c.options("/v1/chat/completions", headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.get("/health", headers={"Origin": "http://ui.example"})
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        assert "x-session-id" in r.headers["access-control-expose-headers"]


# ============================================================================ loading state
def test_health_is_503_while_loading(make_engine):
    go = threading.Event()

    def factory():
        assert go.wait(30)
        return make_engine()

    with TestClient(create_app(engine_factory=factory), raise_server_exceptions=False) as c:
        r = c.get("/health")
        assert_error(r, 503, "unavailable_error", "Loading model")
        assert r.headers["retry-after"]
        assert_error(c.post("/completion", json={"prompt": "x"}), 503, match="Loading model")
        go.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.post("/completion", json={"prompt": "x", "n_predict": 1}).status_code == 200
    # the app owned that engine: it is shut down with the app (make_engine's check skips closed engines)


def test_load_failure_is_reported():
    def factory():
        raise RuntimeError("no such model")

    with TestClient(create_app(engine_factory=factory), raise_server_exceptions=False) as c:
        deadline = time.monotonic() + 30
        while c.get("/health").status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert_error(c.get("/health"), 500, "model_load_error", "no such model")


# ============================================================================ disconnects (raw ASGI)
async def asgi_request(app, path: str, body: dict, disconnect_after_chunks: int | None = None,
                       on_chunk=None) -> tuple[int | None, list[bytes]]:
    """Drive the ASGI app directly; optionally disconnect after N body chunks (0: right after the request)."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 80)}
    gone = asyncio.Event()
    if disconnect_after_chunks == 0:
        gone.set()
    sent_body = False
    status = None
    chunks: list[bytes] = []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body" and msg.get("body"):
            chunks.append(msg["body"])
            if on_chunk is not None:
                on_chunk(len(chunks))
            if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
                gone.set()

    await asyncio.wait_for(app(scope, receive, send), 60)
    return status, chunks


def wait_idle(engine, session_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        rows = {s["session_id"]: s for s in engine.tps_snapshot()["sessions"]}
        if rows.get(session_id, {}).get("state") == "idle":
            return rows[session_id]
        assert time.monotonic() < deadline, rows
        time.sleep(0.01)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    ("/completion", {"prompt": "Tell me everything", "stream": True}),
    ("/v1/completions", {"prompt": "Tell me everything", "stream": True}),
])
def test_disconnect_mid_stream_cancels_and_frees(engine, path, body):
    app = create_app(engine)
    pool = engine.create_pool(text="shared prefix text")
    blockers = []

    def on_chunk(n):
        if n == 2:  # hold the step thread: the request cannot run to its end before the cancel lands
            blockers.append(StepBlocker(engine))

    req = {**body, "max_tokens": 400, "n_predict": 400, "session_id": "leaver", "pool_id": pool.pool_id, **GREEDY}
    if "prompt" in req:
        req["prompt"] = "shared prefix text, then more"
    status, chunks = asyncio.run(asgi_request(app, path, req, disconnect_after_chunks=2, on_chunk=on_chunk))
    blockers[0].release.set()
    assert status == 200 and len(chunks) >= 2
    row = wait_idle(engine, "leaver")
    assert row["generated_tokens"] < 400  # cancelled, not run to the end
    st = engine.stats()
    assert st["running"] == 0 and st["waiting"] == 0
    engine.check_integrity()
    # the session kept its cache (pages owned by it); releasing it leaves only the pool's pages
    engine.release_session("leaver")
    pools = engine.pools()
    assert pools["kv_pages_used"] * engine.kv.page_bytes == sum(p["own_kv_bytes"] for p in pools["pools"])


def test_disconnect_before_a_non_streaming_answer(engine):
    app = create_app(engine)
    blocker = StepBlocker(engine)  # nothing runs until the client is gone
    threading.Timer(0.3, blocker.release.set).start()
    status, chunks = asyncio.run(asgi_request(app, "/completion", {"prompt": "abc", "n_predict": 300,
                                                                   "session_id": "gone", **GREEDY},
                                              disconnect_after_chunks=0))
    assert chunks == [] or status == 499
    # the request was still waiting for the step thread when the client left: it never started
    # (had it started, it would have been cancelled: idle, short of its 300 tokens)
    sessions = {s["session_id"]: s for s in engine.tps_snapshot()["sessions"]}
    if "gone" in sessions:
        assert wait_idle(engine, "gone")["generated_tokens"] < 300
        engine.release_session("gone")
    st = engine.stats()
    assert st["running"] == st["waiting"] == 0 and engine.pools()["kv_pages_used"] == 0


# ============================================================================ metrics & load
def test_metrics_parse(client):
    pool = client.post("/polykv/pools", json={"text": "metrics prefix"}).json()
    for i in range(2):
        r = client.post("/completion", json={"prompt": "metrics prefix!", "n_predict": 4, "pool_id": pool["pool_id"],
                                             **GREEDY})
        assert r.status_code == 200
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("opencoti:time_to_first_token_seconds", "opencoti:inter_token_latency_seconds",
                 "opencoti:e2e_request_latency_seconds", "opencoti:num_requests_running",
                 "opencoti:num_requests_waiting", "opencoti:kv_cache_usage_perc", "opencoti:http_requests",
                 "opencoti:request_success", "opencoti_polykv:pool_kv_bytes", "opencoti_polykv:gen_throughput_tps",
                 "opencoti_polykv:pool_sessions", "opencoti_polykv:prefix_cache_hits", "opencoti_polykv:queries"):
        assert name in fams, name
    ttft = {s.name: s.value for s in fams["opencoti:time_to_first_token_seconds"].samples}
    assert ttft["opencoti:time_to_first_token_seconds_count"] == 2
    itl = {s.name: s.value for s in fams["opencoti:inter_token_latency_seconds"].samples}
    assert itl["opencoti:inter_token_latency_seconds_count"] == 6
    for fam in fams.values():
        if fam.name.startswith("opencoti_polykv:"):
            for s in fam.samples:
                assert set(s.labels) <= {"pool"}, (fam.name, s.labels)  # never a session label
    queries = [s for s in fams["opencoti_polykv:queries"].samples if s.labels.get("pool") == str(pool["pool_id"])]
    assert queries and queries[0].value == 2
    success = {s.labels["finished_reason"]: s.value for s in fams["opencoti:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"length": 2}


def test_32_concurrent_streaming_chats_on_one_pool(engine):
    app = create_app(engine)
    system = [{"role": "system", "content": "Shared system prompt for the whole team of agents."}]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            pool = (await c.post("/polykv/pools", json={"messages": system})).json()

            async def agent(i: int):
                r = await c.post("/v1/chat/completions", json={
                    "messages": system + [{"role": "user", "content": f"task {i}"}], "pool_id": pool["pool_id"],
                    "session_id": f"agent-{i}", "max_tokens": 8, "stream": True,
                    "stream_options": {"include_usage": True}, **GREEDY})
                return r

            rs = await asyncio.gather(*(agent(i) for i in range(32)))
            return pool, rs

    pool, rs = asyncio.run(main())
    for i, r in enumerate(rs):
        assert r.status_code == 200
        assert r.headers["x-pool-id"] == str(pool["pool_id"]) and r.headers["x-session-id"] == f"agent-{i}"
        assert r.headers["x-cached-prefix-tokens"] == str(pool["prefix_len"])
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
        assert events[-3]["choices"][0]["finish_reason"] == "length"
    info = engine.pool(pool["pool_id"])
    assert len(info.sessions) == 32
    engine.check_integrity()
