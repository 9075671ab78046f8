"""What the capacity gate did for this run: the run's own workload replayed on the simulator, with
and without the gate (pure functions over the run record; ``report_calc.summarize`` calls them).

The run happened once, with the gate; the run without it did not happen. So both are replayed on
the simulator (``opencoti.sim``) with what this run measured:

1. **speed**: the run's samples give the experienced per-session tps at each number of sessions
   decoding (the median of ``mean_active_tps`` over the samples with that many decoding); a step
   takes 1 / that tps there, a straight line through those points beyond them, with a log-normal
   noise of the sampled spread and a prompt-token cost from the attaches' TTFT.
2. **workload**: every recorded model call (its start, prompt tokens, cached tokens, tokens
   generated). With the gate, each starts when it started in this run; without it, the calls of
   an agent that waited at a gate start that much earlier (every agent spawns when it reaches its
   gate); the other calls keep their start times.
3. both replays on the same seeds; the share of session-decode seconds under the floor (and
   under 80 % of it) comes from the simulated token times, as in the simulator benchmark
   (``opencoti.sim.ramp.decode_shares``), the mean over seeds.

The replay with the gate, next to the share measured in the run itself, shows how close the
replay is to what happened.
"""

from __future__ import annotations

import math
import statistics

SEEDS = (0, 1, 2, 3, 4)
MIN_SAMPLES = 3  # samples with b sessions decoding before b counts as measured
HELD_S = 0.5  # an agent that waited at its gate at least this long was held (a spawn itself takes a moment)


def speed_profile(samples: list[dict], requests: list[dict]):
    """A ``StepProfile`` of this run's speed (see the module docstring), or None if nothing decoded."""
    from ..sim.profile import StepProfile, _lstsq

    by_b: dict[int, list[float]] = {}
    for s in samples:
        b, tps = s.get("n_decoding") or 0, s.get("mean_active_tps")
        if b >= 1 and tps and tps > 0:
            by_b.setdefault(int(b), []).append(float(tps))
    by_b = {b: v for b, v in by_b.items() if len(v) >= MIN_SAMPLES}
    if not by_b:
        return None
    table = {b: 1.0 / statistics.median(v) for b, v in by_b.items()}
    bs = sorted(table)
    if len(bs) >= 2:
        base_s, seq_s = _lstsq([[1.0, float(b)] for b in bs], [table[b] for b in bs])
        seq_s = max(seq_s, 0.0)
    else:  # one size measured: every further session costs a full share
        base_s, seq_s = 0.0, table[bs[0]] / bs[0]
    logs = [math.log(x / statistics.median(v)) for v in by_b.values() for x in v]
    sigma = 1.4826 * statistics.median(abs(x) for x in logs) if logs else 0.0
    per_tok = [r["ttft_ms"] / 1e3 / ((r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0))
               for r in requests if r.get("ttft_ms") and (r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0) >= 8]
    prefill_s = statistics.median(per_tok) if per_tok else 0.0
    return StepProfile(name="this run", source="measured", base_s=base_s, seq_s=seq_s, table=table,
                       noise_sigma=sigma, prefill_s=prefill_s)


def gate_waits(agents: dict) -> dict[str, list[tuple[float, float]]]:
    """agent -> [(reached its gate, spawned)] from the agents' lifecycle histories."""
    out: dict[str, list[tuple[float, float]]] = {}
    for name, a in agents.items():
        arrived = None
        for t, state in a.get("history") or ():
            if state == "waiting":
                arrived = t
            elif state == "running" and arrived is not None:
                out.setdefault(name, []).append((arrived, t))
                arrived = None
    return out


def workload(run: dict) -> list[dict]:
    """The recorded model calls: ``{agent, start, start_ungated, prompt, cached, tokens}`` (times
    from the run's start)."""
    t0 = run.get("t0") or 0.0
    waits = gate_waits(run.get("agents") or {})
    out = []
    for r in run.get("requests") or ():
        if r.get("t_start") is None or not r.get("completion_tokens"):
            continue
        start = r["t_start"] - t0
        shift = sum(sp - ar for ar, sp in waits.get(r.get("agent"), ()) if sp - t0 <= start + 1e-6)
        out.append({"agent": r.get("agent"), "start": start, "start_ungated": start - shift,
                    "prompt": max(int(r.get("prompt_tokens") or 1), 1),
                    "cached": max(0, min(int(r.get("cached_tokens") or 0), int(r.get("prompt_tokens") or 1) - 1)),
                    "tokens": int(r["completion_tokens"])})
    return out


def replay(profile, calls: list[dict], key: str, floor: float, seed: int) -> dict:
    """One replay of ``calls`` (starting at ``call[key]``) on ``profile``: the under-floor shares,
    the most sessions decoding at once, and the wall time."""
    from ..engine.config import SamplingParams
    from ..sim.engine import SimEngine
    from ..sim.ramp import decode_shares

    sim = SimEngine(profile, seed)
    pools = {}
    times: dict[str, list[float]] = {}
    peak = [0]

    def on_token(job, t):
        times[job.session.session_id].append(t)
        peak[0] = max(peak[0], len(sim.core.scheduler.running))

    sim.on_token = on_token
    sim.on_finish = lambda job, t: sim.core.release_session(job.session.session_id)
    for i, c in sorted(enumerate(calls), key=lambda ic: (ic[1][key], ic[0])):
        sim.run_until(max(c[key], 0.0))
        if c["cached"] and c["cached"] not in pools:
            pools[c["cached"]] = sim.core.add_pool(c["cached"]).pool_id
        sid = f"call-{i}"
        times[sid] = []
        sim.admission.submit(list(range(1, c["prompt"] + 1)), SamplingParams.greedy(c["tokens"], ignore_eos=True),
                             lambda ev: None, session_id=sid, pool_id=pools.get(c["cached"])).result()
    guard = 0
    while sim.has_work and guard < 10_000_000:
        sim.step()
        guard += 1
    under, deep = decode_shares(times.values(), floor)
    return {"under_share": under, "deep_share": deep, "max_decoding": peak[0], "wall_s": sim.t}


def gate_effect(run: dict, seeds=SEEDS) -> dict | None:
    """The under-floor share of this run with and without the gate (see the module docstring);
    None without a floor, a gate that held anyone, or speed samples."""
    floor = (run.get("config") or {}).get("floor")
    if not floor:
        return None
    calls = workload(run)
    waits = {a: sum(sp - ar for ar, sp in pairs) for a, pairs in gate_waits(run.get("agents") or {}).items()}
    waited = sorted(a for a, w in waits.items() if w >= HELD_S and any(c["agent"] == a for c in calls))
    profile = speed_profile(run.get("samples") or [], run.get("requests") or [])
    if profile is None or not calls:
        return None
    out = {"floor": floor, "seeds": list(seeds), "agents_held": waited, "held_s": sum(waits[a] for a in waited),
           "speed_tps": {b: 1.0 / s for b, s in sorted(profile.table.items())}, "noise_sigma": profile.noise_sigma}
    for name, key in (("with_gate", "start"), ("without_gate", "start_ungated")):
        rows = [replay(profile, calls, key, floor, s) for s in seeds]
        out[name] = {k: sum(r[k] for r in rows) / len(rows) for k in ("under_share", "deep_share", "wall_s")}
        out[name]["max_decoding"] = max(r["max_decoding"] for r in rows)
    return out
