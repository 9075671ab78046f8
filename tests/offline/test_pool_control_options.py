"""Explicit pool-control options on every surface (HTTP, ops, sync/async clients, LangGraph tools):
``from_session`` as a child of the session's pool (default) or ``as_root``; ``DELETE
/polykv/pools/{id}?immediate=true``; ``--no-metrics``; the cluster's merged ``mean_active_tps``."""

from __future__ import annotations

import asyncio
import random

import pytest
from starlette.testclient import TestClient

from opencoti.client import AsyncPolyKVClient, InvalidRequestError, PolyKVClient, PoolNotFoundError
from opencoti.cluster import aggregate
from opencoti.langgraph import polykv_tools
from opencoti.server import ServerConfig, create_app
from http_checks import err, ok

GREEDY = {"temperature": 0, "ignore_eos": True}


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


def session_pool(engine, sid: str) -> int | None:
    return next(s["pool_id"] for s in engine.tps_snapshot()["sessions"] if s["session_id"] == sid)


# ============================================================================ from_session: child or root
def test_from_session_child_by_default_root_on_request(engine):
    page = engine.kv.page_size
    prefix = toks(1, 10)  # not page-aligned: the session borrows the pool's 2 full pages, [0, 8)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        pool = ok(c.post("/polykv/pools", json={"tokens": prefix}))
        for sid, seed in (("s", 2), ("t", 3)):
            ok(c.post("/completion", json={"prompt": prefix + toks(seed, 5), "n_predict": 3, "session_id": sid,
                                           "pool_id": pool["pool_id"], **GREEDY}))
        child = ok(c.post("/polykv/pools", json={"from_session": "s"}))  # the default: as_root false
        assert child["parent"] == pool["pool_id"]
        assert child["branch_pos"] == (len(prefix) // page) * page == 8
        assert child["prefix_len"] == len(prefix) + 5 + 3 - 1
        assert session_pool(engine, "s") == child["pool_id"]  # zero-copy: the session is now its leaf

        root = ok(c.post("/polykv/pools", json={"from_session": "t", "as_root": True}))
        assert root["parent"] is None and root["branch_pos"] == 0 and root["own_len"] == root["prefix_len"]
        assert root["prefix_len"] == len(prefix) + 5 + 3 - 1
        assert session_pool(engine, "t") == pool["pool_id"]  # the session stays where it was
        # the root is an exact, independent prefix: a request on it reuses all of it
        r = c.post("/completion", json={"prompt": engine.core.tree.get(root["pool_id"]).tokens + [7, 8],
                                        "n_predict": 2, "pool_id": root["pool_id"], **GREEDY})
        assert int(r.headers["x-cached-prefix-tokens"]) == root["prefix_len"]
        # a prefix given as tokens is a root anyway; as_root changes nothing there
        plain = ok(c.post("/polykv/pools", json={"tokens": toks(4, 6), "as_root": True}))
        assert plain["parent"] is None
        # bad inputs: nothing is created
        before = ok(c.get("/polykv/pools"))["pools_used"]
        err(c.post("/polykv/pools", json={"from_session": "t", "as_root": "yes"}), 400, "as_root")
        err(c.post("/polykv/pools", json={"from_session": "t", "as_root": 1}), 400, "as_root")
        err(c.post("/polykv/pools", json={"from_session": "t", "as_root": None}), 400, "as_root")
        err(c.post(f"/polykv/pools/{pool['pool_id']}/fork", json={"from_session": "t", "as_root": True}), 400,
            "as_root")  # fork always makes a child
        err(c.post("/polykv/pools", json={"from_session": "nobody", "as_root": True}), 404)
        assert ok(c.get("/polykv/pools"))["pools_used"] == before
        assert ok(c.get("/polykv/integrity"))["ok"] is True


def test_as_root_on_the_clients_engine_and_tools(engine):
    prefix = toks(5, 12)
    pool = engine.create_pool(tokens=prefix)
    for i, sid in enumerate(("a", "b", "c", "d")):
        engine.generate(prefix + toks(10 + i, 4), params=_greedy(2), pool_id=pool.pool_id, session_id=sid)
    sync, aio = PolyKVClient(engine=engine), AsyncPolyKVClient(engine=engine)
    assert sync.create_pool(from_session="a").parent == pool.pool_id
    assert sync.create_pool(from_session="b", as_root=True).parent is None
    assert asyncio.run(aio.create_pool(from_session="c", as_root=True)).parent is None
    with pytest.raises(InvalidRequestError, match="as_root"):
        sync.create_pool(from_session="d", as_root="yes")
    # the engine API itself checks the flag too
    with pytest.raises(InvalidRequestError, match="as_root"):
        engine.create_pool(from_session="d", as_root="yes")
    tools = {t.name: t for t in polykv_tools(engine)}
    out = tools["create_pool"].invoke({"from_session": "d", "as_root": True})
    assert out["parent"] is None and out["prefix_len"] == len(prefix) + 4 + 2 - 1
    assert "as_root" in tools["create_pool"].args


def _greedy(n: int):
    from opencoti.engine import SamplingParams
    return SamplingParams.greedy(n, ignore_eos=True)


# ============================================================================ release: deferred or immediate
def test_release_deferred_or_immediate_over_http(make_engine):
    engine = make_engine(pool_grace_ttl_s=30.0)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        ids = []
        for seed in (1, 2):
            p = ok(c.post("/polykv/pools", json={"tokens": toks(seed, 8)}))
            ok(c.post("/completion", json={"prompt": toks(seed, 8) + [3, 4], "n_predict": 2, "pool_id": p["pool_id"],
                                           "session_id": f"s{seed}", **GREEDY}))
            ok(c.delete(f"/polykv/sessions/s{seed}"))  # the last descendant left: the grace starts
            ids.append(p["pool_id"])
        a, b = ids
        out = ok(c.delete(f"/polykv/pools/{a}"))  # within the grace: deferred, still attachable
        assert out["released"] is True and 0 < out["release_in_s"] <= 30
        assert ok(c.get(f"/polykv/pools/{a}"))["release_in_s"] > 0
        out = ok(c.delete(f"/polykv/pools/{a}", params={"immediate": "true"}))
        assert out == {"pool_id": a, "released": True, "release_in_s": None}
        err(c.get(f"/polykv/pools/{a}"), 404)
        # bad values change nothing
        err(c.delete(f"/polykv/pools/{b}", params={"immediate": "maybe"}), 400, "immediate")
        assert ok(c.get(f"/polykv/pools/{b}"))["release_in_s"] is None
        assert ok(c.delete(f"/polykv/pools/{b}", params={"immediate": 1}))["release_in_s"] is None
        err(c.delete(f"/polykv/pools/{b}", params={"immediate": "true"}), 404)
        assert ok(c.get("/polykv/pools"))["pools_used"] == 0


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_release_immediate_on_both_clients(make_engine, transport):
    engine = make_engine(pool_grace_ttl_s=30.0)
    app = create_app(engine)
    with TestClient(app, raise_server_exceptions=False) as tc:
        if transport == "engine":
            sync, aio = PolyKVClient(engine=engine), AsyncPolyKVClient(engine=engine)
        else:
            import httpx
            sync = PolyKVClient(http_client=tc)
            aio = AsyncPolyKVClient(http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                                  base_url="http://testserver"))
        pools = []
        for seed in (1, 2, 3):
            p = sync.create_pool(tokens=toks(seed, 8))
            sync.complete(toks(seed, 8) + [5], pool_id=p.pool_id, session_id=f"x{seed}", max_tokens=2, temperature=0)
            sync.release_session(f"x{seed}")
            pools.append(p.pool_id)
        sync.release_pool(pools[0])  # deferred by the grace TTL
        assert sync.pool(pools[0]).release_in_s > 0
        sync.release_pool(pools[0], immediate=True)
        asyncio.run(aio.release_pool(pools[1], immediate=True))
        for pid in pools[:2]:
            with pytest.raises(PoolNotFoundError):
                sync.pool(pid)
        with pytest.raises(InvalidRequestError, match="immediate"):
            sync.release_pool(pools[2], immediate="yes")
        with pytest.raises(InvalidRequestError, match="immediate"):
            asyncio.run(aio.release_pool(pools[2], immediate=1))
        assert sync.pool(pools[2]).release_in_s is None  # untouched
        tools = {t.name: t for t in polykv_tools(sync)}
        assert tools["release_pool"].invoke({"pool_id": pools[2], "immediate": True})["released"] is True
        with pytest.raises(PoolNotFoundError):
            sync.pool(pools[2])


