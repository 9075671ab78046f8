#!/usr/bin/env python
"""Admission on the simulator: ours (the adaptive forecast) vs naive, per profile, over many seeds.

For every step-cost profile in ``opencoti/sim/profiles`` (measured on this machine, or derived /
synthetic), the spawn ramp (``opencoti.sim.ramp``) runs with the naive rule and with ours on the
same seeds; the real ``AdmissionController`` and ``Metrics`` run unchanged on the simulated clock.
Printed per profile (means over seeds; ratios are ours / naive on the same profile and seeds):

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
from opencoti.sim.ramp import RampConfig, compare, expected_tps, run_ramp  # noqa: E402

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


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--profiles", nargs="*", default=None, help=f"default: all of {profile_names()}")
    p.add_argument("--plot", default=str(common.REPO_ROOT / "docs" / "img" / "admission_sim.png"))
    p.add_argument("--no-conservative", action="store_true", help="skip the conservative-forecast columns")
    args = p.parse_args()
    names = args.profiles or profile_names()
    seeds = list(range(3 if args.quick else args.seeds))
    profiles = [StepProfile.load(n) for n in names]
    rows, brows, payload = [], [], {"seeds": seeds, "targets": TARGETS, "profiles": {}}
    t0 = time.perf_counter()
    for prof in profiles:
        cfg = RampConfig.for_profile(prof)
        naive = [run_ramp(prof, "naive", s, cfg) for s in seeds]
        c = compare(prof, seeds, naive=naive)
        gate = compare(prof, seeds, policy="gate", naive=naive)
        same = sum(a["spawns"] == b["spawns"] for a, b in zip(c["runs"]["ours"], gate["runs"]["ours"]))
        cons = None if args.no_conservative else compare(prof, seeds, admission={"forecast": "conservative"},
                                                         naive=naive)
        orc = compare(prof, seeds, policy="oracle", naive=naive)
        orc1 = compare(prof, seeds, policy="oracle+1", naive=naive)
        m = c["means"]
        o3 = lambda x: f"{fmt(x['under_ratio'])} / {fmt(x['deep_ratio'])} / {fmt(x['wall_ratio'])}"  # noqa: E731
        rows.append([prof.name, prof.source, cfg.fit, fmt(c["floor"]),
                     f"{m['ours']['under_share']:.3f} / {m['naive']['under_share']:.3f}", fmt(c["under_ratio"]),
                     f"{m['ours']['deep_share']:.4f} / {m['naive']['deep_share']:.4f}", fmt(c["deep_ratio"]),
                     c["overshoot_max"], fmt(c["wall_ratio"]), fmt(c["tok_s_ratio"]), o3(orc), o3(orc1),
                     "-" if cons is None else f"{fmt(cons['under_ratio'])} / {fmt(cons['wall_ratio'])}",
                     f"{same}/{len(seeds)}", verdict(c, orc, orc1)])
        wb = c["wall_bound"]
        brows.append([prof.name, m["naive"]["wall_s"], wb["fit+0"]["wall_s"], fmt(wb["fit+0"]["ratio"]),
                      wb["fit+1"]["wall_s"], fmt(wb["fit+1"]["ratio"]), fmt(orc["wall_ratio"]), fmt(orc1["wall_ratio"]),
                      fmt(c["wall_ratio"])])
        payload["profiles"][prof.name] = {"ramp": cfg.__dict__, "tps_by_batch": {
            b: expected_tps(prof, b, cfg) for b in range(1, cfg.fit + 3)}, "adaptive": c, "gate": gate,
            "gate_same_spawns": same, "conservative": cons, "oracle": orc, "oracle+1": orc1,
            "verdict": verdict(c, orc, orc1)}
        log(f"{prof.name}: done ({time.perf_counter() - t0:.0f} s)")
    print_table(["profile", "source", "fit", "floor", "under ours/naive", "under x", "deep ours/naive", "deep x",
                 "overshoot", "wall x", "tok/s x", "oracle under/deep/wall x", "oracle+1 under/deep/wall x",
                 "cons. under/wall x", "gate = ours", "targets"], rows,
                title=f"spawn ramp on the simulator, {len(seeds)} seeds per profile (x = ours / naive)")
    print_table(["profile", "naive wall s", "bound fit s", "x", "bound fit+1 s", "x", "oracle wall x",
                 "oracle+1 wall x", "ours wall x"], brows,
                title="wall time: the lower bound of any schedule with at most fit (+1) sessions in flight "
                      "(opencoti.sim.bounds) vs naive's mean wall")
    write_json("admission_sim", payload, args.out)
    if args.plot:
        plot(profiles, 0, Path(args.plot))


if __name__ == "__main__":
    main()
