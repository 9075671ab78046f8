"""The admission simulator and the adaptive forecast (opencoti.sim, admission.forecast).

The simulator reproduces the step costs measured on this machine; the step-time forecast behaves
as documented; and on every profile the adaptive policy meets the targets against the naive rule
on a few fixed seeds (the benchmark runs 20+; every number here is simulated, no timing asserts).
"""

from __future__ import annotations

import math
import random
import types

import pytest

from opencoti.engine.admission import AdmissionPolicy, CapacityInputs, compute_capacity
from opencoti.engine.admission.forecast import StepForecast
from opencoti.engine.errors import InvalidRequestError
from opencoti.sim.bounds import burst_multiplier, wall_lower_bound
from opencoti.sim.profile import StepClock, StepProfile, fit_profile, profile_names
from opencoti.sim.ramp import RampConfig, compare, run_ramp, wall_bound

MEASURED = "epyc-2core-avx2"


# ============================================================================ the simulator
def test_profiles_ship_the_four_kinds():
    names = profile_names()
    assert MEASURED in names and {"avx512-fast-cpu", "gpu-knee", "bursty-neighbour"} <= set(names)
    assert StepProfile.load(MEASURED).source == "measured"
    gpu = StepProfile.load("gpu-knee")
    assert gpu.cost_s(1) == pytest.approx(gpu.cost_s(gpu.knee))  # flat up to the knee
    assert gpu.cost_s(gpu.knee + 4) > gpu.cost_s(gpu.knee) * 1.5


@pytest.mark.parametrize("name", [MEASURED, "epyc-2core-avx2-bf16", "epyc-2core-avx2-loaded"])
def test_simulator_reproduces_the_measured_step_costs_within_10_percent(name):
    prof = StepProfile.load(name)
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


def test_an_idle_engine_that_measured_one_size_projects_a_full_share_from_it():
    """Sessions that ran one at a time measured size 1 only; with nothing in flight the projection
    to n sessions is the conservative full share from size 1 (it was "none": no headroom past one)."""
    fc = StepForecast()
    feed(fc, 1, 0.02)
    assert fc.project(0, 1).kind == "measured"
    pr = fc.project(0, 4)
    assert pr.kind == "conservative" and pr.frontier
    assert pr.bound_s == pytest.approx(0.08) and pr.est_s == pytest.approx(0.05)
    two = StepForecast()
    feed(two, 2, 0.03)
    assert two.project(0, 1).kind == "none"  # fewer sessions than the size seen: no full-share bound from it
    assert two.project(0, 3).bound_s == pytest.approx(0.045)


def test_noisier_steps_give_wider_bounds_and_longer_settle_windows():
    quiet, noisy = StepForecast(), StepForecast()
    for b in (1, 2, 3):
        feed(quiet, b, 0.01 * (1 + b), cv=0.02, seed=b)
        feed(noisy, b, 0.01 * (1 + b), cv=0.25, seed=b)
    assert noisy.project(3).bound_s - noisy.project(3).est_s > 3 * (quiet.project(3).bound_s - quiet.project(3).est_s)
    assert quiet.settle_tokens(3, cap=48) < noisy.settle_tokens(3, cap=48) == 48
    assert quiet.settle_tokens(3, cap=48) >= 4


def test_stalls_are_pooled_so_batch_sizes_can_be_told_apart():
    """Rare long stalls (an OS preemption, a neighbour) do not depend on the batch size: they go to
    the engine-wide excess, so each batch size's level keeps the spread of its ordinary steps."""
    rng = random.Random(7)
    fc = StepForecast()
    raw = {3: [], 4: []}
    for i in range(600):
        b = 3 + i % 2
        x = (0.40 if b == 3 else 0.45) * math.exp(rng.gauss(0, 0.1))
        if rng.random() < 0.07:
            x += rng.expovariate(1.0)  # a stall of 1 s on average
        raw[b].append(x)
        fc.observe(b, 0, x)
    st3, st4 = fc.stats[3], fc.stats[4]
    # a level keeps the part of a stall under the threshold (2x the level): a little above the plain steps
    assert 0.40 <= st3.slow <= 0.40 * 1.12 and 0.45 <= st4.slow <= 0.45 * 1.12
    assert fc.stall_s == pytest.approx(0.07, rel=0.5)  # the mean excess per step, whatever the batch
    for b, st in ((3, st3), (4, st4)):  # expected step = level + excess = the raw mean
        assert fc.step_s(st) == pytest.approx(sum(raw[b]) / len(raw[b]), rel=0.1)
        mean = sum(raw[b]) / len(raw[b])
        raw_cv = math.sqrt(sum((x - mean) ** 2 for x in raw[b]) / len(raw[b])) / mean
        assert st.cv < 0.5 * raw_cv
    # 12 % apart, told apart: the bound at 4 is below the estimate at 3 grown by 20 %
    pr = fc.project(3)
    assert pr.kind == "measured" and pr.est_s < pr.bound_s < 1.2 * pr.now_s


