"""``bench_kv_tier_steps.classify``: each step is divided by the quiet steps just before and after its
window, so a drift over the run (the context grows) cancels and a window's own cost shows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kv_tier_steps as bench  # noqa: E402


def _run(slowdown: float):
    """Steps of 10 ms growing 1 % a second; 1 s windows of writing (each step ``slowdown`` x) between 1 s
    held (quiet) stretches, after a copy window."""
    spans, windows, t = [], [], 0.0
    windows.append(("copy", 0.95, 1.0, 1))
    for sec in range(0, 12):
        writing = sec % 2 == 1  # (0 s to 1 s: quiet, then writing and held in turn)
        if writing:
            windows.append(("write", float(sec), sec + 1.0, 1))
        while t < sec + 1.0:
            d = 0.01 * (1 + 0.01 * t) * (slowdown if writing else 1.0)
            spans.append((t, t + d))
            t += d + 1e-4
    return bench.classify(spans, windows)


@pytest.mark.parametrize("slowdown", [1.0, 1.2])
def test_a_windows_steps_are_measured_against_the_quiet_ones_around_it(slowdown):
    out = _run(slowdown)
    write = out[("write", 1)]
    # (a step that straddles a window's start is the window's: one a window may be a quiet one)
    assert len(write) > 400 and bench._quantile(write, 0.05) == pytest.approx(slowdown, rel=0.02)
    assert max(write) == pytest.approx(slowdown, rel=0.02)  # the drift cancels (1 % a second over 12 s)
    quiet = out[("quiet", -1)]
    assert len(quiet) > 400 and all(v == pytest.approx(1.0, rel=0.02) for v in quiet)


def test_the_percentile_helper():
    vals = [float(i) for i in range(100)]
    assert bench._quantile(vals, 0.5) == 50.0 and bench._quantile(vals, 0.99) == 99.0
    assert bench._quantile(vals, 1.0) == 99.0
