"""Automatic prefix sharing: the prefix index over resident KV, cache eviction, salts, TTLs."""

from __future__ import annotations

import random
import threading
import time

import pytest

from opencoti.engine import SamplingParams


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


def owned_and_cache(eng) -> tuple[int, int, int]:
    """(pages in use, pages owned by pools and sessions, pages only the cache holds); checks that
    ownership adds up: pools + sessions + the cache owner == every page in use."""
    st = eng.pools()
    pb = eng.kv.page_bytes
    own = sum(p["own_kv_bytes"] for p in st["pools"]) // pb
    sess = eng.run_on_step_thread(lambda: sum(len(s.seq.owned_pages) for s in eng.core.sessions.values()))
    released = eng.run_on_step_thread(lambda: sum(len(p.seq.owned_pages) for p in eng.core.tree.released.values()))
    total = st["kv_pages_used"] + st["kv_pages_cache"]
    assert total == eng.run_on_step_thread(lambda: eng.kv.num_used)
    assert total == own + sess + released + st["prefix_cache"]["owned_pages"]
    assert st["cache_kv_bytes"] == st["kv_pages_cache"] * pb == st["prefix_cache"]["cache_kv_bytes"]
    assert st["prefix_cache"]["owned_pages"] >= st["kv_pages_cache"]
    return total, own + sess + released, st["kv_pages_cache"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equal_with_cache_on_and_off(make_engine, page_size):
    on = make_engine(page_size=page_size)
    off = make_engine(page_size=page_size, prefix_cache=False)
    system = toks(1, 37)
    prompts = [system + toks(10 + i, 5 + 3 * i) for i in range(4)] + [system[:20], system + toks(10, 5)]
    out_on = [on.generate(p, params=greedy(10)) for p in prompts]
    out_off = [off.generate(p, params=greedy(10)) for p in prompts]
    assert [r.token_ids for r in out_on] == [r.token_ids for r in out_off]
    assert all(r.cache_n == 0 for r in out_off)
    assert out_on[0].cache_n == 0
    assert all(r.cache_n >= 37 // page_size * page_size for r in out_on[1:4])  # the system prompt, reused
    assert out_on[5].cache_n == len(prompts[5]) - 1  # the same prompt again: all but the last token
    for r in out_on:  # cache_n counted by the timings too
        assert r.timings["cache_n"] == r.cache_n and r.timings["prompt_n"] == r.info.prompt_tokens - r.cache_n
    # concurrent requests too (they share what the first computes)
    res = [None] * 4

    def run(i):
        res[i] = on.generate(prompts[i][:30] + toks(50 + i, 9), params=greedy(6)).token_ids

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert res == [off.generate(prompts[i][:30] + toks(50 + i, 9), params=greedy(6)).token_ids for i in range(4)]
    on.check_integrity()
    assert on.stats()["prefix_cache"]["hit_rate"] > 0


def test_forced_hash_collisions_never_share(make_engine):
    eng = make_engine(page_size=4)
    ref = make_engine(page_size=4, prefix_cache=False)
    eng.run_on_step_thread(lambda: setattr(eng.core.tables.index, "key_fn", lambda parent, tokens: b"same"))
    a, b = toks(1, 30), toks(2, 30)
    ra = eng.generate(a, params=greedy(8))
    rb = eng.generate(b, params=greedy(8))  # every key equals a's: only the token comparison protects it
    assert rb.cache_n == 0
    assert [ra.token_ids, rb.token_ids] == [ref.generate(x, params=greedy(8)).token_ids for x in (a, b)]
    # the same tokens again share only what the (colliding) chain can prove: the first page
    ra2 = eng.generate(a, params=greedy(8))
    assert ra2.token_ids == ra.token_ids and ra2.cache_n <= 4 + 3


def test_salt_isolation(make_engine):
    eng = make_engine(page_size=4)
    p = toks(3, 40)
    assert eng.generate(p, params=greedy(4), cache_salt="tenant-a").cache_n == 0
    assert eng.generate(p, params=greedy(4), cache_salt="tenant-b").cache_n == 0
    assert eng.generate(p, params=greedy(4)).cache_n == 0  # no salt: its own namespace
    assert eng.generate(p, params=greedy(4), cache_salt="tenant-a").cache_n == 39
    assert eng.generate(p, params=greedy(4)).cache_n == 39
    with pytest.raises(Exception):
        eng.generate(p, params=greedy(4), cache_salt=5)


def test_multi_turn_without_ids_computes_only_new_tokens(make_engine):
    eng = make_engine(page_size=16)
    ref = make_engine(page_size=16, prefix_cache=False)
    convo = toks(4, 50)
    user: list[int] = []
    for turn in range(6):
        r = eng.generate(convo, params=greedy(7))
        assert r.token_ids == ref.generate(convo, params=greedy(7)).token_ids
        if turn:
            # everything but the new user tokens and the previous answer's last token (never computed)
            assert r.timings["prompt_n"] == len(user) + 1, (turn, r.timings)
            assert r.cache_n == len(convo) - len(user) - 1
        user = toks(100 + turn, 11 + turn)
        convo = convo + r.token_ids + user
    eng.check_integrity()


def test_requests_arriving_together_compute_the_prefix_once(make_engine):
    eng = make_engine(page_size=4, max_batch_tokens=512)  # room for all five prompts in one step
    ref = make_engine(page_size=4, prefix_cache=False)
    system = toks(5, 96)
    prompts = [system + toks(200 + i, 6) for i in range(5)]
    res = [None] * 5

    def run(i):
        res[i] = eng.generate(prompts[i], params=greedy(5))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    busy = eng.post_to_step_thread(time.sleep, 0.5)  # hold the step loop so that all five are queued before a step
    [t.start() for t in ts]
    busy.result()
    [t.join() for t in ts]
    assert [r.token_ids for r in res] == [ref.generate(p, params=greedy(5)).token_ids for p in prompts]
    computed = sum(r.timings["prompt_n"] for r in res)
    assert computed <= 96 + 5 * (6 + 4), computed  # the system prompt once, then each suffix (+ a partial page)
    assert sum(r.cache_n for r in res) == sum(len(p) for p in prompts) - computed


def test_eviction_lru_leaves_first_under_churn(make_engine):
    eng = make_engine(page_size=4, kv_budget_tokens=160, max_batch_tokens=32)  # 40 pages
    a, b, c = toks(11, 40), toks(12, 40), toks(13, 40)
    for p in (a, b, c):
        eng.generate(p, params=greedy(2))
    assert eng.generate(a, params=greedy(2)).cache_n == 39  # a is now the most recently used
    eng.generate(toks(14, 60), params=greedy(2))  # needs room: the least recently used cache goes first
    _, owned, cache = owned_and_cache(eng)
    assert eng.stats()["prefix_cache"]["evicted_pages"] > 0
    assert eng.generate(a, params=greedy(2)).cache_n == 39
    assert eng.generate(b, params=greedy(2)).cache_n < 39
    rng = random.Random(0)
    roots = [toks(20 + i, 12) for i in range(4)]
    for i in range(40):  # churn: shared roots, random tails, a tight budget
        p = roots[rng.randrange(4)] + toks(1000 + i, rng.randint(1, 40))
        r = eng.generate(p, params=greedy(rng.randint(1, 8)))
        assert r.stop_reason == "length"
        if i % 10 == 0:
            eng.check_integrity()
    used, owned, cache = owned_and_cache(eng)
    assert used <= 40 and eng.stats()["prefix_cache"]["evicted_pages"] > 40


def test_refused_only_when_evicting_all_cache_would_not_fit(make_engine):
    eng = make_engine(page_size=4, kv_budget_tokens=64, session_ttl_s=0.0)  # 16 pages; sessions end at once
    for i in range(6):
        eng.generate(toks(30 + i, 20), params=greedy(3))
    assert owned_and_cache(eng)[2] > 0 and eng.stats()["sessions"] == 0
    r = eng.generate(toks(99, 50), params=greedy(13))  # 62 tokens of KV: everything but the cache
    assert len(r.token_ids) == 13 and not r.truncated


def test_idle_anonymous_sessions_expire_into_the_cache(make_engine):
    eng = make_engine(page_size=4, session_ttl_s=0.3)
    r = eng.generate(toks(40, 30), params=greedy(4))
    eng.generate(toks(41, 30), params=greedy(4), session_id="named")
    assert eng.stats()["sessions"] == 2
    time.sleep(1.5)
    st = eng.stats()
    assert st["sessions"] == 1 and st["expired_sessions"] == 1  # the named one stays
    used, owned, cache = owned_and_cache(eng)
    assert cache >= 30 // 4
    assert eng.generate(toks(40, 30) + r.token_ids, params=greedy(2)).cache_n == 30 + 3


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_released_pool_pages_return_with_idle_anonymous_session(make_engine, prefix_cache):
    eng = make_engine(page_size=4, kv_budget_tokens=256, max_pools=4, prefix_cache=prefix_cache)  # 64 pages
    pool = eng.create_pool(tokens=toks(50, 120))
    r = eng.generate(toks(50, 120) + toks(51, 10), params=greedy(4), pool_id=pool.pool_id)  # anonymous session
    assert r.cache_n == 120 and r.info.pool_id == pool.pool_id
    eng.release_pool(pool.pool_id)
    used, owned, cache = owned_and_cache(eng)
    assert owned == 0 and eng.stats()["sessions"] == 1  # the session lives on (its TTL), without KV
    assert used == (cache if prefix_cache else 0)
    # the whole KV is available again: a pool of 250 tokens (63 pages) fits
    big = eng.create_pool(tokens=toks(52, 250))
    assert big.residency == "resident"


def test_pools_with_the_cache_on(make_engine):
    eng = make_engine(page_size=4)
    ref = make_engine(page_size=4, prefix_cache=False)
    system = toks(60, 30)
    root = eng.create_pool(tokens=system)
    child = eng.fork_pool(root.pool_id, tokens=system + toks(61, 9))
    q = system + toks(61, 9) + toks(62, 5)
    r1 = eng.generate(q, params=greedy(6), pool_id=child.pool_id, session_id="s1")
    r2 = eng.generate(q, params=greedy(6))  # no pool: the index finds the child's pages
    assert r1.token_ids == r2.token_ids == ref.generate(q, params=greedy(6)).token_ids
    assert r1.cache_n == 39 and r2.cache_n == len(q) - 1
    owned_and_cache(eng)
    eng.release_session("s1")
    eng.release_pool(child.pool_id)
    used, owned, cache = owned_and_cache(eng)
    anon = eng.run_on_step_thread(lambda: sum(len(s.seq.owned_pages) for s in eng.core.sessions.values()))  # r2's session
    assert owned == eng.pool(root.pool_id).own_kv_bytes // eng.kv.page_bytes + anon and cache >= 9 // 4
    assert eng.generate(q, params=greedy(6)).cache_n == len(q) - 1  # still cached after the release
