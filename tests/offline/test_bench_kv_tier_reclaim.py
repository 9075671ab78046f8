"""``bench_kv_tier_reclaim``: each side's steps are classed by what began them (a reclaim between two steps,
the writer's work at a step's start, nothing) and measured against the quiet steps around them; its
arguments reach the sides' processes without ``--out``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kv_tier_reclaim as bench  # noqa: E402


def _run(reclaim_ms: float, work_every: int) -> dict:
    """10 ms steps; every 100th step holds a reclaim of ``reclaim_ms``; every ``work_every``-th step (from
    step 20 to 300) begins with 0.5 ms of the writer's work."""
    times, reclaims, work, t = [0.0], [], [], 0.0
    for i in range(1, 600):
        d = 0.010
        if i % 100 == 50:
            reclaims.append({"t0": t + 0.001, "t1": t + 0.001 + reclaim_ms / 1e3, "ms": reclaim_ms, "pages": 375,
                             "session_pages": 375, "copied_pages": 375 if reclaim_ms > 5 else 0, "held_pages": 0})
            d += reclaim_ms / 1e3
        elif work_every and 20 <= i < 300 and i % work_every == 0:
            work.append((t + 0.0001, t + 0.0006))
            d += 0.0005
        t += d
        times.append(t)
    return {"times": times, "work_spans": work, "reclaims": reclaims, "free_share_before": 0.1,
            "written_ahead_before_reclaims": 0, "decoder_outlasted_reclaims": True,
            "pacer": {"fills": len(work), "fill_s": 0.0005 * len(work), "step_turns": 0, "step_turn_s": 0.0}}


@pytest.mark.parametrize("reclaim_ms", [1.0, 20.0])
def test_the_steps_holding_a_reclaim_show_its_time(reclaim_ms):
    s = bench.summarize_side([_run(reclaim_ms, work_every=3)])
    rec, work, quiet = s["classes"]["reclaim"], s["classes"]["work"], s["classes"]["quiet"]
    assert rec["steps"] == 6 and rec["median_vs_quiet"] == pytest.approx(1 + reclaim_ms / 10, rel=0.02)
    assert work["steps"] > 80 and work["median_vs_quiet"] == pytest.approx(1.05, rel=0.02)
    assert quiet["median_vs_quiet"] == pytest.approx(1.0, rel=0.01) and quiet["share_over_1_1x_quiet"] == 0
    assert s["reclaims"] == 6 and s["reclaim_ms"]["median"] == reclaim_ms
    assert s["reclaim_copied_pages"] == (6 * 375 if reclaim_ms > 5 else 0)
    assert s["step_thread_s"] == pytest.approx(6 * reclaim_ms / 1e3 + s["fill_s"])


def test_the_sides_get_every_argument_but_the_output():
    argv = ["--quick", "--out", "x.json", "--sessions", "2", "--out=y.json", "--threads", "2"]
    assert bench._without(argv, "--out") == ["--quick", "--sessions", "2", "--threads", "2"]
