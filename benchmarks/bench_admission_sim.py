#!/usr/bin/env python
"""Admission on the simulator: ours (the adaptive forecast) vs naive, per profile, over many seeds.

For every step-cost profile in ``opencoti/sim/profiles`` (measured on this machine, or derived /
synthetic), the spawn ramp (``opencoti.sim.ramp``) runs with the naive rule and with ours on the
same seeds; the real ``AdmissionController`` and ``Metrics`` run unchanged on the simulated clock.
Printed per profile (means over seeds; ratios are ours / naive on the same profile and seeds).
The headline is on held-out seeds (``--seeds`` 40 from ``--first-seed`` 20): the policy's constants
were tuned on seeds 0-19, which are reported separately as tuning seeds. Every profile's ``fit``
must follow the rule of ``opencoti.sim.ramp.choose_fit`` (the run stops otherwise):

* under: share of session-decode seconds under the floor; deep: under 80 % of it;
* overshoot: the most sessions in flight beyond ``fit`` (ours: the worst seed);
* wall: first spawn to last token; tok/s: tokens / wall.

Targets on every profile: under <= 0.5x naive, deep <= 0.2x naive, overshoot <= 1, wall <= 1.15x
naive. Also printed, on the same seeds:

* ``oracle``: keeps exactly ``fit`` sessions in flight, ``oracle+1``: exactly ``fit + 1`` (the
  most the overshoot target allows); they know the answer, so what they miss is the profile's
  doing (its noise, or the throughput naive gains by overloading), not the learning's;
* the wall bound (``opencoti.sim.bounds``): the least expected wall time of ANY schedule that never
  has more than ``fit`` (``fit + 1``) sessions in flight, from the profile alone; when the fit + 1
  bound is above 1.15x naive's wall, the wall target cannot be met together with the overshoot
  target; when the fit bound is, it cannot be met while the floor is held (naive is faster by
  running sessions under the floor), and the verdict says what fit + 1 costs the floor;
* ``gate = ours``: seeds on which the LangGraph gate (``CapacityGateNode`` + ``SpawnPacer``, its
  decision code driven on the simulated clock) spawned at exactly the same times as ours;
* ``cons.``: the same ramp with ``forecast: conservative`` (mean * n/(n+1) until a measured drop
  exists), for comparison.

A plot of one seed per profile (floor, per-session tps, sessions in flight; ours vs naive) goes to
``docs/img/admission_sim.png``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, print_table, write_json  # noqa: E402

from opencoti.sim.profile import StepProfile, profile_names  # noqa: E402
from opencoti.sim.ramp import RampConfig, choose_fit, compare, expected_tps, run_ramp  # noqa: E402

TARGETS = {"under_ratio": 0.5, "deep_ratio": 0.2, "overshoot_max": 1, "wall_ratio": 1.15}


def passes(c: dict) -> bool:
    return all(c[k] <= v + 1e-12 for k, v in TARGETS.items())


def plot(profiles: list[StepProfile], seed: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(profiles), figsize=(4.2 * len(profiles), 6.4), squeeze=False)
    for col, prof in enumerate(profiles):
        runs = {pol: run_ramp(prof, pol, seed, keep_timeline=True) for pol in ("naive", "ours")}
        top, bottom = axes[0][col], axes[1][col]
        for pol, color in (("naive", "#b2182b"), ("ours", "#1b7837")):
            tl = runs[pol].timeline
            top.plot([p[0] for p in tl], [p[2] if p[2] is not None else float("nan") for p in tl], color=color,
                     label=f"{pol}: mean tps")
            bottom.step([p[0] for p in tl], [p[1] for p in tl], where="post", color=color, label=pol)
        top.axhline(runs["ours"].floor, color="black", ls="--", lw=1, label="floor")
        top.axhline(0.8 * runs["ours"].floor, color="grey", ls=":", lw=1, label="80 % of floor")
        fit = RampConfig.for_profile(prof).fit
        bottom.axhline(fit, color="black", ls="--", lw=1, label=f"fit = {fit}")
        top.set_title(prof.name, fontsize=10)
        top.set_ylabel("per-session tps (engine mean)")
        bottom.set_ylabel("sessions in flight")
        bottom.set_xlabel("simulated time (s)")
        if col == 0:
            top.legend(fontsize=7)
            bottom.legend(fontsize=7)
    fig.suptitle(f"spawn ramp on the simulator (seed {seed}): ours vs naive", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    log(f"plot written to {out}")


def verdict(c: dict, orc: dict, orc1: dict) -> str:
    """PASS, or the targets missed, each with what the oracles and the wall bound say about it:
    unreachable under the overshoot target (any schedule with at most fit + 1 in flight is slower),
    unreachable while the floor is held (at most fit in flight is slower; then what fit + 1 costs
    the floor), or missed by an oracle too."""
    if passes(c):
        return "PASS"
    out = []
    for k, v in TARGETS.items():
        if c[k] <= v + 1e-12:
            continue
        why = []
        wb = c["wall_bound"]
        if k == "wall_ratio" and wb["fit+1"]["ratio"] > v:
            why.append(f"UNREACHABLE within overshoot 1: bound {fmt(wb['fit+1']['ratio'])}x, short by "
                       f"{fmt(wb['fit+1']['ratio'] - v)}x")
        elif k == "wall_ratio" and wb["fit+0"]["ratio"] > v:
            why.append(f"UNREACHABLE holding the floor: bound with fit in flight {fmt(wb['fit+0']['ratio'])}x, short "
                       f"by {fmt(wb['fit+0']['ratio'] - v)}x; fit + 1 in flight (oracle+1): under "
                       f"{fmt(orc1['under_ratio'])}x, deep {fmt(orc1['deep_ratio'])}x")
        elif orc[k] > v and orc1[k] > v:
            why.append(f"both oracles miss it: {fmt(orc[k])} / {fmt(orc1[k])}")
        elif orc[k] > v:
            why.append(f"the oracle misses it too: {fmt(orc[k])}")
        out.append(f"{k.split('_')[0]} {fmt(c[k])}" + (f" ({'; '.join(why)})" if why else ""))
    return "miss: " + ", ".join(out)


TUNING_SEEDS = 20  # seeds 0..19: the policy's constants were tuned on them


def seed_sets(held_out: int, first_held_out: int, tuning: int, quick: bool = False) -> dict[str, list[int]]:
    """The seeds of the headline (``held_out`` seeds from ``first_held_out``: never among the seeds
    the policy was tuned on) and the tuning seeds 0.. reported separately (``tuning`` of them, at
    most ``TUNING_SEEDS``). ``quick``: 3 of each."""
    if quick:
        held_out, tuning = min(held_out, 3), min(tuning, 3)
    if held_out < 1 or tuning < 0:
        raise ValueError("at least one held-out seed; tuning seeds >= 0")
    if first_held_out < TUNING_SEEDS:
        raise ValueError(f"held-out seeds must start at {TUNING_SEEDS} or later: seeds 0-{TUNING_SEEDS - 1} "
                         f"are the ones the policy was tuned on")
    return {"held_out": list(range(first_held_out, first_held_out + held_out)),
            "tuning": list(range(min(tuning, TUNING_SEEDS)))}


def evaluate(prof: StepProfile, seeds: list[int], conservative: bool) -> tuple[list, list, dict]:
    """(table row, wall-bound row, JSON) of one profile on ``seeds``."""
    cfg = RampConfig.for_profile(prof)
    naive = [run_ramp(prof, "naive", s, cfg) for s in seeds]
    c = compare(prof, seeds, naive=naive)
    gate = compare(prof, seeds, policy="gate", naive=naive)
    same = sum(a["spawns"] == b["spawns"] for a, b in zip(c["runs"]["ours"], gate["runs"]["ours"]))
    cons = compare(prof, seeds, admission={"forecast": "conservative"}, naive=naive) if conservative else None
    orc = compare(prof, seeds, policy="oracle", naive=naive)
    orc1 = compare(prof, seeds, policy="oracle+1", naive=naive)
    m = c["means"]
    o3 = lambda x: f"{fmt(x['under_ratio'])} / {fmt(x['deep_ratio'])} / {fmt(x['wall_ratio'])}"  # noqa: E731
    row = [prof.name, prof.source, cfg.fit, fmt(c["floor"]),
           f"{m['ours']['under_share']:.3f} / {m['naive']['under_share']:.3f}", fmt(c["under_ratio"]),
           f"{m['ours']['deep_share']:.4f} / {m['naive']['deep_share']:.4f}", fmt(c["deep_ratio"]),
           c["overshoot_max"], fmt(c["wall_ratio"]), fmt(c["tok_s_ratio"]), o3(orc), o3(orc1),
           "-" if cons is None else f"{fmt(cons['under_ratio'])} / {fmt(cons['wall_ratio'])}",
           f"{same}/{len(seeds)}", verdict(c, orc, orc1)]
    wb = c["wall_bound"]
    brow = [prof.name, m["naive"]["wall_s"], wb["fit+0"]["wall_s"], fmt(wb["fit+0"]["ratio"]),
            wb["fit+1"]["wall_s"], fmt(wb["fit+1"]["ratio"]), fmt(orc["wall_ratio"]), fmt(orc1["wall_ratio"]),
            fmt(c["wall_ratio"])]
    out = {"ramp": cfg.__dict__, "fit_by_rule": choose_fit(prof),
           "tps_by_batch": {b: expected_tps(prof, b, cfg) for b in range(1, cfg.fit + 3)},
           "adaptive": c, "gate": gate, "gate_same_spawns": same, "conservative": cons, "oracle": orc,
           "oracle+1": orc1, "passes": passes(c), "verdict": verdict(c, orc, orc1)}
    return row, brow, out


HEADERS = ["profile", "source", "fit", "floor", "under ours/naive", "under x", "deep ours/naive", "deep x",
           "overshoot", "wall x", "tok/s x", "oracle under/deep/wall x", "oracle+1 under/deep/wall x",
           "cons. under/wall x", "gate = ours", "targets"]


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40, help="held-out seeds (the headline)")
    p.add_argument("--first-seed", type=int, default=TUNING_SEEDS,
                   help=f"the first held-out seed (>= {TUNING_SEEDS}: 0-{TUNING_SEEDS - 1} are the tuning seeds)")
    p.add_argument("--tuning-seeds", type=int, default=TUNING_SEEDS,
                   help="tuning seeds 0.. to report separately (0: none)")
    p.add_argument("--profiles", nargs="*", default=None, help=f"default: all of {profile_names()}")
    p.add_argument("--plot", default=str(common.REPO_ROOT / "docs" / "img" / "admission_sim.png"))
    p.add_argument("--no-conservative", action="store_true", help="skip the conservative-forecast columns")
    args = p.parse_args()
    try:
        sets = seed_sets(args.seeds, args.first_seed, args.tuning_seeds, args.quick)
    except ValueError as e:
        p.error(str(e))
    names = args.profiles or profile_names()
    profiles = [StepProfile.load(n) for n in names]
    wrong_fit = {prof.name: (prof.ramp.get("fit"), choose_fit(prof)) for prof in profiles
                 if prof.ramp.get("fit") != choose_fit(prof)}
    if wrong_fit:  # every profile's fit follows the documented rule (sim_profiles.py / sim_measure.py write it)
        p.error(f"profiles whose fit does not follow the rule (fit, rule): {wrong_fit}")
    load_before = common.load_snapshot()
    machine = common.machine_info()
    payload: dict = {"config": {"quick": args.quick, "seeds": args.seeds, "first_seed": args.first_seed,
                                "tuning_seeds": args.tuning_seeds, "profiles": names,
                                "conservative": not args.no_conservative},
                     "seeds": sets, "headline": "held_out", "targets": TARGETS, "machine": machine,
                     "load_before": load_before, "fit_rule": choose_fit.__doc__, "profiles": {}}
    t0 = time.perf_counter()
    for kind in ("held_out", "tuning"):
        seeds = sets[kind]
        if not seeds:
            continue
        rows, brows = [], []
        for prof in profiles:
            row, brow, out = evaluate(prof, seeds, not args.no_conservative)
            rows.append(row)
            brows.append(brow)
            payload["profiles"].setdefault(prof.name, {})[kind] = out
            log(f"{prof.name}, {kind} seeds: done ({time.perf_counter() - t0:.0f} s)")
        label = (f"HELD-OUT seeds {seeds[0]}-{seeds[-1]} (the headline: the policy was not tuned on them)"
                 if kind == "held_out" else
                 f"tuning seeds {seeds[0]}-{seeds[-1]} (the policy's constants were tuned on these; for reference)")
        print_table(HEADERS, rows, title=f"spawn ramp on the simulator, {label}, {len(seeds)} seeds per profile "
                                         f"(x = ours / naive)")
        print_table(["profile", "naive wall s", "bound fit s", "x", "bound fit+1 s", "x", "oracle wall x",
                     "oracle+1 wall x", "ours wall x"], brows,
                    title=f"wall time ({kind.replace('_', '-')} seeds): the lower bound of any schedule with at most "
                          f"fit (+1) sessions in flight (opencoti.sim.bounds) vs naive's mean wall")
    met = {n: v["held_out"]["passes"] for n, v in payload["profiles"].items()}
    print(f"\nheld-out seeds: all four targets met on {sum(met.values())}/{len(met)} profiles "
          f"({', '.join(n for n, ok in met.items() if ok) or 'none'})")
    payload["held_out_profiles_meeting_all_targets"] = met
    payload["machine_end"] = common.machine_info()
    payload["seconds"] = time.perf_counter() - t0
    write_json("admission_sim", payload, args.out)
    if args.plot and not args.quick:  # (the docs' plot is the full run's: a quick run never replaces it)
        plot(profiles, sets["held_out"][0], Path(args.plot))


if __name__ == "__main__":
    main()
