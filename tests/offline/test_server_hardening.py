"""Bad input, bounded growth and local-server safety, in-process (ASGI): lone surrogates and other
bad strings are 400s validated before anything is committed; every 429/503 carries Retry-After and
names what is short; released pools leave no metric series; heavy work stays off the event loop
and slow bodies time out; Host / Origin / Content-Type checks; an OpenAPI document that matches."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from opencoti.client import InvalidRequestError, PolyKVClient
from opencoti.server import ServerConfig, create_app
from opencoti.server.serve import allowed_hosts

CHAT = [{"role": "user", "content": "hi"}]
BAD = "a\ud800b"  # a lone surrogate: Python allows it in a str, UTF-8 cannot encode it
JSON = {"content-type": "application/json"}


def raw_json(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800, as a client would send it


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def err(r, status, match=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"code", "message", "type"} and e["code"] == status
    if match:
        assert match in e["message"], e["message"]
    return r


# ============================================================================ 1: bad strings
SURROGATE_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": BAD}}]},
     "tools[0].function.name"),
    ("/tokenize", {"content": BAD}, "content"),
    ("/completion", {"prompt": BAD}, "prompt"),
    ("/completion", {"prompt": "x", "stop": [BAD]}, "stop[0]"),
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/apply-template", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/polykv/pools", {"text": BAD}, "text"),
    ("/polykv/pools", {"text": "ok", "label": BAD}, "label"),
    ("/polykv/sessions/s1/compact", {"ancestor_pool_id": 1, "text": BAD}, "text"),
    ("/polykv/pools", {"text": "ok", BAD: 1}, "'a"),  # a key
]


@pytest.mark.parametrize("path,body,where", SURROGATE_CASES)
def test_lone_surrogates_are_400_before_anything_changes(client, engine, path, body, where):
    before = engine.stats(), engine.pools()["pools_used"]
    r = err(client.post(path, content=raw_json(body), headers=JSON), 400, "lone UTF-16 surrogate")
    assert where in r.json()["error"]["message"]
    assert (engine.stats(), engine.pools()["pools_used"]) == before
    assert client.get("/polykv/pools").status_code == 200


def test_lone_surrogates_in_process_and_in_large_bodies(client, engine):
    local = PolyKVClient(engine=engine)
    with pytest.raises(InvalidRequestError, match="label holds a lone UTF-16 surrogate"):
        local.create_pool(text="ok", label=BAD)
    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate"):
        local.chat([{"role": "user", "content": BAD}], max_tokens=1)
    # a body parsed off the event loop (above the inline size) is checked the same way
    big = {"prompt": "x" * 100_000 + BAD}
    err(client.post("/completion", content=raw_json(big), headers=JSON), 400, "prompt holds a lone")
    assert engine.pools()["pools_used"] == 0


def test_deeply_nested_and_non_finite_values_are_400(client, engine):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/completion", "/polykv/pools", "/tokenize"):
        err(client.post(path, content=deep, headers=JSON), 400, "nested too deeply")
    for raw in ('{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "min_p": Infinity}'):
        err(client.post("/completion", content=raw, headers=JSON), 400)
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(InvalidRequestError):
        PolyKVClient(engine=engine).apply_template([{"role": "user", "content": nested}])
    assert engine.stats()["requests"] == 0


def test_pool_listing_survives_a_bad_label_set_in_process(client, engine):
    pool = engine.create_pool(tokens=[1, 2, 3, 4, 5], label=BAD)  # the engine API itself does not check labels
    r = client.get("/polykv/pools")
    assert r.status_code == 200 and r.json()["pools"][0]["label"] == BAD  # sent \u-escaped, never a 500
    engine.release_pool(pool.pool_id, immediate=True)


@pytest.mark.parametrize("path,body,match", [
    ("/polykv/pools", {"text": "ok", "label": "x" * 257}, "label"),
    ("/completion", {"prompt": "x", "session_id": "s" * 129}, "session_id"),
    ("/completion", {"prompt": "x", "stop": ["s"] * 65}, "stop"),
    ("/completion", {"prompt": "x", "stop": "s" * 1025}, "stop"),
    ("/polykv/pools", {"from_session": ""}, "from_session"),
])
def test_string_limits(client, engine, path, body, match):
    err(client.post(path, json=body), 400, match)
    assert engine.pools()["pools_used"] == 0


# ============================================================================ 3: Retry-After on 429 / 503
def test_every_503_says_what_is_short_and_when_to_retry(make_engine):
    engine = make_engine(kv_budget_tokens=64, max_pools=1)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        pool = c.post("/polykv/pools", json={"tokens": list(range(1, 45)), "pinned": True}).json()
        r = err(c.post("/polykv/pools", json={"tokens": [1, 2, 3]}), 503, "pool budget exhausted")
        assert r.headers["retry-after"] and r.headers["x-opencoti-resource"] == "pools"
        # the cache is big enough for this prompt, only occupied by the pinned pool: "full", not "too small"
        r = err(c.post("/completion", json={"prompt": list(range(50, 86)), "n_predict": 1}), 503, "KV cache full")
        assert r.headers["retry-after"] == "1" and r.headers["x-opencoti-resource"] == "kv_cache"
        assert "too small" not in r.json()["error"]["message"]
        c.post(f"/polykv/pools/{pool['pool_id']}/unpin")
    # the HTTP client does not retry a pool budget (only a release frees it)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        pc = PolyKVClient(http_client=c, max_retries=3, max_retry_wait_s=30)
        from opencoti.client import CapacityError
        with pytest.raises(CapacityError) as e:
            pc.create_pool(tokens=[7, 8, 9])
        assert e.value.retry_after is None


def test_loading_and_saturation_carry_retry_after(engine):
    gate = threading.Event()
    app = create_app(engine_factory=lambda: (gate.wait(30), engine)[1])
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            for path in ("/health", "/props", "/polykv/pools"):
                r = err(c.get(path), 503, "Loading model")
                assert r.headers["retry-after"] == "5" and r.headers["x-opencoti-resource"] == "model"
            gate.set()
    finally:
        gate.set()


# ============================================================================ 4: bounded metrics
def test_released_pools_leave_no_metric_series(client, engine):
    ids = []
    for i in range(3):
        p = client.post("/polykv/pools", json={"tokens": [10 + i] * 8}).json()
        ids.append(p["pool_id"])
        assert client.post("/completion", json={"prompt": [10 + i] * 8 + [1, 2], "pool_id": p["pool_id"],
                                                "n_predict": 1}).status_code == 200
    text = client.get("/metrics").text
    assert all(f'pool="{pid}"' in text for pid in ids)
    for sid in [s["session_id"] for s in client.get("/slots").json()]:
        client.delete(f"/polykv/sessions/{sid}")
    for pid in ids:
        for a in engine.pools()["pools"]:
            pass
        engine.release_pool(pid, immediate=True)
    text = client.get("/metrics").text
    assert not [line for line in text.splitlines() if 'pool="' in line]
    for _ in range(5):  # unknown methods share one label value
        client.request("BREW", "/health")
    methods = {line.split('method="')[1].split('"')[0] for line in text.splitlines() + client.get(
        "/metrics").text.splitlines() if line.startswith("opencoti:http_requests_total")}
    assert "BREW" not in methods and "other" in methods


# ============================================================================ 5: the event loop
def test_tokenizing_runs_off_the_event_loop(engine, monkeypatch):
    """While a big prompt is being tokenized (held here until /health has answered), /health answers."""
    started, release = threading.Event(), threading.Event()
    tokenize = engine.tokenize

    def slow_tokenize(text, **kw):
        if len(text) > 1000:
            started.set()
            assert release.wait(20), "/health never answered while tokenizing"
        return tokenize(text, **kw)

    monkeypatch.setattr(engine, "tokenize", slow_tokenize)

    async def scenario():
        transport = httpx.ASGITransport(create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
            big = asyncio.create_task(c.post("/tokenize", json={"content": "word " * 200_000}))
            while not started.is_set():
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            release.set()
            return health, await big

    health, big = asyncio.run(scenario())
    assert health.status_code == 200 and big.status_code == 200 and len(big.json()["tokens"]) == 1_000_000


def test_slow_or_short_bodies_time_out(engine):
    app = create_app(engine, config=ServerConfig(body_timeout_s=0.3))

    async def call(chunks: list[bytes], length: int):
        sent: list[dict] = []
        queue = list(chunks)

        async def receive():
            if queue:
                return {"type": "http.request", "body": queue.pop(0), "more_body": True}
            await asyncio.sleep(3600)  # the client never sends the rest

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/completion", "raw_path": b"/completion", "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(length).encode())]}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    sent = asyncio.run(call([b'{"prompt": "'], 100))  # fewer bytes than its Content-Length
    assert sent[0]["status"] == 408 and b"did not arrive" in sent[1]["body"]


# ============================================================================ 6: Host, Origin, Content-Type
def test_host_header_checked_on_loopback(engine):
    cfg = ServerConfig(allowed_hosts=allowed_hosts("127.0.0.1", ["box.lan"]))
    with TestClient(create_app(engine, config=cfg), raise_server_exceptions=False) as c:
        for host in ("localhost:8080", "127.0.0.1", "[::1]:9", "127.0.0.5:80", "box.lan"):
            assert c.get("/health", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", "localhost.evil.example", "testserver"):
            err(c.get("/v1/models", headers={"host": host}), 400, "--allowed-host")
            err(c.post("/polykv/pools", json={"text": "x"}, headers={"host": host}), 400, "not allowed")
    assert engine.pools()["pools_used"] == 0
    assert allowed_hosts("0.0.0.0", []) is None and allowed_hosts("127.0.0.1", ["*"]) is None
    assert allowed_hosts("::1", []) == ["localhost", "127.0.0.1", "::1"]


def test_cross_site_posts_are_refused(engine):
    with TestClient(create_app(engine, config=ServerConfig(cors_origins=["http://ui.example"])),
                    base_url="http://127.0.0.1:8080", raise_server_exceptions=False) as c:
        pool = c.post("/polykv/pools", json={"tokens": [1, 2, 3, 4]}).json()
        for origin in ("http://evil.example", "null"):
            err(c.post(f"/polykv/pools/{pool['pool_id']}/evict", headers={"origin": origin}), 403, "cross-site")
            err(c.delete(f"/polykv/pools/{pool['pool_id']}", headers={"origin": origin}), 403)
        # a simple (no-preflight) cross-site POST can only carry text/plain or a form: refused as 415
        err(c.post("/polykv/pools", content=b'{"text": "x"}', headers={"content-type": "text/plain"}), 415)
        assert engine.pools()["pools_used"] == 1
        same = c.post(f"/polykv/pools/{pool['pool_id']}/pin", headers={"origin": "http://127.0.0.1:8080"})
        assert same.status_code == 200  # the page the server serves itself
        assert c.post(f"/polykv/pools/{pool['pool_id']}/unpin", headers={"origin": "http://ui.example"}).status_code \
            == 200
        assert c.get("/polykv/pools", headers={"origin": "http://evil.example"}).status_code == 200  # reads: CORS
        engine.release_pool(pool["pool_id"], immediate=True)


# ============================================================================ 7: the OpenAPI document
def test_openapi_describes_what_the_server_answers(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ErrorResponse" in schemas
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
            if "requestBody" in op:  # the Anthropic routes' errors have Anthropic's shape
                shape = "/AnthropicErrorResponse" if path.startswith("/v1/messages") else "/ErrorResponse"
                assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
                    shape), (method, path)
    for path in ("/completion", "/v1/completions", "/v1/chat/completions", "/polykv/tps"):
        assert "text/event-stream" in doc["paths"][path]["post" if path != "/polykv/tps" else "get"][
            "responses"]["200"]["content"], path
    pool_ops = doc["paths"]["/polykv/pools/{pool_id}/fork"]["post"]["responses"]
    assert {"400", "404", "409", "503"} <= set(pool_ops)
    assert doc["paths"]["/polykv/pools"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    chat = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert chat["minItems"] == 1
    prompt = schemas["OpenAICompletionRequest"]["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in prompt["anyOf"]
    pool = schemas["CreatePoolRequest"]
    assert pool["oneOf"] == [{"required": [n], "properties": {n: {"not": {"type": "null"}}}}  # null = not given
                             for n in ("tokens", "text", "messages", "from_session")]
    assert pool["properties"]["label"]["maxLength"] == 256
    sampling = schemas["CompletionRequest"]["properties"]
    assert (sampling["temperature"]["minimum"], sampling["temperature"]["maximum"]) == (0, 100)
    assert sampling["n_probs"]["maximum"] == 20
    # what the schema forbids, the server refuses
    err(client.post("/completion", json={"prompt": "x", "temperature": 100.5}), 400, "temperature")
    err(client.post("/completion", json={"prompt": "x", "n_probs": 21}), 400)
    err(client.post("/v1/chat/completions", json={"messages": []}), 400)
    err(client.post("/v1/completions", json={"prompt": ""}), 400)
    err(client.post("/polykv/pools", json={}), 400, "exactly one")


def test_openapi_with_a_key_documents_401(engine):
    with TestClient(create_app(engine, config=ServerConfig(api_key="k")), raise_server_exceptions=False) as c:
        doc = c.get("/openapi.json", headers={"authorization": "Bearer k"}).json()
    assert "401" in doc["paths"]["/polykv/pools"]["get"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_405_lists_every_allowed_method(client):
    r = err(client.put("/polykv/pools"), 405)
    assert r.headers["allow"] == "GET, HEAD, POST"
    r = err(client.patch("/polykv/pools/1"), 405)
    assert r.headers["allow"] == "DELETE, GET, HEAD"
    r = err(client.get("/tokenize"), 405)
    assert r.headers["allow"] == "POST"
