#!/usr/bin/env python
"""The spawn ramp (issue 4): naive vs settled admission, on the bundled model, in ONE process.

An orchestrator loop spawns a new session on one pool whenever it believes capacity allows, checking
once per ``--tick`` (1 s). Each spawned session decodes ``--tokens`` tokens (greedy, ignore_eos) and
is released when done; ``--tasks`` sessions are spawned in all. The tps floor is chosen so that
exactly ``--fit`` concurrent sessions stay above it (from a calibration measured first in the same
process: per-session decode tps with n = 1 .. ``--calibrate-max`` concurrent sessions, each decoding
as many tokens as a ramp session (``--calibration-tokens``: the step time grows with the context,
and a calibration of 48 tokens put the floor above what three sessions of 200 tokens got: the oracle
holding ``fit`` ran under it 80 % of its decode time), on a pool like the ramp's, the sizes
interleaved over ``--calibration-rounds`` rounds and the median round kept). ``--fit`` defaults to
the largest k such that every size up to k is at least 1.1x faster per session than k + 1
(``choose_fit``; the simulator's profiles choose theirs the same way), and the floor is the midpoint
between the slowest of sizes 1..fit and tps(fit + 1): per-session tps is not monotonic in the batch
size on every machine, and "the number that fits" is the largest n such that every batch size up to
n stays above the floor (a ramp passes through all of them); a gap smaller than the noise of a mean
would put the floor inside the noise of fit itself.

Three policies, same engine, each on a fresh pool, over ``--rounds`` rounds in a rotating order
(ours, naive, oracle; then naive, oracle, ours; ...: this VM's speed drifts by tens of percent over
minutes, and a fixed order would hand that drift to one policy); every round calibrates again first
(``--no-recalibrate``: one calibration for the whole run), so the floor a round holds is at most a
round old — a floor calibrated several minutes earlier sat inside that drift, and the ramp then
measured the drift as much as the policy. The metrics pool all rounds of a policy (under and deep:
session-decode seconds, each round against its own floor; overshoot: the worst round's most sessions
minus that round's fit; wall: their mean). The engine's step-time forecast has seen the
calibration's steps (and the earlier rounds'), as an engine that has been serving would have:

* ``ours``: spawn when ``engine.capacity(pool)["can_admit"]`` (advisory policy with the floor:
  projected mean after the admit, settle window, warming exclusion, idle estimate, guarantee).
* ``naive``: spawn when nothing is measured yet (no active session) or the raw ``mean_active_tps``
  >= floor (no projection, no settle): the rule docs/polykv.md#admission improves on (a raw mean of
  the running sessions admits into a floor that the newcomer then breaks).
* ``oracle``: spawn while fewer than ``fit`` sessions are in flight (it knows the answer from the
  calibration): what a policy that holds the floor without learning gets on this machine, now.

What the wall target can ask for at all: from the calibration curve (the time per token at each
batch size), ``opencoti.sim.bounds`` gives the least wall time of any schedule of the ramp's tasks
with at most ``fit`` (the floor held) or ``fit + 1`` (the overshoot target) sessions in flight; a
bound above 1.15x naive's wall means the target is unreachable there, and the output says by how
much.

Reported per policy (from the engine's own tps history, sampled every 0.1 s):

* time under floor: seconds during which >= 1 session was active and ``mean_active_tps`` < floor.
* deepest dip: the lowest ``mean_active_tps`` while >= 1 session was active.
* max sessions: the most sessions in flight at once (vs ``fit``); overshoot = max - fit.
* total wall: first spawn to the last session's last token.

and, from the token times each session saw (the metrics of ``bench_admission_sim.py``): the share of
session-decode seconds under the floor and under 80 % of it ("deep"), and tokens/s over the wall.

Targets: under-floor share <= 0.5x naive, deep <= 0.2x naive, overshoot <= 1, wall <= 1.15x naive.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, now, print_table  # noqa: E402

from opencoti.sim.ramp import decode_seconds, deep_at_starts, shares  # noqa: E402

SYSTEM = ("You are a meticulous research assistant in a team of agents. Answer in detail, explain your "
          "reasoning step by step, and never stop early.")
TASKS = ["the history of the printing press", "how vaccines train the immune system", "the life cycle of stars",
         "why the sky is blue", "how a bicycle stays upright", "the causes of the French revolution",
         "how compilers optimize loops", "the water cycle", "how bees communicate", "the invention of radio",
         "plate tectonics", "how batteries store energy"]


def messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Write a long essay about {TASKS[i % len(TASKS)]}."}]


def greedy(n: int):
    from opencoti.engine import SamplingParams

    return SamplingParams.greedy(n, ignore_eos=True)


# ============================================================================ calibration
def calibrate(eng, n_max: int, tokens: int, rounds: int) -> tuple[dict[int, float], dict[int, list[float]]]:
    """Per-session decode tps (predicted_per_second) with n sessions decoding together, on a pool
    like the ramp's sessions; the sizes n = 1 .. n_max interleaved over ``rounds`` rounds (a load
    that drifts spreads over every size) and the median round kept per size."""
    pool = eng.create_pool(messages=[{"role": "system", "content": SYSTEM}], label="calibration")
    per: dict[int, list[float]] = {n: [] for n in range(1, n_max + 1)}
    for rnd in range(rounds):
        for n in range(1, n_max + 1):
            res = [None] * n
            barrier = threading.Barrier(n)

            def run(i):
                barrier.wait()
                sid = f"cal-{rnd}-{n}-{i}"
                res[i] = eng.generate(messages=messages(i), params=greedy(tokens), session_id=sid,
                                      pool_id=pool.pool_id)
                eng.release_session(sid)

            common.run_threads(n, run)
            per[n].append(sum(r.timings["predicted_per_second"] for r in res) / n)
            log(f"calibration round {rnd + 1}: {n} concurrent sessions -> {per[n][-1]:.2f} tok/s per session")
    eng.release_pool(pool.pool_id)
    return {n: statistics.median(v) for n, v in per.items()}, per


def choose_fit(cal: dict[int, float], gap: float = 1.1) -> tuple[int, float]:
    """The largest k such that every size up to k is at least ``gap`` x faster per session than
    k + 1 (a floor between them is then clear of the noise of a mean on both sides; the simulator's
    profiles choose their fit the same way), and that separation. None clears it: the most
    separated k (the output says the curve is flat within its noise)."""
    best, fit = 0.0, 1
    for k in range(1, max(cal)):
        sep = min(cal[j] for j in range(1, k + 1)) / cal[k + 1]
        if sep >= gap:
            fit, best = k, sep
    if best == 0.0:
        fit = max(range(1, max(cal)), key=lambda k: min(cal[j] for j in range(1, k + 1)) / cal[k + 1])
        best = min(cal[j] for j in range(1, fit + 1)) / cal[fit + 1]
    return fit, best


def calibrate_floor(eng, args, n_max: int) -> dict:
    """A calibration, and the floor and fit it gives (``--fit`` / ``--floor`` when given)."""
    cal, cal_rounds = calibrate(eng, n_max, args.calibration_tokens, args.calibration_rounds)
    fit, sep = (args.fit, None) if args.fit is not None else choose_fit(cal)
    floor = args.floor if args.floor is not None else (min(cal[j] for j in range(1, fit + 1)) + cal[fit + 1]) / 2
    fits = 0
    while fits < n_max and cal[fits + 1] >= floor:
        fits += 1
    log(f"floor {floor:.2f} tok/s per session: {fits} session(s) fit"
        + ("" if sep is None else f" (every size up to it {sep:.2f}x faster per session than the next)"))
    if sep is not None and sep < 1.1:
        log(f"WARNING: the calibration curve is flat within its noise (best separation {sep:.2f}x < 1.1x): "
            "the ramp cannot tell fit from fit + 1 sessions")
    return {"calibration": cal, "calibration_rounds": cal_rounds, "separation": sep, "floor": floor, "fit": fits}


# ============================================================================ the ramp
def forecast_state(eng) -> dict:
    """The engine's step-time forecast (calibration, stall excess, context slope, per batch size)."""
    return eng.run_on_step_thread(lambda: eng.admission_controller.forecast.as_dict())


