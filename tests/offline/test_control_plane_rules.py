"""The control plane's rules as a user meets them (docs/polykv.md): one session shape in every
answer, one release rule, conservative projections and backpressure numbers, hold reasons that
name their cause, snapshots and compaction, the LangGraph gate's state keys, legacy fields and
``/metrics`` when idle."""

from __future__ import annotations

import random
import time

import pytest
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


def test_a_release_waits_for_the_request_in_flight_then_the_grace(make_engine):
    eng = make_engine(pool_grace_ttl_s=0.5)
    pool = eng.create_pool(tokens=toks(23, 12))
    stream = eng.stream(toks(23, 12) + [4], params=_greedy(300), pool_id=pool.pool_id, session_id="busy")
    it = iter(stream)
    next(it)  # decoding
    eng.release_pool(pool.pool_id)
    time.sleep(0.6)  # longer than the grace, while it decodes (300 tokens take seconds here)
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
