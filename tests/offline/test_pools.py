"""Pools: the tree of immutable shared prefixes (docs/polykv.md: "Pools and sessions",
"Lifetime: pin, evict, flush, release, grace", "Status", "Compaction") on the tiny model.

Every test compares against the ground truth that matters to a user: the greedy tokens a
pooled session produces must equal the tokens of the same full prompt run with no pool, and the
KV bytes the tree reports (ownership, never membership) must add up to the pages in use.
"""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

from opencoti.engine import (CapacityError, InvalidRequestError, NotFoundError, PoolBusyError, PoolContractError,
                             PoolNotFoundError, SamplingParams, SessionBusyError, SessionNotFoundError)
from opencoti.engine.polykv.state import PoolTree

PAGE_SIZES = [1, 4, 16]


@pytest.fixture
def make_engine(make_engine):
    """Engines with the automatic prefix cache off: these tests check the explicit pool semantics
    and exact ownership accounting (pools + sessions == pages in use); test_prefix_cache.py checks
    pools with the cache on (the cache then owns what nobody else does)."""
    def factory(**kw):
        kw.setdefault("prefix_cache", False)
        return make_engine(**kw)
    return factory


@pytest.fixture
def engine(make_engine):
    return make_engine()


# ----------------------------------------------------------------------------- helpers


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True, **kw)


def toks(seed: int, n: int) -> list[int]:
    """Deterministic token ids in [1, 250]."""
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


def other_than(t: int) -> int:
    """A token id in [1, 250] different from ``t``."""
    return 1 + (t % 250)


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


_ref_counter = itertools.count(1)


def reference(eng, prompt: list[int], n: int = 8) -> list[int]:
    """Greedy tokens of ``prompt`` in a fresh session with no pool (then the session is released)."""
    sid = f"ref-{next(_ref_counter)}"
    res = eng.generate(list(prompt), params=greedy(n), session_id=sid, cache_salt=sid)  # its own salt: no reuse
    assert res.info.pool_id is None and res.info.cached_prefix_tokens == 0
    eng.release_session(sid)
    return res.token_ids


def page_count(eng, nbytes: int) -> int:
    pb = eng.kv.page_bytes
    assert nbytes % pb == 0, f"{nbytes} bytes is not a whole number of {pb}-byte pages"
    return nbytes // pb


def ownership(eng) -> tuple[dict, int, int]:
    """(pools(), Σ own pages of pools, Σ owned pages of the sessions attached to them)."""
    st = eng.pools()
    own = sum(page_count(eng, p["own_kv_bytes"]) for p in st["pools"])
    sess = sum(page_count(eng, s["marginal_kv_bytes"]) for p in st["pools"] for s in p["sessions"])
    return st, own, sess


def pools_by_id(eng) -> dict[int, dict]:
    return {p["pool_id"]: p for p in eng.pools()["pools"]}


def tree_snapshot(eng) -> dict:
    """pools() without the access timestamps and live tps (for 'nothing changed' assertions)."""
    st = eng.pools()
    st["pools"] = [{k: v for k, v in p.items() if k != "last_access_ts"} for p in st["pools"]]
    for p in st["pools"]:
        p["sessions"] = [{k: v for k, v in x.items() if k != "tps_ewma"} for x in p["sessions"]]
    return st


def assert_own_pages(eng, info, page_size: int) -> None:
    """A pool owns [D, L): the pages from floor(D/ps) (a mid-page D's partial page is copied) up to L."""
    expected = pages_for(info.prefix_len, page_size) - info.branch_pos // page_size
    assert page_count(eng, info.own_kv_bytes) == expected, (info.pool_id, info.branch_pos, info.prefix_len)


def run_streams(eng, requests: list[dict]):
    """Start all requests, then drain them: they decode concurrently in the engine's batch."""
    streams = [eng.stream(r.pop("prompt"), **r) for r in requests]
    results = []
    for s in streams:
        for _ in s:
            pass
        results.append(s.result)
    return results


