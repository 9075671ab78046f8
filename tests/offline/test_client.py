"""PolyKVClient / AsyncPolyKVClient on both transports (in-process Engine, and HTTP against the
server app in-process: Starlette's TestClient for sync, httpx's ASGI transport for async), plus
the pure pieces (error mapping, retries, SSE parsing) against httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from opencoti.client import (APIConnectionError, AsyncPolyKVClient, AuthenticationError, CapacityError, ChatChunk,
                             ContextLengthError, InvalidRequestError, PolyKVClient, PoolBusyError, PoolContractError,
                             PoolNotFoundError, PoolSaturatedError, SessionBusyError, SessionNotFoundError,
                             aggregate_chat, error_from_response, GenerationInfo)
from opencoti.client.errors import RetryPolicy as _Retry
from opencoti.client.events import ChatEventParser as _ChatEventParser
from opencoti.engine import SamplingParams
from opencoti.server import create_app

SYSTEM = [{"role": "system", "content": "You coordinate agents."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two ints", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
GREEDY = {"temperature": 0, "max_tokens": 4}


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


@pytest.fixture(params=["engine", "http"])
def client(request, engine):
    if request.param == "engine":
        yield PolyKVClient(engine=engine)
    else:
        with TestClient(create_app(engine), raise_server_exceptions=False) as tc:
            yield PolyKVClient(http_client=tc)


def make_async(kind: str, engine) -> AsyncPolyKVClient:
    if kind == "engine":
        return AsyncPolyKVClient(engine=engine)
    return AsyncPolyKVClient(base_url="http://test", http_client=httpx.AsyncClient(
        transport=httpx.ASGITransport(create_app(engine)), base_url="http://test"))


# ============================================================================ generation
def test_chat_stream_events_and_aggregate(client):
    pool = client.create_pool(messages=SYSTEM)
    msgs = SYSTEM + [{"role": "user", "content": "hi"}]
    chunks = list(client.chat_stream(msgs, pool_id=pool.pool_id, session_id="a1", **GREEDY))
    first, last = chunks[0], chunks[-1]
    assert first.info.session_id == "a1" and first.info.pool_id == pool.pool_id
    assert first.info.cached_prefix_tokens == pool.prefix_len
    assert last.finish_reason in ("stop", "length") and last.usage.completion_tokens <= 4
    assert last.usage.cached_tokens == pool.prefix_len and last.timings["cache_n"] == pool.prefix_len
    done = aggregate_chat(chunks)
    assert done.content == "".join(c.content for c in chunks) and done.info.session_id == "a1"
    # the next turn of the same session reuses its cache
    again = client.chat(msgs, session_id="a1", **GREEDY)
    assert again.usage.cached_tokens > pool.prefix_len
    client.release_session("a1")
    with pytest.raises(SessionNotFoundError):
        client.release_session("a1")


def test_transports_render_and_generate_identically(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as tc:
        http, local = PolyKVClient(http_client=tc), PolyKVClient(engine=engine)
        msgs = SYSTEM + [{"role": "user", "content": "add 2 and 3"}]
        assert http.apply_template(msgs, TOOLS) == local.apply_template(msgs, TOOLS)
        assert http.tokenize("hello world") == local.tokenize("hello world")
        assert local.detokenize(local.tokenize("hello world")) == http.detokenize(http.tokenize("hello world"))
        a = http.chat(msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
        b = local.chat(msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
        assert (a.content, [(c.name, c.arguments) for c in a.tool_calls]) == \
               (b.content, [(c.name, c.arguments) for c in b.tool_calls])
        assert a.tool_calls and a.tool_calls[0].name == "add"
        # the same prompt: the second request reuses the first one's KV from the prefix cache
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        # a pool made from messages + tools on one transport is a prefix of the other's chat request
        pool = http.create_pool(messages=SYSTEM, tools=TOOLS)
        c = local.chat(msgs, tools=TOOLS, pool_id=pool.pool_id, **GREEDY)
        assert c.info.cached_prefix_tokens == pool.prefix_len
        for s in (a, b, c):
            local.release_session(s.info.session_id)


def test_complete(client):
    pool = client.create_pool(tokens=toks(1, 12))
    r = client.complete(toks(1, 12) + toks(2, 3), pool_id=pool.pool_id, max_tokens=3, temperature=0,
                        ignore_eos=True)
    assert r.usage.completion_tokens == 3 and r.finish_reason == "length"
    assert r.info.cached_prefix_tokens == 12 and r.info.pool_id == pool.pool_id
    client.release_session(r.info.session_id)


def test_invalid_and_too_long_requests(client, engine):
    with pytest.raises(InvalidRequestError):
        client.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ContextLengthError):
        client.complete(toks(3, engine.max_context + 8), max_tokens=2)


# ============================================================================ pools
def test_pool_lifecycle(client):
    root = client.create_pool(tokens=toks(1, 16), label="root")
    assert root.prefix_len == 16 and root.parent is None and root.label == "root"
    ext = client.fork_pool(root.pool_id, tokens=toks(1, 16) + toks(2, 8))  # extend at D = L
    br = client.fork_pool(root.pool_id, branch_pos=8, tokens=toks(1, 16)[:8] + toks(3, 6))
    assert (ext.parent, ext.branch_pos, ext.prefix_len) == (root.pool_id, 16, 24)
    assert (br.branch_pos, br.prefix_len) == (8, 14)
    with pytest.raises(PoolContractError):
        client.fork_pool(root.pool_id, tokens=toks(9, 20))
    tree = client.pools()
    assert {p.pool_id for p in tree.pools} >= {root.pool_id, ext.pool_id, br.pool_id}
    assert sorted(p.pool_id for p in client.pool(root.pool_id).subtree) == sorted([ext.pool_id, br.pool_id])
    assert client.pin_pool(ext.pool_id).pinned and not client.unpin_pool(ext.pool_id).pinned
    assert client.evict_pool(br.pool_id).residency == "evicted"
    with pytest.raises(PoolBusyError):
        client.release_pool(root.pool_id)  # children first
    r = client.complete(toks(1, 16) + toks(2, 8) + toks(4, 2), pool_id=ext.pool_id, max_tokens=1, temperature=0)
    assert client.flush_pool(ext.pool_id) == 1
    with pytest.raises(SessionNotFoundError):
        client.release_session(r.info.session_id)
    for p in (ext, br, root):
        client.release_pool(p.pool_id)
    with pytest.raises(PoolNotFoundError):
        client.pool(root.pool_id)
    assert client.integrity()["ok"] and client.pools().kv_pages_used == 0


def test_pool_from_session_and_compaction(client):
    root = client.create_pool(messages=SYSTEM)
    msgs = SYSTEM + [{"role": "user", "content": "a long task"}]
    r = client.chat(msgs, pool_id=root.pool_id, session_id="w", **GREEDY)
    snap = client.create_pool(from_session="w")
    assert snap.prefix_len == r.usage.total_tokens - 1 or snap.prefix_len > root.prefix_len
    client.release_pool(snap.pool_id)
    work = client.fork_pool(root.pool_id, messages=msgs)
    client.chat(msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
                pool_id=work.pool_id, session_id="w2", **GREEDY)
    res = client.compact_session("w2", root.pool_id, messages=SYSTEM + [{"role": "user", "content": "summary"}],
                                 release_old=True)
    assert res.pool.parent == root.pool_id and work.pool_id in res.released_pools
    assert res.kv_pages_after < res.kv_pages_before
    assert client.session_status("w2").pool_id == res.pool.pool_id
    with pytest.raises(SessionNotFoundError):
        client.compact_session("nobody", root.pool_id, text="x")
    for sid in ("w", "w2"):
        client.release_session(sid)
    client.release_pool(res.pool.pool_id)
    client.release_pool(root.pool_id)


# ============================================================================ admission & tps
def test_admission_capacity_and_tps(client):
    pool = client.create_pool(tokens=toks(5, 12))
    pol = client.set_admission(pool.pool_id, target_tps_per_session=5.0, mode="enforced")
    assert pol.mode == "enforced" and pol.target_tps_per_session == 5.0 and pol.settle_tokens == 48
    assert client.admission(pool.pool_id).mode == "enforced"
    cap = client.capacity(pool.pool_id, expected_tokens=16)
    assert cap.can_admit and cap.guaranteed and cap.pool_id == pool.pool_id
    tight = client.capacity(pool.pool_id, expected_tokens=10**6)
    assert not tight.can_admit and not tight.context_ok
    with pytest.raises(InvalidRequestError):
        client.set_admission(pool.pool_id, mode="sometimes")
    r = client.complete(toks(5, 12) + toks(6, 2), pool_id=pool.pool_id, session_id="t1", max_tokens=2)
    st = client.session_status("t1")
    assert st.pool_id == pool.pool_id and st.ctx_used == r.usage.total_tokens - 1 or st.ctx_used > 0
    assert 0.0 <= st.compaction_pressure <= 1.0 and st.ctx_headroom_tokens > 0
    assert client.session_status("nobody") is None
    assert any(e["event"] == "policy" for e in client.events(pool.pool_id))
    client.release_session("t1")
    client.release_pool(pool.pool_id)


@pytest.fixture
def saturated(engine):
    """An enforced pool with an impossible floor and one session decoding: new sessions get 429."""
    prefix = toks(9, 24)
    pool = engine.create_pool(tokens=prefix)
    engine.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", settle_tokens=4)
    s = engine.stream(prefix + toks(1, 6), params=SamplingParams.greedy(450, ignore_eos=True), pool_id=pool.pool_id,
                      session_id="bg")
    for i, _ in enumerate(s):
        if i == 8:
            break
    bg = threading.Thread(target=lambda: [None for _ in s])
    bg.start()
    yield pool.pool_id, prefix
    engine.release_session("bg")
    bg.join(60)


def test_pool_saturated_on_both_transports(engine, saturated):
    pid, prefix = saturated
    with TestClient(create_app(engine), raise_server_exceptions=False) as tc:
        for c in (PolyKVClient(engine=engine, max_retries=0), PolyKVClient(http_client=tc, max_retries=0)):
            with pytest.raises(PoolSaturatedError) as ei:
                list(c.chat_stream([{"role": "user", "content": "x"}], pool_id=pid, max_tokens=2))
            assert ei.value.retry_after is not None and ei.value.retry_after > 0
            with pytest.raises(PoolSaturatedError):
                c.complete(prefix + toks(2, 3), pool_id=pid, max_tokens=2)
            ok = c.complete(prefix + toks(2, 3), pool_id=pid, max_tokens=2, overcommit=True)
            c.release_session(ok.info.session_id)


def test_async_client_on_both_transports(engine):
    async def run(kind):
        c = make_async(kind, engine)
        pool = await c.create_pool(messages=SYSTEM, tools=TOOLS)
        child = await c.fork_pool(pool.pool_id, messages=SYSTEM + [{"role": "user", "content": "task"}], tools=TOOLS)
        msgs = SYSTEM + [{"role": "user", "content": "task"}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "go"}]
        chunks = [x async for x in c.chat_stream(msgs, tools=TOOLS, pool_id=child.pool_id, **GREEDY)]
        assert chunks[0].info.cached_prefix_tokens == child.prefix_len and chunks[-1].usage is not None
        done = await c.chat(msgs, tools=TOOLS, pool_id=child.pool_id, **GREEDY)
        cap = await c.capacity(child.pool_id)
        assert cap.n_pool_sessions == 2 and (await c.tps()).session(done.info.session_id) is not None
        assert (await c.pool(pool.pool_id)).subtree[0].pool_id == child.pool_id
        assert (await c.tokenize("hi")) == engine.tokenize("hi")
        for ch in (chunks[0], done):
            await c.release_session(ch.info.session_id)
        with pytest.raises(PoolBusyError):
            await c.release_pool(pool.pool_id)
        await c.release_pool(child.pool_id)
        await c.release_pool(pool.pool_id)
        with pytest.raises(PoolNotFoundError):
            await c.capacity(pool.pool_id)
        assert (await c.integrity())["ok"]
        await c.aclose()

    for kind in ("engine", "http"):
        asyncio.run(run(kind))


# ============================================================================ pure pieces
def test_error_mapping():
    def e(status, msg, etype="x", headers=None):
        return error_from_response(status, {"error": {"code": status, "message": msg, "type": etype}}, headers)

    assert isinstance(e(400, "bad"), InvalidRequestError)
    assert isinstance(e(400, "too long", "exceed_context_size_error"), ContextLengthError)
    assert isinstance(e(401, "Invalid API Key"), AuthenticationError)
    assert isinstance(e(404, "pool 3 not found"), PoolNotFoundError)
    assert isinstance(e(404, "session 's' not found"), SessionNotFoundError)
    assert isinstance(e(409, "prefix contract violated: tokens[0:4] differ"), PoolContractError)
    assert isinstance(e(409, "pool 1 has child pools [2]"), PoolBusyError)
    assert isinstance(e(409, "session 'a' is serving another request"), SessionBusyError)
    sat = e(429, "cannot admit", headers={"retry-after": "3", "x-admission-reason": "floor"})
    assert isinstance(sat, PoolSaturatedError) and sat.retry_after == 3.0 and sat.reason == "floor"
    busy = e(503, "Loading model", headers={"retry-after": "5"})
    assert isinstance(busy, CapacityError) and busy.retry_after == 5.0
    assert e(500, "boom").status_code == 500


def test_retry_policy_delays():
    r = _Retry(max_retries=2, max_wait_s=10)
    assert r.delay(PoolSaturatedError("x", 3.0), 0) == 3.0
    assert r.delay(PoolSaturatedError("x", 60.0), 1) == 10  # capped
    assert r.delay(PoolSaturatedError("x", 1.0), 2) is None  # out of retries
    assert r.delay(CapacityError("no pool budget"), 0) is None  # waiting would not help
    assert r.delay(InvalidRequestError("bad"), 0) is None
    assert 0 < r.delay(APIConnectionError("refused", retryable=True), 1) <= 1.5
    assert r.delay(APIConnectionError("reset mid-request"), 0) is None


def test_http_retries_honour_retry_after_and_send_the_key():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"},
                                  json={"error": {"code": 429, "message": "cannot admit", "type": "pool_saturated_error"}})
        return httpx.Response(200, json={"pool_id": 7, "can_admit": True, "reason": "ok"})

    c = PolyKVClient("http://x", api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert c.capacity(7).can_admit and len(calls) == 2
    assert calls[0].headers["authorization"] == "Bearer k"
    assert calls[0].url.path == "/polykv/pools/7/capacity"

    c0 = PolyKVClient("http://x", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(
        lambda r: httpx.Response(401, json={"error": {"code": 401, "message": "Invalid API Key", "type": "a"}}))))
    with pytest.raises(AuthenticationError):
        c0.pools()

    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    n = []
    c1 = PolyKVClient("http://x", max_retries=1, max_retry_wait_s=0.01,
                      http_client=httpx.Client(transport=httpx.MockTransport(lambda r: n.append(1) or refuse(r))))
    with pytest.raises(APIConnectionError):
        c1.health()
    assert len(n) == 2


def test_sse_parser_and_stream_errors():
    p = _ChatEventParser(GenerationInfo(session_id="s"), pool_id=None)
    assert p.start().info.session_id == "s"
    ev = lambda **d: json.dumps({"model": "m", **d})  # noqa: E731
    out = p.feed(ev(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
    assert out == []
    out = p.feed(ev(choices=[{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]))
    assert [c.content for c in out] == ["Hi"]
    out = p.feed(ev(choices=[{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        "finish_reason": None}]))
    assert out[0].tool_calls[0].parsed_arguments() == {"a": 1}
    assert p.feed(ev(choices=[{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], timings={"cache_n": 3})) == []
    end = p.feed(ev(choices=[], usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                                       "prompt_tokens_details": {"cached_tokens": 3}}))
    assert end[0].finish_reason == "tool_calls" and end[0].usage.cached_tokens == 3 and end[0].timings["cache_n"] == 3
    assert p.feed("[DONE]") == []
    with pytest.raises(PoolSaturatedError):
        p.feed(json.dumps({"error": {"code": 429, "message": "no", "type": "pool_saturated_error"}}))
    assert aggregate_chat([ChatChunk(info=GenerationInfo(session_id="s")), ChatChunk(content="a"),
                           ChatChunk(finish_reason="stop")]).content == "a"


def test_constructor_checks(engine):
    with pytest.raises(ValueError):
        PolyKVClient()
    with pytest.raises(ValueError):
        PolyKVClient("http://x", engine=engine)
    with pytest.raises(ValueError):
        PolyKVClient(engine=engine, max_retries=-1)
    with pytest.raises(InvalidRequestError):
        PolyKVClient(engine=engine).release_session("")


def test_refused_streams_and_async_calls_are_retried():
    """A 429 with Retry-After before the first chunk is retried, sync and async; the first error past the retries
    is raised as is."""
    ev = lambda **d: "data: " + json.dumps({"model": "m", **d}) + "\n\n"  # noqa: E731
    sse = (ev(choices=[{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}])
           + ev(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]) + "data: [DONE]\n\n")
    refusal = {"error": {"code": 429, "message": "cannot admit", "type": "pool_saturated_error"}}

    def server(refusals: int):
        calls = []

        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request.url.path)
            if len(calls) <= refusals:
                return httpx.Response(429, headers={"Retry-After": "0"}, json=refusal)
            if request.url.path.endswith("/capacity"):
                return httpx.Response(200, json={"pool_id": 7, "can_admit": True, "reason": "ok"})
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        return calls, httpx.MockTransport(handler)

    calls, mock = server(1)
    c = PolyKVClient("http://x", max_retries=1, http_client=httpx.Client(transport=mock))
    assert c.chat([{"role": "user", "content": "x"}]).content == "Hi" and len(calls) == 2
    calls, mock = server(2)
    c = PolyKVClient("http://x", max_retries=1, http_client=httpx.Client(transport=mock))
    with pytest.raises(PoolSaturatedError):
        list(c.chat_stream([{"role": "user", "content": "x"}]))
    assert len(calls) == 2

    async def run_async():
        calls, mock = server(1)
        a = AsyncPolyKVClient("http://x", max_retries=1, http_client=httpx.AsyncClient(transport=mock))
        assert (await a.chat([{"role": "user", "content": "x"}])).content == "Hi" and len(calls) == 2
        calls, mock = server(1)
        a = AsyncPolyKVClient("http://x", max_retries=1, http_client=httpx.AsyncClient(transport=mock))
        assert (await a.capacity(7)).can_admit and len(calls) == 2
        calls, mock = server(2)
        a = AsyncPolyKVClient("http://x", max_retries=1, http_client=httpx.AsyncClient(transport=mock))
        with pytest.raises(PoolSaturatedError):
            await a.capacity(7)
        assert len(calls) == 2
    asyncio.run(run_async())


def test_release_pool_can_end_the_sessions_that_keep_it(client):
    """``cascade_sessions`` (``DELETE ...?cascade=sessions``) ends the idle sessions holding the pool and says which."""
    pool = client.create_pool(messages=SYSTEM)
    client.chat(SYSTEM + [{"role": "user", "content": "hi"}], pool_id=pool.pool_id, session_id="keeper", **GREEDY)
    with pytest.raises(InvalidRequestError, match="cascade_sessions must be a boolean"):
        client.release_pool(pool.pool_id, cascade_sessions="yes")
    assert client.session_status("keeper") is not None
    assert client.release_pool(pool.pool_id, immediate=True, cascade_sessions=True) == ["keeper"]
    assert client.session_status("keeper") is None  # ended
    with pytest.raises(PoolNotFoundError):
        client.pool(pool.pool_id)
