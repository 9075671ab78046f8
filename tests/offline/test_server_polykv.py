"""The /polykv control plane over HTTP on the tiny model (in-process, no sockets): pool
lifecycle and the nested fork / branch journeys, auto-P attach seen in headers and timings, 409s, release
ordering, admission (429 + Retry-After, warn + X-Sessions-Remaining), capacity, the tps stream."""

from __future__ import annotations

import json
import random
import threading

import pytest
from starlette.testclient import TestClient

from opencoti.engine import SamplingParams
from opencoti.server import create_app
from http_checks import err, ok

GREEDY = {"temperature": 0, "ignore_eos": True}
SYSTEM = [{"role": "system", "content": "You coordinate a team of agents. Be precise."}]
TOOLS_A = [{"type": "function", "function": {"name": "web_search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}}}}}]
TOOLS_B = [{"type": "function", "function": {"name": "run_sql", "parameters": {"type": "object", "properties": {
    "sql": {"type": "string"}}}}}]


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


# ChatML that ignores tools and tool calls (like SmolLM2's template)
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line[6:] != "[DONE]"]


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def chat(client, messages, **kw):
    return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **GREEDY, **kw})


# ============================================================================ lifecycle
def test_create_from_each_source_and_read_back(client, engine):
    a = ok(client.post("/polykv/pools", json={"tokens": toks(1, 20), "label": "a"}))
    assert a["prefix_len"] == 20 and a["parent"] is None and a["residency"] == "resident" and a["label"] == "a"
    b = ok(client.post("/polykv/pools", json={"text": "plain text prefix", "pinned": True}))
    assert b["prefix_len"] == len(engine.tokenize("plain text prefix")) and b["pinned"] is True
    c = ok(client.post("/polykv/pools", json={"messages": SYSTEM}))
    assert c["prefix_len"] == len(engine.tokenize(engine.apply_chat_template(SYSTEM, add_generation_prompt=False)))
    # from_session: snapshot an idle session's context
    r = client.post("/completion", json={"prompt": toks(2, 12), "n_predict": 3, "session_id": "snap", **GREEDY})
    d = ok(client.post("/polykv/pools", json={"from_session": "snap"}))
    assert d["prefix_len"] == 12 + 3 - 1 and r.status_code == 200  # the last sampled token has no KV yet
    tree = ok(client.get("/polykv/pools"))
    assert [p["pool_id"] for p in tree["pools"]] == [a["pool_id"], b["pool_id"], c["pool_id"], d["pool_id"]]
    assert tree["pools_used"] == 4 and tree["pools_max"] == engine.config.max_pools
    assert sum(p["subtree_kv_bytes"] for p in tree["pools"]) == tree["kv_bytes_used"]  # ownership adds up
    one = ok(client.get(f"/polykv/pools/{a['pool_id']}"))
    assert one["pool_id"] == a["pool_id"] and one["subtree"] == []


