"""Admission control (docs/polykv.md): plan -> decide -> commit.

Four layers: the capacity maths on scripted inputs; the pure ``decide`` on scripted plans and
inputs; the controller (settle windows, drop EWMA, idle estimate, deadlines from ``tick``) on a
scripted core with an injected clock; and the enforced gate on real tiny-model engines under
decoding load (no timing asserts anywhere).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from opencoti.engine import (EngineClosedError, InvalidRequestError, PoolNotFoundError, SamplingParams)
from opencoti.engine.admission import (ADMIT, HOLD, REASON_CONTEXT, REASON_FLOOR, REASON_FLOOR_IDLE,
                                       REASON_GUARANTEED, REASON_KV, REASON_OK, REASON_QUEUE_TIMEOUT,
                                       REASON_SETTLING, REJECT, AdmissionController, AdmissionPlan,
                                       AdmissionPolicy, CapacityInputs, GateInputs, PoolState, compute_capacity,
                                       decide, fold_drop)
from opencoti.engine.config import SamplingParams as SP
from opencoti.engine.errors import PoolSaturatedError
from opencoti.engine.kv.pool import Residency
from opencoti.engine.observe.metrics import Metrics
from opencoti.engine.requests import Job, SeqState, Session, SessionState

from fake_core import FakeCore

FLOOR_REASONS = (REASON_FLOOR, REASON_FLOOR_IDLE)


def greedy(n: int) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


# ============================================================================ policy
@pytest.mark.parametrize("kw", [
    {"target_tps_per_session": 0}, {"target_tps_per_session": -3.0}, {"target_tps_per_session": "5"},
    {"target_tps_per_session": float("nan")}, {"mode": "strict"}, {"on_saturation": "drop"},
    {"guarantee_min_sessions": -1}, {"guarantee_min_sessions": 1.5}, {"guarantee_min_sessions": True},
    {"settle_tokens": 0}, {"settle_max_ms": 0}, {"settle_max_ms": float("inf")}, {"queue_timeout_ms": -1},
    {"floor": 5},
])
def test_bad_policy_values(kw):
    with pytest.raises(InvalidRequestError):
        AdmissionPolicy().updated(**kw)


def test_policy_defaults_and_merge():
    p = AdmissionPolicy()
    assert (p.mode, p.on_saturation, p.guarantee_min_sessions, p.settle_tokens, p.settle_max_ms) == \
        ("advisory", "reject", 1, 48, 5000.0)
    q = p.updated(target_tps_per_session=5, mode="enforced")
    assert q.target_tps_per_session == 5 and q.mode == "enforced" and q.settle_tokens == 48
    assert q.updated(settle_tokens=8).as_dict() == {**q.as_dict(), "settle_tokens": 8}


# ============================================================================ the math
def inputs(**kw) -> CapacityInputs:
    # the drop-based projection is the conservative forecast's (test_admission_sim covers the adaptive one)
    base = dict(policy=AdmissionPolicy(target_tps_per_session=5.0, forecast="conservative"), mean=10.0, n_active=2,
                n_decoding=2,
                n_pool_sessions=2, available_cells=1000, free_cells=1000, total_cells=1000, marginal_tokens=100)
    base.update(kw)
    return CapacityInputs(**base)


def test_model_projection_and_measured_projection():
    cap = compute_capacity(inputs())
    assert cap["projected_mean_tps_model"] == pytest.approx(10 * 2 / 3)  # n/(n+1) fallback
    assert cap["projected_mean_tps_measured"] is None
    assert cap["projected_mean_tps_if_admitted"] == cap["projected_mean_tps_model"]
    assert cap["can_admit"] and cap["reason"] == REASON_OK
    # a measured drop takes over once the pool absorbed >= 1 admit
    cap = compute_capacity(inputs(drop_ewma=1.5, drop_samples=1))
    assert cap["projected_mean_tps_measured"] == pytest.approx(8.5)
    assert cap["projected_mean_tps_if_admitted"] == pytest.approx(8.5)
    assert cap["projected_mean_tps_model"] == pytest.approx(10 * 2 / 3)  # always reported
    assert cap["drop_per_admit_ewma"] == 1.5
    # the floor uses the measured projection: 8.5 passes a floor of 8 that the model (6.67) fails
    p8 = AdmissionPolicy(target_tps_per_session=8.0, forecast="conservative")
    assert compute_capacity(inputs(policy=p8, drop_ewma=1.5, drop_samples=1))["can_admit"]
    cap = compute_capacity(inputs(policy=p8))
    assert not cap["can_admit"] and cap["reason"] == REASON_FLOOR
    # the model stays the conservative n/(n+1) bound whatever the batch: 4 decoding -> 4/5
    assert compute_capacity(inputs(n_decoding=4))["projected_mean_tps_model"] == pytest.approx(8.0)
    # how many more the floor allows: measured (10 - 5) // 1.5 = 3; model: 10 * 2/(2+k) >= 5 -> k <= 2
    assert compute_capacity(inputs(drop_ewma=1.5, drop_samples=1))["tps_headroom_sessions"] == 3
    assert compute_capacity(inputs())["tps_headroom_sessions"] == 2
    assert compute_capacity(inputs())["sessions_remaining"] == 2


def test_fold_drop_ewma_alpha_03():
    assert fold_drop(None, 0, 2.0) == (2.0, 1)
    ewma, n = fold_drop(2.0, 1, 1.0)
    assert n == 2 and ewma == pytest.approx(0.3 * 1.0 + 0.7 * 2.0)
    assert fold_drop(2.0, 1, -4.0)[0] == pytest.approx(0.7 * 2.0)  # a rise counts as no drop


def test_idle_estimate_fresh_vs_stale():
    fresh = inputs(mean=None, n_active=0, n_decoding=0, n_pool_sessions=2, last_settled_mean=9.0,
                   last_settled_age_s=5.0, policy=AdmissionPolicy(target_tps_per_session=7.0, forecast="conservative"))
    cap = compute_capacity(fresh)
    assert cap["projected_idle_estimate"]
    assert cap["projected_mean_tps_model"] == pytest.approx(9.0 * 2 / 3)
    assert not cap["can_admit"] and cap["reason"] == REASON_FLOOR_IDLE
    cap = compute_capacity(inputs(**{**fresh.__dict__, "drop_ewma": 1.0, "drop_samples": 2}))
    assert cap["projected_mean_tps_measured"] == pytest.approx(8.0) and cap["can_admit"]
    stale = compute_capacity(inputs(**{**fresh.__dict__, "last_settled_age_s": 31.0}))
    assert not stale["projected_idle_estimate"] and stale["projected_mean_tps_if_admitted"] is None
    assert stale["can_admit"] and stale["reason"] == REASON_OK  # a long-idle pool really has capacity
    nobody = compute_capacity(inputs(**{**fresh.__dict__, "n_pool_sessions": 0}))
    assert not nobody["projected_idle_estimate"]


def test_guarantee_bypasses_floor_kv_and_settling_but_not_the_context_arm():
    starved = dict(policy=AdmissionPolicy(target_tps_per_session=50.0, guarantee_min_sessions=2),
                   n_pool_sessions=1, available_cells=10, settle_remaining_s=2.0)
    cap = compute_capacity(inputs(**starved))
    assert cap["can_admit"] and cap["guaranteed"] and cap["reason"] == REASON_GUARANTEED
    assert cap["headroom_sessions"] == 0 and cap["projected_mean_tps_if_admitted"] < 50
    cap = compute_capacity(inputs(**starved, expected_tokens=11))
    assert not cap["can_admit"] and not cap["guaranteed"] and cap["reason"] == REASON_CONTEXT
    # at the minimum: the normal arms apply, settling first
    at_min = {**starved, "n_pool_sessions": 2}
    assert compute_capacity(inputs(**at_min))["reason"] == REASON_SETTLING
    assert compute_capacity(inputs(**{**at_min, "settle_remaining_s": None}))["reason"] == REASON_KV
    cap = compute_capacity(inputs(**{**at_min, "settle_remaining_s": None, "available_cells": 1000}))
    assert cap["reason"] == REASON_FLOOR
    zero = AdmissionPolicy(target_tps_per_session=50.0, guarantee_min_sessions=0)
    assert compute_capacity(inputs(policy=zero, n_pool_sessions=0))["reason"] == REASON_FLOOR


def test_context_arm_and_kv_headroom():
    cap = compute_capacity(inputs(expected_tokens=1000))
    assert cap["context_ok"] and cap["can_admit"]
    cap = compute_capacity(inputs(expected_tokens=1001))
    assert not cap["can_admit"] and cap["reason"] == REASON_CONTEXT
    cap = compute_capacity(inputs(expected_tokens=300, context_left=299))  # beyond the context after the prefix
    assert cap["reason"] == REASON_CONTEXT
    cap = compute_capacity(inputs(available_cells=350, free_cells=500, marginal_tokens=100))
    assert cap["headroom_sessions"] == 3 and cap["kv_headroom_pct"] == pytest.approx(50.0)
    cap = compute_capacity(inputs(available_cells=99, marginal_tokens=100))
    assert not cap["can_admit"] and cap["reason"] == REASON_KV


def test_compaction_pressure_bounds():
    assert compute_capacity(inputs(free_cells=0))["compaction_pressure"] == 1.0
    assert compute_capacity(inputs(largest_session_share=0.3))["compaction_pressure"] == pytest.approx(0.3)
    assert compute_capacity(inputs(free_cells=250, largest_session_share=0.3))["compaction_pressure"] == \
        pytest.approx(0.75)
    rng = random.Random(0)
    for _ in range(200):
        total = rng.randint(1, 10_000)
        cap = compute_capacity(inputs(total_cells=total, free_cells=rng.randint(0, total),
                                      largest_session_share=rng.random() * 1.5))
        assert 0.0 <= cap["compaction_pressure"] <= 1.0


# ============================================================================ decide (pure)
def gate(now=10.0, **kw) -> GateInputs:
    cap = kw.pop("capacity", None) or inputs(policy=AdmissionPolicy(target_tps_per_session=9.0, mode="enforced"))
    return GateInputs(cap, now, **kw)


PLAN = AdmissionPlan(pool_id=3, session_id="x", new_to_pool=True, prompt_len=30, prefix_len=20, max_tokens=50)


def test_decide_ungated_paths():
    for plan in (AdmissionPlan(None, "x", False, 5), AdmissionPlan(3, "x", False, 30, 20)):
        d = decide(plan, gate())
        assert d.action == ADMIT and d.kind == "ungated" and d.info() is None
    advisory = inputs(policy=AdmissionPolicy(target_tps_per_session=9.0))
    assert decide(PLAN, gate(capacity=advisory)).kind == "ungated"
    assert decide(PLAN, None).kind == "ungated"
    assert PLAN.expected_tokens == 10 + 50


def test_decide_reject_warn_queue_and_overcommit():
    d = decide(PLAN, gate())  # projected 10 * 2/3 < 9
    assert d.action == REJECT and d.reason == REASON_FLOOR and 0.5 <= d.retry_after <= 60
    err = d.error(3)
    assert err.status_code == 429 and "6.67 < 9" in str(err) and err.capacity is d.capacity
    d = decide(PLAN, gate(soonest_finish_s=3.0))
    assert d.retry_after == pytest.approx(3.0)
    warn = inputs(policy=AdmissionPolicy(target_tps_per_session=9.0, mode="enforced", on_saturation="warn"))
    d = decide(PLAN, gate(capacity=warn))
    assert d.action == ADMIT and d.kind == "warned" and "saturated" in d.warning
    assert d.info(12.0) == {"decision": "warned", "reason": REASON_FLOOR, "warning": d.warning,
                            "sessions_remaining": 0, "projected_mean_tps_if_admitted": pytest.approx(20 / 3),
                            "held_ms": 12.0, "retry_after": d.retry_after}
    assert 0.5 <= d.retry_after <= 60  # no room for the next new session: when it is likely to fit
    oc = decide(AdmissionPlan(3, "x", True, 30, 20, 50, overcommit=True), gate())
    assert oc.action == ADMIT and oc.kind == "overcommit" and "overcommit" in oc.warning
    big = AdmissionPlan(3, "x", True, 30, 20, 5000, overcommit=True)
    assert decide(big, gate()).reason == REASON_CONTEXT and decide(big, gate()).action == REJECT
    q = inputs(policy=AdmissionPolicy(target_tps_per_session=9.0, mode="enforced", on_saturation="queue",
                                      queue_timeout_ms=2000))
    d = decide(PLAN, gate(capacity=q))
    assert d.action == HOLD and d.kind == "queued" and d.deadline == pytest.approx(12.0)
    d = decide(PLAN, gate(now=12.5, capacity=q, held_since=10.0))
    assert d.action == REJECT and d.reason == REASON_QUEUE_TIMEOUT and "timed out after 2 s" in d.message
    assert decide(PLAN, gate(capacity=q, can_hold=False)).action == REJECT  # a caller that cannot wait


def test_decide_settling_hold_is_bounded_and_fifo_is_kept():
    settling = inputs(policy=AdmissionPolicy(target_tps_per_session=1.0, mode="enforced", settle_max_ms=500),
                      settle_remaining_s=0.3)
    d = decide(PLAN, gate(capacity=settling))
    assert d.action == HOLD and d.kind == "settling" and d.wake_at == pytest.approx(10.3)
    # held for settle_max_ms + 1 s already: decided without the settling arm
    d = decide(PLAN, gate(now=11.6, capacity=settling, held_since=10.0))
    assert d.action == ADMIT and d.kind == "admitted"
    ok = inputs(policy=AdmissionPolicy(target_tps_per_session=1.0, mode="enforced"))
    d = decide(PLAN, gate(capacity=ok, queued_ahead=2))
    assert d.action == HOLD and d.kind == "behind"
    d = decide(PLAN, gate(capacity=ok, queued_ahead=2, can_hold=False))
    assert d.action == REJECT and "2 requests are queued" in d.message


def test_guarantee_is_checked_against_the_engine_load():
    """N pools that each guarantee one session do not force N sessions past the floor."""
    pol = AdmissionPolicy(target_tps_per_session=9.0, mode="enforced", guarantee_min_sessions=1)
    idle_engine = inputs(policy=pol, n_pool_sessions=0, n_engine_inflight=0)
    assert compute_capacity(idle_engine)["reason"] == REASON_GUARANTEED
    busy_engine = inputs(policy=pol, n_pool_sessions=0, n_engine_inflight=1)  # another pool's session runs
    cap = compute_capacity(busy_engine)
    assert not cap["guaranteed"] and cap["reason"] == REASON_FLOOR
    two = inputs(policy=pol.updated(guarantee_min_sessions=2), n_pool_sessions=1, n_engine_inflight=1)
    assert compute_capacity(two)["reason"] == REASON_GUARANTEED


# ============================================================================ the controller on a scripted core
class Harness:
    def __init__(self, **policy):
        self.t = 0.0
        self.core = core = FakeCore(num_pages=1000, max_context=1000)
        clock = lambda: self.t  # noqa: E731
        self.metrics = Metrics(core, clock=clock, wall_clock=clock)
        self.posted = []
        self.adm = AdmissionController(core, lambda fn, *a: self.posted.append((fn, a)) or Future(), self.metrics,
                                       clock=clock)
        self.pool = core.tree.add(None, 0, list(range(1, 21)))
        self.pool.residency = Residency.RESIDENT
        # these tests script tokens, not engine steps: the drop-based forecast (the adaptive one
        # learns from step events, see test_adaptive_forecast_through_the_controller)
        self.adm.set_policy(self.pool.pool_id, **{"forecast": "conservative", **policy})

    def plan(self, sid, n_prompt=30, max_tokens=100, overcommit=False) -> AdmissionPlan:
        s = self.core.sessions.get(sid)
        return AdmissionPlan(self.pool.pool_id, sid, s is None or s.pool_id != self.pool.pool_id, n_prompt,
                             self.pool.prefix_len, max_tokens, overcommit)

    def submit(self, sid, n_prompt=30, max_tokens=100, overcommit=False) -> Job:
        """What the controller does for a caller that cannot wait: plan, decide, commit (as the core would)."""
        core, pool = self.core, self.pool
        params = SP.greedy(max_tokens)
        plan = self.plan(sid, n_prompt, max_tokens, overcommit)
        d = self.adm.evaluate(plan, self.t)
        if d.action == REJECT:
            raise self.adm.rejected(pool.pool_id, d)
        assert d.action == ADMIT
        s = core.sessions.setdefault(sid, Session(sid))
        job = Job(seq=SeqState(list(range(1, n_prompt + 1))), params=params, emit=lambda ev: None, session=s,
                  prompt_len=n_prompt, max_context=core.max_context)
        job.info = SimpleNamespace(pool_id=pool.pool_id, prompt_tokens=n_prompt, cached_prefix_tokens=20)
        s.job, s.seq, s.pool_id = job, job.seq, pool.pool_id
        pool.sessions.add(sid)
        core.scheduler.waiting.append(job)
        core.emit("submit", job=job)
        self.adm.committed(plan, d, job, self.t)
        return job

    def run(self, t_end, *rates):
        """Decode each (job, tokens/s) at its rate from now until t_end, events in time order."""
        t0 = self.t
        events = []
        for job, r in rates:
            if job in self.core.scheduler.waiting:
                self.core.scheduler.waiting.remove(job)
                self.core.scheduler.running.append(job)
                job.state, job.started = SessionState.DECODE, True
            k = 1
            while t0 + k / r <= t_end + 1e-9:
                events.append((t0 + k / r, id(job), job))
                k += 1
        for t, _, job in sorted(events):
            self.t = t
            job.generated.append(5)
            job.seq.tokens.append(5)
            self.core.emit("token", job=job, now=t)
        self.t = t_end

    def finish(self, job):
        self.core.finish(job)

    def tick(self, t):
        self.t = t
        self.adm.tick(t)

    def steps(self, batch, step_s, n):
        """``n`` pure-decode engine steps of ``batch`` sequences, ``step_s`` each (stats only)."""
        stats = SimpleNamespace(num_seqs=batch, num_decode=batch, num_prefill_tokens=0, num_tokens=batch,
                                total_s=step_s, model_s=step_s)
        for _ in range(n):
            self.core.emit("step", stats=stats)

    def cap(self, **kw):
        return self.adm.capacity(self.pool.pool_id, **kw)

    def events(self, kind):
        return [e for e in self.adm.events if e["event"] == kind]


def test_settle_starts_on_admit_and_ends_by_tokens():
    h = Harness(target_tps_per_session=1.0, settle_tokens=4)
    a = h.submit("a")
    cap = h.cap()
    # a is the pool's first session: admitted by the guarantee, and its admit opens a settle window
    assert cap["settling"] and cap["settle_remaining_ms"] == pytest.approx(5000.0)
    assert cap["n_warming"] == 1 and cap["n_pool_sessions"] == 1
    assert not cap["can_admit"] and cap["reason"] == REASON_SETTLING
    h.run(0.35, (a, 10.0))  # 3 tokens: still settling
    assert h.cap()["settling"] and h.cap()["settle_remaining_ms"] == pytest.approx(5000.0 - 350.0)
    h.run(0.45, (a, 10.0))  # the 4th token
    cap = h.cap()
    assert not cap["settling"] and cap["can_admit"] and cap["reason"] == REASON_OK
    (end,) = h.events("settle_end")
    assert end["by"] == "tokens" and end["tokens"] == 4 and end["drop"] is None  # nothing measured at admit


def test_settle_ends_by_time():
    h = Harness(settle_tokens=1000, settle_max_ms=500)
    a = h.submit("a")
    h.run(0.3, (a, 10.0))
    assert h.cap()["settle_remaining_ms"] == pytest.approx(200.0)
    assert h.adm.next_deadline() == pytest.approx(0.5)  # the step loop sleeps until then at most
    h.tick(0.49)
    assert h.adm.states[h.pool.pool_id].settle is not None
    h.tick(0.5)  # the step loop's tick closes it at the deadline, even if nobody asks
    assert h.adm.next_deadline() is None
    assert h.adm.states[h.pool.pool_id].settle is None
    (end,) = h.events("settle_end")
    assert end["by"] == "time" and end["settle_ms"] == pytest.approx(500.0)


def test_measured_drop_ewma_over_two_admits():
    h = Harness(target_tps_per_session=1.0, settle_tokens=4)
    a = h.submit("a")
    h.run(2.0, (a, 10.0))
    cap = h.cap()
    assert cap["mean_active_tps"] == pytest.approx(10.0) and cap["projected_mean_tps_measured"] is None
    assert cap["projected_mean_tps_model"] == pytest.approx(5.0)  # one batch size seen: n/(n+1)
    b = h.submit("b")
    h.run(3.0, (a, 8.0), (b, 8.0))
    d1 = h.events("settle_end")[-1]
    assert d1["mean_at_admit"] == pytest.approx(10.0)
    assert d1["drop"] == pytest.approx(d1["mean_at_admit"] - d1["mean_settled"]) and d1["drop"] > 0
    st = h.adm.states[h.pool.pool_id]
    assert st.drop_ewma == pytest.approx(d1["drop"]) and st.drop_samples == 1
    cap = h.cap()
    assert cap["projected_mean_tps_measured"] == pytest.approx(cap["mean_active_tps"] - d1["drop"])
    assert cap["projected_mean_tps_if_admitted"] == cap["projected_mean_tps_measured"]
    c = h.submit("c")
    h.run(5.0, (a, 6.0), (b, 6.0), (c, 6.0))
    d2 = h.events("settle_end")[-1]
    assert st.drop_samples == 2 and st.drop_ewma == pytest.approx(0.3 * d2["drop"] + 0.7 * d1["drop"])


def test_admits_while_settling_share_the_drop():
    h = Harness(settle_tokens=4)
    a = h.submit("a")
    h.run(2.0, (a, 10.0))
    b = h.submit("b")
    c = h.submit("c")  # while b's window is open (advisory: nothing stops it)
    assert h.adm.states[h.pool.pool_id].settle.admits == 2
    h.run(3.0, (a, 6.0), (b, 6.0), (c, 6.0))
    end = h.events("settle_end")[-1]
    assert end["admits"] == 2 and end["session_id"] == "c"
    assert end["drop"] == pytest.approx((end["mean_at_admit"] - end["mean_settled"]) / 2)


def test_idle_estimate_through_the_controller():
    h = Harness(target_tps_per_session=6.0, settle_tokens=4)
    a, b = h.submit("a"), h.submit("b")
    h.run(2.0, (a, 8.0), (b, 8.0))
    h.cap()  # measured while active and settled: remembered as the pool's last settled mean
    h.finish(a)
    h.finish(b)  # both between turns (tool calls): attached, nothing decoding
    h.t = 7.0
    cap = h.cap()
    assert cap["n_active"] == 0 and cap["n_pool_sessions"] == 2 and cap["projected_idle_estimate"]
    assert cap["projected_mean_tps_if_admitted"] == pytest.approx(8.0 * 2 / 3, rel=0.02)
    assert not cap["can_admit"] and cap["reason"] == REASON_FLOOR_IDLE
    h.t = 2.0 + 31.0
    cap = h.cap()
    assert not cap["projected_idle_estimate"] and cap["can_admit"]


def test_scripted_gate_reject_continuation_overcommit_and_context_arm():
    h = Harness(target_tps_per_session=9.0, mode="enforced", settle_tokens=4)
    a = h.submit("a")  # guaranteed minimum
    h.run(2.0, (a, 10.0))
    with pytest.raises(PoolSaturatedError) as e:
        h.submit("b")  # projected 10 * 1/2 < 9
    err = e.value
    assert err.status_code == 429 and err.reason == REASON_FLOOR and err.pool_id == h.pool.pool_id
    assert err.retry_after > 0 and err.capacity["projected_mean_tps_if_admitted"] == pytest.approx(5.0)
    assert "b" not in h.core.sessions  # rejected before anything was committed
    h.finish(a)
    h.submit("a")  # a continuation is never gated
    job = h.submit("o", overcommit=True)
    assert job.session.session_id == "o" and h.events("overcommit")
    with pytest.raises(PoolSaturatedError) as e:
        h.submit("big", n_prompt=30, max_tokens=5000, overcommit=True)
    assert e.value.reason == REASON_CONTEXT
    # advisory never rejects, but reports
    h.adm.set_policy(h.pool.pool_id, mode="advisory")
    h.submit("d")
    assert not h.cap()["can_admit"]


def test_adaptive_forecast_through_the_controller():
    h = Harness(target_tps_per_session=6.0, forecast="adaptive", settle_tokens=48)
    a = h.submit("a")
    cap = h.cap()
    # nothing measured at this batch size yet: the conservative model (10 tps is not known either)
    assert cap["forecast"] == "adaptive" and cap["forecast_kind"] == "model" and not cap["can_admit"]
    h.steps(1, 0.1, 20)  # quiet steps: the settle window needs only a few tokens
    h.run(0.45, (a, 10.0))
    cap = h.cap()
    assert not cap["settling"] and cap["forecast_kind"] == "conservative"
    assert cap["projected_mean_tps_if_admitted"] == pytest.approx(5.0)  # a full share: the bound
    assert cap["projected_mean_tps_measured"] == pytest.approx(10 / 1.5)  # half a share: the estimate
    assert cap["can_admit"] and cap["probe"]  # the frontier, and the engine is above the floor now
    b = h.submit("b")
    assert h.adm._settle_tokens(h.adm.states[h.pool.pool_id]) == 4  # sized from the (zero) noise
    h.steps(2, 0.125, 20)
    h.run(1.5, (a, 8.0), (b, 8.0))
    cap = h.cap()
    assert cap["forecast_kind"] == "extrapolated" and cap["projected_mean_tps_measured"] == pytest.approx(10 / 1.5)
    assert cap["can_admit"] and not cap["probe"]  # noiseless points on a line: the bound itself passes
    h.adm.set_policy(h.pool.pool_id, target_tps_per_session=7.0)  # the estimate fails: no probe
    cap = h.cap()
    assert not cap["can_admit"] and cap["reason"] == REASON_FLOOR and not cap["probe"]


def test_known_session_in_capacity():
    h = Harness(target_tps_per_session=9.0, settle_tokens=1)
    a = h.submit("a")
    h.run(1.0, (a, 10.0))
    assert not h.cap()["can_admit"]
    cap = h.cap(session_id="a")
    assert cap["known_session"] and cap["can_admit"]
    assert not h.cap(session_id="zz")["known_session"]


# ============================================================================ on the engine
def test_policy_api_validation_and_readback(engine):
    pool = engine.create_pool(tokens=toks(1, 24))
    pid = pool.pool_id
    assert engine.admission(pid)["mode"] == "advisory"
    got = engine.set_admission(pid, target_tps_per_session=5, mode="enforced", on_saturation="queue",
                               guarantee_min_sessions=2, settle_tokens=16, settle_max_ms=2500)
    assert got == engine.admission(pid)
    assert got["target_tps_per_session"] == 5 and got["on_saturation"] == "queue" and got["settle_tokens"] == 16
    for bad in ({"mode": "x"}, {"target_tps_per_session": -1}, {"settle_tokens": 0}, {"unknown": 1}):
        with pytest.raises(InvalidRequestError):
            engine.set_admission(pid, **bad)
    assert engine.admission(pid) == got  # a rejected update changes nothing
    engine.set_admission(pid, settle_tokens=8)
    assert engine.admission(pid)["settle_tokens"] == 8 and engine.admission(pid)["guarantee_min_sessions"] == 2
    for call in (lambda: engine.set_admission(999, mode="enforced"), lambda: engine.admission(999),
                 lambda: engine.capacity(999)):
        with pytest.raises(PoolNotFoundError):
            call()
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(InvalidRequestError):
            engine.capacity(pid, expected_tokens=bad)


def test_capacity_report_fields_and_context_arm(make_engine):
    eng = make_engine(kv_budget_tokens=512)
    pool = eng.create_pool(tokens=toks(2, 40))
    cap = eng.capacity(pool.pool_id)
    fields = {"can_admit", "reason", "projected_mean_tps_if_admitted", "projected_mean_tps_model",
              "projected_mean_tps_measured", "drop_per_admit_ewma", "headroom_sessions", "kv_headroom_pct",
              "settling", "settle_remaining_ms", "n_warming", "n_pool_sessions", "guaranteed", "known_session",
              "projected_idle_estimate", "compaction_pressure"}
    assert fields <= set(cap)
    assert cap["can_admit"] and cap["guaranteed"] and cap["n_pool_sessions"] == 0
    free = cap["kv_available_cells"]
    assert free == 512 - 40
    assert eng.capacity(pool.pool_id, expected_tokens=free)["can_admit"]
    cap = eng.capacity(pool.pool_id, expected_tokens=free + 1)
    assert not cap["can_admit"] and cap["reason"] == REASON_CONTEXT and not cap["guaranteed"]
    assert 0 < cap["compaction_pressure"] < 1
    eng.generate(toks(2, 40) + toks(3, 200), params=greedy(200), pool_id=pool.pool_id, session_id="big")
    cap = eng.capacity(pool.pool_id, session_id="big")
    assert cap["known_session"] and cap["compaction_pressure"] >= 440 / eng.max_context - 1e-9


def _background(eng, pool_id, sid, n=400, seed=50, min_tokens=20):
    """Stream a long request on the pool in a thread; returns once it decoded ``min_tokens``."""
    got = threading.Event()
    out = {}

    def run():
        try:
            s = eng.stream(toks(9, 24) + toks(seed, 8), params=greedy(n), pool_id=pool_id, session_id=sid)
            k = 0
            for _ in s:
                k += 1
                if k == min_tokens:
                    got.set()
            out["result"] = s.result
        except Exception as e:  # noqa: BLE001
            out["error"] = e
        got.set()

    t = threading.Thread(target=run)
    t.start()
    assert got.wait(60)
    return t, out


@pytest.fixture
def loaded(make_engine):
    """An engine whose pool 'bg' session is decoding, with an impossible floor (1e6 tps)."""
    eng = make_engine()
    pool = eng.create_pool(tokens=toks(9, 24))
    eng.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", settle_tokens=4)
    thread, out = _background(eng, pool.pool_id, "bg")
    yield eng, pool.pool_id
    thread.join(60)
    assert "error" not in out or isinstance(out["error"], Exception)


def test_enforced_reject_under_load(loaded):
    eng, pid = loaded
    with pytest.raises(PoolSaturatedError) as e:
        eng.generate(toks(9, 24) + toks(1, 6), params=greedy(8), pool_id=pid, session_id="new")
    err = e.value
    assert err.status_code == 429 and err.retry_after > 0 and err.reason in FLOOR_REASONS
    assert "new" not in [s["session_id"] for s in eng.tps_snapshot()["sessions"]]
    # continuation: the running session's next turn is never gated
    deadline = time.monotonic() + 60
    while eng.tps_snapshot()["n_warming"] + eng.tps_snapshot()["n_active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    r = eng.generate(toks(9, 24) + toks(50, 8), params=greedy(4), pool_id=pid, session_id="bg")
    assert len(r.token_ids) == 4 and getattr(r.info, "admission", None) is None
    # a request without a pool or on another pool pays nothing
    other = eng.create_pool(tokens=toks(3, 12))
    assert len(eng.generate(toks(3, 12) + [7], params=greedy(2), pool_id=other.pool_id).token_ids) == 2
    assert eng.admission_controller.listener_errors == 0 and eng.metrics.listener_errors == 0


def test_a_session_moving_onto_an_enforced_pool_is_gated(loaded):
    """New to the pool is what counts: a known session that moves onto a saturated pool is refused;
    its next turn on its own pool is a continuation."""
    eng, pid = loaded
    other = eng.create_pool(tokens=toks(3, 12))
    eng.generate(toks(3, 12) + [7], params=greedy(2), pool_id=other.pool_id, session_id="mover")
    assert not eng.capacity(pid, session_id="mover")["known_session"]  # known to the engine, not to this pool
    with pytest.raises(PoolSaturatedError) as e:
        eng.generate(toks(9, 24) + toks(7, 6), params=greedy(4), pool_id=pid, session_id="mover")
    assert e.value.reason in FLOOR_REASONS
    row = next(s for s in eng.tps_snapshot()["sessions"] if s["session_id"] == "mover")
    assert row["pool_id"] == other.pool_id  # refused before anything changed: still on its pool
    r = eng.generate(toks(3, 12) + [7, 8, 9], params=greedy(2), pool_id=other.pool_id, session_id="mover")
    assert r.info.admission is None and r.info.cached_prefix_tokens > 0


def test_enforced_warn_admits_with_sessions_remaining(loaded):
    eng, pid = loaded
    eng.set_admission(pid, on_saturation="warn")
    r = eng.generate(toks(9, 24) + toks(2, 6), params=greedy(6), pool_id=pid, session_id="w")
    adm = r.info.admission
    assert adm["decision"] == "warned" and adm["reason"] in FLOOR_REASONS and "saturated" in adm["warning"]
    assert adm["sessions_remaining"] == 0
    assert any(e["event"] == "warned" for e in eng.admission_events(pid))


def test_overcommit_bypasses_the_floor_not_the_context_arm(make_engine):
    eng = make_engine(kv_budget_tokens=512)
    pool = eng.create_pool(tokens=toks(9, 24))
    eng.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", settle_tokens=4)
    thread, _ = _background(eng, pool.pool_id, "bg", n=300)
    r = eng.generate(toks(9, 24) + toks(4, 6), params=greedy(5), pool_id=pool.pool_id, session_id="oc",
                     overcommit=True)
    assert r.info.admission["decision"] == "overcommit" and len(r.token_ids) == 5
    eng.release_session("oc")
    # 200 more tokens do not fit next to bg's reservation (24 + 8 + 300 of 512 cells): refused even with overcommit
    with pytest.raises(PoolSaturatedError) as e:
        eng.generate(toks(9, 24) + toks(5, 6), params=greedy(200), pool_id=pool.pool_id, session_id="huge",
                     overcommit=True)
    assert e.value.reason == REASON_CONTEXT
    thread.join(60)


def test_queue_holds_fifo_until_capacity_returns_and_times_out(loaded):
    eng, pid = loaded
    eng.set_admission(pid, on_saturation="queue")
    results = {}

    def run(sid):
        try:
            results[sid] = eng.generate(toks(9, 24) + toks(hash(sid) % 100, 6), params=greedy(6), pool_id=pid,
                                        session_id=sid)
        except Exception as e:  # noqa: BLE001
            results[sid] = e

    def wait_for(cond):
        deadline = time.monotonic() + 60
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cond()

    holds = lambda: [e for e in eng.admission_events(pid) if e["event"] == "hold"]  # noqa: E731
    ta = threading.Thread(target=run, args=("qa",))
    ta.start()
    wait_for(lambda: len(holds()) == 1)
    tb = threading.Thread(target=run, args=("qb",))
    tb.start()
    wait_for(lambda: len(holds()) == 2)
    assert eng.capacity(pid)["n_queued"] == 2
    eng.release_session("bg")  # the pool empties: the guarantee admits the head of the queue
    ta.join(60)
    assert results["qa"].info.admission["decision"] == "guaranteed"
    assert results["qa"].info.admission["held_ms"] > 0 and len(results["qa"].token_ids) == 6
    assert "qb" not in results  # still queued behind: qa is attached now, the floor still fails
    eng.release_session("qa")
    tb.join(60)
    assert results["qb"].info.admission["decision"] == "guaranteed"
    # timeout: a clear 429 when capacity does not return in time
    eng.set_admission(pid, queue_timeout_ms=100)
    with pytest.raises(PoolSaturatedError, match="timed out"):
        eng.generate(toks(9, 24) + [3, 4], params=greedy(2), pool_id=pid, session_id="late")
    assert eng.capacity(pid)["n_queued"] == 0


def test_settling_is_a_bounded_hold_not_a_reject(make_engine):
    eng = make_engine()
    pool = eng.create_pool(tokens=toks(9, 24))
    # conservative: a settle window of settle_tokens (the adaptive one closes once the noise allows)
    eng.set_admission(pool.pool_id, target_tps_per_session=1e-3, mode="enforced", settle_tokens=1_000_000,
                      settle_max_ms=150, forecast="conservative")
    thread, _ = _background(eng, pool.pool_id, "first", n=400, min_tokens=1)
    r = eng.generate(toks(9, 24) + toks(6, 6), params=greedy(4), pool_id=pool.pool_id, session_id="second")
    adm = r.info.admission
    assert adm["decision"] == "admitted" and adm["held_ms"] > 0
    assert [e["kind"] for e in eng.admission_events(pool.pool_id) if e["event"] == "hold"] == ["settling"]
    # the hold's deadline is driven by the step loop: there is no timer thread
    assert not [t for t in threading.enumerate() if t.name == "opencoti-admission"]
    thread.join(60)


def test_settle_windows_on_a_pool_without_a_floor_measure_but_never_block(make_engine):
    eng = make_engine()
    pool = eng.create_pool(tokens=toks(9, 24))
    eng.set_admission(pool.pool_id, mode="enforced", settle_tokens=1_000_000, settle_max_ms=60_000)
    thread, _ = _background(eng, pool.pool_id, "first", n=300, min_tokens=1)
    cap = eng.capacity(pool.pool_id)
    assert cap["measuring"] and not cap["settling"] and cap["settle_remaining_ms"] > 0
    assert cap["can_admit"] and cap["reason"] == REASON_OK
    r = eng.generate(toks(9, 24) + toks(6, 6), params=greedy(4), pool_id=pool.pool_id, session_id="second")
    assert r.info.admission["decision"] == "admitted" and r.info.admission["held_ms"] == 0.0
    assert not [e for e in eng.admission_events(pool.pool_id) if e["event"] == "hold"]
    # advisory pool without any policy: the same, and the report never says "settling"
    other = eng.create_pool(tokens=toks(3, 12))
    eng.generate(toks(3, 12) + [5], params=greedy(2), pool_id=other.pool_id, session_id="o1")
    cap = eng.capacity(other.pool_id)
    assert not cap["settling"] and cap["can_admit"]
    thread.join(60)


def test_shutdown_fails_held_requests(make_engine):
    eng = make_engine()
    pool = eng.create_pool(tokens=toks(9, 24))
    eng.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", on_saturation="queue",
                      settle_tokens=1)
    eng.generate(toks(9, 24) + [1], params=greedy(3), pool_id=pool.pool_id, session_id="a")
    out = {}

    def run():
        try:
            eng.generate(toks(9, 24) + [2], params=greedy(3), pool_id=pool.pool_id, session_id="b")
        except Exception as e:  # noqa: BLE001
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while eng.capacity(pool.pool_id)["n_queued"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.check_integrity()
    eng.shutdown()
    t.join(60)
    assert isinstance(out["e"], EngineClosedError)


def test_async_cancel_of_a_held_request(make_engine):
    import asyncio

    eng = make_engine()
    pool = eng.create_pool(tokens=toks(9, 24))
    eng.set_admission(pool.pool_id, target_tps_per_session=1e6, mode="enforced", on_saturation="queue",
                      settle_tokens=1)
    eng.generate(toks(9, 24) + [1], params=greedy(3), pool_id=pool.pool_id, session_id="a")

    async def main():
        task = asyncio.ensure_future(eng.agenerate(toks(9, 24) + [2], params=greedy(3), pool_id=pool.pool_id,
                                                   session_id="b"))
        for _ in range(6000):
            if eng.capacity(pool.pool_id)["n_queued"] or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    eng.release_session("a")
    deadline = time.monotonic() + 60
    while eng.capacity(pool.pool_id)["n_queued"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.capacity(pool.pool_id)["n_queued"] == 0
    assert "b" not in [s["session_id"] for s in eng.tps_snapshot()["sessions"]]  # never admitted


def test_pool_state_settle_remaining():
    st = PoolState(1)
    assert st.settle_remaining_s(0.0) is None
    st.start_settle(10.0, "x", 5.0)
    assert st.settle_remaining_s(12.0) == pytest.approx(3.0) and st.settle_remaining_s(20.0) == 0.0
    row = st.end_settle(12.0, 4.0, fold=True)
    assert row["drop"] == pytest.approx(1.0) and st.last_settled_mean == 4.0 and st.settle is None
