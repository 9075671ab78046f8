#!/usr/bin/env python
"""The spawn ramp (issue 4): naive vs settled admission, on the bundled model, in ONE process.

An orchestrator loop spawns a new session on one pool whenever it believes capacity allows,
checking once per ``--tick`` (1 s). Each spawned session decodes ``--tokens`` tokens (greedy,
ignore_eos) and is released when done; ``--tasks`` sessions are spawned in all. The tps floor is
chosen so that exactly ``--fit`` concurrent sessions stay above it (from a calibration measured
first in the same process: per-session decode tps with n = 1 .. ``--calibrate-max`` concurrent
sessions; the floor is the midpoint between tps(fit) and tps(fit+1)). ``--fit`` defaults to the
largest k whose calibration curve decreases strictly through k+1: per-session tps is not
monotonic in the batch size on every machine (on a 2-core CPU the lm_head matmul is ~2x slower
for 2-3 rows than for 4), and "the number that fits" is the largest n such that every batch
size up to n stays above the floor (a ramp passes through all of them).

Two policies, same engine, each on a fresh pool (ours runs first, so it starts with a cold
step-cost model):

* ``ours``: spawn when ``engine.capacity(pool)["can_admit"]`` (advisory policy with the floor:
  projected mean after the admit, settle window, warming exclusion, idle estimate, guarantee).
* ``naive``: spawn when nothing is measured yet (no active session) or the raw ``mean_active_tps``
  >= floor (no projection, no settle) — the courier's original rule (spec §14.1 root causes 1, 4).

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

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, now, print_table  # noqa: E402

from opencoti.sim.ramp import decode_shares  # noqa: E402

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
def calibrate(eng, n_max: int, tokens: int) -> dict[int, float]:
    """Mean per-session decode tps (predicted_per_second) with n sessions decoding together."""
    out = {}
    for n in range(1, n_max + 1):
        res = [None] * n
        barrier = threading.Barrier(n)

        def run(i):
            barrier.wait()
            res[i] = eng.generate(messages=messages(i), params=greedy(tokens), session_id=f"cal-{n}-{i}")
            eng.release_session(f"cal-{n}-{i}")

        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out[n] = sum(r.timings["predicted_per_second"] for r in res) / n
        log(f"calibration: {n} concurrent sessions -> {out[n]:.2f} tok/s per session")
    return out


# ============================================================================ the ramp
def ramp(eng, policy: str, floor: float, n_tasks: int, tokens: int, tick: float) -> dict:
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
        if policy == "ours":
            cap = eng.capacity(pid)
            return cap["can_admit"], {k: cap[k] for k in ("reason", "mean_active_tps", "projected_mean_tps_if_admitted",
                                                          "settling", "n_warming")}
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
    out["under_share"], out["deep_share"] = decode_shares(token_times.values(), floor)
    out["tok_s"] = n_tasks * tokens / out["total_wall_s"]
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
    p.add_argument("--calibration-tokens", type=int, default=48)
    p.add_argument("--floor", type=float, default=None, help="use this floor instead of calibrating")
    args = p.parse_args()
    if args.quick:
        args.tasks, args.tokens = min(args.tasks, 5), min(args.tokens, 96)
    common.set_threads(args.threads)
    info = common.machine_info()
    log(common.describe_machine(info))
    eng = common.make_engine(args, kv_budget_tokens=16384)
    eng.configure_tps(history_interval_s=0.1)
    eng.generate("warm up", params=greedy(8))
    n_max = max(args.calibrate_max, (args.fit or 0) + 1)
    cal = calibrate(eng, n_max, args.calibration_tokens)
    if args.fit is None:
        args.fit = 1
        while args.fit + 1 < n_max and cal[args.fit + 2] < cal[args.fit + 1]:
            args.fit += 1
    floor = args.floor if args.floor is not None else (cal[args.fit] + cal[args.fit + 1]) / 2
    fits = 0
    while fits < n_max and cal[fits + 1] >= floor:
        fits += 1
    args.fit = fits
    log(f"floor {floor:.2f} tok/s per session: {fits} session(s) fit")
    runs = {}
    for policy in ("ours", "naive"):
        log(f"ramp: {policy} ({args.tasks} sessions x {args.tokens} tokens, tick {args.tick} s)")
        runs[policy] = ramp(eng, policy, floor, args.tasks, args.tokens, args.tick)
        r = runs[policy]
        log(f"  {policy}: under floor {r['time_under_floor_s']:.1f} s, dip {fmt(r['deepest_dip_tps'])}, "
            f"max {r['max_sessions']} sessions, wall {r['total_wall_s']:.1f} s")
    eng.check_integrity()
    eng.shutdown()
    ours, naive = runs["ours"], runs["naive"]
    rows = [[k, r["time_under_floor_s"], r["deepest_dip_tps"], f"{r['max_sessions']} (fit {args.fit})",
             r["max_sessions"] - args.fit, r["total_wall_s"]] for k, r in runs.items()]
    print_table(["policy", "under floor s", "deepest dip tps", "max sessions", "overshoot", "wall s"], rows,
                title=f"spawn ramp: floor {floor:.2f} tok/s/session, {args.tasks} x {args.tokens} tokens, "
                      f"tick {args.tick} s")
    def rel(key):
        return ours[key] / naive[key] if naive[key] else (0.0 if not ours[key] else None)

    print_table(["policy", "under-floor share", "deep share", "overshoot", "wall s", "tok/s"],
                [[k, f"{r['under_share']:.3f}", f"{r['deep_share']:.4f}", r["max_sessions"] - args.fit,
                  r["total_wall_s"], r["tok_s"]] for k, r in runs.items()],
                title="the metrics of the simulator benchmark (session-decode seconds, from token times)")
    over = {k: r["max_sessions"] - args.fit for k, r in runs.items()}
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
    ratio = (ours["time_under_floor_s"] / naive["time_under_floor_s"]) if naive["time_under_floor_s"] else None
    ok_ratio = ours["time_under_floor_s"] <= 0.5 * naive["time_under_floor_s"] + 1e-9
    ok_over = over["ours"] <= 1
    print("\ncalibration (per-session tps by concurrency): "
          + ", ".join(f"{n}: {v:.2f}" for n, v in cal.items()))
    print(f"engine-mean time under floor, ours / naive: {fmt(ratio)}")
    info["loadavg_end"] = common.machine_info()["loadavg"]
    path = common.write_json("admission", {"config": vars(args), "machine": info, "calibration": cal,
                                           "floor": floor, "runs": runs,
                                           "targets": {"under_floor_ratio": ratio, "under_floor_ok": ok_ratio,
                                                       "overshoot_ok": ok_over,
                                                       "ratios": {k: x for k, (x, _) in targets.items()},
                                                       "overshoot": over}}, args.out)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
