#!/usr/bin/env python
"""Write the simulator's derived and synthetic profiles (``opencoti/sim/profiles``).

The measured profiles come from ``sim_measure.py`` (this machine: ``epyc-2core-avx2`` quiet,
``epyc-2core-avx2-loaded`` measured while the machine was shared and loaded). The others are
written here from the parameters below, so they can be reviewed and regenerated; every profile's
``fit`` follows the rule of ``opencoti.sim.ramp.choose_fit``:

* ``avx512-fast-cpu``: a faster CPU with AVX-512 (derived, not measured): a few times the 2-core
  machine's speed, a fixed cost per step that is small next to the per-sequence cost, little noise.
* ``gpu-knee``: a GPU-like curve: flat up to a knee of 8 sequences (memory-bound decode), then
  linear (compute-bound); little noise.
* ``bursty-neighbour``: the loaded measured profile with a noisy neighbour: calm and burst periods
  (exponential lengths, means 8 s and 3 s) during which every step costs 1.8x more.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opencoti.sim.profile import PROFILE_DIR, StepProfile  # noqa: E402
from opencoti.sim.ramp import choose_fit  # noqa: E402

MEASURED = "epyc-2core-avx2-loaded"  # the base of bursty-neighbour


def profiles() -> list[StepProfile]:
    out = [
        StepProfile(name="avx512-fast-cpu", source="derived", description=__doc__.split("* ")[1].strip(),
                    base_s=0.012, seq_s=0.0045, ctx_s=2e-7, prefill_s=0.00012, noise_sigma=0.04,
                    stall_prob=0.002, stall_mean_s=0.02,
                    ramp={"tasks": 12, "tokens": 400, "prompt_tokens": 60, "cached_tokens": 40}),
        StepProfile(name="gpu-knee", source="synthetic", description=__doc__.split("* ")[2].strip(),
                    base_s=0.012, seq_s=0.0025, knee=8, ctx_s=5e-8, prefill_s=0.00002, noise_sigma=0.03,
                    stall_prob=0.001, stall_mean_s=0.01,
                    ramp={"tasks": 20, "tokens": 1500, "prompt_tokens": 60, "cached_tokens": 40}),
    ]
    measured = StepProfile.load(MEASURED)
    out.append(replace(measured, name="bursty-neighbour", source="derived",
                       description=__doc__.split("* ")[3].strip().replace("\n", " "),
                       burst_factor=1.8, burst_on_mean_s=3.0, burst_off_mean_s=8.0, measured_mean_s={}))
    for p in out:  # every profile's fit by the same rule as the measured ones (sim_measure.py)
        p.ramp = {**{k: v for k, v in p.ramp.items() if k != "fit"}, "fit": choose_fit(p, p.ramp)}
    return out


def main() -> None:
    for p in profiles():
        p.description = " ".join(p.description.split())
        path = PROFILE_DIR / f"{p.name}.json"
        path.write_text(p.to_json())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
