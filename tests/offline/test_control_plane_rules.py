"""The control plane's rules as a user meets them (docs/polykv.md): one session shape in every
answer, one release rule, conservative projections and backpressure numbers, hold reasons that
name their cause, snapshots and compaction, the LangGraph gate's state keys, legacy fields and
``/metrics`` when idle."""

from __future__ import annotations

import random
import time

from starlette.testclient import TestClient

from opencoti.client import PolyKVClient
from opencoti.langgraph import polykv_tools
from opencoti.server import create_app
from http_checks import err, ok

GREEDY = {"temperature": 0, "ignore_eos": True}
SESSION_KEYS = {"session_id", "pool_id", "suffix_n_tokens", "marginal_kv_bytes", "ctx_used", "ctx_total", "state",
                "tps_ewma", "ttft_ms"}


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


# ============================================================================ 1. one session shape
def test_every_pool_answer_lists_sessions_with_tps_and_ttft(engine):
    prefix = toks(1, 12)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        pool = ok(c.post("/polykv/pools", json={"tokens": prefix}))
        pid = pool["pool_id"]
        for sid, seed in (("a", 2), ("b", 3)):
            ok(c.post("/completion", json={"prompt": prefix + toks(seed, 4), "n_predict": 8, "session_id": sid,
                                           "pool_id": pid, **GREEDY}))

        def check(sessions, names):
            assert sorted(s["session_id"] for s in sessions) == sorted(names)
            for s in sessions:
                assert SESSION_KEYS <= set(s), set(s) ^ SESSION_KEYS
                assert s["tps_ewma"] > 0 and s["ttft_ms"] is not None and s["ttft_ms"] >= 0, s

        tree = {p["pool_id"]: p for p in ok(c.get("/polykv/pools"))["pools"]}
        check(tree[pid]["sessions"], "ab")
        check(ok(c.get(f"/polykv/pools/{pid}"))["sessions"], "ab")
        check(ok(c.post(f"/polykv/pools/{pid}/pin"))["sessions"], "ab")
        check(ok(c.post(f"/polykv/pools/{pid}/unpin"))["sessions"], "ab")
        child = ok(c.post("/polykv/pools", json={"from_session": "a"}))  # a moves onto its snapshot
        check(child["sessions"], "a")
        fork = ok(c.post(f"/polykv/pools/{pid}/fork", json={"from_session": "b"}))
        check(fork["sessions"], "b")
        # the subtree rows of GET /polykv/pools/{id} and the tree's rows are the same rows
        sub = {p["pool_id"]: p for p in ok(c.get(f"/polykv/pools/{pid}"))["subtree"]}
        tree = {p["pool_id"]: p for p in ok(c.get("/polykv/pools"))["pools"]}
        for q in (child["pool_id"], fork["pool_id"]):
            assert [s["session_id"] for s in sub[q]["sessions"]] == [s["session_id"] for s in tree[q]["sessions"]]
            check(sub[q]["sessions"], [s["session_id"] for s in tree[q]["sessions"]])

        # the LangGraph tool, over HTTP, reports the session's speed
        tools = {t.name: t for t in polykv_tools(PolyKVClient(http_client=c))}
        row = tools["pool_status"].invoke({"pool_id": child["pool_id"]})["sessions"][0]
        assert row["session_id"] == "a" and row["tps_ewma"] > 0 and row["ttft_ms"] is not None
        # in process too
        row = {t.name: t for t in polykv_tools(engine)}["pool_status"].invoke({"pool_id": fork["pool_id"]})
        assert row["sessions"][0]["tps_ewma"] > 0


# ============================================================================ 2. one release rule
def _greedy(n: int):
    from opencoti.engine import SamplingParams
    return SamplingParams.greedy(n, ignore_eos=True)


def _live_ids(eng) -> set[int]:
    return {p["pool_id"] for p in eng.pools()["pools"]}


