"""The demo report's charts (matplotlib, Agg): per-session tps vs the floor, KV by ownership, TTFT."""

from __future__ import annotations

import math
from pathlib import Path

from .report_calc import MiB, _is_active, _short, session_names


def _mpl():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


ELAPSED = "seconds since the run started"


def _axis(ax, xlabel: str | None, ylabel: str, **legend) -> None:
    """Labels, legend and grid of a time-series axis."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(**legend)
    ax.grid(alpha=0.3)


def _saved(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tps(run: dict, summary: dict, path: Path) -> Path:
    """Per-session tps over time, the floor, settle windows; below: sessions decoding / agents waiting."""
    plt = _mpl()
    samples, t0 = run.get("samples", []), run.get("t0", 0.0)
    floor = run.get("config", {}).get("floor")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12.5, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    series: dict[str, tuple[list, list]] = {}
    for s in samples:
        present = set()
        for row in s.get("sessions", ()):
            sid = row["session_id"]
            xs, ys = series.setdefault(sid, ([], []))
            xs.append(s["t"] - t0)
            ys.append(row["tps_ewma"] if _is_active(row) else math.nan)
            present.add(sid)
        for sid, (xs, ys) in series.items():
            if sid not in present and ys and not math.isnan(ys[-1]):
                xs.append(s["t"] - t0)
                ys.append(math.nan)
    cmap = plt.get_cmap("tab20")
    names = session_names(run.get("requests", []))
    for i, (sid, (xs, ys)) in enumerate(sorted(series.items())):
        if all(math.isnan(y) for y in ys):
            continue
        ax.plot(xs, ys, lw=1.4, color=cmap(i % 20), label=_short(names.get(sid, sid).split(" (")[0]))
    xs = [s["t"] - t0 for s in samples]
    ax.plot(xs, [s.get("mean_active_tps") if (s.get("n_active") or 0) > 0 else math.nan for s in samples],
            color="black", lw=2.2, ls="--", label="mean active tps")
    if floor is not None:
        ax.axhline(floor, color="red", lw=2, label=f"floor {floor:.1f} tok/s")
    for i, w in enumerate(summary["settle_windows"]):
        ax.axvspan(w["t_start"] - t0, w["t_end"] - t0, color="orange", alpha=0.18,
                   label="settle window" if i == 0 else None)
    for e in run.get("events", []):
        if e.get("event") == "admit":
            ax.axvline(e["t"] - t0, color="orange", lw=0.8, alpha=0.8)
    ax.set_title("Per-session decode speed, the tps floor and the settle windows after each admit")
    _axis(ax, None, "experienced decode tok/s (EWMA)", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.step(xs, [s.get("n_decoding") or 0 for s in samples], where="post", label="sessions decoding")
    ax2.step(xs, [sum(1 for v in (s.get("agents") or {}).values() if v == "waiting") for s in samples],
             where="post", label="agents waiting at a gate", color="red")
    for p in run.get("phases", []):
        for a in (ax, ax2):
            a.axvline(p["t"] - t0, color="grey", lw=0.6, ls=":")
        ax2.annotate(p["name"], (p["t"] - t0, 0), fontsize=6, rotation=90, va="bottom", color="grey")
    _axis(ax2, ELAPSED, "count", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _saved(plt, fig, path)


def plot_kv(run: dict, summary: dict, path: Path) -> Path:
    """KV bytes in use (pools + sessions, by ownership) vs the same sessions without sharing."""
    plt = _mpl()
    samples, t0 = [s for s in run.get("samples", []) if s.get("kv")], run.get("t0", 0.0)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = [s["t"] - t0 for s in samples]
    pools = [s["kv"]["pools"] / MiB for s in samples]
    sess = [(s["kv"]["sessions"] + s["kv"]["other"]) / MiB for s in samples]
    ax.stackplot(xs, pools, sess, labels=["used: pools (shared prefixes)", "used: sessions (own suffixes)"],
                 colors=["#4c72b0", "#55a868"], alpha=0.75)
    ax.plot(xs, [s["kv"]["without_sharing"] / MiB for s in samples], color="red", lw=2,
            label="without sharing: every session holds its whole context")
    ax.set_title("KV cache in use vs. the same run without prefix sharing")
    _axis(ax, ELAPSED, "KV cache MiB", fontsize=8, loc="upper left")
    return _saved(plt, fig, path)


def plot_ttft(run: dict, summary: dict, path: Path) -> Path:
    """TTFT of every request, colored by whether it attached to a pool or prefilled everything."""
    plt = _mpl()
    reqs = [r for r in run.get("requests", []) if r.get("ttft_ms") is not None]
    reqs.sort(key=lambda r: r.get("t_end") or 0)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 1.2]})
    names = [f"{r.get('agent')}" for r in reqs]
    colors = ["#55a868" if (r.get("cached_tokens") or 0) > 0 else "#c44e52" for r in reqs]
    ax.bar(range(len(reqs)), [r["ttft_ms"] for r in reqs], color=colors)
    ax.set_xticks(range(len(reqs)))
    ax.set_xticklabels(names, rotation=70, fontsize=7)
    ax.set_ylabel("time to first token, ms")
    ax.set_title("TTFT per request (green: attached to a pool, red: full prefill)")
    ax.grid(axis="y", alpha=0.3)
    t = summary["ttft"]
    base = t["control"] or t["full_prefill"]
    labels, vals = [], []
    if t["attach"]:
        labels.append(f"attach\n(median of {t['attach']['n']})")
        vals.append(t["attach"]["median_ms"])
    if base:
        labels.append("full prefill\n(same prompt)" if t["control"] else "full prefill")
        vals.append(base["median_ms"])
    ax2.bar(labels, vals, color=["#55a868", "#c44e52"][:len(vals)])
    for i, v in enumerate(vals):
        ax2.annotate(f"{v:.0f} ms", (i, v), ha="center", va="bottom", fontsize=9)
    ax2.set_title("median TTFT")
    ax2.grid(axis="y", alpha=0.3)
    return _saved(plt, fig, path)