def test_context_growth_is_not_read_as_the_cost_of_the_batch_size():
    """Contexts grow while sessions decode: with the context each step attended, the forecast learns
    the step time per context token (pooled over batch sizes) and moves every level to the context
    of now, so a batch size measured while its sessions were long is not judged slower than it is."""
    rng = random.Random(3)
    k, base = 2e-4, {2: 0.30, 3: 0.33}  # 0.2 ms per context token attended
    fc, blind = StepForecast(), StepForecast()
    for b, c0 in ((2, 60), (3, 60)):
        for i in range(400):  # each size measured while its sessions grew from 60 to 460 tokens
            ctx = b * (c0 + i)
            x = (base[b] + k * ctx) * math.exp(rng.gauss(0, 0.1))
            fc.observe(b, 0, x, ctx)
            blind.observe(b, 0, x)
    assert fc.ctx.slope == pytest.approx(k, rel=0.25)
    assert blind.ctx.slope == 0.0  # no context given: no context model
    # now: two sessions of 100 tokens, a new one of 100: the truth is 0.33 + 3 * 100 * k = 0.39 s
    pr = fc.project(2, 1, ctx_now=200, ctx_new=100)
    assert pr.est_s == pytest.approx(0.39 * math.exp(0.005), rel=0.06)
    assert pr.now_s == pytest.approx((0.30 + 200 * k) * math.exp(0.005), rel=0.06)
    # the same levels read without the context: the long sessions' cost counted as the batch size's
    assert blind.project(2).est_s > 1.3 * pr.est_s
    # a new session with a longer context costs more
    assert fc.project(2, 1, ctx_now=200, ctx_new=1000).est_s == pytest.approx(pr.est_s + 900 * fc.ctx.slope)
    # a new session far shorter than those in flight: one more session is still never cheaper than now
    short = fc.project(2, 1, ctx_now=2000, ctx_new=0)
    assert short.est_s >= short.now_s and short.bound_s >= short.now_s
    # no steady slope where the step time does not depend on the context
    flat = StepForecast()
    for i in range(600):
        flat.observe(2, 0, 0.3 * math.exp(rng.gauss(0, 0.1)), 2 * (60 + i))
    assert flat.ctx.slope < 0.1 * k


def test_a_projection_to_short_new_contexts_never_costs_nothing():
    """This pool's sessions shorter than the engine's other sessions in flight, the batch size now
    never measured, and a steep early slope: the headroom loop projects up to 64 sessions more, and
    the shift to the new sessions' short contexts once drove the step time to 0 s (the loop then
    divided by it). A shift takes at most half a projection off, as a level moved along the slope
    does, and the headroom loop never divides by a step time of 0."""
    fc = StepForecast()
    for b, ctx, n in ((1, 70, 19), (2, 190, 48)):
        for i in range(n):
            fc.observe(b, 0, 0.51 * math.exp(0.05 * math.sin(i)), ctx + i)
    fc.ctx = types.SimpleNamespace(slope=6.7e-4)  # an early, steep slope
    for k in (1, 8, 44, 64):
        pr = fc.project(3, k, ctx_now=304, ctx_new=40)  # size 3 unmeasured
        unshifted = fc.project(3, k, ctx_now=304, ctx_new=304 / 3)
        assert pr.now_s is None and pr.est_s >= 0.5 * unshifted.est_s > 0
        assert pr.bound_s >= 0.5 * unshifted.bound_s > 0