def ramp(eng, policy: str, floor: float, n_tasks: int, tokens: int, tick: float, fit: int) -> dict:
    pool = eng.create_pool(messages=[{"role": "system", "content": SYSTEM}], label=f"ramp-{policy}")
    pid = pool.pool_id
    eng.set_admission(pid, target_tps_per_session=floor, mode="advisory")
    lock = threading.Lock()
    inflight: list[int] = [0]
    timeline: list[tuple[float, int]] = []  # (t, sessions in flight) at every change
    finished: list[float] = []
    decisions: list[dict] = []
    threads = []
    token_times: dict[str, list[float]] = {}

    def task(i: int):
        sid = f"{policy}-{i}"
        ts = token_times.setdefault(sid, [])
        try:
            s = eng.stream(messages=messages(i), params=greedy(tokens), pool_id=pid, session_id=sid)
            for _ in s:
                ts.append(now())
            assert len(s.result.token_ids) == tokens
        finally:
            with lock:
                inflight[0] -= 1
                timeline.append((now(), inflight[0]))
                finished.append(now())
            eng.release_session(sid)

    def decide() -> tuple[bool, dict]:
        if policy == "oracle":
            return inflight[0] < fit, {"reason": f"{inflight[0]} < fit {fit}"}
        if policy == "ours":
            cap = eng.capacity(pid)
            why = {k: cap[k] for k in ("reason", "mean_active_tps", "projected_mean_tps_if_admitted",
                                       "projected_mean_tps_measured", "forecast_kind", "probe", "settling", "n_warming")}
            # what the engine's step-time forecast knew at this decision (per batch size: steps, level, cv)
            return cap["can_admit"], {**why, "forecast": forecast_state(eng)}
        snap = eng.tps_snapshot()
        if snap["n_active"] == 0:
            return True, {"reason": "no measurement", "mean_active_tps": None}
        return snap["mean_active_tps"] >= floor, {"mean_active_tps": snap["mean_active_tps"]}

    t0 = now()
    wall0 = time.time()
    spawned = 0
    next_tick = t0
    while len(finished) < n_tasks:
        t = now()
        if spawned < n_tasks and t >= next_tick:
            next_tick += tick
            ok, why = decide()
            decisions.append({"t": t - t0, "spawn": ok, "in_flight": inflight[0], **why})
            if ok:
                with lock:
                    inflight[0] += 1
                    timeline.append((now(), inflight[0]))
                th = threading.Thread(target=task, args=(spawned,))
                th.start()
                threads.append(th)
                spawned += 1
        time.sleep(0.05)
    for th in threads:
        th.join()
    t_end = max(finished)
    hist = eng.tps_history(since=wall0)["aggregate"]
    events = eng.admission_events(pid)
    eng.release_pool(pid)
    out = summarize(policy, floor, t0, t_end, wall0, hist, timeline, decisions, events)
    out["decode_s"] = decode_seconds(token_times.values(), floor)
    out["under_share"], out["deep_share"] = shares(out["decode_s"])
    out["deep_at_starts_s"] = deep_at_starts(token_times.values(), floor)
    out["fit"], out["tokens"] = fit, sum(len(ts) for ts in token_times.values())
    # each session's token times (s since the round's start, ms), so under and deep can be located
    out["token_times_s"] = {sid: [round(t - t0, 3) for t in ts] for sid, ts in token_times.items()}
    out["tok_s"] = n_tasks * tokens / out["total_wall_s"]
    return out


