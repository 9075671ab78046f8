"""Tenants sharing one engine: pools and sessions are private, listings show only one's own."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from opencoti.engine import InvalidRequestError, PoolNotFoundError, SamplingParams, SessionNotFoundError
from opencoti.engine.kv.pool import Pool
from opencoti.engine.polykv.state import PoolTree
from opencoti.engine.api.tenancy import TenantEngine

SYS = list(range(20, 52))


@pytest.fixture
def views(engine):
    return engine, TenantEngine(engine, "alice"), TenantEngine(engine, "bob")


def test_pools_are_private(views):
    eng, alice, bob = views
    pa = alice.create_pool(tokens=SYS, label="alice-system")
    child = alice.fork_pool(pa.pool_id, tokens=SYS + [3, 4, 5])
    pb = bob.create_pool(tokens=SYS)
    assert [p["pool_id"] for p in alice.pools()["pools"]] == [pa.pool_id, child.pool_id]
    assert [p["pool_id"] for p in bob.pools()["pools"]] == [pb.pool_id]
    assert alice.pools()["tree_depth"] == 2 and bob.pools()["tree_depth"] == 1
    assert len(eng.pools()["pools"]) == 3  # the engine itself sees everything
    pid = pa.pool_id
    for call in (lambda: bob.pool(pid), lambda: bob.fork_pool(pid, tokens=SYS + [1]), lambda: bob.pin_pool(pid),
                 lambda: bob.unpin_pool(pid), lambda: bob.evict_pool(pid), lambda: bob.flush_pool(pid),
                 lambda: bob.release_pool(pid), lambda: bob.admission(pid),
                 lambda: bob.set_admission(pid, target_tps_per_session=1.0), lambda: bob.capacity(pid),
                 lambda: bob.admission_events(pid),
                 lambda: bob.generate(SYS + [9], pool_id=pid, params=SamplingParams.greedy(1)),
                 lambda: bob.compact_session("x", pid, tokens=SYS)):
        with pytest.raises(PoolNotFoundError, match=f"pool {pid} not found"):  # exactly as an unknown id
            call()
    with pytest.raises(PoolNotFoundError, match="pool 999 not found"):
        bob.pool(999)
    assert alice.pool(pid).children == [child.pool_id]
    assert eng.pool(pid).pinned is False  # bob's attempts changed nothing
    bob.release_pool(pb.pool_id)
    alice.release_pool(child.pool_id)


def test_sessions_are_per_tenant(views):
    eng, alice, bob = views
    pa = alice.create_pool(tokens=SYS)
    ra = alice.generate(SYS + [7, 8], pool_id=pa.pool_id, session_id="agent-1", params=SamplingParams.greedy(3))
    rb = bob.generate([5, 6, 7], session_id="agent-1", params=SamplingParams.greedy(3))
    assert ra.info.session_id == "agent-1" and rb.session_id == "agent-1"
    assert ra.info.cached_prefix_tokens == len(SYS)
    assert rb.info.cached_prefix_tokens == 0  # bob's agent-1 is another session
    assert sorted(eng.run_on_step_thread(lambda: list(eng.core.sessions))) == ["alice:agent-1", "bob:agent-1"]
    assert alice.engine_and_session_id("agent-1") == (eng, "alice:agent-1")
    assert [s["session_id"] for s in alice.tps_snapshot()["sessions"]] == ["agent-1"]
    assert [s["pool_id"] for s in bob.tps_snapshot()["sessions"]] == [None]
    assert [s["session_id"] for s in alice.pool(pa.pool_id).sessions] == ["agent-1"]
    assert [s["session_id"] for s in alice.pools()["pools"][0]["sessions"]] == ["agent-1"]
    assert set(alice.tps_history()["sessions"]) <= {"agent-1"}
    s = alice.stream(SYS + [9], session_id="agent-2", params=SamplingParams.greedy(2))
    assert s.info.session_id == "agent-2"
    list(s)
    assert s.result.info.session_id == "agent-2"
    anon = bob.generate([1, 2, 3], params=SamplingParams.greedy(1))  # a made-up id, in bob's namespace ...
    assert anon.session_id.startswith("s-")
    s = eng.run_on_step_thread(lambda: eng.core.sessions.get(f"bob:{anon.session_id}"))
    assert s is not None and s.anonymous and not eng.run_on_step_thread(lambda: eng.core.sessions["bob:agent-1"].anonymous)
    # ... that expires like the engine's own anonymous sessions (session_ttl_s)
    with pytest.raises(SessionNotFoundError) as e:
        bob.release_session("agent-2")
    assert "alice" not in str(e.value) and "bob:" not in str(e.value)
    with pytest.raises(SessionNotFoundError):  # alice's session as bob's snapshot source
        bob.create_pool(from_session="agent-2")
    bob.release_session("agent-1")
    assert eng.run_on_step_thread(lambda: "alice:agent-1" in eng.core.sessions)
    with pytest.raises(InvalidRequestError, match="at most"):
        alice.generate([1, 2], session_id="x" * 128, params=SamplingParams.greedy(1))


def test_a_pool_declares_its_owner(views):
    """``tenant`` is a field of Pool: None on a pool no tenant made, the creator's, else the parent's."""
    eng, alice, _ = views
    assert "tenant" in {f.name for f in dataclasses.fields(Pool)}
    assert PoolTree(max_pools=2).add(None, 0, [1, 2]).tenant is None
    own = eng.create_pool(tokens=SYS)
    pa = alice.create_pool(tokens=SYS)
    fork = eng.fork_pool(pa.pool_id, tokens=SYS + [1])  # forked by the engine itself: stays with its tree
    owners = eng.run_on_step_thread(lambda: {pid: p.tenant for pid, p in eng.core.tree.pools.items()})
    assert owners == {own.pool_id: None, pa.pool_id: "alice", fork.pool_id: "alice"}


def test_snapshot_fork_and_compaction_stay_with_the_owner(views):
    eng, alice, bob = views
    pa = alice.create_pool(tokens=SYS)
    alice.generate(SYS + [3, 4, 5, 6], pool_id=pa.pool_id, session_id="a", params=SamplingParams.greedy(4))
    snap = alice.create_pool(from_session="a")
    assert snap.pool_id in {p["pool_id"] for p in alice.pools()["pools"]}
    out = alice.compact_session("a", pa.pool_id, tokens=SYS + [9, 9])
    assert out["pool"].pool_id in {p["pool_id"] for p in alice.pools()["pools"]}
    assert [s["session_id"] for s in out["pool"].sessions] == ["a"]
    assert bob.pools()["pools"] == [] and bob.admission_events() == []
    alice.set_admission(pa.pool_id, target_tps_per_session=1.0)
    assert {e["pool_id"] for e in alice.admission_events()} == {pa.pool_id}
    assert bob.admission_events() == []


def test_async_streams_and_refused_surface(views):
    eng, alice, bob = views

    async def run():
        s = await alice.astream([1, 2, 3], session_id="z", params=SamplingParams.greedy(2))
        assert s.info.session_id == "z"
        async for _ in s:
            pass
        return s.result

    r = asyncio.run(run())
    assert r.info.session_id == "z"
    assert alice.tokenize("hi") == eng.tokenize("hi") and alice.max_context == eng.max_context
    with pytest.raises(AttributeError, match="not available"):
        alice.core  # noqa: B018 - the engine internals are not part of the view
    with pytest.raises(AttributeError):
        alice.set_admission_defaults  # noqa: B018
    with pytest.raises(InvalidRequestError, match="server-wide"):
        alice.configure_tps(window_tokens=8)
    assert alice.configure_tps() == eng.configure_tps()
    with pytest.raises(InvalidRequestError):
        TenantEngine(eng, "bad name")


def test_automatic_prefix_reuse_stays_within_a_tenant(views):
    eng, alice, bob = views
    prompt = list(range(60, 100))
    greedy = SamplingParams.greedy(2)
    first = alice.generate(prompt, session_id="a1", params=greedy)
    assert first.info.cached_prefix_tokens == 0
    again = alice.generate(prompt, session_id="a2", params=greedy)
    assert again.info.cached_prefix_tokens > 0  # alice's own cached prefix is reused ...
    other = bob.generate(prompt, session_id="b1", params=greedy)
    assert other.info.cached_prefix_tokens == 0  # ... never bob's (nor the engine's unsalted one)
    assert other.token_ids == first.token_ids
    assert bob.generate(prompt, session_id="b2", params=greedy).info.cached_prefix_tokens > 0
    plain = eng.generate(prompt, params=greedy)  # a request without a tenant shares with neither
    assert plain.info.cached_prefix_tokens == 0
