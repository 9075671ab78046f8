"""What admission measures of a pool at one instant: the capacity maths' inputs (the pool's
sessions and their contexts, the engine's activity and KV cells, the adaptive forecast for one more
session) and the soonest expected end of a running request. Read on the step thread by the
controller (``controller.py``) before each decision and capacity report."""

from __future__ import annotations

import math

from ..observe.metrics import Activity, Metrics
from ..polykv.view import PolyKVView, PoolView
from .capacity import CapacityInputs
from .forecast import StepForecast
from .policy import ADAPTIVE, IDLE_FRESH_S
from .state import PoolState


def capacity_inputs(core: PolyKVView, metrics: Metrics, forecast: StepForecast, pool: PoolView, st: PoolState,
                    expected_tokens: int | None, now: float, known: bool = False,
                    prompt_len: int | None = None) -> CapacityInputs:
    """What the capacity maths takes for pool ``pool`` at ``now`` (``st``: its admission state, whose
    last settled mean is refreshed while no window is open). ``prompt_len``: the prompt of the
    request being decided (the newcomer's context), when known."""
    act = metrics.activity()
    if act.mean_active_tps is not None and st.settle is None:
        st.last_settled_mean, st.last_settled_t = act.mean_active_tps, now
    cells = metrics.kv_cells(keep_pool=pool)
    ps = core.page_size
    largest = 0.0
    suffixes: list[int] = []
    running: list[int] = []  # prompt tokens of the pool's sessions in flight
    for sid in pool.sessions:
        s = core.sessions.get(sid)
        if s is None:
            continue
        job = s.job
        used = len(job.seq.tokens) if job is not None else len(s.seq.tokens)
        if job is not None:
            running.append(job.prompt_len)
        largest = max(largest, used / core.max_context)
        final = used
        if job is not None and job.params is not None and job.params.max_tokens is not None:
            final = max(used, min(job.prompt_len + job.params.max_tokens, core.max_context))
        suffixes.append(max(final - pool.prefix_len, 0))
    cands: list[float] = [ps] if expected_tokens is None else [ps, expected_tokens]
    if suffixes:
        cands.append(sum(suffixes) / len(suffixes))
    if st.marginal_ewma is not None:
        cands.append(st.marginal_ewma)
    partial = 1 if pool.prefix_len % ps else 0  # the pool's partial last page is copied per session
    marginal = (-(-int(math.ceil(max(cands))) // ps) + partial) * ps
    # a new session's context: its prompt (the request's own when deciding on one, else as long as
    # the pool's sessions' prompts), not the contexts the running sessions have grown to (that
    # made the end of a cohort look full)
    ctx_new: float
    if prompt_len is not None:
        ctx_new = prompt_len
    else:
        ctx_new = sum(running) / len(running) if running else pool.prefix_len
    fc = forecast_inputs(metrics, forecast, st, act, len(pool.sessions), now, ctx_new)
    return CapacityInputs(**fc,
        policy=st.policy, mean=act.mean_active_tps, n_active=act.n_active, n_warming=act.n_warming,
        n_decoding=act.n_decoding, n_pool_sessions=len(pool.sessions),
        n_engine_inflight=act.n_inflight,
        settle_remaining_s=st.settle_remaining_s(now), drop_ewma=st.drop_ewma, drop_samples=st.drop_samples,
        last_settled_mean=st.last_settled_mean,
        last_settled_age_s=None if st.last_settled_t is None else now - st.last_settled_t,
        available_cells=cells["available"], free_cells=cells["free"], total_cells=cells["total"],
        marginal_tokens=marginal, expected_tokens=expected_tokens,
        context_left=core.max_context - pool.prefix_len, largest_session_share=largest, known_session=known)


def forecast_inputs(metrics: Metrics, fc: StepForecast, st: PoolState, act: Activity, n_pool_sessions: int,
                    now: float, ctx_new: float) -> dict:
    """The adaptive forecast for one more session: tps now, estimated and bounded after it, at
    the context the sessions in flight attend now (``ctx_new``: a new session's)."""
    if st.policy.forecast != ADAPTIVE:
        return {}
    b = act.n_inflight
    ctx_now = None
    if b == 0 and n_pool_sessions and st.last_settled_t is not None and now - st.last_settled_t < IDLE_FRESH_S:
        b = n_pool_sessions  # between turns: they come back (the idle estimate)
    else:
        ctx_now = float(sum(len(j.seq.tokens) for j in metrics.generation_jobs()))
    c = fc.calibration
    pr = fc.project(b, 1, ctx_now, ctx_new)
    tps = lambda s: None if s is None or s <= 0 else c / s  # noqa: E731
    # running, but this batch size has no data yet: never project from it (a short settle window on
    # a slow engine would otherwise extrapolate sizes beyond any measured): the conservative model
    kind = "unmeasured" if pr.now_s is None and b > 0 else pr.kind
    out = {"fc_kind": kind, "fc_now_tps": tps(pr.now_s), "fc_now_low_tps": tps(pr.now_hi_s),
           "fc_est_tps": tps(pr.est_s), "fc_bound_tps": tps(pr.bound_s), "fc_frontier": pr.frontier}
    cur = fc.stats.get(b)  # the frontier only from a size measured as well as a settle window aims for
    out["fc_thin"] = pr.frontier and b > 0 and (cur is None or cur.n < fc.need_steps(b, st.policy.settle_tokens))
    floor = st.policy.target_tps_per_session
    if floor is not None and pr.bound_s is not None:
        k = 0
        while k < 64:
            q = fc.project(b, k + 1, ctx_now, ctx_new)
            if q.bound_s is None or q.bound_s <= 0 or c / q.bound_s < floor:
                break
            k += 1
        out["fc_headroom"] = k
    return out


def soonest_finish_s(metrics: Metrics) -> float | None:
    """Soonest expected end of a running request: remaining max_tokens / its tps."""
    best = None
    mean = None
    for job in metrics.generation_jobs():
        mt = job.params.max_tokens
        tps = metrics.session_tps(job.session.session_id, job)
        if not tps:
            mean = metrics.activity().mean_active_tps if mean is None else mean
            tps = mean or 0.0
        if mt is not None and tps > 0:
            eta = max(0, mt - len(job.generated)) / tps
            best = eta if best is None else min(best, eta)
    return best