def merge_rounds(rs: list[dict]) -> dict:
    """One policy's rounds as one run: under/deep shares over all its session-decode seconds (each
    round against its own floor), time under floor summed, the deepest dip relative to its round's
    floor, the largest overshoot of a round (its most sessions minus its fit), the mean wall; the
    rounds themselves in ``rounds``."""
    keys = ("floor", "fit", "total_wall_s", "under_share", "deep_share", "max_sessions", "time_under_floor_s",
            "spawn_times_s", "decisions", "token_times_s")
    # the first round's history and decisions stand for the run; its floor, fit and dip are per round
    out = {**{k: v for k, v in rs[0].items() if k not in ("floor", "fit", "deepest_dip_tps", "tokens", "token_times_s")},
           "rounds": [{k: r[k] for k in keys} for r in rs]}
    out["decode_s"] = tuple(sum(r["decode_s"][i] for r in rs) for i in range(3))
    out["deep_at_starts_s"] = tuple(sum(r["deep_at_starts_s"][i] for r in rs) for i in range(2))
    out["under_share"], out["deep_share"] = shares(out["decode_s"])
    out["time_under_floor_s"] = sum(r["time_under_floor_s"] for r in rs)
    dips = [r["deepest_dip_tps"] / r["floor"] for r in rs if r["deepest_dip_tps"] is not None]
    out["deepest_dip_x_floor"] = min(dips) if dips else None
    out["max_sessions"] = max(r["max_sessions"] for r in rs)
    out["overshoot"] = max(r["max_sessions"] - r["fit"] for r in rs)
    out["total_wall_s"] = statistics.mean(r["total_wall_s"] for r in rs)
    out["tok_s"] = sum(r["tokens"] for r in rs) / sum(r["total_wall_s"] for r in rs)
    return out


