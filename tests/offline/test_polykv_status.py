"""PolyKV status fields and release semantics (docs/polykv.md): ttft_ms per session, both names of the
pool-id budget, one meaning of mean_active_tps, and a release that honours the grace TTL."""

from __future__ import annotations

import time

import pytest

from opencoti.engine import PoolBusyError, PoolNotFoundError, SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 240 + 3 for j in range(n)]


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_status_fields_ttft_seq_ids_and_parent(engine):
    root = engine.create_pool(tokens=toks(1, 16))
    child = engine.fork_pool(root.pool_id, tokens=toks(1, 16) + toks(2, 8))
    r = engine.generate(toks(1, 16) + toks(2, 8) + [5, 6], params=greedy(3), pool_id=child.pool_id, session_id="a")
    st = engine.pools()
    assert st["seq_ids_used"] == st["pools_used"] == 2 and st["seq_ids_max"] == st["pools_max"]
    by_id = {p["pool_id"]: p for p in st["pools"]}
    assert by_id[root.pool_id]["parent"] is None and by_id[child.pool_id]["parent"] == root.pool_id
    (sess,) = by_id[child.pool_id]["sessions"]
    assert sess["session_id"] == "a" and sess["ttft_ms"] > 0
    assert sess["ttft_ms"] >= r.timings["prompt_ms"] * 0.999  # from submit: queueing included
    assert by_id[child.pool_id]["release_in_s"] is None


def test_mean_active_tps_is_null_when_nothing_is_active_in_both_views(engine):
    pool = engine.create_pool(tokens=toks(3, 12))
    engine.generate(toks(3, 12) + [9], params=greedy(3), pool_id=pool.pool_id, session_id="b")
    snap, cap = engine.tps_snapshot(), engine.capacity(pool.pool_id)
    assert snap["n_active"] == cap["n_active"] == 0
    assert snap["mean_active_tps"] is None and cap["mean_active_tps"] is None


def test_release_is_deferred_by_the_grace_ttl_and_the_pool_stays_attachable(make_engine):
    eng = make_engine(pool_grace_ttl_s=0.6)
    pool = eng.create_pool(tokens=toks(4, 12))
    pid = pool.pool_id
    eng.generate(toks(4, 12) + [7], params=greedy(2), pool_id=pid, session_id="s")
    eng.release_session("s")  # the last descendant leaves: the grace TTL starts
    eng.release_pool(pid)
    info = eng.pool(pid)  # still there, resident, with the time left
    assert info.residency == "resident" and 0 < info.release_in_s <= 0.6
    r = eng.generate(toks(4, 12) + [8], params=greedy(2), pool_id=pid, session_id="t")  # re-attach: cheap
    assert r.info.cached_prefix_tokens >= 11
    eng.release_session("t")
    assert wait_for(lambda: pid not in [p["pool_id"] for p in eng.pools()["pools"]])
    with pytest.raises(PoolNotFoundError):
        eng.pool(pid)
    eng.check_integrity()
    # a pool never used waits out the grace the same way; immediate=True releases at once
    p2 = eng.create_pool(tokens=toks(5, 12))
    eng.release_pool(p2.pool_id)
    assert 0 < eng.pool(p2.pool_id).release_in_s <= 0.6
    assert wait_for(lambda: p2.pool_id not in [p["pool_id"] for p in eng.pools()["pools"]])
    p3 = eng.create_pool(tokens=toks(6, 12))
    eng.generate(toks(6, 12) + [7], params=greedy(2), pool_id=p3.pool_id, session_id="u")
    eng.release_session("u")
    eng.release_pool(p3.pool_id, immediate=True)
    with pytest.raises(PoolNotFoundError):
        eng.pool(p3.pool_id)
    eng.check_integrity()


def test_leaves_first_release_within_the_grace_ttl_defers_the_parent_too(make_engine):
    """Releasing a just-used child then its parent (leaves first) is not refused: the child waits out its
    grace, the parent goes after it; immediate=True on the parent takes the deferred children with it."""
    eng = make_engine(pool_grace_ttl_s=0.6)
    root = eng.create_pool(tokens=toks(7, 12))
    child = eng.fork_pool(root.pool_id, tokens=toks(7, 12) + toks(8, 6))
    eng.generate(toks(7, 12) + toks(8, 6) + [9], params=greedy(2), pool_id=child.pool_id, session_id="s")
    eng.release_session("s")
    eng.release_pool(child.pool_id)        # deferred (its grace)
    eng.release_pool(root.pool_id)         # deferred after the child, not a 409
    assert eng.pool(root.pool_id).release_in_s is not None
    live = {p["pool_id"] for p in eng.pools()["pools"]}
    assert {root.pool_id, child.pool_id} <= live
    assert wait_for(lambda: not {root.pool_id, child.pool_id} & {p["pool_id"] for p in eng.pools()["pools"]})
    eng.check_integrity()
    # a child that was never released still blocks its parent
    r2 = eng.create_pool(tokens=toks(10, 12))
    c2 = eng.fork_pool(r2.pool_id, tokens=toks(10, 12) + toks(11, 6))
    with pytest.raises(PoolBusyError):
        eng.release_pool(r2.pool_id)
    # immediate on the parent completes the children's pending releases first
    eng.generate(toks(10, 12) + toks(11, 6) + [9], params=greedy(2), pool_id=c2.pool_id, session_id="t")
    eng.release_session("t")
    eng.release_pool(c2.pool_id)
    eng.release_pool(r2.pool_id, immediate=True)
    live = {p["pool_id"] for p in eng.pools()["pools"]}
    assert r2.pool_id not in live and c2.pool_id not in live
    eng.check_integrity()