def test_a_stall_among_the_first_steps_does_not_set_the_level():
    fc = StepForecast()
    for x in (0.1, 0.1, 0.11, 2.5, 0.09, 0.1, 0.1, 0.1, 0.1, 0.1):
        fc.observe(2, 0, x)
    assert 0.1 <= fc.stats[2].slow < 0.12  # the raw mean is 0.35
    assert fc.stall_s > 0


def test_a_batch_size_measured_before_settles_at_once():
    """Settle windows wait for the steps the noise asks for beyond those measured at that size
    already: a batch coming back to a size it had (sessions ended, new ones admitted) is known."""
    fc = StepForecast()
    feed(fc, 3, 0.03, n=100, cv=0.2, seed=4)
    assert fc.need_steps(3, 48) == 48 and fc.settle_tokens(3, 48) == 48  # a size never measured before
    assert fc.settle_tokens(3, 48, have=fc.measured_steps(3)) == 4  # MIN_SETTLE_TOKENS
    assert fc.settle_tokens(3, 48, have=30) == 18
    assert fc.measured_steps(4) == 0
    assert fc.settle_tokens(3, 2) == fc.settle_tokens(3, 2, have=100) == 2  # the policy's settle_tokens caps it


def test_calibration_is_not_biased_by_noisy_samples():
    """A steady sample (mean tps over a short window x the step time) is above 1 when its window held
    no stall and below when it held one: clipping only the high ones would bias the average low."""
    fc = StepForecast()
    feed(fc, 2, 0.1)
    for i in range(200):
        fc.calibrate((1.2 if i % 2 else 0.8) / fc.step_s(fc.stats[2], fast=True), 2)
    assert fc.calibration == pytest.approx(1.0, abs=0.03)  # clipping at 1 gave ~0.9
    for _ in range(200):
        fc.calibrate(0.85 / fc.step_s(fc.stats[2], fast=True), 2)
    assert fc.calibration == pytest.approx(0.85, abs=0.01)
    for _ in range(200):  # never more than one token per step
        fc.calibrate(1.4 / fc.step_s(fc.stats[2], fast=True), 2)
    assert fc.calibration == 1.0


def test_the_frontier_is_entered_only_from_a_size_measured_to_precision():
    pol = AdmissionPolicy(target_tps_per_session=30.0)
    base = dict(policy=pol, mean=40.0, n_active=2, n_decoding=2, n_pool_sessions=2, n_engine_inflight=2,
                available_cells=1000, free_cells=1000, total_cells=1000, marginal_tokens=100, fc_now_tps=40.0,
                fc_kind="extrapolated", fc_frontier=True)
    ok = compute_capacity(CapacityInputs(**base, fc_est_tps=37.0, fc_bound_tps=34.0, fc_headroom=1))
    assert ok["can_admit"] and ok["sessions_remaining"] == 1
    thin = compute_capacity(CapacityInputs(**base, fc_est_tps=37.0, fc_bound_tps=34.0, fc_headroom=1, fc_thin=True))
    assert not thin["can_admit"] and thin["reason"] == "batch size not yet measured enough"
    assert thin["sessions_remaining"] == 0
    probe = dict(base, fc_est_tps=37.0, fc_bound_tps=28.0)  # a probe, unless the current size is thin
    assert compute_capacity(CapacityInputs(**probe))["probe"]
    cap = compute_capacity(CapacityInputs(**probe, fc_thin=True))
    assert not cap["probe"] and not cap["can_admit"]
    # a measured size inside the curve is not the frontier: thin or not, the bound decides
    inner = dict(base, fc_frontier=False, fc_kind="measured", fc_est_tps=37.0, fc_bound_tps=34.0)
    assert compute_capacity(CapacityInputs(**inner))["can_admit"]