# ============================================================================ --no-metrics
def test_metrics_on_by_default_and_off_answers_501(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        r = c.get("/metrics")
        assert r.status_code == 200 and "opencoti:http_requests" in r.text
    app = create_app(engine, config=ServerConfig(metrics=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/metrics")  # llama.cpp without --metrics: 501, not_supported_error
        assert r.status_code == 501, r.text
        assert r.json()["error"]["type"] == "not_supported_error" and "--no-metrics" in r.json()["error"]["message"]
        assert c.post("/metrics").status_code == 405
        # nothing is collected: no metrics object, no request-metrics middleware, generation still works
        assert app.state.server.metrics is None
        assert not [m for m in app.user_middleware if m.cls.__name__ == "RequestMetricsMiddleware"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        with c.stream("POST", "/completion", json={"prompt": "abc", "n_predict": 3, "stream": True}) as s:
            assert s.status_code == 200 and "data: " in "".join(s.iter_text())
        assert "/metrics" not in c.get("/openapi.json").json()["paths"]


def test_serve_no_metrics_flag(monkeypatch):
    import argparse

    import uvicorn

    from opencoti.server import app as app_module
    from opencoti.server.serve import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).no_metrics is False
    seen = {}
    real = app_module.create_app

    def spy(*a, **kw):
        seen["config"] = kw["config"]
        return real(*a, **kw)

    monkeypatch.setattr(app_module, "create_app", spy)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: None)  # build everything, serve nothing
    for argv, want in ((["--no-metrics"], False), ([], True)):
        assert run(p.parse_args(["--model", "tiny:llama", "--state-dir", "none", "--port", "0", *argv])) == 0
        assert seen["config"].metrics is want


# ============================================================================ cluster
def test_cluster_mean_active_tps_is_null_when_nothing_decodes():
    idle = {1: {"aggregate_tps": 0.0, "n_active": 0, "mean_active_tps": None, "sessions": []},
            2: {"aggregate_tps": 0.0, "n_active": 0, "mean_active_tps": None, "sessions": []}}
    assert aggregate.merge_tps(idle)["mean_active_tps"] is None
    assert aggregate.merge_tps({})["mean_active_tps"] is None
    # a replica without the field (or a junk value) does not count; the others are weighted by n_active
    mixed = {1: {"n_active": 2, "mean_active_tps": 6.0}, 2: {"n_active": 0, "mean_active_tps": None},
             3: {"n_active": 1, "mean_active_tps": 12.0}, 4: {"n_active": 3}, 5: {"n_active": "x",
                                                                                  "mean_active_tps": 1.0}}
    assert aggregate.merge_tps(mixed)["mean_active_tps"] == pytest.approx(8.0)
