#!/usr/bin/env python
"""Measure the real engine's step costs on the bundled model and fit a simulator profile.

Runs n = 1 .. ``--max-batch`` sessions decoding together (each ``--tokens`` tokens, greedy,
ignore_eos, on one shared pool like the admission ramp; the batch sizes interleaved over
``--repeats`` rounds; the weight format of ``--weights``, ``auto`` by default like the real ramp
``bench_admission.py``, so the profile is of the engine that ramp runs), records every engine step
(sequences, prompt tokens, context tokens, wall time) from the core's ``step`` event, and fits an
``opencoti.sim.StepProfile`` (``fit_profile``). Writes the raw records to
``benchmarks/results/sim_measure.json`` and the profile to ``opencoti/sim/profiles/<--name>.json``.

This is done once per machine kind; the machine's load average is recorded with the profile,
since a shared machine's load shows in every step it times.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import log, make_engine, machine_info, write_json  # noqa: E402

from opencoti.sim.ramp import choose_fit  # noqa: E402  (the rule every profile's fit follows)

SYSTEM = "You are a meticulous research assistant. Answer in detail and never stop early."


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--max-batch", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=4, help="rounds over the batch sizes")
    p.add_argument("--name", default="epyc-2core-avx2")
    p.add_argument("--refit", action="store_true",
                   help="fit again from the records of the last run (benchmarks/results/sim_measure.json)")
    args = p.parse_args()
    from opencoti.engine import SamplingParams
    from opencoti.sim.profile import PROFILE_DIR, StepProfile, fit_profile

    if args.refit:
        path = PROFILE_DIR / f"{args.name}.json"
        old = StepProfile.load(path)
        records = json.loads((common.RESULTS_DIR / "sim_measure.json").read_text())["records"]
        prof = fit_profile(records, args.name, description=old.description)
        prof.machine, prof.ramp = old.machine, {**old.ramp, "fit": choose_fit(prof, old.ramp)}
        path.write_text(prof.to_json())
        print(prof.to_json())
        return

    eng = make_engine(args)
    weights = eng.weights_info().get("format", args.weights)
    records: list[dict] = []
    core = eng.core

    def on_event(event: str, data: dict) -> None:  # the step thread, right after each step
        if event != "step":
            return
        st = data["stats"]
        if not st.num_seqs:
            return
        running = list(core.scheduler.running)
        records.append({"b": st.num_seqs, "decode": st.num_decode, "prefill": st.num_prefill_tokens,
                        "ctx_sum": sum(len(j.seq.tokens) for j in running), "total_s": st.total_s})

    pool = eng.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    eng.run_on_step_thread(lambda: core.listeners.append(on_event))
    load0 = os.getloadavg()
    # batch sizes interleaved round by round, so a load that drifts over the run (a shared
    # machine) spreads over every batch size instead of masquerading as a batch-size effect
    for rep in range(args.repeats):
        for n in range(1, args.max_batch + 1):
            barrier = threading.Barrier(n)

            def run(i: int) -> None:
                barrier.wait()
                sid = f"m{n}-{rep}-{i}"
                eng.generate(messages=[{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": f"Essay number {i} on topic {n * 7 + rep}."}],
                             params=SamplingParams.greedy(args.tokens, ignore_eos=True), pool_id=pool.pool_id,
                             session_id=sid)
                eng.release_session(sid)

            common.run_threads(n, run)
            log(f"round {rep + 1}, batch {n}: {len(records)} steps recorded so far")
    load1 = os.getloadavg()
    eng.shutdown()
    info = machine_info()
    prof = fit_profile(records, args.name, description=(
        f"Measured on this machine ({info.get('cpu', '?')}) with the bundled model, {weights} weights, "
        f"{args.max_batch} batch sizes x {args.repeats} interleaved rounds x {args.tokens} tokens; load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} at the end (the measurement's own threads included)."))
    prof.machine = {"cpu": info.get("cpu"), "cpu_flags_of_interest": info.get("cpu_flags_of_interest"),
                    "weights": weights, "load_avg_before": load0[0], "load_avg_after": load1[0],
                    "steps": len(records)}
    ramp = {"tasks": 10, "tokens": 200, "prompt_tokens": 60, "cached_tokens": 40}
    prof.ramp = {**ramp, "fit": choose_fit(prof, ramp)}
    path = PROFILE_DIR / f"{args.name}.json"
    path.write_text(prof.to_json())
    write_json("sim_measure", {"machine": info, "records": records, "profile": args.name}, args.out)
    log(f"profile written to {path}")
    print(prof.to_json())


if __name__ == "__main__":
    main()
