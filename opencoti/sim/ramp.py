"""The spawn ramp on the simulator, and the metrics users feel.

An orchestrator spawns sessions on one pool, at most one per ``tick_s`` (1 s), whenever its
policy says capacity allows; each session decodes ``tokens`` tokens and is released; ``tasks``
sessions are spawned in all. The floor is set so that exactly ``fit`` concurrent sessions stay
above it: the midpoint between the expected per-session tps with ``fit`` and ``fit + 1`` decoding.

Policies (the same engine code for both, only the orchestrator's rule differs):

* ``naive``: spawn when nothing is measured yet or the raw ``mean_active_tps`` >= the floor.
* ``ours``: spawn when ``capacity(pool)["can_admit"]`` (an advisory pool with the floor).
* ``oracle``: spawn while fewer than ``fit`` sessions are in flight (it knows the answer; what a
  perfect policy would get on the profile, noise included).

Metrics, from the simulated token times (ground truth, not the engine's own estimates): a
session's experienced rate at each token is its rate over its last ``rate_tokens`` intervals;
each interval counts its seconds as under the floor (or under 80 % of it: "deep") when that rate
is. Shares are of all session-decode seconds. ``overshoot`` = the most sessions in flight at once
minus ``fit``; ``wall`` = first spawn to last token; ``tok_s`` = tokens / wall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engine.config import SamplingParams
from .engine import SimEngine
from .profile import StepProfile

DEEP = 0.8


@dataclass
class RampConfig:
    fit: int = 3
    tasks: int = 10
    tokens: int = 200
    prompt_tokens: int = 60
    cached_tokens: int = 40  # the pool's prefix
    tick_s: float = 1.0
    rate_tokens: int = 8
    max_time_s: float = 3600.0

    @classmethod
    def for_profile(cls, profile: StepProfile, **over) -> "RampConfig":
        return cls(**{**profile.ramp, **over})


def expected_tps(profile: StepProfile, b: int, cfg: RampConfig) -> float:
    """Per-session tps with ``b`` sessions decoding (mid-request context, mean noise, stalls)."""
    ctx = b * (cfg.prompt_tokens + cfg.tokens / 2)
    share = 0.0
    if profile.burst_factor > 1 and profile.burst_on_mean_s > 0:
        share = profile.burst_on_mean_s / (profile.burst_on_mean_s + profile.burst_off_mean_s)
    return 1.0 / profile.expected_step_s(b, ctx, share)


def decode_shares(token_times, floor: float, rate_tokens: int = 8) -> tuple[float, float]:
    """(under, deep): the shares of session-decode seconds whose experienced rate (over the
    session's last ``rate_tokens`` intervals) is under the floor, and under 80 % of it.
    ``token_times``: one list of token timestamps per session."""
    under = deep = total = 0.0
    for ts in token_times:
        for i in range(1, len(ts)):
            dt = ts[i] - ts[i - 1]
            k = min(i, rate_tokens)
            span = ts[i] - ts[i - k]
            rate = k / span if span > 0 else math.inf
            total += dt
            if rate < floor:
                under += dt
                if rate < DEEP * floor:
                    deep += dt
    return (under / total, deep / total) if total else (0.0, 0.0)


def floor_for(profile: StepProfile, cfg: RampConfig) -> float:
    return (expected_tps(profile, cfg.fit, cfg) + expected_tps(profile, cfg.fit + 1, cfg)) / 2


@dataclass
class RampResult:
    policy: str
    seed: int
    floor: float
    under_share: float
    deep_share: float
    max_sessions: int
    overshoot: int
    wall_s: float
    tok_s: float
    timeline: list = field(default_factory=list)  # (t, sessions in flight, mean rate of active sessions)
    decisions: int = 0

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "timeline"}


def run_ramp(profile: StepProfile, policy: str, seed: int, cfg: RampConfig | None = None,
             admission: dict | None = None, keep_timeline: bool = False) -> RampResult:
    cfg = cfg or RampConfig.for_profile(profile)
    floor = floor_for(profile, cfg)
    sim = SimEngine(profile, seed)
    pool = sim.core.add_pool(cfg.cached_tokens)
    pid = pool.pool_id
    adm = sim.admission
    adm.set_policy(pid, target_tps_per_session=floor, mode="advisory", **(admission or {}))
    tokens: dict[str, list[float]] = {}
    inflight: set[str] = set()
    state = {"spawned": 0, "max": 0, "t_first": None, "t_last": 0.0, "done": 0}
    timeline: list = []

    def on_token(job, t):
        tokens[job.session.session_id].append(t)

    def on_finish(job, t):
        sid = job.session.session_id
        inflight.discard(sid)
        state["done"] += 1
        state["t_last"] = max(state["t_last"], t)
        sim.core.release_session(sid)

    sim.on_token, sim.on_finish = on_token, on_finish
    params = SamplingParams.greedy(cfg.tokens, ignore_eos=True)
    prompt = list(range(1, cfg.prompt_tokens + 1))

    def wants_spawn() -> bool:
        if policy == "naive":
            act = sim.metrics.activity()
            return act.n_active == 0 or act.mean_active_tps >= floor
        if policy == "oracle":
            return len(inflight) < cfg.fit
        return adm.capacity(pid)["can_admit"]

    t_tick = 0.0
    while state["done"] < cfg.tasks and sim.t < cfg.max_time_s:
        if state["spawned"] < cfg.tasks and wants_spawn():
            sid = f"{policy}-{state['spawned']}"
            tokens[sid] = []
            fut = adm.submit(prompt, params, lambda ev: None, session_id=sid, pool_id=pid)
            fut.result()
            inflight.add(sid)
            state["spawned"] += 1
            state["t_first"] = sim.t if state["t_first"] is None else state["t_first"]
            state["max"] = max(state["max"], len(inflight))
        if keep_timeline:
            act = sim.metrics.activity()
            timeline.append((sim.t, len(inflight), act.mean_active_tps))
        t_tick += cfg.tick_s
        sim.run_until(t_tick)
    under, deep = decode_shares(tokens.values(), floor, cfg.rate_tokens)
    wall = state["t_last"] - (state["t_first"] or 0.0)
    n_tok = sum(len(ts) for ts in tokens.values())
    return RampResult(policy, seed, floor, under, deep, state["max"], max(0, state["max"] - cfg.fit), wall, n_tok / wall if wall > 0 else 0.0,
                      timeline if keep_timeline else [])


def compare(profile: StepProfile, seeds, cfg: RampConfig | None = None, admission: dict | None = None,
            policy: str = "ours") -> dict:
    """``policy`` (ours, or the oracle) vs naive on the same profile and seeds: per-seed results and
    the ratios that the targets are about (means over seeds of each metric, ours / naive)."""
    rows = {"ours": [], "naive": []}
    for seed in seeds:
        rows["ours"].append(run_ramp(profile, policy, seed, cfg, admission))
        rows["naive"].append(run_ramp(profile, "naive", seed, cfg))

    def mean(pol, key):
        v = [getattr(r, key) for r in rows[pol]]
        return sum(v) / len(v)

    def rel(key):
        n = mean("naive", key)
        return mean("ours", key) / n if n > 0 else (0.0 if mean("ours", key) == 0 else math.inf)

    return {"profile": profile.name, "seeds": list(seeds), "floor": rows["ours"][0].floor,
            "under_ratio": rel("under_share"), "deep_ratio": rel("deep_share"), "wall_ratio": rel("wall_s"),
            "tok_s_ratio": rel("tok_s"), "overshoot_max": max(r.overshoot for r in rows["ours"]),
            "means": {pol: {k: mean(pol, k) for k in ("under_share", "deep_share", "overshoot", "wall_s", "tok_s")}
                      for pol in rows},
            "runs": {pol: [r.row() for r in rs] for pol, rs in rows.items()}}