# ----------------------------------------------------------------------------- journeys: nested fork, branch


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_journey_a_nesting_extend(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    system = toks(1, 37)  # 37: mid-page for page sizes 4 and 16
    task = toks(2, 22)
    p0 = eng.create_pool(tokens=system)
    assert (p0.parent, p0.branch_pos, p0.prefix_len, p0.own_len) == (None, 0, 37, 37)
    assert p0.residency == "resident" and p0.children == [] and p0.sessions == []
    assert_own_pages(eng, p0, page_size)
    used0 = eng.pools()["kv_pages_used"]

    p1 = eng.fork_pool(p0.pool_id, tokens=system + task)  # D defaults to P0.L: extend
    assert (p1.parent, p1.branch_pos, p1.prefix_len, p1.own_len) == (p0.pool_id, 37, 59, 22)
    assert p1.residency == "resident"
    assert_own_pages(eng, p1, page_size)
    # the extend computed (and holds) only its own range
    assert eng.pools()["kv_pages_used"] - used0 == page_count(eng, p1.own_kv_bytes)
    assert eng.pool(p0.pool_id).children == [p1.pool_id]

    suffixes = [toks(10 + i, 5 + i) for i in range(4)]
    prompts = [system + task + s for s in suffixes]
    refs = [reference(eng, p, 10) for p in prompts]
    results = run_streams(eng, [dict(prompt=p, params=greedy(10), session_id=f"sub-{i}", pool_id=p1.pool_id)
                                for i, p in enumerate(prompts)])
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res.info.pool_id == p1.pool_id and res.info.session_id == f"sub-{i}"
        assert res.info.cached_prefix_tokens == res.cache_n == 59
        assert res.timings["cache_n"] == 59 and res.timings["prompt_n"] == len(prompts[i]) - 59
        assert res.info.rematerialized_pools == []
        assert res.token_ids == ref, f"sub-agent {i} differs from the no-pool run"

    st = eng.pools()
    assert st["tree_depth"] == 2 and st["pools_used"] == 2
    by_id = {p["pool_id"]: p for p in st["pools"]}
    root, inner = by_id[p0.pool_id], by_id[p1.pool_id]
    assert root["children"] == [p1.pool_id] and root["sessions"] == [] and root["parent"] is None
    assert inner["parent"] == p0.pool_id and inner["children"] == []
    assert sorted(s["session_id"] for s in inner["sessions"]) == [f"sub-{i}" for i in range(4)]
    assert all(p["residency"] == "resident" for p in st["pools"])
    assert root["auto_pinned"] and inner["auto_pinned"]  # interior pool stays resident while descendants attach
    for s in inner["sessions"]:
        i = int(s["session_id"].split("-")[1])
        assert s["pool_id"] == p1.pool_id
        assert s["ctx_used"] == len(prompts[i]) + 10
        assert s["suffix_n_tokens"] == s["ctx_used"] - 59  # its suffix range is [L, L+S)
    # subtree rollup of the root covers the whole tree
    assert root["subtree_kv_bytes"] == st["kv_bytes_used"]

    # a later turn of a sub-agent stays on its pool and reuses its own cache
    prev = prompts[0] + results[0].token_ids
    nxt = prev + toks(99, 3)
    res = eng.generate(nxt, params=greedy(6), session_id="sub-0")
    assert res.info.pool_id == p1.pool_id
    assert res.cache_n == len(prev) - 1  # the last sampled token was never computed
    assert res.token_ids == reference(eng, nxt, 6)
    (s0,) = [s for s in eng.pool(p1.pool_id).sessions if s["session_id"] == "sub-0"]
    assert s0["ctx_used"] == len(nxt) + 6 and s0["suffix_n_tokens"] == len(nxt) + 6 - 59


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_journey_b_branch_cow(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    preamble = toks(3, 21)
    toolset_a, toolset_b = toks(4, 16), toks(5, 30)
    assert toolset_a[0] != toolset_b[0]
    p0 = eng.create_pool(tokens=preamble + toolset_a)  # N0 = 37
    used0 = eng.pools()["kv_pages_used"]
    pb = eng.fork_pool(p0.pool_id, branch_pos=21, tokens=preamble + toolset_b)
    assert (pb.parent, pb.branch_pos, pb.prefix_len, pb.own_len) == (p0.pool_id, 21, 51, 30)
    assert pb.residency == "resident"
    assert_own_pages(eng, pb, page_size)
    # the shared preamble is not copied (only the partial page at D, when D is mid-page)
    assert eng.pools()["kv_pages_used"] - used0 == pages_for(51, page_size) - 21 // page_size
    # an extend of the same root next to the branch
    pa = eng.fork_pool(p0.pool_id, tokens=preamble + toolset_a + toks(6, 9))
    assert (pa.branch_pos, pa.prefix_len) == (37, 46)
    assert eng.pool(p0.pool_id).children == [pb.pool_id, pa.pool_id]

    prompts_b = [preamble + toolset_b + toks(20 + i, 4 + 2 * i) for i in range(3)]
    refs = [reference(eng, p) for p in prompts_b]
    results = run_streams(eng, [dict(prompt=p, params=greedy(), session_id=f"b-{i}", pool_id=pb.pool_id)
                                for i, p in enumerate(prompts_b)])
    for res, ref in zip(results, refs):
        assert res.info.pool_id == pb.pool_id and res.cache_n == 51
        assert res.token_ids == ref
    # a session attached directly to the root, with toolset A
    pr = preamble + toolset_a + toks(30, 5)
    res = eng.generate(pr, params=greedy(), session_id="root-user", pool_id=p0.pool_id)
    assert res.cache_n == 37 and res.token_ids == reference(eng, pr)

    by_id = pools_by_id(eng)
    assert eng.pools()["tree_depth"] == 2
    assert [s["session_id"] for s in by_id[p0.pool_id]["sessions"]] == ["root-user"]
    assert sorted(s["session_id"] for s in by_id[pb.pool_id]["sessions"]) == ["b-0", "b-1", "b-2"]
    assert by_id[pa.pool_id]["sessions"] == [] and by_id[pa.pool_id]["children"] == []
    assert all(p["residency"] == "resident" for p in by_id.values())
    st, own, sess = ownership(eng)
    assert st["kv_pages_used"] == own + sess


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_fork_outputs_match_no_pool(make_engine, page_size):
    """Extended, branched and deeply nested pools (D mid-page) give the no-pool greedy tokens."""
    eng = make_engine(page_size=page_size)
    t0 = toks(7, 41)
    t_ext = t0 + toks(8, 13)  # extend at D = 41
    t_br = t0[:18] + toks(9, 27)  # branch at D = 18
    t_deep = t_br[:33] + toks(11, 6)  # branch of the branch at D = 33
    t_deeper = t_deep + toks(12, 7)  # extend of that
    p0 = eng.create_pool(tokens=t0)
    ext = eng.fork_pool(p0.pool_id, tokens=t_ext)
    br = eng.fork_pool(p0.pool_id, branch_pos=18, tokens=t_br)
    deep = eng.fork_pool(br.pool_id, branch_pos=33, tokens=t_deep)
    deeper = eng.fork_pool(deep.pool_id, tokens=t_deeper)
    assert eng.pools()["tree_depth"] == 4
    for info in (p0, ext, br, deep, deeper):
        assert_own_pages(eng, info, page_size)
    cases = [(ext, t_ext, toks(40, 6)), (br, t_br, toks(41, 3)), (deep, t_deep, toks(42, 9)),
             (deeper, t_deeper, toks(43, 1)), (p0, t0, toks(44, 5))]
    for pool, prefix, suffix in cases:
        prompt = prefix + suffix
        fresh = eng.generate(prompt, params=greedy(12, logprobs=0))
        res = eng.generate(prompt, params=greedy(12, logprobs=0), pool_id=pool.pool_id)
        assert res.cache_n == len(prefix)
        assert res.token_ids == fresh.token_ids, f"pool {pool.pool_id} (D={pool.branch_pos}, L={pool.prefix_len})"
        for a, b in zip(res.logprobs, fresh.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        eng.release_session(fresh.session_id)
        eng.release_session(res.session_id)
    st, own, sess = ownership(eng)
    assert sess == 0 and st["kv_pages_used"] == own


# ----------------------------------------------------------------------------- zero-copy accounting


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_zero_copy_accounting(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    t0 = toks(13, 96)
    t1 = t0 + toks(14, 64)  # extend, L = 160
    t2 = t0[:40] + toks(15, 60)  # branch at D = 40, L = 100
    p0 = eng.create_pool(tokens=t0)
    p1 = eng.fork_pool(p0.pool_id, tokens=t1)
    p2 = eng.fork_pool(p0.pool_id, branch_pos=40, tokens=t2)
    pool_pages = eng.pools()["kv_pages_used"]
    assert pool_pages == sum(pages_for(p.prefix_len, page_size) - p.branch_pos // page_size for p in (p0, p1, p2))

    requests, private = [], 0
    for i in range(8):
        pool, prefix = (p1, t1) if i % 2 == 0 else (p2, t2)
        prompt = prefix + toks(100 + i, 6)
        requests.append(dict(prompt=prompt, params=greedy(4), session_id=f"s{i}", pool_id=pool.pool_id))
        private += pages_for(len(prompt) + 4, page_size)
    results = run_streams(eng, requests)
    assert [r.cache_n for r in results] == [160 if i % 2 == 0 else 100 for i in range(8)]

    st, own, sess = ownership(eng)
    used = st["kv_pages_used"]
    assert used == own + sess, "Σ own pages + Σ session pages must equal the physical pages in use"
    assert own == pool_pages  # attaching never changes what the pools own
    for p in st["pools"]:
        for s in p["sessions"]:  # a session owns its suffix (+ at most the copied partial page)
            n = page_count(eng, s["marginal_kv_bytes"])
            assert n <= pages_for(s["suffix_n_tokens"], page_size) + 1, s
    assert used * 2 < private, f"{used} pages in use vs {private} for 8 private copies"
    by_id = {p["pool_id"]: p for p in st["pools"]}
    assert by_id[p0.pool_id]["subtree_kv_bytes"] == st["kv_bytes_used"]
    assert by_id[p1.pool_id]["subtree_kv_bytes"] == by_id[p1.pool_id]["own_kv_bytes"] + sum(
        s["marginal_kv_bytes"] for s in by_id[p1.pool_id]["sessions"])

    for i in range(8):
        eng.release_session(f"s{i}")
    assert eng.pools()["kv_pages_used"] == pool_pages
    for p in (p2, p1, p0):  # leaves first
        eng.release_pool(p.pool_id)
    st = eng.pools()
    assert st["pools"] == [] and st["pools_used"] == 0 and st["tree_depth"] == 0
    assert st["kv_pages_used"] == 0 and eng.stats()["kv_pages_used"] == 0


# ----------------------------------------------------------------------------- auto-P and explicit P


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_auto_p(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    pt = toks(16, 45)
    pool = eng.create_pool(tokens=pt).pool_id

    def check(prompt, expected_cache_n, n=8):
        ref = reference(eng, prompt, n)
        res = eng.generate(prompt, params=greedy(n), pool_id=pool)
        assert res.cache_n == expected_cache_n, (len(prompt), res.cache_n, expected_cache_n)
        assert res.timings["prompt_n"] == len(prompt) - expected_cache_n
        assert res.info.pool_id == pool
        assert res.token_ids == ref
        eng.release_session(res.session_id)

    check(pt + toks(17, 7), 45)  # exact: pool + suffix
    check(pt + [pt[0]], 45)  # one-token suffix
    for k in (1, 13, 30, 44):  # partial divergence: cache_n == LCP
        check(pt[:k] + [other_than(pt[k])] + toks(18, 5), k)
    check([other_than(pt[0])] + pt[1:] + toks(19, 3), 0)  # no overlap at position 0
    unrelated = toks(20, 17)
    unrelated[0] = other_than(pt[0])
    check(unrelated, 0)
    for k in (2, 9, 30):  # prompt shorter than the pool: the last prompt token is always computed
        check(pt[:k], k - 1)
    check(pt, 44)  # prompt == pool


@pytest.mark.parametrize("page_size", [1, 4])
def test_explicit_shared_prefix(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    pt = toks(21, 40)
    pool = eng.create_pool(tokens=pt).pool_id
    prompt = pt + toks(22, 6)
    ref = reference(eng, prompt)
    for p in (0, 1, 17, 40):
        res = eng.generate(prompt, params=greedy(), pool_id=pool, shared_prefix_n_tokens=p)
        assert res.cache_n == p and res.token_ids == ref
        eng.release_session(res.session_id)
    diverged = pt[:20] + [other_than(pt[20])] + pt[21:] + toks(23, 4)
    res = eng.generate(diverged, params=greedy(), pool_id=pool, shared_prefix_n_tokens=20)
    assert res.cache_n == 20 and res.token_ids == reference(eng, diverged)
    eng.release_session(res.session_id)

    before = (tree_snapshot(eng), eng.stats())
    with pytest.raises(PoolContractError) as ei:  # P beyond the common prefix
        eng.generate(diverged, params=greedy(), pool_id=pool, shared_prefix_n_tokens=21, session_id="bad")
    assert ei.value.status_code == 409
    for bad in (41, -1, len(pt[:10]) + 1, True, 3.0, "4"):
        short = pt[:10] if bad == 11 else prompt
        with pytest.raises(InvalidRequestError) as ei:
            eng.generate(short, params=greedy(), pool_id=pool, shared_prefix_n_tokens=bad, session_id="bad")
        assert ei.value.status_code == 400
    with pytest.raises(InvalidRequestError):  # shared_prefix_n_tokens without a pool
        eng.generate(prompt, params=greedy(), shared_prefix_n_tokens=10, session_id="bad")
    after = (tree_snapshot(eng), eng.stats())
    assert after[0] == before[0]
    assert after[1]["sessions"] == before[1]["sessions"] and after[1]["kv_pages_used"] == before[1]["kv_pages_used"]
    with pytest.raises(SessionNotFoundError):  # a rejected request creates no session
        eng.release_session("bad")


# ----------------------------------------------------------------------------- contract & errors


def test_fork_contract_and_errors(make_engine):
    eng = make_engine(page_size=4)
    pt = toks(24, 30)
    p0 = eng.create_pool(tokens=pt)
    child = eng.fork_pool(p0.pool_id, tokens=pt + toks(25, 5))
    before = (tree_snapshot(eng), eng.stats()["kv_pages_used"])

    bad = list(pt)
    bad[17] = other_than(bad[17])
    for d in (18, 30):  # tokens[0:D] differ from the parent
        with pytest.raises(PoolContractError) as ei:
            eng.fork_pool(p0.pool_id, branch_pos=d, tokens=bad + toks(26, 4))
        assert ei.value.status_code == 409
    # a difference at or after D is a legitimate branch, not a violation (checked below separately)
    with pytest.raises(InvalidRequestError):  # branch_pos > parent.L
        eng.fork_pool(p0.pool_id, branch_pos=31, tokens=pt + toks(26, 4))
    for d in (-1, True, 2.0):
        with pytest.raises(InvalidRequestError):
            eng.fork_pool(p0.pool_id, branch_pos=d, tokens=pt + toks(26, 4))
    with pytest.raises(InvalidRequestError):  # empty own range: tokens == parent prefix
        eng.fork_pool(p0.pool_id, tokens=pt)
    with pytest.raises(InvalidRequestError):  # tokens shorter than D
        eng.fork_pool(p0.pool_id, branch_pos=20, tokens=pt[:15])
    with pytest.raises(InvalidRequestError):
        eng.fork_pool(p0.pool_id, tokens=pt + [10_000])  # outside the vocabulary
    with pytest.raises(InvalidRequestError):
        eng.create_pool(tokens=[])
    with pytest.raises(InvalidRequestError):
        eng.create_pool(tokens=pt, from_session="x")
    with pytest.raises(InvalidRequestError):
        eng.create_pool()
    assert (tree_snapshot(eng), eng.stats()["kv_pages_used"]) == before, "a rejected fork changed the tree"

    ok = eng.fork_pool(p0.pool_id, branch_pos=17, tokens=bad + toks(26, 4))  # diverges exactly at D
    assert (ok.branch_pos, ok.parent) == (17, p0.pool_id)
    eng.release_pool(ok.pool_id)

    with pytest.raises(PoolBusyError) as ei:  # release with children
        eng.release_pool(p0.pool_id)
    assert ei.value.status_code == 409
    assert eng.pool(p0.pool_id).residency == "resident"
    eng.release_pool(child.pool_id)
    eng.release_pool(p0.pool_id)
    assert eng.pools()["kv_pages_used"] == 0


def test_unknown_ids(engine):
    eng = engine
    pid = eng.create_pool(tokens=toks(27, 10)).pool_id
    calls = [
        lambda: eng.pool(999), lambda: eng.fork_pool(999, tokens=toks(1, 5)),
        lambda: eng.fork_pool(999, branch_pos=0, tokens=toks(1, 5)), lambda: eng.pin_pool(999),
        lambda: eng.unpin_pool(999), lambda: eng.evict_pool(999), lambda: eng.flush_pool(999),
        lambda: eng.release_pool(999), lambda: eng.generate(toks(1, 5), params=greedy(2), pool_id=999),
        lambda: eng.pool(-5), lambda: eng.compact_session("s", 999, tokens=toks(27, 12)),
    ]
    eng.generate(toks(27, 3), params=greedy(2), session_id="s")
    for call in calls:
        with pytest.raises(PoolNotFoundError) as ei:
            call()
        assert ei.value.status_code == 404 and isinstance(ei.value, NotFoundError)
    for call in (lambda: eng.release_session("nope"), lambda: eng.create_pool(from_session="nope"),
                 lambda: eng.fork_pool(pid, from_session="nope"),
                 lambda: eng.compact_session("nope", pid, tokens=toks(27, 12))):
        with pytest.raises(SessionNotFoundError) as ei:
            call()
        assert ei.value.status_code == 404
    eng.release_pool(pid)
    with pytest.raises(PoolNotFoundError):  # a released pool is gone from the API
        eng.generate(toks(27, 12), params=greedy(2), pool_id=pid)
    with pytest.raises(PoolNotFoundError):
        eng.release_pool(pid)
    assert eng.stats()["sessions"] == 1  # only "s"; the rejected calls created none


def test_pool_budget(make_engine):
    eng = make_engine(max_pools=2)
    a = eng.create_pool(tokens=toks(28, 9))
    b = eng.fork_pool(a.pool_id, tokens=toks(28, 9) + toks(29, 3))
    res = eng.generate(toks(31, 4), params=greedy(2), session_id="snap")
    before = tree_snapshot(eng)
    with pytest.raises(CapacityError):
        eng.create_pool(tokens=toks(30, 9))
    with pytest.raises(CapacityError):
        eng.fork_pool(b.pool_id, tokens=toks(28, 9) + toks(29, 3) + [5])
    with pytest.raises(CapacityError):
        eng.create_pool(from_session="snap")
    assert tree_snapshot(eng) == before
    assert eng.pools()["pools_used"] == eng.pools()["pools_max"] == 2
    eng.release_session(res.session_id)
    eng.release_pool(b.pool_id)
    c = eng.create_pool(tokens=toks(30, 9))
    assert c.residency == "resident" and eng.pools()["pools_used"] == 2


# ----------------------------------------------------------------------------- pin / evict / re-materialize


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_rules_and_rematerialization(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    pt = toks(32, 26)
    pool = eng.create_pool(tokens=pt, pinned=True)
    assert pool.pinned and pool.orphaned_pin
    with pytest.raises(PoolBusyError) as ei:
        eng.evict_pool(pool.pool_id)
    assert ei.value.status_code == 409
    eng.unpin_pool(pool.pool_id)
    prompt = pt + toks(33, 5)
    ref = reference(eng, prompt)
    res = eng.generate(prompt, params=greedy(), pool_id=pool.pool_id, session_id="att")
    assert res.token_ids == ref
    with pytest.raises(PoolBusyError):  # an (idle) session is attached
        eng.evict_pool(pool.pool_id)
    assert eng.pool(pool.pool_id).residency == "resident"
    assert eng.flush_pool(pool.pool_id) == 1
    with pytest.raises(SessionNotFoundError):
        eng.release_session("att")

    used = eng.pools()["kv_pages_used"]
    info = eng.evict_pool(pool.pool_id)
    assert info.residency == "evicted" and info.own_kv_bytes == 0 and info.prefix_len == 26
    assert eng.pools()["kv_pages_used"] == used - pages_for(26, page_size)
    res = eng.generate(prompt, params=greedy(), pool_id=pool.pool_id)
    assert res.info.rematerialized_pools == [pool.pool_id]
    assert res.cache_n == 26 and res.token_ids == ref
    info = eng.pool(pool.pool_id)
    assert info.residency == "resident" and info.rematerialized
    assert_own_pages(eng, info, page_size)
    eng.release_session(res.session_id)

    # a fork of an evicted parent re-materializes the parent first
    eng.evict_pool(pool.pool_id)
    child = eng.fork_pool(pool.pool_id, tokens=pt + toks(34, 7))
    assert eng.pool(pool.pool_id).residency == "resident" and child.residency == "resident"
    cp = pt + toks(34, 7) + toks(35, 2)
    res = eng.generate(cp, params=greedy(), pool_id=child.pool_id)
    assert res.cache_n == 33 and res.token_ids == reference(eng, cp)
    eng.release_session(res.session_id)


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_root_and_child_then_rematerialize_both(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    t0 = toks(36, 23)
    t1 = t0 + toks(37, 11)
    root = eng.create_pool(tokens=t0)
    child = eng.fork_pool(root.pool_id, tokens=t1)
    prompt = t1 + toks(38, 4)
    ref = reference(eng, prompt)
    eng.evict_pool(child.pool_id)
    assert eng.pool(child.pool_id).residency == "evicted"
    # the child is evicted (holds no pages, has no sessions): nothing keeps the root resident
    root_info = eng.evict_pool(root.pool_id)
    assert root_info.residency == "evicted"
    assert eng.pools()["kv_pages_used"] == 0
    res = eng.generate(prompt, params=greedy(), pool_id=child.pool_id)
    assert res.cache_n == 34 and res.token_ids == ref
    assert set(res.info.rematerialized_pools) == {root.pool_id, child.pool_id}
    assert eng.pool(root.pool_id).residency == eng.pool(child.pool_id).residency == "resident"


# ----------------------------------------------------------------------------- from_session snapshots


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_from_session_snapshot(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    x = toks(40, 23)
    first = eng.generate(x, params=greedy(6), session_id="main")
    snapshot = x + first.token_ids[:-1]  # the last sampled token has no KV yet
    used = eng.pools()["kv_pages_used"]
    root = eng.create_pool(from_session="main")
    assert (root.parent, root.branch_pos, root.prefix_len, root.residency) == (None, 0, len(snapshot), "resident")
    assert eng.pools()["kv_pages_used"] - used <= 1, "a snapshot must be zero-copy (at most the partial page)"
    st, own, sess = ownership(eng)
    assert st["kv_pages_used"] == own + sess

    prompt = snapshot + toks(41, 5)
    res = eng.generate(prompt, params=greedy(), pool_id=root.pool_id, session_id="sub")
    assert res.cache_n == len(snapshot) and res.token_ids == reference(eng, prompt)
    # the snapshotted session keeps working from its own cache
    cont = x + first.token_ids + toks(42, 3)
    res = eng.generate(cont, params=greedy(), session_id="main")
    assert res.cache_n == len(snapshot) and res.token_ids == reference(eng, cont)

    # fork(from_session): a session on the pool snapshots its context as a child (extend)
    eng.release_session("main")
    eng.release_session("sub")
    p3 = snapshot + toks(43, 7)
    r3 = eng.generate(p3, params=greedy(5), pool_id=root.pool_id, session_id="worker")
    snap3 = p3 + r3.token_ids[:-1]
    used = eng.pools()["kv_pages_used"]
    child = eng.fork_pool(root.pool_id, from_session="worker")
    assert (child.parent, child.branch_pos, child.prefix_len) == (root.pool_id, len(snapshot), len(snap3))
    assert eng.pools()["kv_pages_used"] - used <= 1
    prompt = snap3 + toks(44, 4)
    res = eng.generate(prompt, params=greedy(), pool_id=child.pool_id)
    assert res.cache_n == len(snap3) and res.token_ids == reference(eng, prompt)
    eng.release_session(res.session_id)

    # create_pool(from_session) of a pooled session forks that session's pool, zero-copy
    p4 = snapshot + toks(45, 9)
    r4 = eng.generate(p4, params=greedy(3), pool_id=root.pool_id, session_id="w2")
    used = eng.pools()["kv_pages_used"]
    snap_pool = eng.create_pool(from_session="w2")
    assert snap_pool.parent == root.pool_id and snap_pool.prefix_len == len(p4) + 2
    assert eng.pools()["kv_pages_used"] - used <= 1
    prompt = p4 + r4.token_ids[:2] + toks(46, 2)
    res = eng.generate(prompt, params=greedy(), pool_id=snap_pool.pool_id)
    assert res.cache_n == len(p4) + 2 and res.token_ids == reference(eng, prompt)
    st, own, sess = ownership(eng)
    assert st["kv_pages_used"] == own + sess



def test_snapshot_of_busy_or_unknown_session(engine):
    eng = engine
    pid = eng.create_pool(tokens=toks(47, 12)).pool_id
    stream = eng.stream(toks(47, 12) + toks(48, 3), params=greedy(300), session_id="busy", pool_id=pid)
    next(iter(stream))
    before = tree_snapshot(eng)
    with pytest.raises(SessionBusyError) as ei:
        eng.create_pool(from_session="busy")
    assert ei.value.status_code == 409
    with pytest.raises(SessionBusyError):
        eng.fork_pool(pid, from_session="busy")
    stream.close()
    after = tree_snapshot(eng)
    for st in (before, after):
        for p in st["pools"]:
            for s in p["sessions"]:
                s.pop("state"), s.pop("suffix_n_tokens"), s.pop("marginal_kv_bytes"), s.pop("ctx_used"), s.pop("kv_ram_tokens")
            p.pop("subtree_kv_bytes")
        st.pop("kv_pages_used"), st.pop("kv_bytes_used"), st.pop("kv_memory"), st.pop("kv_tiers")  # (the stream's pages)
    assert after == before
    with pytest.raises(SessionNotFoundError):
        eng.create_pool(from_session="ghost")
    with pytest.raises(SessionNotFoundError):
        eng.fork_pool(pid, from_session="ghost")
    assert eng.pools()["pools_used"] == 1


def test_compaction_of_busy_session_changes_nothing(engine):
    eng = engine
    pid = eng.create_pool(tokens=toks(47, 12)).pool_id
    stream = eng.stream(toks(47, 12) + toks(48, 3), params=greedy(300), session_id="busy", pool_id=pid)
    next(iter(stream))
    with pytest.raises(SessionBusyError) as ei:
        eng.compact_session("busy", pid, tokens=toks(47, 12) + [9, 9])
    assert ei.value.status_code == 409
    stream.close()
    st = eng.pools()
    assert st["pools_used"] == 1, f"a rejected compaction left a pool behind: {[p['pool_id'] for p in st['pools']]}"
    assert eng.pool(pid).children == []


def test_snapshot_under_memory_pressure_is_clean(make_engine):
    """The KV is full and the snapshot needs a page for its partial last page. Reclaiming memory
    must never free the pages being snapshotted: the call either succeeds (usable pool) or raises
    CapacityError and leaves nothing behind (no half-created pool, the session's cache intact)."""
    eng = make_engine(page_size=4, kv_budget_tokens=64)  # 16 pages
    eng.create_pool(tokens=[5, 6, 7, 8], pinned=True)  # 1 page, never evicted
    prompt = toks(49, 58)
    first = eng.generate(prompt, params=greedy(2), session_id="s")  # 59 cached tokens: 15 pages
    assert eng.stats()["kv_pages_used"] == eng.stats()["kv_pages_total"]
    before = tree_snapshot(eng)
    try:
        pool = eng.create_pool(from_session="s")
    except CapacityError:
        assert tree_snapshot(eng) == before
        cont = prompt + first.token_ids  # 60 tokens: exactly the 15 pages the pinned pool leaves
        res = eng.generate(cont, params=greedy(1), session_id="s")
        assert res.cache_n == 59  # the session's cache survived the failed snapshot
    else:
        assert pool.residency == "resident" and pool.prefix_len == 59
        assert all(p["residency"] != "materializing" for p in eng.pools()["pools"])


# ----------------------------------------------------------------------------- compaction by re-fork


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_compaction_by_refork(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    system = toks(50, 30)
    context = toks(51, 200)
    s_pool = eng.create_pool(tokens=system, pinned=True)
    w_pool = eng.fork_pool(s_pool.pool_id, tokens=system + context)
    prompt = system + context + toks(52, 8)
    res = eng.generate(prompt, params=greedy(8), pool_id=w_pool.pool_id, session_id="agent")
    assert res.cache_n == 230

    summary = toks(53, 12)
    out = eng.compact_session("agent", s_pool.pool_id, tokens=system + summary)
    assert out["kv_pages_after"] < out["kv_pages_before"]
    assert out["released_pools"] == [w_pool.pool_id]
    new = out["pool"]
    assert (new.parent, new.branch_pos, new.prefix_len, new.residency) == (s_pool.pool_id, 30, 42, "resident")
    assert [s["session_id"] for s in new.sessions] == ["agent"]
    assert w_pool.pool_id not in pools_by_id(eng)
    with pytest.raises(PoolNotFoundError):
        eng.pool(w_pool.pool_id)
    assert eng.pool(s_pool.pool_id).children == [new.pool_id]
    assert eng.pools()["kv_pages_used"] == out["kv_pages_after"]

    nxt = system + summary + toks(54, 6)
    res = eng.generate(nxt, params=greedy(), session_id="agent")  # continues on the compacted pool
    assert res.info.pool_id == new.pool_id
    assert res.cache_n == 42 > 0
    assert res.token_ids == reference(eng, nxt)
    st, own, sess = ownership(eng)
    assert st["kv_pages_used"] == own + sess


def test_compaction_keeps_a_pool_that_others_use(engine):
    eng = engine
    system = toks(55, 20)
    s_pool = eng.create_pool(tokens=system)
    w_pool = eng.fork_pool(s_pool.pool_id, tokens=system + toks(56, 80))
    for sid in ("a", "b"):
        eng.generate(system + toks(56, 80) + toks(57, 3), params=greedy(3), pool_id=w_pool.pool_id, session_id=sid)
    out = eng.compact_session("a", s_pool.pool_id, tokens=system + toks(58, 5))
    assert out["released_pools"] == []
    assert eng.pool(w_pool.pool_id).residency == "resident"
    assert [s["session_id"] for s in eng.pool(w_pool.pool_id).sessions] == ["b"]
    assert [s["session_id"] for s in out["pool"].sessions] == ["a"]


# ----------------------------------------------------------------------------- release with sessions attached


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_release_while_sessions_attached(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    t0 = toks(60, 27)
    t1 = t0 + toks(61, 14)
    p0 = eng.create_pool(tokens=t0)
    p1 = eng.fork_pool(p0.pool_id, tokens=t1)
    pa = t1 + toks(62, 4)
    ra = eng.generate(pa, params=greedy(6), pool_id=p1.pool_id, session_id="a")
    pr = t0 + toks(63, 4)
    eng.generate(pr, params=greedy(6), pool_id=p0.pool_id, session_id="r")
    used = eng.pools()["kv_pages_used"]

    eng.release_pool(p1.pool_id)  # allowed: its session keeps the pages alive
    assert p1.pool_id not in pools_by_id(eng)
    assert eng.pool(p0.pool_id).children == []
    assert eng.pools()["kv_pages_used"] == used
    with pytest.raises(PoolNotFoundError):
        eng.generate(pa, params=greedy(2), pool_id=p1.pool_id)
    eng.release_pool(p0.pool_id)  # its only child is released; a session is attached: allowed
    st = eng.pools()
    assert st["pools"] == [] and st["pools_used"] == 0 and st["kv_pages_used"] == used

    cont = pa + ra.token_ids + toks(64, 2)
    res = eng.generate(cont, params=greedy(), session_id="a")
    assert res.cache_n == len(pa) + 5 and res.token_ids == reference(eng, cont)
    new = eng.create_pool(tokens=t0)  # the budget slot of a released pool is free again
    eng.release_pool(new.pool_id)
    eng.release_session("a")
    assert 0 < eng.pools()["kv_pages_used"] < used
    eng.release_session("r")
    assert eng.pools()["kv_pages_used"] == 0
    eng.check_integrity()


# ----------------------------------------------------------------------------- memory pressure


def test_memory_pressure_evicts_idle_sessions_then_lru_pools(make_engine):
    ref_eng = make_engine(page_size=4)
    eng = make_engine(page_size=4, kv_budget_tokens=256)  # 64 pages
    ta, tb, tc = toks(70, 48), toks(71, 48), toks(72, 48)
    a = eng.create_pool(tokens=ta, pinned=True)  # 12 pages each
    b = eng.create_pool(tokens=tb)
    time.sleep(0.01)
    c = eng.create_pool(tokens=tc)
    eng.generate(tc + toks(73, 3), params=greedy(4), pool_id=c.pool_id, session_id="idle")
    assert eng.stats()["kv_pages_used"] == 38

    big = toks(74, 120)  # needs 34 pages: the idle session, then the LRU unpinned pool (b) must go
    res = eng.generate(big, params=greedy(16))
    assert res.token_ids == reference(ref_eng, big, 16)
    st = eng.stats()
    assert st["evicted_sessions"] >= 1 and st["evicted_pools"] == 1
    assert eng.pool(a.pool_id).residency == "resident"
    assert eng.pool(b.pool_id).residency == "evicted"
    assert eng.pool(c.pool_id).residency == "resident"

    huge = toks(75, 190)  # 50 of the 52 pages not pinned: everything unpinned must go
    res = eng.generate(huge, params=greedy(8))
    assert res.token_ids == reference(ref_eng, huge, 8)
    assert eng.pool(a.pool_id).residency == "resident" and eng.pool(a.pool_id).pinned
    assert eng.pool(c.pool_id).residency == "evicted"

    prompt = tb + toks(76, 5)  # an evicted pool comes back on attach
    res = eng.generate(prompt, params=greedy())
    res = eng.generate(prompt, params=greedy(), pool_id=b.pool_id)
    assert res.info.rematerialized_pools == [b.pool_id] and res.cache_n == 48
    assert res.token_ids == reference(ref_eng, prompt)
    prompt = ta + toks(77, 5)
    res = eng.generate(prompt, params=greedy(), pool_id=a.pool_id)
    assert res.info.rematerialized_pools == [] and res.cache_n == 48
    assert res.token_ids == reference(ref_eng, prompt)
    st, own, sess = ownership(eng)
    pooled = {s["session_id"] for p in st["pools"] for s in p["sessions"]}
    assert st["kv_pages_used"] >= own + sess and pooled


def test_session_whose_kv_was_evicted_stays_on_its_pool(make_engine):
    """Memory pressure drops an idle session's KV, not its place in the tree: its next turn
    (same session_id, no pool_id) still attaches to its (pinned, resident) pool."""
    ref_eng = make_engine(page_size=4)
    eng = make_engine(page_size=4, kv_budget_tokens=128)  # 32 pages
    pt = toks(78, 32)
    pool = eng.create_pool(tokens=pt, pinned=True)  # 8 pages
    first = eng.generate(pt + toks(79, 3), params=greedy(3), session_id="x", pool_id=pool.pool_id)
    assert first.cache_n == 32
    other = toks(79, 84)  # 23 pages (+8 pinned): the idle session "x" must give its 2 pages back
    assert eng.generate(other, params=greedy(8)).token_ids == reference(ref_eng, other, 8)
    assert eng.stats()["evicted_sessions"] == 1
    assert eng.pool(pool.pool_id).residency == "resident"
    nxt = pt + toks(79, 3) + first.token_ids + [4]
    res = eng.generate(nxt, params=greedy(3), session_id="x")
    assert res.token_ids == reference(ref_eng, nxt, 3)
    assert res.info.pool_id == pool.pool_id and res.cache_n == 32


def test_evicted_session_on_an_evicted_pool_comes_back(make_engine):
    """An idle session's KV is dropped, then its (unpinned, now unused) pool is evicted; the
    session's next turn re-materializes the pool and attaches to it again."""
    ref_eng = make_engine(page_size=4)
    eng = make_engine(page_size=4, kv_budget_tokens=128)  # 32 pages
    pt = toks(81, 32)
    pool = eng.create_pool(tokens=pt)  # 8 pages
    p1 = pt + toks(82, 3)
    first = eng.generate(p1, params=greedy(3), session_id="x", pool_id=pool.pool_id)
    other = toks(83, 100)  # 27 pages: needs x's KV and then the pool's pages
    assert eng.generate(other, params=greedy(8)).token_ids == reference(ref_eng, other, 8)
    assert eng.pool(pool.pool_id).residency == "evicted"
    nxt = p1 + first.token_ids + toks(84, 2)
    res = eng.generate(nxt, params=greedy(), session_id="x")
    assert res.info.pool_id == pool.pool_id and res.info.rematerialized_pools == [pool.pool_id]
    assert res.cache_n == 32 and res.token_ids == reference(ref_eng, nxt)
    assert eng.pool(pool.pool_id).residency == "resident"
    st, own, sess = ownership(eng)
    assert st["kv_pages_used"] >= own + sess


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_turn_that_rewrites_history_mid_page(make_engine, page_size):
    """A later turn that diverges inside the session's own cache (an edited message, a retry):
    the session keeps [0, LCP) and recomputes the rest; outputs match a fresh run."""
    eng = make_engine(page_size=page_size)
    pt = toks(85, 21)
    pool = eng.create_pool(tokens=pt)
    for pool_id in (pool.pool_id, None):
        sid = f"edit-{pool_id}"
        p1 = pt + toks(86, 30)
        r1 = eng.generate(p1, params=greedy(10), session_id=sid, pool_id=pool_id)
        history = p1 + r1.token_ids
        for cut in (len(p1) + 3, 41, 30, 22):  # inside generated text, inside the prompt, just after the pool
            edited = history[:cut] + [other_than(history[cut])] + toks(87 + cut, 4)
            res = eng.generate(edited, params=greedy(6), session_id=sid)
            assert res.cache_n == cut, (pool_id, cut)
            assert res.token_ids == reference(eng, edited, 6), (pool_id, cut)
            history = edited + res.token_ids
            st, own, sess = ownership(eng)
            if pool_id is not None:
                assert st["kv_pages_used"] == own + sess
            eng.check_integrity()
        eng.release_session(sid)
    assert eng.pools()["kv_pages_used"] == pages_for(21, page_size)


def test_session_moves_between_pools(engine):
    eng = engine
    ta, tb = toks(90, 18), toks(91, 22)
    a, b = eng.create_pool(tokens=ta), eng.create_pool(tokens=tb)
    r1 = eng.generate(ta + [3, 4], params=greedy(4), session_id="m", pool_id=a.pool_id)
    assert r1.cache_n == 18
    # explicit P below the session's own cache: P is what the caller asked for
    again = ta + [3, 4] + r1.token_ids + [5]
    res = eng.generate(again, params=greedy(4), session_id="m", shared_prefix_n_tokens=6, pool_id=a.pool_id)
    assert res.cache_n == 6 and res.token_ids == reference(eng, again, 4)
    res = eng.generate(tb + [6], params=greedy(4), session_id="m", pool_id=b.pool_id)
    assert res.cache_n == 22 and res.info.pool_id == b.pool_id and res.token_ids == reference(eng, tb + [6], 4)
    by_id = pools_by_id(eng)
    assert by_id[a.pool_id]["sessions"] == [] and [s["session_id"] for s in by_id[b.pool_id]["sessions"]] == ["m"]
    st, own, sess = ownership(eng)
    assert st["kv_pages_used"] == own + sess
    eng.evict_pool(a.pool_id)  # nothing is attached to a any more


# ----------------------------------------------------------------------------- concurrency


def test_concurrent_pool_ops_and_decoding(make_engine):
    eng = make_engine(page_size=4, kv_budget_tokens=8192, max_pools=16)
    ITERS = 10
    rt = toks(80, 33)
    root = eng.create_pool(tokens=rt)

    def pool_prefix(kind: int, w: int, it: int) -> list[int]:
        own = toks(1000 + 10 * w + it, 9 + w)
        return own if kind == 0 else rt + own if kind == 1 else rt[:14] + own

    plans = {}  # (w, it) -> (kind, prefix, prompt, reference tokens)
    for w in range(4):
        for it in range(ITERS):
            kind = (w + it) % 3
            prefix = pool_prefix(kind, w, it)
            if kind == 2:
                prefix[14] = other_than(rt[14]) if prefix[14] == rt[14] else prefix[14]
            prompt = prefix + toks(2000 + 10 * w + it, 3)
            plans[w, it] = (kind, prefix, prompt, reference(eng, prompt, 6))
    turns = {}
    for d in range(4):
        q1 = (rt if d % 2 == 0 else []) + toks(3000 + d, 20)
        r1 = reference(eng, q1, 12)
        q2 = q1 + r1 + toks(3100 + d, 4)
        turns[d] = (q1, r1, q2, reference(eng, q2, 12))

    errors: list[BaseException] = []
    expected = (CapacityError,)

    def pool_worker(w: int) -> None:
        try:
            for it in range(ITERS):
                kind, prefix, prompt, ref = plans[w, it]
                try:
                    if kind == 0:
                        pool = eng.create_pool(tokens=prefix)
                    elif kind == 1:
                        pool = eng.fork_pool(root.pool_id, tokens=prefix)
                    else:
                        pool = eng.fork_pool(root.pool_id, branch_pos=14, tokens=prefix)
                except expected:
                    continue
                sid = f"w{w}-{it}"
                if it % 3 == 2:  # a client that goes away mid-stream, on the pool
                    stream = eng.stream(prompt, params=greedy(50), pool_id=pool.pool_id, session_id=sid + "c")
                    next(iter(stream))
                    stream.close()
                    eng.release_session(sid + "c")
                res = eng.generate(prompt, params=greedy(6), pool_id=pool.pool_id, session_id=sid)
                assert res.cache_n == len(prefix), (w, it, res.cache_n)
                assert res.token_ids == ref, (w, it)
                if it % 2:
                    eng.release_pool(pool.pool_id)  # release while attached
                    eng.release_session(sid)
                else:
                    eng.release_session(sid)
                    eng.release_pool(pool.pool_id)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def decoder(d: int) -> None:
        try:
            q1, r1, q2, r2 = turns[d]
            pool_id = root.pool_id if d % 2 == 0 else None
            res = eng.generate(q1, params=greedy(12), session_id=f"d{d}", pool_id=pool_id)
            assert res.token_ids == r1 and res.cache_n == (33 if pool_id else 0)
            res = eng.generate(q2, params=greedy(12), session_id=f"d{d}")
            assert res.token_ids == r2 and res.cache_n == len(q1) + 11
            eng.release_session(f"d{d}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=pool_worker, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=decoder, args=(d,)) for d in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        eng.check_integrity()
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert not errors, errors
    eng.check_integrity()
    st, own, sess = ownership(eng)
    assert [p["pool_id"] for p in st["pools"]] == [root.pool_id] and sess == 0
    assert st["kv_pages_used"] == own == pages_for(33, 4)
    assert eng.stats()["sessions"] == 0
    eng.release_pool(root.pool_id)
    assert eng.pools()["kv_pages_used"] == 0


def test_pool_ids_only_skip_forward():
    """Restoring a state directory moves the next id past every id spent before (never back)."""
    tree = PoolTree(max_pools=4, id_base=100)
    assert tree.next_id == 101
    tree.skip_ids(110)
    tree.skip_ids(105)
    assert tree.next_id == 110
    assert tree.add(None, 0, [1, 2]).pool_id == 110 and tree.next_id == 111


def test_pool_tokens_is_the_whole_prefix(make_engine):
    eng = make_engine(page_size=4)
    root = eng.create_pool(tokens=list(range(10, 30)))
    child = eng.fork_pool(root.pool_id, tokens=list(range(10, 30)) + [7, 8, 9])
    assert eng.pool_tokens(child.pool_id) == list(range(10, 30)) + [7, 8, 9]
    with pytest.raises(PoolNotFoundError):
        eng.pool_tokens(999)
    eng.release_pool(child.pool_id)
    eng.release_pool(root.pool_id)