@pytest.mark.parametrize("body,status,match", [
    ({}, 400, "exactly one of"),
    ({"tokens": [1, 2], "text": "x"}, 400, "exactly one of"),
    ({"text": ""}, 400, "non-empty"),
    ({"tokens": []}, 400, "empty"),
    ({"tokens": [1, 100000]}, 400, "vocabulary"),
    ({"tokens": "1 2 3"}, 400, "tokens"),
    ({"text": "x", "tools": TOOLS_A}, 400, "tools are rendered with messages"),
    ({"text": "x", "colour": "red"}, 400, "colour"),  # control-plane bodies reject unknown fields
    ({"from_session": "nobody"}, 404, "nobody"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
])
def test_create_pool_bad_bodies(client, engine, body, status, match):
    err(client.post("/polykv/pools", json=body), status, match)
    assert ok(client.get("/polykv/pools"))["pools"] == [] and engine.pools()["kv_pages_used"] == 0


def test_pool_budget_is_503(make_engine):
    eng = make_engine(max_pools=1)
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        ok(c.post("/polykv/pools", json={"tokens": toks(1, 8)}))
        e = err(c.post("/polykv/pools", json={"tokens": toks(2, 8)}), 503, "pool budget exhausted")
        assert e["type"] == "unavailable_error"
        assert len(ok(c.get("/polykv/pools"))["pools"]) == 1


# ============================================================================ journeys: nested fork, branch
def test_journey_a_nesting_with_auto_p(client, engine):
    root = ok(client.post("/polykv/pools", json={"messages": SYSTEM, "tools": TOOLS_A}))
    brief = SYSTEM + [{"role": "user", "content": "Task brief: compare three databases."},
                      {"role": "assistant", "content": "Understood; splitting the work."}]
    # extend: the child's FULL prefix, branch_pos defaults to the parent's L
    p1 = ok(client.post(f"/polykv/pools/{root['pool_id']}/fork", json={"messages": brief, "tools": TOOLS_A}))
    assert p1["parent"] == root["pool_id"] and p1["branch_pos"] == root["prefix_len"]
    assert p1["prefix_len"] > root["prefix_len"]
    for i in range(3):
        r = chat(client, brief + [{"role": "user", "content": f"Subtask {i}"}], tools=TOOLS_A, pool_id=p1["pool_id"],
                 session_id=f"sub-{i}")
        body = ok(r)
        assert r.headers["x-pool-id"] == str(p1["pool_id"]) and r.headers["x-session-id"] == f"sub-{i}"
        assert int(r.headers["x-cached-prefix-tokens"]) == p1["prefix_len"] == body["timings"]["cache_n"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == p1["prefix_len"]
    tree = ok(client.get("/polykv/pools"))
    by_id = {p["pool_id"]: p for p in tree["pools"]}
    assert by_id[root["pool_id"]]["children"] == [p1["pool_id"]] and tree["tree_depth"] == 2
    assert sorted(s["session_id"] for s in by_id[p1["pool_id"]]["sessions"]) == ["sub-0", "sub-1", "sub-2"]
    sub = ok(client.get(f"/polykv/pools/{root['pool_id']}"))
    assert [p["pool_id"] for p in sub["subtree"]] == [p1["pool_id"]]
    # nothing was copied: the child owns only its [D, L) range
    page = engine.kv.page_bytes
    assert by_id[p1["pool_id"]]["own_kv_bytes"] <= (-(-(p1["prefix_len"] - p1["branch_pos"]) // 4) + 1) * page


def test_journey_b_branch_contract_and_release_ordering(client, engine):
    base = toks(7, 24)
    root = ok(client.post("/polykv/pools", json={"tokens": base + toks(8, 16)}))
    d = 24
    branch = ok(client.post(f"/polykv/pools/{root['pool_id']}/fork", json={"branch_pos": d, "tokens": base + toks(9, 10)}))
    assert branch["branch_pos"] == d and branch["prefix_len"] == 34 and branch["parent"] == root["pool_id"]
    r = client.post("/completion", json={"prompt": base + toks(9, 10) + [5, 6], "pool_id": branch["pool_id"],
                                         "n_predict": 2, **GREEDY})
    assert r.headers["x-cached-prefix-tokens"] == "34" and ok(r)["timings"]["cache_n"] == 34
    # the prefix contract is token-exact: a different [0, D) is a 409, and nothing changes
    bad = base[:-1] + [base[-1] % 250 + 1] + toks(9, 10)
    before = ok(client.get("/polykv/pools"))
    err(client.post(f"/polykv/pools/{root['pool_id']}/fork", json={"branch_pos": d, "tokens": bad}), 409,
        "prefix contract")
    err(client.post(f"/polykv/pools/{root['pool_id']}/fork", json={"branch_pos": 999, "tokens": base}), 400, "beyond")
    err(client.post("/polykv/pools/999/fork", json={"tokens": base}), 404, "999")
    assert ok(client.get("/polykv/pools"))["pools"] == before["pools"]
    # explicit P must match the pool
    err(client.post("/completion", json={"prompt": bad + [1], "pool_id": root["pool_id"], "shared_prefix_n_tokens": 24}),
        409, "differs")
    # release ordering: a parent with children is a 409; leaves first
    err(client.delete(f"/polykv/pools/{root['pool_id']}"), 409, "child pools")
    assert ok(client.delete(f"/polykv/pools/{branch['pool_id']}")) == {"pool_id": branch["pool_id"], "released": True,
                                                                       "release_in_s": None}  # no grace TTL here
    ok(client.delete(f"/polykv/pools/{root['pool_id']}"))
    err(client.delete(f"/polykv/pools/{root['pool_id']}"), 404)
    sid = r.headers["x-session-id"]
    assert ok(client.delete(f"/polykv/sessions/{sid}")) == {"session_id": sid, "released": True}
    assert ok(client.get("/polykv/pools")) | {} and engine.pools()["kv_pages_used"] == 0


def test_from_session_fork_and_compaction(client, engine):
    root = ok(client.post("/polykv/pools", json={"tokens": toks(3, 16)}))
    r = client.post("/completion", json={"prompt": toks(3, 16) + toks(4, 6), "pool_id": root["pool_id"], "n_predict": 3,
                                         "session_id": "worker", **GREEDY})
    assert r.headers["x-cached-prefix-tokens"] == "16"
    snap = ok(client.post(f"/polykv/pools/{root['pool_id']}/fork", json={"from_session": "worker", "branch_pos": 16}))
    assert snap["parent"] == root["pool_id"] and snap["prefix_len"] == 16 + 6 + 3 - 1
    out = ok(client.post("/polykv/sessions/worker/compact", json={"ancestor_pool_id": root["pool_id"],
                                                                  "tokens": toks(3, 16) + toks(5, 4)}))
    assert out["pool"]["parent"] == root["pool_id"] and out["pool"]["prefix_len"] == 20
    assert "worker" in [s["session_id"] for s in out["pool"]["sessions"]]
    err(client.post("/polykv/sessions/worker/compact", json={"ancestor_pool_id": root["pool_id"]}), 400, "exactly one")
    err(client.post("/polykv/sessions/ghost/compact", json={"ancestor_pool_id": root["pool_id"], "tokens": [1, 2]}), 404)


def test_pin_unpin_evict_flush(client, engine):
    p = ok(client.post("/polykv/pools", json={"tokens": toks(5, 12)}))
    pid = p["pool_id"]
    assert ok(client.post(f"/polykv/pools/{pid}/pin"))["pinned"] is True
    err(client.post(f"/polykv/pools/{pid}/evict"), 409, "pinned")
    assert ok(client.post(f"/polykv/pools/{pid}/unpin"))["pinned"] is False
    assert ok(client.post(f"/polykv/pools/{pid}/evict"))["residency"] == "evicted"
    # the next attach re-materializes it
    r = client.post("/completion", json={"prompt": toks(5, 12) + [9], "pool_id": pid, "n_predict": 2,
                                         "session_id": "w", **GREEDY})
    assert ok(r) and ok(client.get(f"/polykv/pools/{pid}"))["residency"] == "resident"
    assert ok(client.post(f"/polykv/pools/{pid}/flush")) == {"pool_id": pid, "flushed_sessions": 1}
    assert ok(client.get(f"/polykv/pools/{pid}"))["sessions"] == []
    for verb in ("pin", "unpin", "evict", "flush"):
        err(client.post(f"/polykv/pools/424/{verb}"), 404, "424")
    err(client.get("/polykv/pools/424"), 404)


# ============================================================================ admission & capacity
def test_admission_policy_and_capacity(client, engine):
    pid = ok(client.post("/polykv/pools", json={"tokens": toks(6, 20)}))["pool_id"]
    pol = ok(client.get(f"/polykv/pools/{pid}/admission"))
    assert pol["mode"] == "advisory" and pol["guarantee_min_sessions"] == 1
    pol = ok(client.post(f"/polykv/pools/{pid}/admission", json={"target_tps_per_session": 5, "mode": "enforced",
                                                                  "on_saturation": "warn"}))
    assert pol["target_tps_per_session"] == 5 and pol["mode"] == "enforced" and pol["settle_tokens"] == 48
    pol = ok(client.post(f"/polykv/pools/{pid}/admission", json={"target_tps_per_session": None}))
    assert pol["target_tps_per_session"] is None and pol["mode"] == "enforced"  # merged
    err(client.post(f"/polykv/pools/{pid}/admission", json={"mode": "strict"}), 400, "mode")
    err(client.post(f"/polykv/pools/{pid}/admission", json={"settle_tokens": 0}), 400, "settle_tokens")
    err(client.post(f"/polykv/pools/{pid}/admission", json={"floor": 3}), 400, "floor")
    err(client.post("/polykv/pools/999/admission", json={"mode": "enforced"}), 404)
    assert ok(client.get(f"/polykv/pools/{pid}/admission"))["on_saturation"] == "warn"
    cap = ok(client.get(f"/polykv/pools/{pid}/capacity"))
    for key in ("can_admit", "projected_mean_tps_if_admitted", "headroom_sessions", "kv_headroom_pct", "reason",
                "settling", "settle_remaining_ms", "n_warming", "n_pool_sessions", "guaranteed",
                "projected_mean_tps_model", "projected_mean_tps_measured", "drop_per_admit_ewma", "known_session"):
        assert key in cap, key
    assert cap["can_admit"] is True and cap["reason"] == "guaranteed minimum"
    cap = ok(client.get(f"/polykv/pools/{pid}/capacity", params={"expected_tokens": 10_000_000}))
    assert cap["can_admit"] is False and cap["reason"] == "context headroom exhausted"
    err(client.get(f"/polykv/pools/{pid}/capacity", params={"expected_tokens": -1}), 400, "expected_tokens")
    err(client.get(f"/polykv/pools/{pid}/capacity", params={"expected_tokens": "lots"}), 400, "expected_tokens")
    err(client.get("/polykv/pools/999/capacity"), 404)
    events = ok(client.get("/polykv/events", params={"pool_id": pid}))["events"]
    assert [e["event"] for e in events] == ["policy", "policy"]


@pytest.fixture
def loaded(engine):
    """Pool with an impossible floor (1e6 tps, enforced) and one session 'bg' decoding a long answer."""
    prefix = toks(9, 24)
    pool = engine.create_pool(tokens=prefix)
    engine.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", settle_tokens=4)
    s = engine.stream(prefix + toks(1, 6), params=SamplingParams.greedy(450, ignore_eos=True), pool_id=pool.pool_id,
                      session_id="bg")
    n = 0
    for _ in s:  # measured (not warming) and past its settle window
        n += 1
        if n == 8:
            break
    done = threading.Thread(target=lambda: [None for _ in s])
    done.start()
    yield engine, pool.pool_id, prefix
    done.join(60)


def test_enforced_reject_is_429_with_retry_after(loaded):
    engine, pid, prefix = loaded
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        r = c.post("/completion", json={"prompt": prefix + toks(2, 6), "pool_id": pid, "session_id": "new",
                                        "n_predict": 8, **GREEDY})
        e = err(r, 429, "cannot admit")
        assert e["type"] == "pool_saturated_error"
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-sessions-remaining"] == "0"
        assert "new" not in [s["session_id"] for s in engine.tps_snapshot()["sessions"]]
        # overcommit bypasses the floor
        r = c.post("/completion", json={"prompt": prefix + toks(2, 6), "pool_id": pid, "session_id": "oc",
                                        "n_predict": 2, "overcommit": True, **GREEDY})
        assert ok(r)["opencoti"]["admission"]["decision"] == "overcommit"
        # warn admits with X-Sessions-Remaining
        c.post(f"/polykv/pools/{pid}/admission", json={"on_saturation": "warn"})
        r = c.post("/v1/completions", json={"prompt": prefix + toks(3, 6), "pool_id": pid, "session_id": "warned",
                                            "max_tokens": 2, **GREEDY})
        assert r.status_code == 200 and r.headers["x-sessions-remaining"] == "0"
        assert "saturated" in r.headers["x-admission-warning"]
        assert r.json()["opencoti"]["admission"]["decision"] == "warned"


def test_queue_and_settling_holds_are_bounded(loaded):
    engine, pid, prefix = loaded
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        # queue: held FIFO until capacity returns or the timeout, then a 429
        ok(c.post(f"/polykv/pools/{pid}/admission", json={"on_saturation": "queue", "queue_timeout_ms": 100}))
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "pool_id": pid,
                                                 "session_id": "queued", "max_tokens": 2})
        err(r, 429, "timed out")
        assert r.headers["retry-after"]
        # settling: a new admit opens a settle window; the next new session is held, not refused
        ok(c.post(f"/polykv/pools/{pid}/admission", json={"target_tps_per_session": 1e-3, "forecast": "conservative",
                                                          "settle_tokens": 1_000_000, "settle_max_ms": 100,
                                                          "on_saturation": "reject"}))
        s1 = engine.stream(prefix + toks(4, 3), params=SamplingParams.greedy(450, ignore_eos=True), pool_id=pid,
                           session_id="s1")  # admitted: the pool settles while it decodes
        try:
            r = c.post("/completion", json={"prompt": prefix + toks(5, 3), "pool_id": pid, "session_id": "s2",
                                            "n_predict": 2, **GREEDY})
            assert r.status_code == 200, r.text
            assert r.json()["opencoti"]["admission"]["held_ms"] > 0
        finally:
            s1.close()
        holds = [e for e in ok(c.get("/polykv/events", params={"pool_id": pid}))["events"] if e["event"] == "hold"]
        assert any(e["kind"] == "settling" for e in holds)


# ============================================================================ tps
def test_tps_once_stream_and_history(client, engine):
    r = client.post("/completion", json={"prompt": "abc", "n_predict": 5, "session_id": "t1", **GREEDY})
    assert r.status_code == 200
    snap = ok(client.get("/polykv/tps", params={"once": 1}))
    assert {"ts", "aggregate_tps", "mean_active_tps", "n_warming", "sessions"} <= set(snap)
    row = snap["sessions"][0]
    assert row["session_id"] == "t1" and {"pool_id", "tps_ewma", "ctx_used", "ctx_total", "ctx_headroom_tokens"} <= set(row)
    with client.stream("GET", "/polykv/tps", params={"interval_ms": 50, "count": 3}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        text = "".join(s.iter_text())
    events = sse_events(text)
    assert len(events) == 3 and all("aggregate_tps" in e for e in events)
    assert events[0]["ts"] <= events[1]["ts"] <= events[2]["ts"]
    err(client.get("/polykv/tps", params={"interval_ms": 1}), 400, "interval_ms")
    hist = ok(client.get("/polykv/tps/history"))
    assert "aggregate" in hist and "sessions" in hist
    assert ok(client.get("/polykv/integrity"))["ok"] is True


@pytest.fixture
def long_engine():
    """A tiny model with a 2048-token context (the injected tool block is long in bytes)."""
    from opencoti.engine import Engine, EngineConfig
    from opencoti.engine.model.loader import tiny_model

    eng = Engine(EngineConfig(model="tiny:llama", page_size=4, kv_budget_tokens=8192, pool_grace_ttl_s=0.0),
                 loaded=tiny_model("llama", max_position_embeddings=2048))
    yield eng
    try:
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pool_with_tools_injected_is_an_exact_prefix(long_engine):
    """On a template that ignores tools (SmolLM2), tools are injected into the system prompt; a pool
    made from the same messages + tools must still be a token-exact prefix of the chat request, and
    a branch at the end of the shared preamble serves the other toolset (journey B with tools)."""
    engine = long_engine
    engine.tokenizer.chat_template = PLAIN_TEMPLATE  # as SmolLM2's: it ignores tools
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        a = ok(client.post("/polykv/pools", json={"messages": SYSTEM, "tools": TOOLS_A}))
        preamble = ok(client.post("/apply-template", json={"messages": SYSTEM, "add_generation_prompt": False}))
        d = len(engine.tokenize(preamble["prompt"].removesuffix("<|im_end|>\n")))  # system text, before the tools
        b = ok(client.post(f"/polykv/pools/{a['pool_id']}/fork", json={"branch_pos": d, "messages": SYSTEM,
                                                                       "tools": TOOLS_B}))
        assert b["branch_pos"] == d < a["prefix_len"]
        for pool, tools in ((a, TOOLS_A), (b, TOOLS_B)):
            r = chat(client, SYSTEM + [{"role": "user", "content": "go"}], tools=tools, pool_id=pool["pool_id"])
            assert r.status_code == 200 and r.headers["x-cached-prefix-tokens"] == str(pool["prefix_len"])
        rendered = ok(client.post("/apply-template", json={"messages": SYSTEM, "tools": TOOLS_B,
                                                           "add_generation_prompt": False}))["prompt"]
        assert len(engine.tokenize(rendered)) == b["prefix_len"] and "run_sql" in rendered
