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