def summarize(policy, floor, t0, t_end, wall0, hist, timeline, decisions, events) -> dict:
    under = 0.0
    dip = None
    pts = [p for p in hist if p["ts"] <= wall0 + (t_end - t0)]
    for a, b in zip(pts, pts[1:]):
        if a["n_active"] > 0 and a["mean_active_tps"] is not None:
            dip = a["mean_active_tps"] if dip is None else min(dip, a["mean_active_tps"])
            if a["mean_active_tps"] < floor:
                under += b["ts"] - a["ts"]
    max_sessions = max(n for _, n in timeline)
    return {"policy": policy, "floor": floor, "time_under_floor_s": under, "deepest_dip_tps": dip,
            "max_sessions": max_sessions, "total_wall_s": t_end - t0,
            "spawn_times_s": [d["t"] for d in decisions if d["spawn"]], "decisions": decisions,
            "timeline": [(t - t0, n) for t, n in timeline], "history": pts,
            "settles": sum(1 for e in events if e["event"] == "settle_end"),
            "drop_per_admit_ewma": next((e["drop_per_admit_ewma"] for e in reversed(events)
                                         if e["event"] == "settle_end"), None)}


def main() -> int:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--fit", type=int, default=None,
                   help="sessions that should fit above the floor (default: from the calibration curve)")
    p.add_argument("--calibrate-max", type=int, default=5, help="calibrate n = 1 .. this many sessions")
    p.add_argument("--tasks", type=int, default=8, help="sessions spawned per policy run")
    p.add_argument("--tokens", type=int, default=200, help="tokens each session decodes")
    p.add_argument("--tick", type=float, default=1.0, help="orchestrator tick (s)")
    p.add_argument("--calibration-tokens", type=int, default=None,
                   help="tokens each calibration session decodes (default: --tokens, so the calibration "
                        "sees the contexts the ramp's sessions grow through)")
    p.add_argument("--calibration-rounds", type=int, default=3, help="interleaved rounds over the sizes (median)")
    p.add_argument("--floor", type=float, default=None, help="use this floor instead of calibrating")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of the policies, in a rotating order (metrics over all rounds, wall = mean)")
    p.add_argument("--recalibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate again (floor and fit) before every round, so a round's floor is minutes old, "
                        "not the whole run's age (default: on)")
    p.add_argument("--policies", default="ours,naive,oracle",
                   help="comma-separated, run in this order (ours and naive are required)")
    args = p.parse_args()
    if args.quick:
        args.tasks, args.tokens, args.rounds = min(args.tasks, 5), min(args.tokens, 96), 1
    if args.calibration_tokens is None:
        args.calibration_tokens = args.tokens
    common.set_threads(args.threads)
    info = common.machine_info()
    log(common.describe_machine(info))
    eng = common.make_engine(args, kv_budget_tokens=16384)
    info["weights"] = eng.weights_info().get("format")
    log(f"weights: {info['weights']}")
    eng.configure_tps(history_interval_s=0.1)
    eng.generate("warm up", params=greedy(8))
    n_max = max(args.calibrate_max, (args.fit or 0) + 1)
    policies = args.policies.split(",")
    per_round: dict[str, list[dict]] = {p: [] for p in policies}
    cals: list[dict] = []
    for rnd in range(args.rounds):  # the order rotates, so a drift of the machine's speed hits each alike
        if rnd == 0 or args.recalibrate:
            cals.append(calibrate_floor(eng, args, n_max))
        c = cals[-1]
        for policy in policies[rnd % len(policies):] + policies[:rnd % len(policies)]:
            log(f"ramp {rnd + 1}/{args.rounds}: {policy} ({args.tasks} sessions x {args.tokens} tokens, "
                f"tick {args.tick} s, floor {c['floor']:.2f}, fit {c['fit']})")
            r = ramp(eng, policy, c["floor"], args.tasks, args.tokens, args.tick, c["fit"])
            per_round[policy].append(r)
            log(f"  {policy}: under floor {r['time_under_floor_s']:.1f} s, dip {fmt(r['deepest_dip_tps'])}, "
                f"max {r['max_sessions']} sessions, wall {r['total_wall_s']:.1f} s")
    runs = {p: merge_rounds(rs) for p, rs in per_round.items()}
    eng.check_integrity()
    eng.shutdown()
    ours, naive = runs["ours"], runs["naive"]
    fits = ",".join(str(r["fit"]) for r in ours["rounds"])
    floors = ", ".join(f"{r['floor']:.2f}" for r in ours["rounds"])
    rows = [[k, r["time_under_floor_s"], fmt(r["deepest_dip_x_floor"]), f"{r['max_sessions']} (fit {fits})",
             r["overshoot"], r["total_wall_s"]] for k, r in runs.items()]
    print_table(["policy", "under floor s", "deepest dip x floor", "max sessions", "overshoot", "wall s"], rows,
                title=f"spawn ramp: floor {floors} tok/s/session (per round), {args.tasks} x {args.tokens} tokens, "
                      f"tick {args.tick} s")

    def rel(key, pol="ours"):
        r = runs[pol]
        return r[key] / naive[key] if naive[key] else (0.0 if not r[key] else None)

    print_table(["policy", "under-floor share", "deep share", "overshoot", "wall s", "tok/s", "wall x naive"],
                [[k, f"{r['under_share']:.3f}", f"{r['deep_share']:.4f}", r["overshoot"],
                  r["total_wall_s"], r["tok_s"], fmt(rel("total_wall_s", k))] for k, r in runs.items()],
                title="the metrics of the simulator benchmark (session-decode seconds, from token times)")
    # the bounds of each round (its calibration, its naive wall), and their mean ratio
    per_bounds = []
    for rnd, nv in enumerate(naive["rounds"]):
        c = cals[rnd if args.recalibrate else 0]
        per_bounds.append(wall_bounds(c["calibration"], c["fit"], args.tasks, args.tokens, nv["total_wall_s"]))
    bounds = {name: {**per_bounds[0][name], "ratio": statistics.mean(pb[name]["ratio"] for pb in per_bounds)}
              for name in per_bounds[0]}
    print_table(["round", "at most in flight", "bound s", "x naive wall", "schedule (steps per batch size)"],
                [[rnd + 1, f"{b['k']} ({name})", b["wall_s"], fmt(b["ratio"]),
                  ", ".join(f"{n:.0f} x {bs}" for bs, n in sorted(b["batches"].items()))]
                 for rnd, pb in enumerate(per_bounds) for name, b in pb.items()],
                title="wall time: the least of any schedule with at most k sessions in flight, from the "
                      "round's calibration curve (opencoti.sim.bounds; no tick, no ramp)")
    over = {k: r["overshoot"] for k, r in runs.items()}
    targets = {"under-floor share": (rel("under_share"), 0.5), "deep share": (rel("deep_share"), 0.2),
               "wall": (rel("total_wall_s"), 1.15)}

    def verdict(x, limit):
        return "n/a" if x is None else "PASS" if x <= limit + 1e-9 else "FAIL"

    print("ours / naive (targets on the four metrics):")
    for name, (x, limit) in targets.items():
        print(f"  {name:18s} {fmt(x):>8s}  (target <= {limit:g}: {verdict(x, limit)})")
    print(f"  {'overshoot':18s} ours {over['ours']}, naive {over['naive']}  "
          f"(target ours <= 1: {verdict(over['ours'], 1)})")
    print(f"  {'tok/s':18s} {fmt(rel('tok_s')):>8s}")
    if args.rounds > 1:
        print("  wall x naive per round: " + ", ".join(
            fmt(a["total_wall_s"] / b["total_wall_s"]) for a, b in zip(ours["rounds"], naive["rounds"])))
    wall_why = wall_reachability(bounds, runs, naive, 1.15)
    for line in wall_why:
        print(f"  wall: {line}")
    if "oracle" in runs:  # what holding exactly fit gets against this run's floors: the floor's doing, not ours
        print(f"  under / deep: the oracle (exactly fit in flight) got {fmt(rel('under_share', 'oracle'))}x / "
              f"{fmt(rel('deep_share', 'oracle'))}x naive")
    # where the deep time is: a newcomer's prompt is computed in one step that every decoding session
    # waits for, which no policy that runs every task avoids (8 per round)
    print("  deep seconds in the rate window of a newcomer's first token (its prompt's step), of all deep seconds: "
          + ", ".join(f"{k} {r['deep_at_starts_s'][0]:.2f} of {r['deep_at_starts_s'][1]:.2f}" for k, r in runs.items())
          + (f"; ours' there alone = {ours['deep_at_starts_s'][0] / naive['decode_s'][1]:.2f}x naive's deep time"
             if naive["decode_s"][1] else ""))
    ratio = (ours["time_under_floor_s"] / naive["time_under_floor_s"]) if naive["time_under_floor_s"] else None
    ok_ratio = ours["time_under_floor_s"] <= 0.5 * naive["time_under_floor_s"] + 1e-9
    ok_over = over["ours"] <= 1
    for i, c in enumerate(cals):
        print(f"\ncalibration {i + 1} (per-session tps by concurrency): "
              + ", ".join(f"{n}: {v:.2f}" for n, v in c["calibration"].items())
              + f"; floor {c['floor']:.2f}, fit {c['fit']}")
    print(f"engine-mean time under floor, ours / naive: {fmt(ratio)}")
    info["loadavg_end"] = common.machine_info()["loadavg"]
    print(f"load average: {info['loadavg'][0]:.2f} at the start, {info['loadavg_end'][0]:.2f} at the end; "
          f"weights {info['weights']}")
    path = common.write_json("admission", {"config": vars(args), "machine": info, "calibrations": cals,
                                           "runs": runs, "wall_bounds": per_bounds,
                                           "targets": {"under_floor_ratio": ratio, "under_floor_ok": ok_ratio,
                                                       "overshoot_ok": ok_over,
                                                       "ratios": {k: x for k, (x, _) in targets.items()},
                                                       "oracle_wall_ratio": rel("total_wall_s", "oracle")
                                                       if "oracle" in runs else None,
                                                       "oracle_under_deep_ratios": [rel("under_share", "oracle"),
                                                                                    rel("deep_share", "oracle")]
                                                       if "oracle" in runs else None,
                                                       "wall_reachability": wall_why,
                                                       "overshoot": over}}, args.out)
    log(f"wrote {path}")
    return 0


