"""Issue 49 (5): a released pool kept by an idle session of a child says so. Its deferred release
completes on time (a released child held by its session no longer holds the parent in the pool
budget with ``release_in_s: 0.0``); the listing says which sessions keep a pool's KV and until when
(``held_by``, ``released_pools``); ``DELETE /polykv/pools/{id}?cascade=sessions`` ends them."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from opencoti.engine import SamplingParams
from opencoti.server import create_app
from http_checks import ok

ROOT = list(range(10, 42))
CHILD = ROOT + [5, 6, 7, 8]


def _tree(eng, session_id="s", grace=0.0):
    p = eng.create_pool(tokens=ROOT).pool_id
    c = eng.fork_pool(p, tokens=CHILD).pool_id
    eng.generate(CHILD + [9], params=SamplingParams.greedy(3), pool_id=c, session_id=session_id)
    return p, c


def test_a_deferred_release_is_not_held_by_a_released_childs_idle_session(make_engine):
    eng = make_engine(pool_grace_ttl_s=0.3)
    p, c = _tree(eng)
    eng.release_pool(c)
    eng.release_pool(p)
    assert eng.pool(p).release_in_s > 0
    time.sleep(0.5)
    eng.pools()  # (a step: the due releases run)
    time.sleep(0.2)
    st = eng.pools()
    assert st["pools"] == [] and st["pools_used"] == 0  # before: pool p listed, release_in_s 0.0, auto_pinned
    # its KV lives on while the session reads it, and the listing says so
    assert [r["pool_id"] for r in st["released_pools"]] == [p, c]
    held = st["released_pools"][0]["held_by"]
    assert held == [{"session_id": "s", "pool_id": c, "state": "idle", "expires_in_s": None}]
    eng.release_session("s")
    st = eng.pools()
    assert st["released_pools"] == [] and st["kv_pages_used"] == 0


def test_held_by_names_the_sessions_of_released_children_and_their_ttl(make_engine):
    eng = make_engine(session_ttl_s=300.0)
    p, c = _tree(eng)
    eng.core.polykv.mark_anonymous("s")  # nobody named it: idle, it expires after the TTL
    eng.release_pool(c)  # released at once (no grace), kept by... nothing: an idle anonymous session lets go
    assert eng.pools()["released_pools"] == [] and eng.pool(p).held_by == []
    q, d = _tree(eng, session_id="named")
    eng.release_pool(d)  # a named session keeps it
    info = eng.pool(q)
    assert info.auto_pinned and info.children == [] and info.sessions == []
    assert info.held_by == [{"session_id": "named", "pool_id": d, "state": "idle", "expires_in_s": None}]


def test_delete_cascade_sessions_ends_the_sessions_that_keep_a_pool(make_engine):
    eng = make_engine(session_ttl_s=300.0)
    p, c = _tree(eng)
    eng.generate(ROOT + [3, 4], params=SamplingParams.greedy(2), pool_id=p, session_id="own")
    eng.release_pool(c)
    with TestClient(create_app(eng), raise_server_exceptions=False) as client:
        listing = ok(client.get("/polykv/pools"))
        row = next(x for x in listing["pools"] if x["pool_id"] == p)
        assert [h["session_id"] for h in row["held_by"]] == ["s"] and row["auto_pinned"]
        assert client.delete(f"/polykv/pools/{p}?cascade=everything").status_code == 400
        out = ok(client.delete(f"/polykv/pools/{p}?cascade=sessions"))
        assert out["released"] and sorted(out["ended_sessions"]) == ["own", "s"]
        st = ok(client.get("/polykv/pools"))
        assert st["pools"] == [] and st["released_pools"] == [] and st["kv_pages_used"] == 0
        assert "s" not in eng.core.polykv.sessions and "own" not in eng.core.polykv.sessions
        # without cascade nothing is ended
        p2, c2 = _tree(eng, session_id="t")
        ok(client.delete(f"/polykv/pools/{c2}"))
        assert "ended_sessions" not in ok(client.delete(f"/polykv/pools/{p2}"))
        assert "t" in eng.core.polykv.sessions
