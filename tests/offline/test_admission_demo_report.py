"""The demo report's "with and without the gate" numbers (opencoti.demo.gate_effect) on a scripted run:
the run's own speed curve and model calls replayed on the simulator, once as they happened (gated)
and once with every agent starting when it reached its gate."""

from __future__ import annotations

import pytest

from opencoti.demo.gate_effect import gate_effect, gate_waits, speed_profile, workload
from opencoti.demo.report import build_report

T0 = 1000.0
TPS = {1: 10.0, 2: 9.5, 3: 9.0, 4: 6.0, 5: 5.0}  # per-session tok/s by sessions decoding: 3 fit above 7.5


def scripted_run(floor: float | None = 7.5) -> dict:
    samples = []
    t = T0
    for b, tps in TPS.items():
        for i in range(6):
            t += 0.25
            samples.append({"t": t, "n_decoding": b, "n_active": b, "mean_active_tps": tps * (1 + 0.02 * (i % 3 - 1)),
                            "sessions": []})
    samples.append({"t": t + 0.25, "n_decoding": 0, "n_active": 0, "mean_active_tps": None, "sessions": []})
    agents, requests = {}, []
    for i in range(6):
        arrive = T0 + 1.0
        start = arrive if i < 3 else arrive + 6.0  # the gate held three of them for 6 s
        agents[f"sub-{i}"] = {"history": [(arrive, "waiting"), (start, "running"), (start + 5.0, "done")]}
        requests.append({"agent": f"sub-{i}", "session_id": f"sub-{i}", "pool_id": 2, "prompt_tokens": 120,
                         "cached_tokens": 100, "completion_tokens": 40, "t_start": start, "t_end": start + 5.0,
                         "ttft_ms": 20.0})
    requests.append({"agent": "lead", "session_id": "lead", "pool_id": 1, "prompt_tokens": 50, "cached_tokens": 0,
                     "completion_tokens": 5, "t_start": T0 + 0.2, "t_end": T0 + 0.9, "ttft_ms": 100.0})
    agents["lead"] = {"history": [(T0 + 0.2, "running"), (T0 + 0.9, "idle")]}
    return {"t0": T0, "t_end": T0 + 30.0, "config": {"floor": floor, "agents": 6}, "samples": samples,
            "agents": agents, "requests": requests, "decisions": [], "events": [], "phases": [], "pool_ops": []}


def test_speed_profile_from_the_samples():
    run = scripted_run()
    prof = speed_profile(run["samples"], run["requests"])
    for b, tps in TPS.items():
        assert 1.0 / prof.decode_s(b, 0.0) == pytest.approx(tps, rel=0.03)
    assert prof.decode_s(7, 0.0) > prof.decode_s(5, 0.0)  # a line beyond what was measured
    assert prof.prefill_s == pytest.approx(0.001)  # the attaches' TTFT over their computed tokens
    assert speed_profile([], []) is None


def test_workload_starts_held_agents_when_they_reached_their_gate():
    run = scripted_run()
    assert gate_waits(run["agents"])["sub-4"] == [(T0 + 1.0, T0 + 7.0)]
    assert "lead" not in gate_waits(run["agents"])
    calls = {c["agent"]: c for c in workload(run)}
    assert calls["sub-4"]["start"] == pytest.approx(7.0) and calls["sub-4"]["start_ungated"] == pytest.approx(1.0)
    assert calls["sub-0"]["start"] == calls["sub-0"]["start_ungated"] == pytest.approx(1.0)
    assert calls["lead"]["start"] == calls["lead"]["start_ungated"] == pytest.approx(0.2)
    assert calls["sub-4"]["cached"] == 100 and calls["sub-4"]["tokens"] == 40


def test_gate_effect_with_and_without_the_gate():
    ge = gate_effect(scripted_run())
    assert ge["agents_held"] == ["sub-3", "sub-4", "sub-5"] and ge["held_s"] == pytest.approx(18.0)
    w, wo = ge["with_gate"], ge["without_gate"]
    assert w["max_decoding"] == 3 and wo["max_decoding"] == 6
    assert w["under_share"] < 0.5 * wo["under_share"] and wo["deep_share"] > w["deep_share"]
    assert wo["wall_s"] < w["wall_s"]  # without the gate the run ends sooner (and below the floor)
    assert gate_effect(scripted_run(floor=None)) is None
    assert gate_effect({**scripted_run(), "samples": []}) is None


def test_report_shows_the_gate_effect(tmp_path):
    paths = build_report(scripted_run(), tmp_path, charts=False)
    md = paths["report"].read_text()
    assert "### With and without the gate" in md
    assert "with / without the gate (this run replayed)" in md
    assert "sub-3, sub-4, sub-5" in md
