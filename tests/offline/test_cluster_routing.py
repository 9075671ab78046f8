"""The cluster's routing pieces that need no Ray: pool id ranges, hints, the policy, merged answers."""

from __future__ import annotations

import json

import pytest

from opencoti.cluster import aggregate
from opencoti.cluster.hints import Hint, hint_for, messages_key
from opencoti.cluster.ids import MAX_TAG, id_base, tag_of
from opencoti.cluster.policy import PrefixIndex, RoutingOptions, RoutingPolicy
from opencoti.engine import EngineConfig
from opencoti.engine.errors import InvalidRequestError


# ============================================================================ ids
def test_pool_ids_name_their_replica():
    assert tag_of(id_base(3) + 1) == 3
    assert tag_of(id_base(MAX_TAG) + 2**32 - 1) == MAX_TAG
    assert id_base(MAX_TAG) + 2**32 - 1 < 2**53
    for bad in (0, -1, 1, 2**32 - 1, id_base(2), True, "x", None, 1.5):
        assert tag_of(bad) is None, bad
    assert tag_of(str(id_base(7) + 5)) == 7
    with pytest.raises(ValueError):
        id_base(0)
    with pytest.raises(ValueError):
        id_base(MAX_TAG + 1)


def test_engine_pool_id_base():
    from opencoti.engine import Engine
    with pytest.raises(InvalidRequestError, match="pool_id_base"):
        EngineConfig(model="tiny:llama", pool_id_base=-1)
    with pytest.raises(InvalidRequestError, match="pool_id_base"):
        EngineConfig(model="tiny:llama", pool_id_base=2**53)
    eng = Engine(EngineConfig(model="tiny:llama", num_threads=1, kv_budget_tokens=512, pool_id_base=id_base(5)))
    try:
        a = eng.create_pool(tokens=list(range(1, 20)))
        b = eng.fork_pool(a.pool_id, tokens=list(range(1, 30)))
        assert (a.pool_id, b.pool_id) == (id_base(5) + 1, id_base(5) + 2)
        assert tag_of(b.pool_id) == 5
        r = eng.generate(list(range(1, 25)), pool_id=a.pool_id)
        assert r.info.pool_id == a.pool_id
    finally:
        eng.shutdown()


# ============================================================================ hints
def test_hints_from_paths_and_bodies():
    pid = id_base(2) + 4
    assert hint_for("GET", f"/polykv/pools/{pid}/capacity", b"") == Hint(pool_id=pid)
    assert hint_for("DELETE", f"/polykv/pools/{pid}", b"") == Hint(pool_id=pid)
    assert hint_for("POST", "/polykv/sessions/abc/compact", b"{}") == Hint(session_id="abc")
    assert hint_for("GET", "/polykv/pools/notanint", b"") == Hint()
    h = hint_for("POST", "/v1/chat/completions",
                 json.dumps({"messages": [{"role": "user", "content": "hi"}], "pool_id": pid,
                             "session_id": "s1"}).encode())
    assert (h.pool_id, h.session_id) == (pid, "s1") and h.prefix.startswith("user\x1fhi")
    h = hint_for("POST", "/completion", json.dumps({"prompt": "abc"}).encode())
    assert h == Hint(prefix="abc")
    assert hint_for("POST", "/completion", b"not json") == Hint()
    assert hint_for("POST", "/polykv/pools", json.dumps({"from_session": "s9"}).encode()) == Hint(session_id="s9")
    assert hint_for("POST", "/polykv/pools", json.dumps({"text": "sys"}).encode()) == Hint(prefix="sys")
    assert hint_for("POST", "/tokenize", json.dumps({"content": "x"}).encode()) == Hint()


