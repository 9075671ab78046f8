"""The admission simulator and the adaptive forecast (opencoti.sim, admission.forecast).

The simulator reproduces the step costs measured on this machine; the step-time forecast behaves
as documented; and on every profile the adaptive policy meets the targets against the naive rule
on a few fixed seeds (the benchmark runs 20+; every number here is simulated, no timing asserts).
"""

from __future__ import annotations

import math
import random

import pytest

from opencoti.engine.admission import AdmissionPolicy, CapacityInputs, compute_capacity
from opencoti.engine.admission.forecast import StepForecast
from opencoti.engine.errors import InvalidRequestError
from opencoti.sim.profile import StepClock, StepProfile, fit_profile, profile_names
from opencoti.sim.ramp import compare, run_ramp

MEASURED = "epyc-2core-avx2"


# ============================================================================ the simulator
def test_profiles_ship_the_four_kinds():
    names = profile_names()
    assert MEASURED in names and {"avx512-fast-cpu", "gpu-knee", "bursty-neighbour"} <= set(names)
    assert StepProfile.load(MEASURED).source == "measured"
    gpu = StepProfile.load("gpu-knee")
    assert gpu.cost_s(1) == pytest.approx(gpu.cost_s(gpu.knee))  # flat up to the knee
    assert gpu.cost_s(gpu.knee + 4) > gpu.cost_s(gpu.knee) * 1.5


def test_simulator_reproduces_the_measured_step_costs_within_10_percent():
    prof = StepProfile.load(MEASURED)
    assert len(prof.measured_mean_s) >= 4
    for b, measured in prof.measured_mean_s.items():
        clock = StepClock(prof, seed=b)
        n = 20_000
        mean = sum(clock.step(0.0, b, 0, b * prof.ctx_ref) for _ in range(n)) / n
        assert mean == pytest.approx(measured, rel=0.10), f"batch {b}"


