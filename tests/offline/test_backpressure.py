"""What a generation reports besides its body: the enforced gate's backpressure (headers,
``info.admission``, ``response_metadata["backpressure"]`` of OpencotiChatModel on both transports,
sync and async, streamed and not) and the ``x-session-tps`` header."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from starlette.testclient import TestClient

from opencoti.engine import SamplingParams
from opencoti.engine.admission import AdmissionPolicy
from opencoti.engine.admission.capacity import CapacityInputs
from opencoti.engine.admission.decide import ADMIT, AdmissionPlan, GateInputs, decide
from opencoti.langgraph import OpencotiChatModel
from opencoti.ops.headers import generation_headers, whole_seconds
from opencoti.server import create_app

GREEDY = {"temperature": 0, "ignore_eos": True}
USER = [{"role": "user", "content": "hi"}]


# ============================================================================ the decision
def _gate(available_cells: int) -> GateInputs:
    cap = CapacityInputs(policy=AdmissionPolicy(mode="enforced"), mean=10.0, n_active=2, n_decoding=2,
                         n_pool_sessions=2, available_cells=available_cells, free_cells=available_cells,
                         total_cells=1000, marginal_tokens=100)
    return GateInputs(cap, 10.0, soonest_finish_s=2.5)


def test_an_admit_that_fills_the_pool_carries_retry_after():
    plan = AdmissionPlan(pool_id=3, session_id="x", new_to_pool=True, prompt_len=30, prefix_len=20, max_tokens=10)
    last = decide(plan, _gate(150))  # room for this one only
    assert last.action == ADMIT and last.kind == "admitted" and last.capacity["sessions_remaining"] == 1
    assert last.retry_after == pytest.approx(2.5) and last.info()["retry_after"] == pytest.approx(2.5)
    roomy = decide(plan, _gate(1000))
    assert roomy.capacity["sessions_remaining"] > 1 and roomy.retry_after is None
    assert roomy.info()["retry_after"] is None


def test_header_values():
    from opencoti.engine.results import RequestInfo

    info = RequestInfo("r", "s", 2, 5, 9, admission={"sessions_remaining": 0, "warning": "full ✓",
                                                      "retry_after": 2.2}, session_tps=12.345)
    h = generation_headers(info)
    assert h["X-Sessions-Remaining"] == "0" and h["x-admission-warning"] == "full ?"  # ASCII only
    assert h["x-admission-retry-after"] == "3" and h["x-session-tps"] == "12.35"
    assert generation_headers(info, {"predicted_per_second": 4.0})["x-session-tps"] == "4.00"
    assert "x-session-tps" not in generation_headers(info, {"predicted_per_second": 0.0})
    bare = generation_headers(RequestInfo("r", "s", None, 0, 3))
    assert set(bare) == {"x-session-id", "x-cached-prefix-tokens"}
    assert whole_seconds(0.01) == 1 and whole_seconds(None) is None and whole_seconds(float("inf")) is None


# ============================================================================ a saturated enforced pool
@pytest.fixture
def saturated():
    """A pool with an impossible floor (enforced, warn) and one session 'bg' decoding a long answer
    (a long context, so it outlives the test): every new session is admitted with a warning and no
    room after it."""
    from opencoti.engine import Engine, EngineConfig
    from opencoti.engine.model.loader import tiny_model

    engine = Engine(EngineConfig(model="tiny:llama", page_size=4, kv_budget_tokens=32768, pool_grace_ttl_s=0.0),
                    loaded=tiny_model("llama", max_position_embeddings=16384))
    prefix = engine.tokenize("the shared prefix of a saturated pool")
    pool = engine.create_pool(tokens=prefix)
    engine.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", on_saturation="warn",
                         settle_tokens=4, settle_max_ms=50)  # each admit's settle hold stays short
    s = engine.stream(prefix + [5, 6], params=SamplingParams.greedy(16000, ignore_eos=True), pool_id=pool.pool_id,
                      session_id="bg")
    for i, _ in enumerate(s):
        if i == 8:
            break
    bg = threading.Thread(target=lambda: [None for _ in s])
    bg.start()
    try:
        yield engine, pool.pool_id
        assert engine.tps_snapshot()["n_active"] >= 1, "the background session ended before the test did"
    finally:
        engine.release_session("bg")
        bg.join(60)
        try:
            engine.check_integrity()
        finally:
            engine.shutdown()


def _check_backpressure(bp: dict | None):
    assert bp is not None
    assert set(bp) == {"sessions_remaining", "warning", "retry_after_s"}, bp
    assert bp["sessions_remaining"] == 0 and "saturated" in bp["warning"]
    assert isinstance(bp["retry_after_s"], float) and 1 <= bp["retry_after_s"] <= 60


def test_backpressure_headers_on_every_route(saturated):
    engine, pid = saturated
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
                           ("/v1/completions", {"prompt": "x y", "max_tokens": 2}),
                           ("/completion", {"prompt": "x y", "n_predict": 2})):
            for stream in (False, True):
                r = c.post(path, json={**body, "pool_id": pid, "stream": stream, **GREEDY})
                assert r.status_code == 200, r.text
                assert r.headers["x-sessions-remaining"] == "0" and "saturated" in r.headers["x-admission-warning"]
                assert 1 <= int(r.headers["x-admission-retry-after"]) <= 60
                assert "retry-after" not in r.headers  # that one is for refusals
        # a continuation is never gated: no backpressure headers
        ok = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "pool_id": pid,
                                                  "session_id": "cont", **GREEDY})
        assert "x-sessions-remaining" in ok.headers
        again = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "session_id": "cont",
                                                     **GREEDY})
        assert again.status_code == 200 and "x-sessions-remaining" not in again.headers
        assert "x-admission-retry-after" not in again.headers


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_chat_model_backpressure_on_both_transports(saturated, transport):
    engine, pid = saturated
    app = create_app(engine)
    with TestClient(app, raise_server_exceptions=False) as tc:
        if transport == "engine":
            model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=2)
        else:
            model = OpencotiChatModel(base_url="http://testserver", http_client=tc, temperature=0, max_tokens=2,
                                      http_async_client=httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                                          base_url="http://testserver"))
        _check_backpressure(model.invoke("x", pool_id=pid).response_metadata.get("backpressure"))
        chunks = list(model.stream("x", pool_id=pid))
        _check_backpressure(chunks[-1].response_metadata.get("backpressure"))
        _check_backpressure(asyncio.run(model.ainvoke("x", pool_id=pid)).response_metadata.get("backpressure"))

        async def astream():
            return [c async for c in model.astream("x", pool_id=pid)]

        _check_backpressure(asyncio.run(astream())[-1].response_metadata.get("backpressure"))
        # no gate looked at it: no backpressure key (a continuation, or no pool)
        first = model.invoke([HumanMessage("a")], pool_id=pid, session_id=f"agent-{transport}")
        _check_backpressure(first.response_metadata.get("backpressure"))
        later = model.invoke([HumanMessage("a"), first, HumanMessage("b")], session_id=f"agent-{transport}")
        assert "backpressure" not in later.response_metadata
        assert "backpressure" not in model.invoke("x").response_metadata


def test_response_metadata_backpressure_keys_follow_the_headers():
    from opencoti.client import ChatChunk, GenerationInfo, Usage
    from opencoti.langgraph.convert import response_metadata

    end = ChatChunk(finish_reason="stop", usage=Usage())
    for info, want in (
        (GenerationInfo(session_id="s", pool_id=1, sessions_remaining=4), {"sessions_remaining": 4}),
        (GenerationInfo(session_id="s", pool_id=1, sessions_remaining=1, admission_retry_after_s=3.0),
         {"sessions_remaining": 1, "retry_after_s": 3.0}),
        (GenerationInfo(session_id="s", pool_id=1), None),
        (None, None),
    ):
        assert response_metadata(end, info, None, "m").get("backpressure") == want


# ============================================================================ x-session-tps
def test_session_tps_header(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 8}),
                           ("/v1/completions", {"prompt": "a b c", "max_tokens": 8}),
                           ("/completion", {"prompt": "a b c", "n_predict": 8})):
            sid = "tps" + path.replace("/", "-")
            r = c.post(path, json={**body, "session_id": sid, **GREEDY})
            assert r.status_code == 200, r.text
            rate = r.json()["timings"]["predicted_per_second"]
            assert rate > 0 and r.headers["x-session-tps"] == f"{rate:.2f}"  # this request's own rate
            # a stream's headers precede its tokens: the session's rate before this request
            row = next(s for s in c.get("/polykv/tps", params={"once": 1}).json()["sessions"]
                       if s["session_id"] == sid)
            with c.stream("POST", path, json={**body, "session_id": sid, "stream": True, **GREEDY}) as s:
                assert s.status_code == 200
                assert s.headers["x-session-tps"] == f"{row['tps_ewma']:.2f}"
                events = [json.loads(x[6:]) for x in "".join(s.iter_text()).split("\n")
                          if x.startswith("data: ") and x[6:] != "[DONE]"]
            assert any((e.get("timings") or {}).get("predicted_per_second", 0) > 0 for e in events)
        # a new session's stream has no measurement yet; one generated token has no interval
        with c.stream("POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "stream": True,
                                                            "session_id": "fresh", **GREEDY}) as s:
            assert s.status_code == 200 and "x-session-tps" not in s.headers
            "".join(s.iter_text())
        one = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "session_id": "one", **GREEDY})
        assert one.status_code == 200 and "x-session-tps" not in one.headers
        # several choices: several sessions, no single rate
        many = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "n": 2, **GREEDY})
        assert many.status_code == 200 and "x-session-tps" not in many.headers


def test_cors_exposes_the_new_headers(engine):
    from opencoti.server import ServerConfig

    app = create_app(engine, config=ServerConfig(cors_origins=["http://example.com"]))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, **GREEDY},
                   headers={"Origin": "http://example.com"})
        exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {"x-session-tps", "x-admission-retry-after", "x-sessions-remaining"} <= exposed


def test_chat_model_session_tps_metadata_unchanged(engine):
    """``session_tps`` in response_metadata stays the live rate (the header is a separate signal)."""
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=4)
    msg = model.invoke([HumanMessage("hello")], session_id="m1")
    assert isinstance(msg, AIMessage) and msg.response_metadata["session_tps"] > 0