def calibration_profile(cal: dict[int, float]):
    """A noise-free step-cost profile from the calibration: a token every 1 / tps(b) seconds with b
    sessions decoding (a line through the points beyond the sizes calibrated)."""
    from opencoti.sim.profile import StepProfile

    table = {int(b): 1.0 / v for b, v in cal.items() if v and v > 0}
    bs = sorted(table)
    if len(bs) >= 2:
        mb = sum(bs) / len(bs)
        mt = sum(table[b] for b in bs) / len(bs)
        slope = max(0.0, sum((b - mb) * (table[b] - mt) for b in bs) / sum((b - mb) ** 2 for b in bs))
        base = mt - slope * mb
    else:
        base, slope = table[bs[0]], 0.0
    return StepProfile(name="calibration", source="measured", base_s=base, seq_s=slope, table=table,
                       noise_sigma=0.0, prefill_s=0.0)


def wall_bounds(cal: dict[int, float], fit: int, tasks: int, tokens: int, naive_wall: float) -> dict:
    """The least wall time of the ramp's tasks with at most fit / fit + 1 sessions in flight."""
    from opencoti.sim.bounds import wall_lower_bound

    prof = calibration_profile(cal)
    out = {}
    for name, k in (("fit: the floor held", fit), ("fit + 1: the overshoot target", fit + 1)):
        b = wall_lower_bound(prof, tasks=tasks, tokens=tokens, k=max(k, 1), prompt_tokens=1, cached_tokens=1)
        out[name] = {"k": k, **b, "ratio": b["wall_s"] / naive_wall if naive_wall else None}
    return out


