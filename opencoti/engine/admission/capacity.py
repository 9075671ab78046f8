"""Capacity maths: from measured inputs at one instant to the capacity report (pure, no state).

A pool's capacity report answers "does one more session fit?" from these arms, checked in order:

1. **Context arm** (hard, never bypassed): ``expected_tokens`` beyond the KV cells available
   (free + reclaimable - reserved for running requests' remaining ``max_tokens``) or beyond the
   context left after the pool prefix -> ``"context headroom exhausted"``.
2. **Guaranteed minimum**: fewer sessions attached to the pool than ``guarantee_min_sessions`` and
   fewer requests in flight in the whole engine than that -> admit (``"guaranteed minimum"``),
   bypassing settling, the floor and the KV-headroom arm: an idle engine always admits.
3. **Settling** (pools with a floor only): after each new-session admit the pool is settling until
   that session has decoded ``settle_tokens`` tokens or ``settle_max_ms`` passed.
4. **KV headroom** (``headroom_sessions`` = available cells / the pool's per-session suffix size)
   and the **tps floor**: the projected mean tps after one more admit must stay >= the floor.

Projection (all tps numbers are *experienced decode tps*, see ``metrics``):

* ``projected_mean_tps_model`` = ``mean * n / (n + 1)`` with n = the current decode batch: the
  conservative flat-throughput bound (every extra session costs a full share). Always reported.
* ``forecast: "adaptive"`` (default): the engine's measured step time per batch size
  (``forecast.StepForecast``) projects the tps at one more session; the floor arm checks the
  upper confidence bound of that step time (``projected_mean_tps_if_admitted``), and the estimate
  (``projected_mean_tps_measured``) when the next batch size is the frontier (never measured: a
  probe, at most one size beyond what was measured). An estimate that passes while the bound
  does not holds the spawn: ``"next admit may cross the floor (uncertain drop)"``. The frontier
  is entered (by a probe or a passing bound) only from a batch size measured over as many steps
  as a settle window there aims for (``fc_thin``): a window that ran out of time leaves its size
  thin, and a line through thin sizes cannot see a knee one size further. Nor is a session admitted
  past a probed size that has no steps of its own yet (``fc_kind: "unmeasured"`` at the frontier).
* ``forecast: "conservative"``: ``projected_mean_tps_measured`` = ``mean - drop_ewma`` once the
  pool has absorbed >= 1 admit (the drop measured at the end of each settle window), else the
  model.
* **Idle estimate**: when nothing decodes but the pool has sessions attached and a fresh settled
  mean, the projection starts from that mean (``projected_idle_estimate: true``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import (IDLE_FRESH_S, REASON_CONTEXT, REASON_FLOOR, REASON_FLOOR_IDLE, REASON_GUARANTEED, REASON_KV,
                     REASON_OK, REASON_SETTLING, REASON_UNCERTAIN, REASON_UNMEASURED, UNKNOWN, AdmissionPolicy)


@dataclass
class CapacityInputs:
    """Everything ``compute_capacity`` needs, measured at one instant (pure data: tests script it)."""

    policy: AdmissionPolicy
    mean: float | None  # mean_active_tps (engine-wide; None when no session is active)
    n_active: int = 0
    n_warming: int = 0
    n_decoding: int = 0  # decode batch size
    n_pool_sessions: int = 0  # sessions attached to the pool (idle ones included)
    n_engine_inflight: int = 0  # generation requests in flight in the whole engine
    settle_remaining_s: float | None = None  # None: no settle window open
    drop_ewma: float | None = None  # the learned per-admit drop (mean)
    drop_bound: float | None = None  # its upper confidence bound (None: same as the mean)
    drop_samples: int = 0
    last_settled_mean: float | None = None
    last_settled_age_s: float | None = None
    available_cells: int = 0  # free + reclaimable - reserved
    free_cells: int = 0  # free + reclaimable
    total_cells: int = 1
    marginal_tokens: int = 1  # KV tokens one more session of this pool is expected to own
    expected_tokens: int | None = None
    context_left: int | None = None  # max_context - pool prefix
    largest_session_share: float = 0.0  # max ctx_used / ctx_total over the pool's sessions
    known_session: bool = False
    idle_fresh_s: float = IDLE_FRESH_S
    # the adaptive forecast (tps = calibration / step time) for the batch growing by one session
    fc_kind: str = "none"  # measured | extrapolated | conservative | unmeasured (the current batch) | none
    fc_now_tps: float | None = None
    fc_now_low_tps: float | None = None  # its lower confidence bound (None: same as fc_now_tps)
    fc_est_tps: float | None = None
    fc_bound_tps: float | None = None
    fc_frontier: bool = False
    fc_headroom: int | None = None  # more sessions whose bound stays >= the floor
    fc_thin: bool = False  # the next size is the frontier and the current one is not yet measured to precision


PROBE_MARGIN = 0.75  # a probe's estimate must clear the floor by this share of (estimate - bound)


def model_ratio(n: int, k: int = 1) -> float:
    """The conservative factor on a session's tps when the decode batch grows from n to n + k."""
    return n / (n + k) if n > 0 else 1.0


