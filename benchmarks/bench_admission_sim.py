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
naive. The ``conservative`` columns run the same ramp with ``forecast: conservative`` (mean * n/(n+1)
until a measured drop exists) for comparison; the ``oracle`` column keeps exactly ``fit`` sessions
in flight (what a perfect policy gets on the profile: when even it misses a target, the profile's
noise makes that target unreachable). A plot of one seed per profile (floor, per-session
tps, sessions in flight; ours vs naive) goes to ``docs/img/admission_sim.png``.
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


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--profiles", nargs="*", default=None, help=f"default: all of {profile_names()}")
    p.add_argument("--plot", default=str(common.REPO_ROOT / "docs" / "img" / "admission_sim.png"))
    p.add_argument("--no-conservative", action="store_true", help="skip the conservative-forecast columns")
    args = p.parse_args()
    names = args.profiles or profile_names()
    seeds = range(3 if args.quick else args.seeds)
    profiles = [StepProfile.load(n) for n in names]
    rows, payload = [], {"seeds": list(seeds), "targets": TARGETS, "profiles": {}}
    t0 = time.perf_counter()
    for prof in profiles:
        cfg = RampConfig.for_profile(prof)
        c = compare(prof, seeds)
        cons = None if args.no_conservative else compare(prof, seeds, admission={"forecast": "conservative"})
        orc = compare(prof, seeds, policy="oracle")
        m = c["means"]
        rows.append([prof.name, prof.source, cfg.fit, fmt(c["floor"]),
                     f"{m['ours']['under_share']:.3f} / {m['naive']['under_share']:.3f}", fmt(c["under_ratio"]),
                     f"{m['ours']['deep_share']:.4f} / {m['naive']['deep_share']:.4f}", fmt(c["deep_ratio"]),
                     c["overshoot_max"], fmt(c["wall_ratio"]), fmt(c["tok_s_ratio"]),
                     "-" if cons is None else fmt(cons["under_ratio"]), "-" if cons is None else fmt(cons["wall_ratio"]),
                     f"{fmt(orc['under_ratio'])} / {fmt(orc['deep_ratio'])} / {fmt(orc['wall_ratio'])}",
                     "PASS" if passes(c) else "fail" + ("" if passes(orc) else " (oracle too)")])
        payload["profiles"][prof.name] = {"ramp": cfg.__dict__, "tps_by_batch": {
            b: expected_tps(prof, b, cfg) for b in range(1, cfg.fit + 3)}, "adaptive": c, "conservative": cons,
            "oracle": orc}
        log(f"{prof.name}: done ({time.perf_counter() - t0:.0f} s)")
    print_table(["profile", "source", "fit", "floor", "under ours/naive", "under x", "deep ours/naive", "deep x",
                 "overshoot", "wall x", "tok/s x", "cons. under x", "cons. wall x", "oracle under/deep/wall x",
                 "targets"], rows,
                title=f"spawn ramp on the simulator, {len(seeds)} seeds per profile (x = ours / naive)")
    write_json("admission_sim", payload, args.out)
    if args.plot:
        plot(profiles, 0, Path(args.plot))


if __name__ == "__main__":
    main()