def _wait(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_a_release_waits_out_the_grace_whatever_happened_before(make_engine):
    """Never used, idle sessions still attached, or its sessions gone: the same deferred release,
    and the next agent attaches instead of getting 404."""
    eng = make_engine(pool_grace_ttl_s=0.8)
    never = eng.create_pool(tokens=toks(20, 12))
    idle = eng.create_pool(tokens=toks(21, 12))
    eng.generate(toks(21, 12) + [5], params=_greedy(2), pool_id=idle.pool_id, session_id="idle-agent")
    left = eng.create_pool(tokens=toks(22, 12))
    eng.generate(toks(22, 12) + [5], params=_greedy(2), pool_id=left.pool_id, session_id="gone")
    eng.release_session("gone")
    for p in (never, idle, left):
        eng.release_pool(p.pool_id)
        info = eng.pool(p.pool_id)  # deferred: resident, attachable, with the time left
        assert info.residency == "resident" and 0.5 < info.release_in_s <= 0.8, (p.pool_id, info.release_in_s)
    assert [s["session_id"] for s in eng.pool(idle.pool_id).sessions] == ["idle-agent"]
    r = eng.generate(toks(20, 12) + [9], params=_greedy(2), pool_id=never.pool_id, session_id="next")
    assert r.info.pool_id == never.pool_id and r.info.cached_prefix_tokens >= 11
    # the grace ends: all three go, the idle session's included (it keeps its own context)
    assert _wait(lambda: not {never.pool_id, idle.pool_id, left.pool_id} & _live_ids(eng))
    r = eng.generate(toks(21, 12) + [5, 6], params=_greedy(2), session_id="idle-agent")
    assert r.info.cached_prefix_tokens >= 12
    eng.check_integrity()


def test_a_release_waits_for_the_request_in_flight_then_the_grace(make_engine, monkeypatch):
    eng = make_engine(pool_grace_ttl_s=0.5, speculative="off")
    forward = eng.model.forward

    def slow_forward(*a, **k):  # >= 5 ms a step: the 300 tokens below outlast the grace on any machine
        time.sleep(0.005)
        return forward(*a, **k)

    monkeypatch.setattr(eng.model, "forward", slow_forward)
    pool = eng.create_pool(tokens=toks(23, 12))
    stream = eng.stream(toks(23, 12) + [4], params=_greedy(300), pool_id=pool.pool_id, session_id="busy")
    it = iter(stream)
    next(it)  # decoding
    eng.release_pool(pool.pool_id)
    time.sleep(0.6)  # longer than the grace, while it decodes (300 steps of >= 5 ms)
    assert eng.pool(pool.pool_id).sessions[0]["state"] != "idle"
    for _ in it:
        pass
    t_end = time.monotonic()
    assert pool.pool_id in _live_ids(eng)  # the grace counts from the end of the last request
    assert _wait(lambda: pool.pool_id not in _live_ids(eng))
    assert time.monotonic() - t_end >= 0.3
    # immediate: at once, decoding or not
    p2 = eng.create_pool(tokens=toks(24, 12))
    eng.generate(toks(24, 12) + [4], params=_greedy(2), pool_id=p2.pool_id, session_id="x")
    eng.release_pool(p2.pool_id, immediate=True)
    assert p2.pool_id not in _live_ids(eng)
    eng.check_integrity()


# ============================================================================ 5. snapshots and compaction
def test_compaction_after_a_released_snapshot_frees_the_old_working_pool(engine):
    """from_session moves the session onto its snapshot (a child of its pool); once the snapshot is
    released, compaction still releases the working pool the session came from, and reports the KV
    owned by pools and sessions (cache apart)."""
    system = toks(30, 12)
    root = engine.create_pool(tokens=system)
    work = engine.fork_pool(root.pool_id, tokens=system + toks(31, 40))
    engine.generate(engine.core.tree.get(work.pool_id).tokens + toks(32, 10), params=_greedy(12),
                    pool_id=work.pool_id, session_id="agent")
    snap = engine.create_pool(from_session="agent")
    assert snap.parent == work.pool_id and [s["session_id"] for s in snap.sessions] == ["agent"]
    assert [s["session_id"] for s in engine.pool(work.pool_id).sessions] == []  # the documented move
    engine.release_pool(snap.pool_id, immediate=True)
    used_before = engine.pools()["kv_pages_used"]
    out = engine.compact_session("agent", root.pool_id, tokens=system + toks(33, 6))
    assert out["released_pools"] == [work.pool_id]
    live = _live_ids(engine)
    assert work.pool_id not in live and snap.pool_id not in live and out["pool"].pool_id in live
    assert out["kv_pages_before"] == used_before  # pages owned by pools and sessions, as /polykv/pools says
    assert out["kv_pages_after"] == engine.pools()["kv_pages_used"] < out["kv_pages_before"]
    # what was freed and still sits in the prefix cache is reported apart
    assert out["kv_pages_cache_after"] == engine.pools()["kv_pages_cache"]
    assert out["kv_pages_cache_after"] > out["kv_pages_cache_before"]
    r = engine.generate(system + toks(33, 6) + [7], params=_greedy(2), session_id="agent")
    assert r.info.pool_id == out["pool"].pool_id and r.info.cached_prefix_tokens >= 18
    engine.check_integrity()


def test_compaction_keeps_what_others_still_use(engine):
    system = toks(34, 12)
    root = engine.create_pool(tokens=system)
    work = engine.fork_pool(root.pool_id, tokens=system + toks(35, 20))
    wtoks = engine.core.tree.get(work.pool_id).tokens
    for sid in ("a", "b"):
        engine.generate(wtoks + toks(36, 4), params=_greedy(4), pool_id=work.pool_id, session_id=sid)
    snap = engine.create_pool(from_session="a")
    engine.release_pool(snap.pool_id, immediate=True)
    out = engine.compact_session("a", root.pool_id, tokens=system + toks(37, 6))
    assert out["released_pools"] == [] and work.pool_id in _live_ids(engine)  # "b" still works on it
    engine.check_integrity()


# ============================================================================ 3. conservative projections
from opencoti.engine.admission import (REASON_FLOOR, REASON_FLOOR_IDLE, REASON_GUARANTEED, REASON_UNCERTAIN,  # noqa: E402
                                       REASON_UNMEASURED, AdmissionPolicy, CapacityInputs, compute_capacity)


def _cap(**kw) -> dict:
    base = dict(available_cells=1000, free_cells=1000, total_cells=1000, marginal_tokens=100)
    return compute_capacity(CapacityInputs(**{**base, **kw}))


def test_a_projection_is_never_above_what_is_measured_now():
    pol = AdmissionPolicy(target_tps_per_session=10.0)
    cap = _cap(policy=pol, mean=26.88, n_active=3, n_decoding=3, n_pool_sessions=3, n_engine_inflight=3,
               fc_kind="measured", fc_now_tps=26.9, fc_est_tps=27.35, fc_bound_tps=27.1, fc_headroom=4)
    assert cap["projected_mean_tps_measured"] <= 26.88 and cap["projected_mean_tps_if_admitted"] <= 26.88
    assert cap["can_admit"]
    # with nothing decoding, the ceiling is the step time measured at the current size
    cap = _cap(policy=pol, mean=None, n_pool_sessions=0, n_engine_inflight=0, fc_kind="extrapolated",
               fc_now_tps=20.0, fc_est_tps=21.0, fc_bound_tps=20.5)
    assert cap["projected_mean_tps_measured"] <= 20.0 and cap["projected_mean_tps_if_admitted"] <= 20.0


def test_with_nothing_measured_a_floor_says_unknown_never_a_number():
    absurd = AdmissionPolicy(target_tps_per_session=1e6, mode="enforced")
    # the first session on a cold engine: guaranteed, and how many more fit is unknown
    first = _cap(policy=absurd, mean=None, n_pool_sessions=0, n_engine_inflight=0)
    assert first["can_admit"] and first["reason"] == REASON_GUARANTEED and first["sessions_remaining"] == "unknown"
    # a second one while the first still warms up: held until its steps are measured
    second = _cap(policy=absurd, mean=None, n_warming=1, n_pool_sessions=1, n_engine_inflight=1)
    assert not second["can_admit"] and second["reason"] == REASON_UNMEASURED
    assert second["sessions_remaining"] == "unknown"
    # an idle engine that measured nothing: the only way to learn is to admit; it says unknown
    idle = _cap(policy=absurd, mean=None, n_pool_sessions=1, n_engine_inflight=0)
    assert idle["can_admit"] and idle["probe"] and idle["sessions_remaining"] == "unknown"
    # no floor: nothing to project, the KV headroom is the number
    assert _cap(policy=AdmissionPolicy(), mean=None, n_pool_sessions=1, n_engine_inflight=1)["sessions_remaining"] == 10


def test_x_sessions_remaining_means_one_thing_cold_and_warm(make_engine):
    eng = make_engine()
    system = toks(40, 12)
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        def enforced_pool(seed):
            p = ok(c.post("/polykv/pools", json={"tokens": system + toks(seed, 4)}))
            ok(c.post(f"/polykv/pools/{p['pool_id']}/admission",
                     json={"target_tps_per_session": 1e6, "mode": "enforced", "on_saturation": "reject"}))
            return p["pool_id"], system + toks(seed, 4)

        pid, prefix = enforced_pool(41)
        # cold engine: the guaranteed first session, nothing measured yet
        r = c.post("/completion", json={"prompt": prefix + [5], "n_predict": 40, "pool_id": pid, "session_id": "a",
                                         **GREEDY})
        ok(r)
        assert r.headers["x-sessions-remaining"] == "unknown"
        # warm engine, idle again: a second session is refused with the floor's reason, 0 remaining
        r = c.post("/completion", json={"prompt": prefix + [6], "n_predict": 4, "pool_id": pid, "session_id": "b",
                                        **GREEDY})
        assert r.status_code == 429 and r.headers["x-sessions-remaining"] == "0"
        assert r.headers["x-admission-reason"] in (REASON_FLOOR, REASON_FLOOR_IDLE, REASON_UNCERTAIN)
        # the guaranteed first session of a new pool on the warm engine: 0, no session fits past it
        pid2, prefix2 = enforced_pool(42)
        r = c.post("/completion", json={"prompt": prefix2 + [5], "n_predict": 4, "pool_id": pid2,
                                        "session_id": "c", **GREEDY})
        ok(r)
        assert r.headers["x-sessions-remaining"] == "0"
    # the same values in process (the client reads the engine's answer)
    pid3 = eng.create_pool(tokens=toks(43, 12)).pool_id
    eng.set_admission(pid3, target_tps_per_session=1e6, mode="enforced")
    res = eng.generate(toks(43, 12) + [5], params=_greedy(4), pool_id=pid3, session_id="d")
    assert res.info.admission["decision"] == "guaranteed" and res.info.admission["sessions_remaining"] == 0


# ============================================================================ 4. hold reasons name their cause
def test_hold_reasons_name_their_real_cause():
    pol = AdmissionPolicy(target_tps_per_session=0.01)
    idle = dict(policy=pol, mean=None, n_pool_sessions=2, n_engine_inflight=0, last_settled_mean=25.5,
                last_settled_age_s=1.0, fc_now_tps=25.5, fc_frontier=True, fc_kind="extrapolated")
    # held because the current batch size is not measured to precision (not "below the floor")
    cap = _cap(**idle, fc_est_tps=25.3, fc_bound_tps=25.08, fc_thin=True)
    assert cap["projected_idle_estimate"] and not cap["can_admit"]
    assert cap["reason"] == REASON_UNMEASURED and cap["projected_mean_tps_if_admitted"] > 0.01
    # estimate above the floor, bound below it: uncertain, idle estimate or not
    pol2 = AdmissionPolicy(target_tps_per_session=25.0)
    cap = _cap(**{**idle, "policy": pol2, "fc_frontier": False, "fc_kind": "measured"}, fc_est_tps=25.3,
               fc_bound_tps=24.0)
    assert cap["projected_idle_estimate"] and cap["reason"] == REASON_UNCERTAIN
    # both below: below the floor, from the idle estimate
    cap = _cap(**{**idle, "policy": pol2, "fc_frontier": False, "fc_kind": "measured"}, fc_est_tps=24.5,
               fc_bound_tps=24.0)
    assert cap["reason"] == REASON_FLOOR_IDLE
    # a probed size with no steps of its own yet
    cap = _cap(policy=AdmissionPolicy(target_tps_per_session=30.0), mean=50.0, n_active=5, n_decoding=5,
               n_pool_sessions=5, n_engine_inflight=5, fc_kind="unmeasured", fc_frontier=True)
    assert cap["reason"] == REASON_UNMEASURED


def test_unknown_reaches_every_surface_the_same_way():
    from opencoti.client.events import generation_info, info_from_headers
    from opencoti.engine.results import RequestInfo
    from opencoti.langgraph.convert import backpressure
    from opencoti.ops.headers import generation_headers

    info = RequestInfo("r", "s", 2, 5, 9, admission={"decision": "guaranteed", "sessions_remaining": "unknown",
                                                     "warning": None, "retry_after": None})
    h = generation_headers(info)
    assert h["X-Sessions-Remaining"] == "unknown" and "x-admission-retry-after" not in h
    over_http = info_from_headers({k.lower(): v for k, v in h.items()})
    in_process = generation_info(info)
    assert over_http.sessions_remaining == in_process.sessions_remaining == "unknown"
    assert backpressure(over_http) == backpressure(in_process) == {"sessions_remaining": "unknown"}
    assert info_from_headers({"x-session-id": "s", "x-sessions-remaining": "3"}).sessions_remaining == 3


# ============================================================================ 6. the gate's state update
def test_the_gate_puts_the_combined_sessions_remaining_in_the_state(make_engine):
    from langgraph.graph import END, START, StateGraph

    from opencoti.langgraph import CapacityGateNode, PolyKVState

    class S(PolyKVState, total=False):
        route: str

    eng = make_engine()
    prefix = toks(50, 12)
    pool = eng.create_pool(tokens=prefix)
    eng.generate(prefix + [5], params=_greedy(40), pool_id=pool.pool_id, session_id="warm")  # measured now
    eng.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced")
    g = StateGraph(S)
    g.add_node("gate", CapacityGateNode(PolyKVClient(engine=eng), spawn="spawn", hold="hold"))
    g.add_node("spawn", lambda s: {"route": "spawn"})
    g.add_node("hold", lambda s: {"route": "hold"})
    g.add_edge(START, "gate")
    g.add_edge("spawn", END)
    g.add_edge("hold", END)
    out = g.compile().invoke({"pool_id": pool.pool_id})
    assert out["route"] == "hold" and out["capacity_ok"] is False
    assert out["sessions_remaining"] == 0  # what a graph branches on: nothing fits under this floor
    assert out["kv_headroom_sessions"] > 10  # the KV alone would have room: named for what it is
    assert "headroom_sessions" not in out


# ============================================================================ 7. legacy field, /metrics when idle
def test_shared_pool_slot_is_the_legacy_name_of_pool_id(engine):
    prefix = toks(60, 12)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        pid = ok(c.post("/polykv/pools", json={"tokens": prefix}))["pool_id"]
        other = ok(c.post("/polykv/pools", json={"tokens": toks(61, 12)}))["pool_id"]
        r = c.post("/completion", json={"prompt": prefix + [5], "n_predict": 2, "shared_pool_slot": pid, **GREEDY})
        ok(r)
        assert r.headers["x-pool-id"] == str(pid) and int(r.headers["x-cached-prefix-tokens"]) >= 12
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "shared_pool_slot": pid, "pool_id": pid, **GREEDY})
        ok(r)
        assert r.headers["x-pool-id"] == str(pid)
        before = ok(c.get("/slots"))
        # both names with different pools: refused, nothing runs
        err(c.post("/completion", json={"prompt": prefix + [6], "n_predict": 2, "shared_pool_slot": pid,
                                        "pool_id": other, **GREEDY}), 400, "shared_pool_slot")
        err(c.post("/completion", json={"prompt": prefix + [6], "n_predict": 2, "shared_pool_slot": "1"}), 400,
            "shared_pool_slot")
        err(c.post("/completion", json={"prompt": prefix + [6], "n_predict": 2, "shared_pool_slot": 999}), 404)
        assert ok(c.get("/slots")) == before


def test_metrics_has_no_mean_active_tps_sample_when_idle(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        text = c.get("/metrics").text
        assert "# TYPE opencoti_polykv:mean_active_tps gauge" in text
        assert not [ln for ln in text.splitlines() if ln.startswith("opencoti_polykv:mean_active_tps")]
        stream = engine.stream(toks(62, 8), params=_greedy(400), session_id="busy")
        it = iter(stream)
        assert _wait(lambda: engine.tps_snapshot()["mean_active_tps"] is not None)
        text = c.get("/metrics").text
        (line,) = [ln for ln in text.splitlines() if ln.startswith("opencoti_polykv:mean_active_tps")]
        assert float(line.split()[-1]) > 0
        for _ in it:
            pass


def test_a_cluster_routes_shared_pool_slot_like_pool_id():
    import json

    from opencoti.cluster.hints import hint_for

    body = json.dumps({"prompt": "hi", "shared_pool_slot": 7}).encode()
    assert hint_for("POST", "/completion", body).pool_id == 7
    assert hint_for("POST", "/completion", json.dumps({"prompt": "hi", "pool_id": 3}).encode()).pool_id == 3