def test_pool_messages_are_a_prefix_of_chat_requests():
    system = [{"role": "system", "content": "You are terse."}]
    turn = system + [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert messages_key(turn).startswith(messages_key(system))
    assert messages_key(turn, tools=[{"type": "function"}]) != messages_key(turn)
    assert messages_key("nope") is None and messages_key([1]) is None


# ============================================================================ policy
def _policy(**kw) -> RoutingPolicy:
    p = RoutingPolicy(RoutingOptions(**kw))
    p.set_live({1: {}, 2: {}})
    return p


def test_pool_and_session_affinity_and_lost_pools():
    p = _policy()
    pid = id_base(2) + 1
    assert p.rank(Hint(pool_id=pid)) == ([2], "pool")
    p.routed(Hint(pool_id=pid, session_id="s"), 2)
    assert p.rank(Hint(session_id="s")) == ([2], "session")
    # a pool whose replica is gone: one replica, which answers 410
    gone = id_base(9) + 1
    ranked, reason = p.rank(Hint(pool_id=gone))
    assert reason == "pool_gone" and len(ranked) == 1
    # a replica leaves: its sessions and prefixes are forgotten
    p.set_live({1: {}})
    assert p.rank(Hint(session_id="s"))[1] != "session"
    assert p.rank(Hint(pool_id=pid)) == ([1], "pool_gone")


def test_copies_spread_attaches_and_sessions_stay():
    p = _policy()
    pid = id_base(1) + 1
    p.add_copy(pid, 2, id_base(2) + 7)
    assert p.holders(pid) == {1: pid, 2: id_base(2) + 7}
    first, _ = p.rank(Hint(pool_id=pid))
    p.routed(Hint(pool_id=pid, session_id="a"), first[0])
    second, _ = p.rank(Hint(pool_id=pid))
    assert second[0] != first[0]  # the less loaded copy
    # with equal loads, new attaches alternate between the copies
    p.completed(first[0])
    picks = []
    for _ in range(4):
        t = p.rank(Hint(pool_id=pid))[0][0]
        p.routed(Hint(pool_id=pid), t)
        p.completed(t)
        picks.append(t)
    assert sorted(picks) == [1, 1, 2, 2]
    p.routed(Hint(pool_id=pid, session_id="a"), first[0])
    # a session stays on its copy whatever the loads
    for _ in range(5):
        p.routed(Hint(), first[0])
    assert p.rank(Hint(pool_id=pid, session_id="a")) == ([first[0]], "session")


def test_prefix_affinity_with_imbalance_threshold():
    p = _policy(imbalance_threshold=2, match_threshold=0.5, chunk_chars=4)
    sys_a, sys_b = "A" * 200, "B" * 200
    ranked, reason = p.rank(Hint(prefix=sys_a + "q1"))
    p.routed(Hint(prefix=sys_a + "q1"), ranked[0])
    p.completed(ranked[0])
    home = ranked[0]
    ranked, _ = p.rank(Hint(prefix=sys_b + "q1"))
    assert ranked[0] != home  # unmatched: least loaded / least chosen
    p.routed(Hint(prefix=sys_b + "q1"), ranked[0])
    p.completed(ranked[0])
    assert p.rank(Hint(prefix=sys_a + "q2")) == ([home, 3 - home], "prefix")
    # a short match (< match_threshold of the prompt) does not count
    assert p.rank(Hint(prefix=sys_a[:8] + "x" * 400))[1] == "least_loaded"
    # the prefix's replica is overloaded: least loaded wins
    for _ in range(3):
        p.routed(Hint(), home)
    assert p.rank(Hint(prefix=sys_a + "q3")) == ([3 - home, home], "imbalanced")


def test_a_prefix_placed_by_the_ingress_is_learned():
    # a pool the first replica refused and the ingress created on the other: its text now leads there
    p = _policy(match_threshold=0.5, chunk_chars=4)
    text = "S" * 200
    first, _ = p.rank(Hint(prefix=text))
    p.routed(Hint(prefix=text), first[0])
    p.completed(first[0])
    other = 3 - first[0]
    p.learn_prefix(text, other)
    assert p.index.match(text + "q", [1, 2]) == {1: 200, 2: 200}
    assert p.load == {first[0]: 0} and p.chosen == {first[0]: 1}  # not a routing choice


def test_prefix_index_lru_and_drop():
    idx = PrefixIndex(chunk=4, max_entries=3)
    idx.insert("aaaabbbbcccc", 1)
    assert idx.match("aaaabbbbccccdd", [1, 2]) == {1: 12, 2: 0}
    assert idx.size == {1: 3}
    idx.insert("zzzz", 2)  # evicts the oldest chunk
    assert len(idx) == 3 and idx.match("aaaabbbbcccc", [1]) == {1: 0}
    assert idx.size == {1: 2, 2: 1}
    idx.drop_tag(2)
    assert idx.match("zzzz", [2]) == {2: 0}


def test_routing_options_are_checked():
    with pytest.raises(ValueError):
        RoutingOptions(match_threshold=2)
    with pytest.raises(ValueError):
        RoutingOptions(imbalance_threshold=-1)


# ============================================================================ merged answers
def test_merge_pools_lists_copies():
    pid, copy = id_base(1) + 1, id_base(2) + 1
    per = {1: {"pools": [{"pool_id": pid}], "pools_used": 1, "pools_max": 16, "kv_pages_total": 10,
               "kv_pages_used": 2, "kv_bytes_used": 5, "tree_depth": 1, "page_size": 16},
           2: {"pools": [{"pool_id": copy}], "pools_used": 1, "pools_max": 16, "kv_pages_total": 10,
               "kv_pages_used": 3, "kv_bytes_used": 6, "tree_depth": 1, "page_size": 16}}
    out = aggregate.merge_pools(per, {pid: {2: copy}})
    assert out["pools_used"] == 2 and out["kv_pages_used"] == 5 and out["page_size"] == 16
    p1, p2 = out["pools"]
    assert p1["replica"] == 1 and p1["copies"] == [{"replica": 2, "pool_id": copy}]
    assert p2["copy_of"] == pid and [r["replica"] for r in out["replicas"]] == [1, 2]


def test_merge_tps_and_capacity():
    per = {1: {"aggregate_tps": 10.0, "n_active": 1, "mean_active_tps": 10.0, "kv_free_cells": 5,
               "kv_total_cells": 10, "sessions": [{"session_id": "a"}]},
           2: {"aggregate_tps": 30.0, "n_active": 3, "mean_active_tps": 10.0, "kv_free_cells": 1,
               "kv_total_cells": 10, "sessions": [{"session_id": "b"}]}}
    out = aggregate.merge_tps(per)
    assert out["aggregate_tps"] == 40.0 and out["n_active"] == 4 and out["mean_active_tps"] == 10.0
    assert [s["replica"] for s in out["sessions"]] == [1, 2] and out["kv_used_cells"] == 14
    cap = aggregate.merge_capacity(7, {1: (200, {"can_admit": False, "sessions_remaining": 0}),
                                       2: (200, {"can_admit": True, "sessions_remaining": 3})}, 1)
    assert cap["can_admit"] is True and cap["sessions_remaining"] == 3 and len(cap["copies"]) == 2


def test_merge_metrics_adds_replica_label():
    text = ("# HELP x_total a counter\n# TYPE x_total counter\nx_total{a=\"1\"} 2.0\n"
            "# HELP y gauge\n# TYPE y gauge\ny 3\n")
    out = aggregate.merge_metrics({1: text, 2: text})
    lines = out.splitlines()
    assert lines.count("# HELP x_total a counter") == 1
    assert 'x_total{replica="1",a="1"} 2.0' in lines and 'x_total{replica="2",a="1"} 2.0' in lines
    assert 'y{replica="2"} 3' in lines
    # samples stay under their family's header
    assert lines.index('y{replica="1"} 3') > lines.index("# TYPE y gauge")