def compute_capacity(x: CapacityInputs) -> dict:
    """The capacity report (see the module docstring)."""
    p = x.policy
    floor = p.target_tps_per_session
    model = measured = None
    idle_estimate = False
    base, n = x.mean, x.n_decoding
    if base is None and x.n_pool_sessions > 0 and x.last_settled_mean is not None \
            and x.last_settled_age_s is not None and x.last_settled_age_s < x.idle_fresh_s:
        base, n, idle_estimate = x.last_settled_mean, x.n_pool_sessions, True
    drop = None
    if x.drop_samples:
        drop = x.drop_bound if x.drop_bound is not None else x.drop_ewma
    # adaptive, once the current batch size has step statistics; before that the conservative model
    adaptive = p.forecast == "adaptive" and x.fc_kind not in ("none", "unmeasured")
    probe = False
    if base is not None:
        model = base * model_ratio(max(n, 1))
        if drop is not None and p.forecast != "adaptive":
            measured = max(0.0, base - drop)
    if adaptive:
        measured = x.fc_est_tps
        projected = x.fc_bound_tps
        # never above what is measured now: one more session never makes anyone faster
        ceiling = base if base is not None else x.fc_now_tps
        if ceiling is not None:
            measured = None if measured is None else min(measured, ceiling)
            projected = None if projected is None else min(projected, ceiling)
        # the frontier (a batch size never measured) is probed while the engine is above the floor
        # now, when the estimate passes, or with a single size measured (no slope known at all);
        # "above the floor now" is judged on its lower confidence bound, so a size reached by a
        # probe and not yet known to be above the floor is never the base of another probe
        # probe only when the estimate clears the floor by PROBE_MARGIN of the estimate's
        # uncertainty (estimate - bound): a probe that fails stays until a session ends, so a
        # coin-flip probe costs more under-floor time than it can win
        now = x.fc_now_low_tps if x.fc_now_low_tps is not None else x.fc_now_tps
        probe = (x.fc_frontier and floor is not None and projected is not None and projected < floor
                 and now is not None and now >= floor
                 and (x.fc_kind == "conservative"
                      or (measured is not None and measured - floor >= PROBE_MARGIN * (measured - projected))))
    else:
        projected = measured if measured is not None else model
    # the frontier is entered only from a size measured to the precision a settle window aims for:
    # a window that ran out of time leaves its size thin, and a line through thin sizes cannot see
    # a knee one size further (an admit past it stays until a session ends)
    thin = adaptive and floor is not None and x.fc_thin and x.fc_kind == "extrapolated"
    # nor from a size beyond every size measured that has no steps of its own yet (a probe whose
    # settle window ran out of time): the model's full-share projection from a few steps' mean tps
    # would admit one more past the probe
    unmeasured = p.forecast == "adaptive" and floor is not None and x.fc_kind == "unmeasured" and x.fc_frontier
    thin = thin or unmeasured
    probe = probe and not thin

    marginal = max(int(x.marginal_tokens), 1)
    headroom_sessions = max(0, x.available_cells) // marginal
    kv_headroom_pct = 100.0 * x.free_cells / x.total_cells if x.total_cells else 0.0
    occupancy = 1.0 - x.free_cells / x.total_cells if x.total_cells else 1.0
    pressure = min(1.0, max(0.0, occupancy, x.largest_session_share))

    # how many more sessions the floor allows (measured drop when known, else the model)
    tps_headroom = None
    if adaptive and floor is not None:
        tps_headroom = x.fc_headroom if x.fc_headroom is not None else int(projected is not None and projected >= floor)
        tps_headroom = max(tps_headroom, 1) if probe else tps_headroom
    elif floor is not None and base is not None:
        if measured is not None and drop is not None:  # (measured is only set with a drop here)
            tps_headroom = max(0, int((base - floor) // drop)) if drop > 0 else \
                (headroom_sessions if base >= floor else 0)
        else:
            k = 0
            while k < 4096 and base * model_ratio(max(n, 1), k + 1) >= floor:
                k += 1
            tps_headroom = k
    if thin:  # held for want of a measured size: no session fits until it is measured
        tps_headroom = 0
    # a floor with nothing measured to project from: how many fit is unknown, not a number; an idle
    # engine admits (measuring is the only way to learn), a busy one holds until its steps are measured
    unknown = floor is not None and projected is None and not thin
    sessions_remaining: int | str
    if unknown:
        sessions_remaining = UNKNOWN
        probe = x.n_engine_inflight == 0
    else:
        sessions_remaining = headroom_sessions if tps_headroom is None else min(headroom_sessions, tps_headroom)

    ctx_limit = x.available_cells if x.context_left is None else min(x.available_cells, x.context_left)
    context_ok = x.expected_tokens is None or x.expected_tokens <= ctx_limit
    guaranteed = x.n_pool_sessions < p.guarantee_min_sessions and x.n_engine_inflight < p.guarantee_min_sessions
    window_open = x.settle_remaining_s is not None
    settling = window_open and p.has_floor  # a pool without a floor measures but never waits
    below = floor is not None and not probe and projected is not None and projected < floor
    below = below or thin or (unknown and not probe)
    if not context_ok:
        can, reason = False, REASON_CONTEXT
    elif guaranteed:
        can, reason = True, REASON_GUARANTEED
    elif settling:
        can, reason = False, REASON_SETTLING
    elif headroom_sessions < 1:
        can, reason = False, REASON_KV
    elif below:
        mean_only = floor is not None and ((measured is not None and measured >= floor) if adaptive else
                                           measured is not None and x.drop_ewma is not None and base is not None
                                           and base - x.drop_ewma >= floor)  # (below: a floor is set)
        can = False
        # the real cause: a batch size not measured enough (or nothing measured), an estimate that
        # passes with a bound that does not, or a projection below the floor (from the idle estimate)
        reason = (REASON_UNMEASURED if thin or unknown else REASON_UNCERTAIN if mean_only
                  else REASON_FLOOR_IDLE if idle_estimate else REASON_FLOOR)
    else:
        can, reason = True, REASON_OK
    return {
        "can_admit": can,
        "reason": reason,
        "projected_mean_tps_if_admitted": projected,
        "projected_mean_tps_model": model,
        "projected_mean_tps_measured": measured,
        "projected_idle_estimate": idle_estimate,
        "forecast": p.forecast,
        "forecast_kind": x.fc_kind if adaptive else "drop" if measured is not None else "model",
        "probe": probe,
        "drop_per_admit_ewma": x.drop_ewma,
        "drop_per_admit_bound": drop,
        "drop_samples": x.drop_samples,
        "mean_active_tps": x.mean,
        "target_tps_per_session": floor,
        "headroom_sessions": headroom_sessions,
        "tps_headroom_sessions": tps_headroom,
        "sessions_remaining": sessions_remaining,
        "marginal_tokens_per_session": marginal,
        "kv_headroom_pct": kv_headroom_pct,
        "kv_free_cells": x.free_cells,
        "kv_available_cells": max(0, x.available_cells),
        "kv_total_cells": x.total_cells,
        "expected_tokens": x.expected_tokens,
        "context_ok": context_ok,
        "settling": settling,
        "measuring": window_open,
        "settle_remaining_ms": x.settle_remaining_s * 1e3 if x.settle_remaining_s is not None else 0.0,
        "n_active": x.n_active,
        "n_warming": x.n_warming,
        "n_decoding": x.n_decoding,
        "n_pool_sessions": x.n_pool_sessions,
        "n_engine_inflight": x.n_engine_inflight,
        "guaranteed": guaranteed and context_ok,
        "known_session": x.known_session,
        "compaction_pressure": pressure,
        "mode": p.mode,
        "on_saturation": p.on_saturation,
    }