def test_a_settle_window_that_ran_out_of_time_leaves_the_frontier_closed():
    """On the simulated engine: a noisy step time needs 48 steps for 3 % precision, a settle window
    ends by time after ~10; a size never measured is not extrapolated to from the thin one until it
    has them."""
    from opencoti.engine.config import SamplingParams
    from opencoti.sim.engine import SimEngine

    prof = StepProfile(name="t", table={1: 0.05, 2: 0.05, 3: 0.05}, noise_sigma=0.2, prefill_s=0.0)
    sim = SimEngine(prof, seed=1)
    pid = sim.core.add_pool(40).pool_id
    adm = sim.admission
    adm.set_policy(pid, target_tps_per_session=1.0, settle_max_ms=500)
    params = SamplingParams.greedy(2000, ignore_eos=True)

    def spawn(sid):
        assert adm.capacity(pid)["can_admit"]
        adm.submit(list(range(1, 61)), params, lambda ev: None, session_id=sid, pool_id=pid).result()

    spawn("a")
    sim.run_until(4.0)  # size 1: ~80 steps
    spawn("b")
    sim.run_until(4.8)  # the window (0.5 s, ~10 steps at size 2) closed by time
    fc = adm.forecast
    assert 6 <= fc.stats[2].n < fc.settle_tokens(2, 48) == 48
    cap = adm.capacity(pid)
    assert cap["forecast_kind"] == "extrapolated" and not cap["settling"]
    assert cap["projected_mean_tps_if_admitted"] > 1.0  # the bound passes, but size 2 is thin:
    assert not cap["can_admit"] and cap["reason"] == "batch size not yet measured enough"
    assert cap["sessions_remaining"] == 0
    sim.run_until(8.0)
    assert fc.stats[2].n >= 48 and adm.capacity(pid)["can_admit"]


def test_a_size_measured_over_few_steps_is_blended_with_the_line_through_the_others():
    """A probe's short window that came out slow (stalls, a noisy draw) does not close that size:
    its few steps are weighed against the line through the sizes measured well, by precision; once
    it is measured over THIN steps, its own level alone counts."""
    from opencoti.engine.admission.forecast import THIN

    fc = StepForecast()
    for b in (1, 2, 3):
        feed(fc, b, 0.020, n=300, cv=0.1, seed=b)
    feed(fc, 4, 0.030, n=8, cv=0.3, seed=4)  # an unlucky short window: 50 % over the flat curve
    raw = fc.stats[4].mean + fc.stall_s
    pr = fc.project(3)
    assert pr.kind == "measured" and pr.frontier  # thin: it may be probed again
    assert 0.020 < pr.est_s < 0.5 * (0.020 + raw), (pr.est_s, raw)  # nearer the line than its own mean
    assert pr.est_s < pr.bound_s < raw + 2 * fc.se(fc.stats[4])
    feed(fc, 4, 0.030, n=THIN, cv=0.3, seed=5)  # measured for real: the knee is its own
    pr = fc.project(3)
    assert not pr.frontier and pr.est_s == pytest.approx(fc.stats[4].slow + fc.stall_s)


def test_being_above_the_floor_now_is_judged_on_the_level_not_on_the_stalls():
    """The stall excess is engine-wide (its uncertainty is the same at every batch size): the lower
    bound on the tps now that a probe needs is the level's, with the stalls at their mean."""
    fc = StepForecast()
    feed(fc, 1, 0.4, n=12, cv=0.1, seed=1)
    fc.observe(1, 0, 4.0)  # one long stall among few steps: a wide standard error of the stall mean
    pr = fc.project(1)
    st = fc.stats[1]
    assert fc.stalls.se(0.002) > 5 * st.se_slow
    assert pr.now_hi_s == pytest.approx(pr.now_s + fc.z * st.se_slow)
    assert pr.now_s == pytest.approx(st.slow + fc.stall_s)


def test_no_admit_from_a_probed_size_before_it_is_measured():
    """A probe whose settle window ran out of time leaves a batch size with no steps of its own: the
    model's full share from a few steps' mean tps (here 50 * 5 / 6 = 41.7 > 30) does not admit a
    second session past the probe; a size inside the curve without steps (another pool's sessions)
    still falls back to the model."""
    pol = AdmissionPolicy(target_tps_per_session=30.0)
    base = dict(policy=pol, mean=50.0, n_active=5, n_decoding=5, n_pool_sessions=5, n_engine_inflight=5,
                available_cells=1000, free_cells=1000, total_cells=1000, marginal_tokens=100, fc_kind="unmeasured")
    cap = compute_capacity(CapacityInputs(**base, fc_frontier=True))
    assert not cap["can_admit"] and cap["reason"] == "batch size not yet measured enough"
    assert cap["sessions_remaining"] == 0
    inner = compute_capacity(CapacityInputs(**base, fc_frontier=False))
    assert inner["can_admit"] and inner["projected_mean_tps_if_admitted"] == pytest.approx(50 * 5 / 6)
    # no floor: nothing to hold for
    free = compute_capacity(CapacityInputs(**{**base, "policy": AdmissionPolicy()}, fc_frontier=True))
    assert free["can_admit"]


