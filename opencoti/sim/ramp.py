"""The spawn ramp on the simulator, and the metrics users feel.

An orchestrator spawns sessions on one pool, at most one per ``tick_s`` (1 s), whenever its
policy says capacity allows; each session decodes ``tokens`` tokens and is released; ``tasks``
sessions are spawned in all. The floor is set so that exactly ``fit`` concurrent sessions stay
above it: the midpoint between the expected per-session tps with ``fit`` and ``fit + 1`` decoding.

Policies (the same engine code for both, only the orchestrator's rule differs):

* ``naive``: spawn when nothing is measured yet or the raw ``mean_active_tps`` >= the floor.
* ``ours``: spawn when ``capacity(pool)["can_admit"]`` (an advisory pool with the floor).
* ``gate``: the LangGraph fan-out's decision: ``CapacityGateNode`` (with a ``SpawnPacer``) run on
  the same capacity reports (its decision code driven step by step on the simulated clock).
* ``oracle``: spawn while fewer than ``fit`` sessions are in flight (it knows the answer; what a
  perfect policy would get on the profile, noise included); ``oracle+1``: while fewer than
  ``fit + 1`` (the most the overshoot target allows).

Metrics, from the simulated token times (ground truth, not the engine's own estimates): a
session's experienced rate at each token is its rate over its last ``rate_tokens`` intervals;
each interval counts its seconds as under the floor (or under 80 % of it: "deep") when that rate
is. Shares are of all session-decode seconds. ``overshoot`` = the most sessions in flight at once
minus ``fit``; ``wall`` = first spawn to last token; ``tok_s`` = tokens / wall.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ..engine.config import SamplingParams
from .bounds import wall_lower_bound
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


FIT_GAP = 1.1  # every size up to fit is at least this much faster per session than fit + 1
FIT_SEARCH_MAX = 64  # the largest batch size considered for a profile without a measured table


def choose_fit(profile: StepProfile, ramp: dict | None = None) -> int:
    """The rule for a profile's ``fit``: the largest k such that every batch size 1..k is at least
    10 % (``FIT_GAP``) faster per session than k + 1, so a floor between tps(k) and tps(k + 1) keeps
    all of them above it, with a gap larger than the noise of a mean. Batch sizes up to the largest
    measured one (``profile.table``), or up to ``FIT_SEARCH_MAX`` for a profile given by its line;
    1 when no k qualifies. ``ramp``: the scenario (context lengths), default ``profile.ramp``."""
    cfg = RampConfig(**{**(profile.ramp if ramp is None else ramp), "fit": 1})
    top = max(profile.table) if profile.table else FIT_SEARCH_MAX
    tps = {b: expected_tps(profile, b, cfg) for b in range(1, top + 1)}
    fit, fastest_below = 1, math.inf
    for k in range(1, top):
        fastest_below = min(fastest_below, tps[k])  # the slowest of sizes 1..k per session
        if fastest_below > FIT_GAP * tps[k + 1]:
            fit = k
    return fit


def _intervals(ts, rate_tokens: int):
    """(seconds, experienced rate, start of the rate's window) of each interval of one session's
    token times: the rate over its last ``rate_tokens`` intervals."""
    for i in range(1, len(ts)):
        k = min(i, rate_tokens)
        span = ts[i] - ts[i - k]
        yield ts[i] - ts[i - 1], (k / span if span > 0 else math.inf), ts[i - k]


def decode_seconds(token_times, floor: float, rate_tokens: int = 8) -> tuple[float, float, float]:
    """(under, deep, total): session-decode seconds whose experienced rate (over the session's last
    ``rate_tokens`` intervals) is under the floor, under 80 % of it, and all of them.
    ``token_times``: one list of token timestamps per session."""
    under = deep = total = 0.0
    for ts in token_times:
        for dt, rate, _ in _intervals(ts, rate_tokens):
            total += dt
            if rate < floor:
                under += dt
                if rate < DEEP * floor:
                    deep += dt
    return under, deep, total


def deep_at_starts(token_times, floor: float, rate_tokens: int = 8) -> tuple[float, float]:
    """(deep seconds whose rate window holds another session's first token, all deep seconds): the
    share of the deep time that a newcomer's prompt (computed in the step before its first token,
    which every session decoding then waits for) accounts for."""
    token_times = [ts for ts in token_times if ts]
    firsts = sorted(ts[0] for ts in token_times)
    at = deep = 0.0
    for ts in token_times:
        for (dt, rate, t0), t1 in zip(_intervals(ts, rate_tokens), ts[1:]):
            if rate < DEEP * floor:
                deep += dt
                lo, hi = bisect.bisect_left(firsts, t0), bisect.bisect_right(firsts, t1)
                if any(f != ts[0] for f in firsts[lo:hi]):
                    at += dt
    return at, deep


def shares(seconds: tuple[float, float, float]) -> tuple[float, float]:
    """(under, deep) shares from ``decode_seconds``' (under, deep, total)."""
    under, deep, total = seconds
    return (under / total, deep / total) if total else (0.0, 0.0)


def decode_shares(token_times, floor: float, rate_tokens: int = 8) -> tuple[float, float]:
    """(under, deep): the shares of session-decode seconds under the floor, and under 80 % of it
    (``decode_seconds``)."""
    return shares(decode_seconds(token_times, floor, rate_tokens))


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
    spawns: list = field(default_factory=list)  # spawn times

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
    spawns: list[float] = []
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

    gate = GateDriver(adm, pid) if policy == "gate" else None
    if policy not in ("naive", "ours", "gate", "oracle", "oracle+1"):
        raise ValueError(f"unknown ramp policy {policy!r}")

    def wants_spawn(sid: str) -> bool:
        if policy == "naive":
            act = sim.metrics.activity()
            return act.n_active == 0 or act.mean_active_tps >= floor
        if policy in ("oracle", "oracle+1"):
            return len(inflight) < cfg.fit + (policy == "oracle+1")
        if gate is not None:
            return gate.decide(sid)
        return adm.capacity(pid)["can_admit"]

    t_tick = 0.0
    while state["done"] < cfg.tasks and sim.t < cfg.max_time_s:
        sid = f"{policy}-{state['spawned']}"
        if state["spawned"] < cfg.tasks and wants_spawn(sid):
            tokens[sid] = []
            fut = adm.submit(prompt, params, lambda ev: None, session_id=sid, pool_id=pid)
            fut.result()
            if gate is not None:
                gate.spawned(sid)
            inflight.add(sid)
            spawns.append(sim.t)
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
    return RampResult(policy, seed, floor, under, deep, state["max"], max(0, state["max"] - cfg.fit), wall,
                      n_tok / wall if wall > 0 else 0.0, timeline if keep_timeline else [], spawns)


class GateDriver:
    """``CapacityGateNode``'s decision (with a ``SpawnPacer``), driven on the simulated engine: the
    gate's own decision steps (capacity report, pacer turn, sessions seen, settled check, claim) with the capacity
    reports of the simulated controller, as an in-process client would hand them over."""

    def __init__(self, adm, pool_id: int):
        from ..langgraph import CapacityGateNode, SpawnPacer
        from ..langgraph._clients import ClientPair
        from ..ops.results import Capacity

        self.adm, self.pool_id, self.Capacity = adm, pool_id, Capacity
        self.pacer = SpawnPacer()
        # the gate never reaches a transport here: every step it asks for is answered below
        self.gate = CapacityGateNode(ClientPair(None, None), spawn="work", hold="wait", on_hold="route",
                                     pool_id=pool_id, pacer=self.pacer)
        self.claimed: str | None = None

    def decide(self, sid: str) -> bool:
        gen, result = self.gate._steps({"session_id": sid}, self.pool_id), None
        try:
            while True:
                step = gen.send(result)
                result = None
                if step[0] == "capacity":
                    result = self.Capacity(**self.adm.capacity(step[1], expected_tokens=step[2]))
                elif step[0] == "acquire":
                    result = self.pacer.acquire(step[1], 0.0)
                elif step[0] == "seen":  # spawned sessions the engine has not seen yet: the gate holds
                    result = self.pacer.wait_seen(step[1], 0.0)
                elif step[0] == "claim":
                    self.claimed = step[2]
                    self.pacer.mark_spawned(step[1], step[2])
                else:
                    raise RuntimeError(f"unexpected gate step {step!r} with on_hold='route'")
        except StopIteration as stop:
            _cap, ok, extra = stop.value
        assert not ok or extra.get("session_id") == sid
        return ok

    def spawned(self, sid: str) -> None:
        """The spawned session was submitted: the pacer's claim ends once the engine knows it."""
        if self.claimed is not None:
            assert self.adm.capacity(self.pool_id, session_id=sid)["known_session"]
            self.pacer.mark_seen(self.pool_id, self.claimed)
            self.claimed = None


def wall_bound(profile: StepProfile, cfg: RampConfig, extra: int = 1) -> dict:
    """``bounds.wall_lower_bound`` for the ramp with at most ``fit + extra`` sessions in flight."""
    return wall_lower_bound(profile, tasks=cfg.tasks, tokens=cfg.tokens, k=cfg.fit + extra,
                            prompt_tokens=cfg.prompt_tokens, cached_tokens=cfg.cached_tokens)


def compare(profile: StepProfile, seeds, cfg: RampConfig | None = None, admission: dict | None = None,
            policy: str = "ours", naive: list | None = None) -> dict:
    """``policy`` (ours, the gate, an oracle) vs naive on the same profile and seeds: per-seed
    results and the ratios that the targets are about (means over seeds of each metric, ours /
    naive), and ``wall_bound``: the lower bound on the wall time with at most fit (+0 / +1)
    sessions in flight, and its ratio to naive's. ``naive``: naive's results on these seeds, if
    already run."""
    seeds = list(seeds)
    rows = {"ours": [run_ramp(profile, policy, seed, cfg, admission) for seed in seeds],
            "naive": list(naive) if naive is not None else [run_ramp(profile, "naive", seed, cfg) for seed in seeds]}
    if [r.seed for r in rows["naive"]] != seeds:
        raise ValueError("naive results for other seeds")

    def mean(pol, key):
        v = [getattr(r, key) for r in rows[pol]]
        return sum(v) / len(v)

    def rel(key):
        n = mean("naive", key)
        return mean("ours", key) / n if n > 0 else (0.0 if mean("ours", key) == 0 else math.inf)

    cfg = cfg or RampConfig.for_profile(profile)
    naive_wall = mean("naive", "wall_s")
    bounds = {f"fit+{x}": {**wall_bound(profile, cfg, x), "ratio": wall_bound(profile, cfg, x)["wall_s"] / naive_wall}
              for x in (0, 1)}
    return {"profile": profile.name, "seeds": list(seeds), "floor": rows["ours"][0].floor, "policy": policy,
            "wall_bound": bounds,
            "under_ratio": rel("under_share"), "deep_ratio": rel("deep_share"), "wall_ratio": rel("wall_s"),
            "tok_s_ratio": rel("tok_s"), "overshoot_max": max(r.overshoot for r in rows["ours"]),
            "means": {pol: {k: mean(pol, k) for k in ("under_share", "deep_share", "overshoot", "wall_s", "tok_s")}
                      for pol in rows},
            "runs": {pol: [r.row() for r in rs] for pol, rs in rows.items()}}
