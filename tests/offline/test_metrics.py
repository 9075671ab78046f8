"""tps instrumentation (docs/polykv.md, "tps"): the estimators on scripted timestamps, then the
engine's own numbers on tiny random-weight models (no timing asserts: only comparisons between
numbers measured in the same run)."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest

from opencoti.engine import InvalidRequestError, PoolNotFoundError, SamplingParams
from opencoti.engine.observe.metrics import Metrics, RateWindow, SessionTps, TpsConfig
from opencoti.engine.requests import SessionState

from fake_core import FakeCore


def greedy(n: int) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + j * 7) % 250 + 1 for j in range(n)]


def feed(m: SessionTps, times, key=None) -> None:
    for t in times:
        m.on_token(t, key)


# ============================================================================ SessionTps
def test_steady_rate_first_token_is_not_a_sample():
    m = SessionTps(TpsConfig())
    key = object()
    m.on_token(5.0, key)  # closes the prefill: no interval yet
    assert m.value() == 0.0 and not m.is_fresh(key)
    feed(m, [5.0 + 0.1 * i for i in range(1, 11)], key)
    assert m.is_fresh(key)
    assert m.value() == pytest.approx(10.0)
    assert m.total_tokens == 11 and m.chain_intervals == 10


def test_gap_between_requests_is_not_counted_and_new_request_warms():
    m = SessionTps(TpsConfig(window_s=100.0))
    first, second = object(), object()
    feed(m, [0.0, 0.1, 0.2, 0.3], first)
    # a tool call of 5 s, then the next turn of the same session
    feed(m, [5.3], second)
    assert not m.is_fresh(second)  # warming again: the new request has no interval yet
    assert m.value() == pytest.approx(10.0)  # the 5 s gap is not a sample
    feed(m, [5.4, 5.5], second)
    assert m.is_fresh(second) and m.value() == pytest.approx(10.0)


def test_window_by_tokens():
    m = SessionTps(TpsConfig(window_tokens=8, window_s=100.0, tau_s=1e6))
    t = [0.1 * i for i in range(21)]  # 20 intervals at 10 tps
    t += [t[-1] + 0.05 * i for i in range(1, 9)]  # then 8 at 20 tps: the whole window
    feed(m, t)
    assert m.value() == pytest.approx(20.0)


def test_window_by_time():
    m = SessionTps(TpsConfig(window_tokens=10_000, window_s=1.0, tau_s=1e6))
    t = [0.5 * i for i in range(11)]  # 2 tps for 5 s
    t += [t[-1] + 0.1 * i for i in range(1, 21)]  # 10 tps for the last 2 s
    feed(m, t)
    assert m.value() == pytest.approx(10.0)  # only the last second counts
    # a stall longer than the window keeps the newest interval (never an empty window)
    m2 = SessionTps(TpsConfig(window_s=1.0))
    feed(m2, [0.0, 3.0])
    assert m2.value() == pytest.approx(1 / 3)


def test_ewma_weights_recent_samples_and_is_harmonic():
    cfg = TpsConfig(window_tokens=10_000, window_s=4.0, tau_s=1.0)
    m = SessionTps(cfg)
    t = [0.2 * i for i in range(11)]  # 5 tps for 2 s
    t += [t[-1] + 0.05 * i for i in range(1, 41)]  # 20 tps for 2 s
    feed(m, t)
    flat = (10 + 40) / 4.0  # tokens / seconds over the window = 12.5
    assert flat < m.value() < 20.0  # recent samples weigh more
    # flat weights: exactly tokens / seconds, not the mean of 1/dt (which would be 13.33 here)
    m = SessionTps(TpsConfig(window_tokens=10_000, window_s=100.0, tau_s=1e9))
    dts = [0.05, 0.15] * 20
    t = [0.0]
    for dt in dts:
        t.append(t[-1] + dt)
    feed(m, t)
    assert m.value() == pytest.approx(10.0)


def test_reconfigure_keeps_samples():
    m = SessionTps(TpsConfig(window_tokens=4, window_s=100.0, tau_s=1e9))
    feed(m, [0.1 * i for i in range(20)])
    assert len(m._t) == 4
    m.reconfigure(TpsConfig(window_tokens=2, window_s=100.0, tau_s=1e9))
    assert len(m._t) == 2 and m.value() == pytest.approx(10.0)


# ============================================================================ RateWindow
def test_rate_window_steady_start_gap_and_decay():
    w = RateWindow(2.0)
    assert w.rate(0.0) == 0.0
    for i in range(1, 11):  # 4 tokens every 0.05 s = 80 tps
        w.add(0.05 * i, 4)
    assert w.rate(0.5) == pytest.approx(80.0, rel=1e-6)  # busy for less than the window
    for i in range(11, 101):
        w.add(0.05 * i, 4)
    assert w.rate(5.0) == pytest.approx(80.0, rel=0.03)
    assert w.rate(6.0) == pytest.approx(80.0 / 2, rel=0.05)  # nothing new: decays
    assert w.rate(20.0) == 0.0
    # a new busy period after a long gap is not diluted by the gap
    for i in range(1, 11):
        w.add(100.0 + 0.1 * i, 2)
    assert w.rate(101.0) == pytest.approx(20.0, rel=1e-6)


@pytest.mark.parametrize("kw", [{"window_tokens": 0}, {"window_tokens": 1.5}, {"window_s": 0}, {"window_s": math.inf},
                                {"tau_s": -1.0}, {"min_samples": 0}, {"history_len": 0},
                                {"aggregate_window_s": "2"}, {"nope": 1}])
def test_tps_config_validation(kw):
    with pytest.raises(InvalidRequestError):
        TpsConfig().updated(**kw)


# ============================================================================ Metrics on a scripted core (fake_core.py)
def test_warming_sessions_are_excluded_from_the_mean():
    core = FakeCore()
    clock = SimpleNamespace(t=0.0)
    m = Metrics(core, clock=lambda: clock.t, wall_clock=lambda: clock.t)
    a, b = core.job("a"), core.job("b")
    for i in range(11):
        core.token(a, 0.1 * i)  # a: 10 tps
    core.token(b, 1.0)  # b: first token only -> warming
    w = core.job("w", state=SessionState.WAITING)  # queued: warming too
    act = m.activity()
    assert act.n_active == 1 and act.n_warming == 2 and act.n_decoding == 2
    assert act.mean_active_tps == pytest.approx(10.0)  # not dragged toward 0 by b and w
    rows = {r["session_id"]: r for r in m.snapshot()["sessions"]}
    assert rows["b"]["tps_ewma"] == 0.0 and rows["b"]["warming"] and rows["w"]["warming"]
    for i in range(1, 6):
        core.token(b, 1.0 + 0.2 * i)  # b: 5 tps
    act = m.activity()
    assert act.n_active == 2 and act.n_warming == 1
    assert act.mean_active_tps == pytest.approx(7.5)
    core.finish(a)
    assert m.activity().n_active == 1
    core.scheduler.waiting.remove(w)
    w.session.job = None
    assert m.activity().n_warming == 0


def test_context_headroom_and_compaction_pressure():
    core = FakeCore(num_pages=100, page_size=4, max_context=200)
    m = Metrics(core, clock=lambda: 0.0, wall_clock=lambda: 0.0)
    job = core.job("a", n_prompt=150)
    snap = m.snapshot()
    row = snap["sessions"][0]
    assert (row["ctx_used"], row["ctx_total"], row["ctx_headroom_tokens"]) == (150, 200, 50)
    assert row["compaction_pressure"] == pytest.approx(0.75)  # 150 / 200: its own context is the wall
    assert job.session.state == SessionState.DECODE
    core.kv.num_free = 5  # 20 free cells left in the shared cache
    row = m.snapshot()["sessions"][0]
    assert row["ctx_headroom_tokens"] == 20
    assert row["compaction_pressure"] == pytest.approx(0.95)  # occupancy 95 %
    core.kv.num_free = 0
    snap = m.snapshot()
    assert snap["sessions"][0]["ctx_headroom_tokens"] == 0 and snap["compaction_pressure"] == 1.0
    for pressure in (snap["compaction_pressure"], snap["sessions"][0]["compaction_pressure"]):
        assert 0.0 <= pressure <= 1.0


# ============================================================================ on the engine
def test_session_ewma_matches_predicted_per_second(engine):
    r = engine.generate(prompt(1, 12), params=greedy(120), session_id="solo")
    snap = engine.tps_snapshot()
    row = next(s for s in snap["sessions"] if s["session_id"] == "solo")
    pps = r.timings["predicted_per_second"]
    assert pps > 0 and row["tps_ewma"] == pytest.approx(pps, rel=0.10)
    assert row["state"] == "idle" and row["generated_tokens"] == 120
    assert (row["ctx_used"], row["ctx_total"]) == (12 + 120, engine.max_context)
    assert row["ctx_headroom_tokens"] == engine.max_context - 132
    assert snap["n_warming"] == 0 and snap["mean_active_tps"] is None  # nothing in flight: no measurement


def test_configured_window_covering_the_request_equals_predicted_per_second(engine):
    engine.configure_tps(window_tokens=1000, window_s=600.0, tau_s=1e6)
    r = engine.generate(prompt(2, 9), params=greedy(80), session_id="s")
    row = engine.tps_snapshot()["sessions"][0]
    assert row["tps_ewma"] == pytest.approx(r.timings["predicted_per_second"], rel=1e-6)
    with pytest.raises(InvalidRequestError):
        engine.configure_tps(window_tokens=-1)


def test_aggregate_is_the_sum_of_sessions_under_concurrency(engine):
    n, max_tokens = 4, 400
    seen = [0] * n
    ready = threading.Event()
    results = [None] * n

    def run(i):
        s = engine.stream(prompt(10 + i, 8), params=greedy(max_tokens), session_id=f"c{i}")
        for _ in s:
            seen[i] += 1
            if min(seen) >= 120:
                ready.set()
        results[i] = s.result

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert ready.wait(60)
    snap = engine.tps_snapshot()
    for t in threads:
        t.join(60)
    active = [s for s in snap["sessions"] if s["state"] == "decode"]
    assert snap["n_active"] == len(active) == n and snap["n_warming"] == 0
    total = sum(s["tps_ewma"] for s in active)
    assert snap["aggregate_tps"] == pytest.approx(total, rel=0.25)
    assert snap["mean_active_tps"] == pytest.approx(total / n)
    for r in results:
        assert r is not None and len(r.token_ids) == max_tokens


def test_warming_counted_for_a_queued_request(engine):
    """A request accepted but not yet computed is warming (checked on the step thread, no race)."""
    engine.generate(prompt(3, 8), params=greedy(4), session_id="old")

    def submit_and_look():
        engine.core.submit(prompt(4, 30), greedy(4), lambda ev: None, session_id="new")
        return engine.metrics.activity(), engine.metrics.snapshot()

    act, snap = engine.run_on_step_thread(submit_and_look)
    assert act.n_warming == 1 and act.n_active == 0 and act.mean_active_tps is None
    row = next(s for s in snap["sessions"] if s["session_id"] == "new")
    assert row["warming"] and row["tps_ewma"] == 0.0 and row["state"] == "waiting"
    engine.release_session("new")


def test_counters_per_pool_survive_release(engine):
    pool = engine.create_pool(tokens=prompt(5, 20))
    p = prompt(5, 20) + prompt(6, 5)
    engine.generate(p, params=greedy(6), pool_id=pool.pool_id, session_id="x")
    engine.generate(prompt(7, 9), params=greedy(3), pool_id=pool.pool_id, session_id="y")  # no prefix match
    text = engine.prometheus_metrics()
    assert f'opencoti_polykv:queries_total{{pool="{pool.pool_id}"}} 2' in text
    assert "# TYPE opencoti_polykv:gen_throughput_tps gauge" in text
    engine.release_session("x")
    engine.release_session("y")
    engine.release_pool(pool.pool_id)
    c = engine.metrics_counters()
    pc = c["pools"][pool.pool_id]
    assert pc == {"queries": 2, "prefix_cache_hits": 1, "prompt_tokens": 25 + 9, "cached_prompt_tokens": 20,
                  "generated_tokens": 9, "live": False}
    assert c["totals"]["generated_tokens"] >= 9 and c["totals"]["prefill_tokens_computed"] >= 20 + 5 + 9
    # /metrics keeps series of live pools only (bounded cardinality); the counters above keep all
    assert f'pool="{pool.pool_id}"' not in engine.prometheus_metrics()


def test_history_is_sampled_and_bounded(engine):
    engine.configure_tps(history_interval_s=1e-6, history_len=5, global_history_len=7)
    engine.generate(prompt(8, 6), params=greedy(40), session_id="h")
    h = engine.tps_history()
    assert len(h["aggregate"]) == 7 and len(h["sessions"]["h"]) == 5
    pts = engine.tps_history("h")["points"]
    assert [p["ts"] for p in pts] == sorted(p["ts"] for p in pts)
    assert all(p["ctx_used"] >= 6 and p["tps_ewma"] >= 0 for p in pts)
    assert any(p["tps_ewma"] > 0 for p in pts)
    assert engine.tps_history(since=pts[-1]["ts"])["sessions"]["h"][-1] == pts[-1]


def test_listener_errors_are_zero_and_no_policy_pays_nothing(engine):
    engine.generate(prompt(9, 10), params=greedy(10))
    assert engine.metrics.listener_errors == 0 and engine.admission_controller.listener_errors == 0
    with pytest.raises(PoolNotFoundError):
        engine.capacity(999)