def test_wall_bound_is_the_linear_programme():
    # 3 tasks x 10 tokens, at most 2 in flight: one lane runs two tasks back to back (20 steps); the
    # cheapest 30 session-steps in 20 steps: 10 steps of 2 sessions (1.2 s) + 10 of 1 (1.0 s)
    p = StepProfile(name="t", table={1: 1.0, 2: 1.2, 3: 1.3}, noise_sigma=0.0, prefill_s=0.0)
    b = wall_lower_bound(p, tasks=3, tokens=10, k=2, prompt_tokens=5, cached_tokens=4)
    assert b["wall_s"] == pytest.approx(22.0) and b["batches"] == {1: pytest.approx(10), 2: pytest.approx(10)}
    assert wall_lower_bound(p, tasks=3, tokens=10, k=3, prompt_tokens=5, cached_tokens=4)["wall_s"] == \
        pytest.approx(13.0)  # all three at once
    noisy = StepProfile(name="n", table={1: 1.0, 2: 1.2}, noise_sigma=0.2, prefill_s=0.0, stall_prob=0.1,
                        stall_mean_s=0.5, burst_factor=2.0, burst_on_mean_s=1.0, burst_off_mean_s=3.0)
    nb = wall_lower_bound(noisy, tasks=3, tokens=10, k=2, prompt_tokens=5, cached_tokens=4)
    assert nb["wall_s"] > 22.0 * noisy.mean_factor() * burst_multiplier(noisy)
    with pytest.raises(ValueError):
        wall_lower_bound(p, tasks=0, tokens=10, k=2, prompt_tokens=5, cached_tokens=4)


@pytest.mark.parametrize("name", ["epyc-2core-avx2", "gpu-knee"])
def test_no_run_beats_the_wall_bound(name):
    """The bound holds for the clairvoyant schedules too (fit and fit + 1 in flight, noise and all)."""
    prof = StepProfile.load(name)
    cfg = RampConfig.for_profile(prof)
    for policy, extra in (("oracle", 0), ("oracle+1", 1)):
        walls = [run_ramp(prof, policy, seed, cfg).wall_s for seed in (0, 1)]
        assert sum(walls) / len(walls) >= 0.97 * wall_bound(prof, cfg, extra)["wall_s"]


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
    # at the frontier (never measured): a probe, when the estimate clears the floor by enough of its
    # uncertainty (PROBE_MARGIN of estimate - bound) ...
    cap = compute_capacity(CapacityInputs(**base, fc_kind="extrapolated", fc_est_tps=37.0, fc_bound_tps=28.0,
                                          fc_frontier=True))
    assert cap["can_admit"] and cap["probe"]
    # ... but not a coin flip (estimate 32, bound 28, floor 30)
    cap = compute_capacity(CapacityInputs(**base, fc_kind="extrapolated", fc_est_tps=32.0, fc_bound_tps=28.0,
                                          fc_frontier=True))
    assert not cap["can_admit"] and not cap["probe"] and cap["reason"] == "next admit may cross the floor (uncertain drop)"
    # nor from a batch size not known to be above the floor now (its lower bound is under it)
    cap = compute_capacity(CapacityInputs(**base, fc_kind="extrapolated", fc_est_tps=37.0, fc_bound_tps=28.0,
                                          fc_frontier=True, fc_now_low_tps=29.0))
    assert not cap["can_admit"] and not cap["probe"]
    cap = compute_capacity(CapacityInputs(**base, fc_kind="extrapolated", fc_est_tps=29.0, fc_bound_tps=25.0,
                                          fc_frontier=True))
    assert not cap["can_admit"] and cap["reason"] == "projected mean tps below floor"
    # the conservative forecast ignores the step statistics
    cons = compute_capacity(CapacityInputs(**{**base, "policy": pol.updated(forecast="conservative")},
                                           fc_kind="measured", fc_est_tps=36.0, fc_bound_tps=34.0))
    assert cons["projected_mean_tps_if_admitted"] == pytest.approx(40 * 2 / 3) and not cons["can_admit"]
    with pytest.raises(InvalidRequestError):
        pol.updated(forecast="optimistic")