def test_fit_recovers_a_known_profile():
    truth = StepProfile(name="t", base_s=0.02, seq_s=0.006, ctx_s=1e-6, prefill_s=0.0004, noise_sigma=0.08,
                        stall_prob=0.02, stall_mean_s=0.1)
    clock, rng = StepClock(truth, seed=3), random.Random(4)
    records = []
    for b in range(1, 7):
        for i in range(400):
            ctx = b * (50 + i // 4)
            prefill = 30 if rng.random() < 0.05 else 0
            records.append({"b": b, "prefill": prefill, "ctx_sum": ctx, "total_s": clock.step(0.0, b, prefill, ctx)})
    fit = fit_profile(records, "fit")
    assert fit.noise_sigma == pytest.approx(0.08, rel=0.3)
    # stalls shorter than the threshold (2x the median) cannot be told from noise: fewer are counted
    assert 0.4 * 0.02 <= fit.stall_prob <= 1.2 * 0.02 and fit.stall_mean_s > 0.05
    for b in range(1, 7):  # the fitted profile's mean step matches the truth's
        ctx = b * 100
        assert fit.expected_step_s(b, ctx) == pytest.approx(truth.expected_step_s(b, ctx), rel=0.1)


def test_the_simulation_is_deterministic_under_a_seed():
    prof = StepProfile.load("avx512-fast-cpu")
    a, b = run_ramp(prof, "ours", 5), run_ramp(prof, "ours", 5)
    assert a.row() == b.row()
    assert run_ramp(prof, "ours", 6).row() != a.row()


# ============================================================================ the forecast
def feed(fc: StepForecast, b: int, mean: float, n: int = 40, cv: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        fc.observe(b, 0, mean * (1 + cv * rng.gauss(0, 1)))


def test_forecast_kinds_and_bounds():
    fc = StepForecast()
    assert fc.project(1).kind == "none"
    feed(fc, 1, 0.02)
    pr = fc.project(1)  # one size seen: a full share per session is the bound, half a share the estimate
    assert pr.kind == "conservative" and pr.frontier
    assert pr.bound_s == pytest.approx(0.04) and pr.est_s == pytest.approx(0.03)
    feed(fc, 2, 0.025)
    pr = fc.project(2)  # two sizes: a line, bounded above the estimate
    assert pr.kind == "extrapolated" and pr.frontier and pr.est_s == pytest.approx(0.03)
    assert pr.bound_s >= pr.est_s
    pr = fc.project(1)  # a size measured: its own statistics (still thin: it may be probed again)
    assert pr.kind == "measured" and pr.frontier and pr.est_s == pytest.approx(0.025)
    feed(fc, 2, 0.025, n=200)
    assert not fc.project(1).frontier
    fc.observe(3, 12, 0.5)  # a step with prompt tokens is not a decode sample
    assert 3 not in fc.stats
    # a knee: the local slope of the two largest sizes, not the flat average, extrapolates
    knee = StepForecast()
    for b in range(1, 9):
        feed(knee, b, 0.012)
    feed(knee, 9, 0.0145)
    feed(knee, 10, 0.017)
    assert knee.project(10).est_s == pytest.approx(0.0195)


def test_noisier_steps_give_wider_bounds_and_longer_settle_windows():
    quiet, noisy = StepForecast(), StepForecast()
    for b in (1, 2, 3):
        feed(quiet, b, 0.01 * (1 + b), cv=0.02, seed=b)
        feed(noisy, b, 0.01 * (1 + b), cv=0.25, seed=b)
    assert noisy.project(3).bound_s - noisy.project(3).est_s > 3 * (quiet.project(3).bound_s - quiet.project(3).est_s)
    assert quiet.settle_tokens(3, cap=48) < noisy.settle_tokens(3, cap=48) == 48
    assert quiet.settle_tokens(3, cap=48) >= 4


def test_capacity_probe_and_uncertain_hold():
    pol = AdmissionPolicy(target_tps_per_session=30.0)
    base = dict(policy=pol, mean=40.0, n_active=2, n_decoding=2, n_pool_sessions=2, n_engine_inflight=2,
                available_cells=1000, free_cells=1000, total_cells=1000, marginal_tokens=100, fc_now_tps=40.0)
    # estimate and bound above the floor: admit
    cap = compute_capacity(CapacityInputs(**base, fc_kind="measured", fc_est_tps=36.0, fc_bound_tps=34.0,
                                          fc_headroom=1))
    assert cap["can_admit"] and cap["projected_mean_tps_if_admitted"] == 34.0 and cap["forecast_kind"] == "measured"
    # the bound below the floor on a measured size: hold, the drop is uncertain
    cap = compute_capacity(CapacityInputs(**base, fc_kind="measured", fc_est_tps=32.0, fc_bound_tps=28.0))
    assert not cap["can_admit"] and cap["reason"] == "next admit may cross the floor (uncertain drop)"
    # the same at the frontier (never measured): a probe
    cap = compute_capacity(CapacityInputs(**base, fc_kind="extrapolated", fc_est_tps=32.0, fc_bound_tps=28.0,
                                          fc_frontier=True))
    assert cap["can_admit"] and cap["probe"]
    cap = compute_capacity(CapacityInputs(**base, fc_kind="extrapolated", fc_est_tps=29.0, fc_bound_tps=25.0,
                                          fc_frontier=True))
    assert not cap["can_admit"] and cap["reason"] == "projected mean tps below floor"
    # the conservative forecast ignores the step statistics
    cons = compute_capacity(CapacityInputs(**{**base, "policy": pol.updated(forecast="conservative")},
                                           fc_kind="measured", fc_est_tps=36.0, fc_bound_tps=34.0))
    assert cons["projected_mean_tps_if_admitted"] == pytest.approx(40 * 2 / 3) and not cons["can_admit"]
    with pytest.raises(InvalidRequestError):
        pol.updated(forecast="optimistic")


# ============================================================================ the targets
TARGETS = {"under_ratio": 0.5, "deep_ratio": 0.2, "overshoot_max": 1, "wall_ratio": 1.15}
# Where a target is out of reach, the limit asserted is the current result with a little room, so a
# regression still fails (docs/benchmarks.md gives the numbers over 20 seeds and the oracle's):
# * epyc-2core-avx2 (this loaded machine): even the oracle, which keeps exactly ``fit`` sessions,
#   needs 1.15x naive's wall time (naive runs more sessions, and aggregate tps still grows there).
# * bursty-neighbour: sessions admitted in a calm spell see the next burst; overshoot up to 3 and
#   ~0.55x naive's under-floor time; the oracle itself needs 1.39x naive's wall time.
LIMITS = {
    "avx512-fast-cpu": TARGETS,
    "gpu-knee": TARGETS,
    "epyc-2core-avx2": {**TARGETS, "wall_ratio": 1.3},
    "bursty-neighbour": {"under_ratio": 0.65, "deep_ratio": 0.4, "overshoot_max": 3, "wall_ratio": 1.6},
}


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_adaptive_policy_against_naive(name):
    c = compare(StepProfile.load(name), seeds=[0, 1])
    got = {k: c[k] for k in TARGETS}
    assert all(got[k] <= v for k, v in LIMITS[name].items()), got
    assert not math.isinf(c["wall_ratio"])
