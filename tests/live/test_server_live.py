"""`opencoti serve` as a real subprocess on 127.0.0.1 with the bundled SmolLM2 model, used through
real clients: the official `openai` SDK, httpx (llama.cpp-style routes, the /polykv control plane,
SSE), and prometheus_client's text parser."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.bundled

API_KEY = "live-test-key"
SYSTEM = [{"role": "system", "content": "You are a helpful assistant in a team of agents. Answer briefly."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY = {"temperature": 0}


class Server:
    def __init__(self, proc: subprocess.Popen, base: str):
        self.proc, self.base = proc, base
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def ok(self, method: str, path: str, **kw) -> dict:
        r = self.http.request(method, path, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def release_all(self) -> None:
        tree = self.ok("GET", "/polykv/pools")
        for p in tree["pools"]:
            for s in p["sessions"]:
                self.http.delete(f"/polykv/sessions/{s['session_id']}")
        for s in self.ok("GET", "/slots"):
            self.http.delete(f"/polykv/sessions/{s['session_id']}")
        for p in sorted(tree["pools"], key=lambda p: -p["pool_id"]):
            assert self.http.delete(f"/polykv/pools/{p['pool_id']}").status_code == 200
        assert self.ok("GET", "/polykv/integrity")["kv_pages_used"] == 0


@pytest.fixture(scope="module")
def server(opencoti_cache, bundled_model):
    env = {**os.environ, "OPENCOTI_CACHE": str(opencoti_cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "opencoti", "serve", "--port", "0", "--api-key", API_KEY,
                             "--page-size", "16", "--kv-budget-tokens", "16384", "--pool-grace-ttl", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    base, lines = None, []
    deadline = time.monotonic() + 300
    while base is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "server exited:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            base = m.group(1)
        assert time.monotonic() < deadline, "".join(lines)
    # keep draining the server's output so it never blocks on a full pipe
    import threading
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    srv = Server(proc, base)
    srv.first_health = srv.http.get("/health")  # the socket opens before the model has loaded
    while srv.http.get("/health").status_code != 200:  # 503 while the model loads
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    yield srv
    try:
        srv.ok("GET", "/polykv/integrity")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert rc == 0, "".join(lines[-40:])  # a clean shutdown on SIGTERM


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def _clean(server):
    yield
    server.release_all()


# ============================================================================ the openai SDK
def test_openai_chat_completion_and_stream(sdk):
    msgs = SYSTEM + [{"role": "user", "content": "What is the capital of France?"}]
    resp = sdk.chat.completions.create(model="any", messages=msgs, max_tokens=24, **GREEDY)
    text = resp.choices[0].message.content
    assert resp.object == "chat.completion" and text.strip()
    assert resp.usage.completion_tokens <= 24 and resp.usage.prompt_tokens > 10
    assert resp.choices[0].finish_reason in ("stop", "length")
    stream = sdk.chat.completions.create(model="any", messages=msgs, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same answer
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens and chunks[-1].choices == []


def test_openai_tool_call_round_trip(sdk):
    msgs = SYSTEM + [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = sdk.chat.completions.create(model="any", messages=msgs, tools=[WEATHER], max_tokens=24,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "sky": "sunny"})}]
    final = sdk.chat.completions.create(model="any", messages=msgs, tools=[WEATHER], max_tokens=12, **GREEDY)
    assert final.choices[0].message.content is not None or final.choices[0].message.tool_calls
    # streamed, with tool_choice required (one tool: it is the one called): a tool_calls delta
    stream = sdk.chat.completions.create(model="any", messages=msgs[:2], tools=[WEATHER], tool_choice="required",
                                         max_tokens=24, stream=True, **GREEDY)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id
    assert chunks[-1].choices[0].finish_reason in ("tool_calls", "length")


def test_openai_completions(sdk):
    resp = sdk.completions.create(model="any", prompt="The capital of France is", max_tokens=8, **GREEDY)
    assert resp.object == "text_completion" and resp.choices[0].text
    assert resp.usage.completion_tokens <= 8
    chunks = list(sdk.completions.create(model="any", prompt="The capital of France is", max_tokens=8, stream=True,
                                         **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text


# ============================================================================ llama.cpp-style routes
def test_completion_tokenize_slots_props(server):
    r = server.http.post("/completion", json={"prompt": "Once upon a time", "n_predict": 12, "session_id": "llama",
                                              "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["stop"] is True and body["tokens_predicted"] <= 12
    t = body["timings"]
    assert t["predicted_n"] >= 1 and t["predicted_per_second"] > 0 and t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"]
    assert r.headers["x-session-id"] == "llama"
    toks = server.ok("POST", "/tokenize", json={"content": "Hello, world!"})["tokens"]
    assert server.ok("POST", "/detokenize", json={"tokens": toks})["content"] == "Hello, world!"
    slots = server.ok("GET", "/slots")
    row = next(s for s in slots if s["session_id"] == "llama")
    assert {"pool_id", "tps_ewma", "ctx_used", "ctx_total", "ctx_headroom_tokens"} <= set(row)
    assert row["ctx_used"] == body["tokens_evaluated"] + body["tokens_predicted"] - 1 or row["ctx_used"] > 0
    props = server.ok("GET", "/props")
    assert props["opencoti"]["polykv"]["page_size"] == 16 and "SmolLM2" in props["model_path"]
    # templates like SmolLM2's ignore tools: the server renders them into the system prompt itself
    assert props["opencoti"]["polykv"]["chat_template_tools"]["native_tools"] is False
    # CORS headers on the wire in llama.cpp's spelling (a plain-dict client looks them up so)
    pre = server.http.options("/completions", headers={"Origin": "http://localhost:8080",
                                                       "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and (b"Access-Control-Allow-Origin", b"http://localhost:8080") in pre.headers.raw


# ============================================================================ journeys over HTTP
def test_journeys_a_and_b_auto_p_and_409s(server):
    http = server.http
    root = server.ok("POST", "/polykv/pools", json={"messages": SYSTEM, "tools": [WEATHER]})
    task = SYSTEM + [{"role": "user", "content": "Task: plan a trip to Paris."},
                     {"role": "assistant", "content": "I will split the planning into parts."}]
    # Journey A: extend the root with the task context; sub-agents attach to the child
    p1 = server.ok("POST", f"/polykv/pools/{root['pool_id']}/fork", json={"messages": task, "tools": [WEATHER]})
    assert p1["branch_pos"] == root["prefix_len"] < p1["prefix_len"]
    for i, q in enumerate(["Find a hotel.", "Find a museum."]):
        r = http.post("/v1/chat/completions", json={"messages": task + [{"role": "user", "content": q}],
                                                    "tools": [WEATHER], "pool_id": p1["pool_id"],
                                                    "session_id": f"sub-{i}", "max_tokens": 8, **GREEDY})
        assert r.status_code == 200, r.text
        assert int(r.headers["x-cached-prefix-tokens"]) == p1["prefix_len"] == r.json()["timings"]["cache_n"]
        assert r.headers["x-pool-id"] == str(p1["pool_id"])
    # Journey B: branch inside the root's prefix with the token path (spec lesson: the child's FULL
    # prefix [0, L) = the parent's tokens [0, D) + its own, built with /tokenize)
    rendered = server.ok("POST", "/apply-template", json={"messages": SYSTEM, "tools": [WEATHER],
                                                          "add_generation_prompt": False})["prompt"]
    root_tokens = server.ok("POST", "/tokenize", json={"content": rendered})["tokens"]
    assert len(root_tokens) == root["prefix_len"]
    d_tokens = root_tokens[:12]
    extra = server.ok("POST", "/tokenize", json={"content": " You only plan museum visits."})["tokens"]
    branch = server.ok("POST", f"/polykv/pools/{root['pool_id']}/fork",
                       json={"branch_pos": len(d_tokens), "tokens": d_tokens + extra})
    assert branch["branch_pos"] == len(d_tokens) < root["prefix_len"]
    r = http.post("/completion", json={"prompt": d_tokens + extra + extra[:3], "pool_id": branch["pool_id"],
                                       "n_predict": 4, "temperature": 0})
    assert r.headers["x-cached-prefix-tokens"] == str(branch["prefix_len"])
    # contract violation: 409, nothing created
    bad = [d_tokens[0] + 1] + d_tokens[1:] + extra
    r = http.post(f"/polykv/pools/{root['pool_id']}/fork", json={"branch_pos": len(d_tokens), "tokens": bad})
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
    # release ordering: parents with children refuse, leaves first
    assert http.delete(f"/polykv/pools/{root['pool_id']}").status_code == 409
    assert http.delete(f"/polykv/pools/{branch['pool_id']}").status_code == 200
    assert http.delete(f"/polykv/pools/{p1['pool_id']}").status_code == 200
    tree = server.ok("GET", "/polykv/pools")
    assert [p["pool_id"] for p in tree["pools"]] == [root["pool_id"]]
    assert server.ok("GET", "/polykv/integrity")["ok"] is True


# ============================================================================ tps SSE and /metrics
def test_tps_sse_and_metrics(server):
    server.http.post("/completion", json={"prompt": "Count: one, two,", "n_predict": 16, "session_id": "tps"})
    events = []
    with server.http.stream("GET", "/polykv/tps", params={"interval_ms": 100}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break  # an endless stream: the client leaves
    assert all({"ts", "aggregate_tps", "mean_active_tps", "sessions"} <= set(e) for e in events)
    assert any(s["session_id"] == "tps" for s in events[-1]["sessions"])
    fams = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    assert fams["opencoti:time_to_first_token_seconds"].samples
    assert "opencoti_polykv:aggregate_tps" in fams and "opencoti:kv_cache_usage_perc" in fams


# ============================================================================ errors
def test_errors_over_http(server, sdk):
    base = server.base
    first = server.first_health
    if first.status_code != 200:  # (the model loads in seconds; the first probe comes right after the socket opens)
        assert first.status_code == 503 and first.headers["retry-after"]
        assert first.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    assert httpx.get(base + "/health").status_code == 200  # public
    r = httpx.get(base + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base + "/v1/models", headers={"X-Api-Key": API_KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    r = server.http.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = server.http.post("/v1/chat/completions", json={"messages": SYSTEM, "max_tokens": "many"})
    assert r.status_code == 400
    r = server.http.post("/completion", json={"prompt": "x", "pool_id": 4242})
    assert r.status_code == 404
    with pytest.raises(openai.BadRequestError):  # prompt beyond the context
        sdk.completions.create(model="any", prompt="word " * 9000, max_tokens=4)


def test_enforced_admission_429_and_mid_stream_disconnect(server):
    http = server.http
    pool = server.ok("POST", "/polykv/pools", json={"messages": SYSTEM})
    pid = pool["pool_id"]
    server.ok("POST", f"/polykv/pools/{pid}/admission", json={"target_tps_per_session": 1e6, "mode": "enforced",
                                                                "settle_tokens": 4})
    ask = lambda q: SYSTEM + [{"role": "user", "content": q}]  # noqa: E731
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": ask("Write a long story about the sea."), "pool_id": pid, "session_id": "long",
            "max_tokens": 400, "stream": True, "ignore_eos": True, **GREEDY}) as bg:
        assert bg.headers["x-cached-prefix-tokens"] == str(pool["prefix_len"])
        n = 0
        for line in bg.iter_lines():
            n += line.startswith("data: ")
            if n == 10:
                break
        r = http.post("/v1/chat/completions", json={"messages": ask("Hi"), "pool_id": pid, "session_id": "new",
                                                    "max_tokens": 8})
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "pool_saturated_error"
    # the client left mid-stream: its request is cancelled, its pages stay as session cache, none leak
    deadline = time.monotonic() + 60
    while True:
        row = next(s for s in server.ok("GET", "/slots") if s["session_id"] == "long")
        if row["state"] == "idle":
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert row["generated_tokens"] < 400
    assert http.delete("/polykv/sessions/long").status_code == 200
    tree = server.ok("GET", "/polykv/pools")
    assert tree["kv_bytes_used"] == sum(p["own_kv_bytes"] for p in tree["pools"])
    assert server.ok("GET", "/polykv/integrity")["ok"] is True


# ============================================================================ load
def test_32_concurrent_streaming_clients_on_one_pool(server):
    pool = server.ok("POST", "/polykv/pools", json={"messages": SYSTEM})
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def agent(i: int):
        stream = await client.chat.completions.create(
            model="any", messages=SYSTEM + [{"role": "user", "content": f"Say a word about the number {i}."}],
            max_tokens=12, stream=True, stream_options={"include_usage": True},
            extra_body={"pool_id": pool["pool_id"], "session_id": f"agent-{i}"}, **GREEDY)
        chunks = [c async for c in stream]
        return stream.response.headers, chunks

    async def main():
        try:
            return await asyncio.gather(*(agent(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, (headers, chunks) in enumerate(results):
        assert headers["x-session-id"] == f"agent-{i}" and headers["x-pool-id"] == str(pool["pool_id"])
        assert headers["x-cached-prefix-tokens"] == str(pool["prefix_len"])
        assert chunks[-1].usage.completion_tokens >= 1
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    tree = server.ok("GET", "/polykv/pools")
    assert len(tree["pools"][0]["sessions"]) == 32
    assert server.ok("GET", "/polykv/integrity")["ok"] is True


# ============================================================================ one chat chain
def test_bundled_template_same_tokens_through_engine_client_and_http(bundled_engine, monkeypatch):
    """SmolLM2's template ignores tools: the chain injects them, and Engine, the in-process client
    and the HTTP server (in-process ASGI) all send the model the same prompt token ids."""
    from starlette.testclient import TestClient

    from opencoti.client import PolyKVClient
    from opencoti.engine.chat import TemplateCaps, template_caps
    from opencoti.server import create_app

    eng = bundled_engine
    assert template_caps(eng.tokenizer) == TemplateCaps(False, False)
    history = SYSTEM + [{"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
                        {"role": "user", "content": "And in Lima?"}]
    expected = eng.tokenize(eng.apply_chat_template(history, tools=[WEATHER]))
    assert "get_weather" in eng.detokenize(expected)
    from opencoti.engine import SamplingParams
    res = eng.generate(messages=history, tools=[WEATHER], session_id="chain", params=SamplingParams(max_tokens=1))
    assert res.info.prompt_tokens == len(expected)
    seen: list[list[int]] = []
    stream, astream = eng.stream, eng.astream

    def spy(prompt=None, **kw):
        seen.append(list(prompt))
        return stream(prompt, **kw)

    async def aspy(prompt=None, **kw):
        seen.append(list(prompt))
        return await astream(prompt, **kw)

    monkeypatch.setattr(eng, "stream", spy)
    monkeypatch.setattr(eng, "astream", aspy)
    pool = eng.create_pool(messages=history, tools=[WEATHER])
    try:
        with TestClient(create_app(eng), raise_server_exceptions=False) as tc:
            r = tc.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER], "max_tokens": 2,
                                                      "pool_id": pool.pool_id, **GREEDY})
            assert r.status_code == 200, r.text
            assert r.headers["x-cached-prefix-tokens"] == str(pool.prefix_len)
        done = PolyKVClient(engine=eng).chat(history, tools=[WEATHER], max_tokens=2, pool_id=pool.pool_id, **GREEDY)
        assert done.info.cached_prefix_tokens == pool.prefix_len
        assert seen == [expected, expected]
    finally:
        for sid in ("chain",):
            try:
                eng.release_session(sid)
            except Exception:  # noqa: BLE001
                pass
        eng.release_pool(pool.pool_id)