# ============================================================================ the LangGraph gate
@pytest.mark.parametrize("name", ["epyc-2core-avx2", "gpu-knee"])
def test_the_langgraph_gate_follows_the_controller_and_batches_within_the_targets(name):
    """CapacityGateNode + SpawnPacer (their decision code, driven on the simulated clock) spawn
    every task, the first spawns no later than the controller alone does (a measured headroom
    opens a batch that skips the settle windows), never overshooting more, and the fan-out still
    meets the simulator's targets against naive on the same seeds."""
    prof, seeds = StepProfile.load(name), [0, 1, 2, 3]
    for seed in seeds:
        ours, gate = run_ramp(prof, "ours", seed), run_ramp(prof, "gate", seed)
        assert len(gate.spawns) == RampConfig.for_profile(prof).tasks
        assert gate.spawns[:3] == ours.spawns[:3]  # nothing measured yet: the controller's own probes
        assert sum(gate.spawns) <= sum(ours.spawns) + 1e-6, (gate.spawns, ours.spawns)
        assert gate.overshoot <= ours.overshoot
    c = compare(prof, seeds, policy="gate")
    for k, limit in TARGETS.items():
        assert c[k] <= limit, (k, c[k])


# ============================================================================ the targets
TARGETS = {"under_ratio": 0.5, "deep_ratio": 0.2, "overshoot_max": 1, "wall_ratio": 1.15}
# What is not met on the benchmark's 20 seeds, and why (docs/benchmarks.md gives the numbers):
# * bursty-neighbour, wall: no schedule with at most fit + 1 sessions in flight can finish within
#   1.15x naive's wall (the bound of opencoti.sim.bounds is ~1.2x: naive runs all ten sessions);
# * epyc-2core-avx2-bf16, wall: one session fits; no schedule with at most one in flight can
#   finish within 1.15x naive's wall (bound ~1.33x: naive runs two, under the floor);
# * epyc-2core-avx2-bf16, deep: the oracle misses it too on 20 seeds (a lone session's stalls);
#   ours adds one probe of a second session (the only way to learn that it does not fit);
# * epyc-2core-avx2-loaded, wall: met on the benchmark's 20 seeds (1.147x) by a thin margin (1.166x on
#   seeds 20-59; the oracle ~1.13x); on these four seeds (1.17x) the learning's cost is checked against
#   the oracle's wall.
# Each is asserted against the bound or the oracle on the same seeds.
UNREACHABLE_OVERSHOOT = {"bursty-neighbour": {"wall_ratio"}}
UNREACHABLE_FLOOR = {"epyc-2core-avx2-bf16": {"wall_ratio"}}
LEARNING_COST = {"epyc-2core-avx2-loaded": {"wall_ratio": 1.10}, "epyc-2core-avx2-bf16": {"deep_ratio": 1.5},
                 "bursty-neighbour": {"wall_ratio": 1.25}}


@pytest.mark.parametrize("name", ["avx512-fast-cpu", "bursty-neighbour", "epyc-2core-avx2", "epyc-2core-avx2-bf16",
                                  "epyc-2core-avx2-loaded", "gpu-knee"])
def test_adaptive_policy_against_naive(name):
    prof, seeds = StepProfile.load(name), [0, 1, 2, 3]
    naive = [run_ramp(prof, "naive", s) for s in seeds]
    c = compare(prof, seeds, naive=naive)
    oracle = compare(prof, seeds, policy="oracle", naive=naive)
    for k, limit in TARGETS.items():
        if k in UNREACHABLE_OVERSHOOT.get(name, ()):
            assert c["wall_bound"]["fit+1"]["ratio"] > limit  # no policy within the overshoot target can
        elif k in UNREACHABLE_FLOOR.get(name, ()):
            assert c["wall_bound"]["fit+0"]["ratio"] > limit  # none that holds the floor can
            assert c[k] <= 1.10 * oracle[k], (k, c[k], oracle[k])
        if k in LEARNING_COST.get(name, {}):
            assert c[k] <= LEARNING_COST[name][k] * oracle[k], (k, c[k], oracle[k])
        elif k not in UNREACHABLE_OVERSHOOT.get(name, ()) and k not in UNREACHABLE_FLOOR.get(name, ()):
            assert c[k] <= limit, (k, c[k])
    assert not math.isinf(c["wall_ratio"])