def wall_reachability(bounds: dict, runs: dict, naive: dict, limit: float) -> list[str]:
    """Why the wall target is (not) reachable on this run, in words."""
    held, over = bounds["fit: the floor held"], bounds["fit + 1: the overshoot target"]
    out = []
    if over["ratio"] is not None and over["ratio"] > limit:
        out.append(f"UNREACHABLE under the overshoot target: any schedule with <= {over['k']} sessions in flight "
                   f"needs >= {over['ratio']:.2f}x naive's wall (target {limit:g}x; short by "
                   f"{over['ratio'] - limit:.2f}x)")
    if held["ratio"] is not None and held["ratio"] > limit:
        out.append(f"unreachable while holding the floor: with <= {held['k']} sessions in flight (all that fit) "
                   f">= {held['ratio']:.2f}x naive's wall; naive is faster by running more sessions under the floor")
    if "oracle" in runs and naive["total_wall_s"]:
        o = runs["oracle"]["total_wall_s"] / naive["total_wall_s"]
        x = runs["ours"]["total_wall_s"] / runs["oracle"]["total_wall_s"]
        out.append(f"the oracle (exactly fit in flight, this run) got {o:.2f}x naive; ours {x:.2f}x the oracle's wall")
    return out

if __name__ == "__main__":
    sys.exit(main())