def test_a_new_session_is_projected_at_its_prompt_not_at_the_running_sessions_contexts():
    """Two sessions deep into long answers (1,000 tokens of context each) and a newcomer with a
    60-token prompt: the projection charges the newcomer its prompt's context (the prompts of the
    pool's sessions in flight), not the context the running sessions have grown to — charging it
    theirs made the end of every cohort look full, and spawns waited for whole cohorts to end."""
    from opencoti.engine.config import SamplingParams
    from opencoti.sim.engine import SimEngine

    prof = StepProfile(name="ctx-heavy", base_s=0.01, seq_s=0.004, ctx_s=2e-5, prefill_s=0.0, noise_sigma=0.02)
    sim = SimEngine(prof, seed=3)
    pid = sim.core.add_pool(40).pool_id
    adm = sim.admission
    adm.set_policy(pid, target_tps_per_session=1.0, mode="advisory")
    sim.on_finish = lambda job, t: sim.core.release_session(job.session.session_id)
    prompt = list(range(1, 61))

    def spawn(sid, tokens):
        adm.submit(prompt, SamplingParams.greedy(tokens, ignore_eos=True), lambda ev: None, session_id=sid,
                   pool_id=pid).result()

    for b in (1, 2, 3, 2, 1):  # every size measured over growing contexts first
        for i in range(b):
            spawn(f"warm-{b}-{i}-{sim.t}", 400)
        while sim.has_work:
            sim.run_until(sim.t + 1.0)
    spawn("long-0", 2000)
    spawn("long-1", 2000)
    while sum(len(j.seq.tokens) for j in sim.core.scheduler.running) < 2 * 1000:
        sim.run_until(sim.t + 0.5)
    ctx_now = sum(len(j.seq.tokens) for j in sim.core.scheduler.running)
    cap = adm.capacity(pid)
    fc = adm.forecast
    truth = fc.calibration / prof.expected_step_s(3, ctx_now + 60)
    as_long = fc.calibration / prof.expected_step_s(3, ctx_now * 3 / 2)
    assert fc.ctx.slope == pytest.approx(prof.ctx_s, rel=0.3)
    assert cap["projected_mean_tps_measured"] == pytest.approx(truth, rel=0.08)
    assert truth > 1.2 * as_long  # what charging the newcomer the running contexts would have said
    # an enforced pool deciding on a request projects at that request's own prompt
    from opencoti.engine.admission.decide import AdmissionPlan

    adm.set_policy(pid, target_tps_per_session=1.0, mode="enforced")
    for prompt_len in (60, 1500):
        plan = AdmissionPlan(pool_id=pid, session_id=f"new-{prompt_len}", new_to_pool=True, prompt_len=prompt_len,
                             prefix_len=40, max_tokens=100)
        got = adm.evaluate(plan, sim.t).capacity["projected_mean_tps_measured"]
        want = fc.calibration / prof.expected_step_s(3, ctx_now + prompt_len)
        assert got == pytest.approx(want, rel=0.08), prompt_len


def test_deep_time_at_a_newcomers_first_step_is_told_apart():
    """``deep_at_starts``: deep seconds whose rate window holds another session's first token (its
    prompt's step) vs all deep seconds, with the same rate as ``decode_seconds``."""
    from opencoti.sim.ramp import decode_seconds, deep_at_starts

    a = [0.1 * i for i in range(40)]  # 10 tok/s, floor 10: never deep ...
    a = a[:10] + [t + 0.5 for t in a[10:20]] + [t + 1.0 for t in a[20:]]  # ... but for two 0.5 s stalls
    b = [a[9] + 0.55 + 0.1 * i for i in range(5)]  # a newcomer whose first token ends the first stall
    _, deep, _ = decode_seconds([a, b], floor=10.0)
    at, deep2 = deep_at_starts([a, b], floor=10.0)
    assert deep2 == pytest.approx(deep) and deep > 0
    # the first stall's deep seconds are the newcomer's, the second's are not (nobody started there)
    first = sum(a[i] - a[i - 1] for i in range(10, 18) if 8 / (a[i] - a[i - 8]) < 8.0)
    assert at == pytest.approx(first) and 0 < at < deep
    assert deep_at_starts([a], floor=10.0)[0] == 0.0  # alone: no newcomer
    assert deep_at_starts([], floor=10.0) == (0.0, 0.0)
