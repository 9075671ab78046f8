#!/usr/bin/env python
"""PNG plots from benchmark results (matplotlib, Agg backend: no display needed).

    .venv/bin/python benchmarks/plots.py [benchmarks/results/fanout.json] [--out docs/img]

``plot_fanout(payload, out_dir)`` is also called by bench_fanout.py at the end of a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
MIB = 2**20

STYLE = {  # system -> (color, marker)
    "opencoti-pool": ("#1b7837", "o"),
    "opencoti-nopool": ("#7fbf7b", "s"),
    "hf-recompute": ("#b2182b", "v"),
    "hf-copy": ("#ef8a62", "^"),
    "hf-batch": ("#2166ac", "D"),
    "hf-cb": ("#67a9cf", "P"),
}
METRICS = [  # key, axis label, log scale, scale
    ("wall_s", "total wall time (s)", True, 1.0),
    ("ttft_p50_s", "TTFT p50 (s)   [dashed: p95]", True, 1.0),
    ("aggregate_decode_tps", "aggregate decode tok/s", False, 1.0),
    ("peak_kv_bytes", "peak KV (MiB)", True, 1 / MIB),
]


def _points(table: list[dict], system: str, fixed: str, value: int, vary: str) -> list[dict]:
    rows = [r for r in table if r["system"] == system and r[fixed] == value]
    return sorted(rows, key=lambda r: r[vary])


def _scaling_figure(payload: dict, vary: str, out: Path) -> Path:
    cfg = payload["config"]
    fixed = "prefix" if vary == "sessions" else "sessions"
    value = cfg["target"][fixed]
    Q, G = cfg["suffix"], cfg["gen"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, label, log, scale) in zip(axes.flat, METRICS):
        for system in cfg["systems"]:
            pts = _points(payload["table"], system, fixed, value, vary)
            pts = [p for p in pts if p.get(key) is not None]
            if not pts:
                continue
            color, marker = STYLE.get(system, ("gray", "o"))
            xs = [p[vary] for p in pts]
            ax.plot(xs, [p[key] * scale for p in pts], marker=marker, color=color,
                    label=payload["labels"].get(system, system))
            if key == "ttft_p50_s":
                ax.plot(xs, [p["ttft_p95_s"] for p in pts], linestyle="--", color=color, alpha=0.6)
        if vary == "prefix":  # the single-session runs at every P (where the slow alternatives were measured)
            n1 = min(r["sessions"] for r in payload["table"])
            for system in cfg["systems"] if n1 != value else []:
                pts = [p for p in _points(payload["table"], system, "sessions", n1, "prefix") if p.get(key) is not None]
                if len(pts) < 2:
                    continue
                color, marker = STYLE.get(system, ("gray", "o"))
                ax.plot([p["prefix"] for p in pts], [p[key] * scale for p in pts], marker=marker, color=color,
                        linestyle=":", markerfacecolor="none", alpha=0.8, linewidth=1)
            if n1 != value:
                ax.plot([], [], color="gray", linestyle=":", marker="o", markerfacecolor="none", linewidth=1,
                        label=f"dotted, hollow: N = {n1}")
        if key == "peak_kv_bytes":  # the ideal ownership lines
            bpt = cfg["kv_bytes_per_token"]
            xs = sorted({r[vary] for r in payload["table"] if r[fixed] == value})
            if vary == "sessions":
                shared = [(value + n * (Q + G)) * bpt / MIB for n in xs]
                copies = [n * (value + Q + G) * bpt / MIB for n in xs]
            else:
                shared = [(p + value * (Q + G)) * bpt / MIB for p in xs]
                copies = [value * (p + Q + G) * bpt / MIB for p in xs]
            ax.plot(xs, shared, color="black", linestyle=":", linewidth=1, label="ideal P + N(Q+G)")
            ax.plot(xs, copies, color="gray", linestyle=":", linewidth=1, label="ideal N(P+Q+G)")
        ax.set_xscale("log", base=2)
        xs_all = sorted({r[vary] for r in payload["table"] if r[fixed] == value})
        ax.set_xticks(xs_all)
        ax.set_xticklabels([str(x) for x in xs_all])
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("N sessions" if vary == "sessions" else "P prefix tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    what = f"P = {value}" if vary == "sessions" else f"N = {value}"
    fig.suptitle(f"Shared-prefix fan-out, {what}, Q = {Q}, G = {G} ({cfg['model']}, {cfg['dtype']}, "
                 f"{cfg['device']})", fontsize=11)
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _grid_figure(payload: dict, out: Path) -> Path:
    """opencoti-pool over the whole grid: one line per P, against N."""
    cfg = payload["config"]
    rows = [r for r in payload["table"] if r["system"] == "opencoti-pool"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    cmap = plt.get_cmap("viridis")
    prefixes = sorted({r["prefix"] for r in rows})
    for k, P in enumerate(prefixes):
        pts = sorted((r for r in rows if r["prefix"] == P), key=lambda r: r["sessions"])
        xs = [r["sessions"] for r in pts]
        color = cmap(k / max(len(prefixes) - 1, 1))
        axes[0].plot(xs, [r["ttft_p50_s"] for r in pts], marker="o", color=color, label=f"P={P} p50")
        axes[0].plot(xs, [r["ttft_p95_s"] for r in pts], linestyle="--", color=color, alpha=0.6)
        axes[1].plot(xs, [r["aggregate_decode_tps"] for r in pts], marker="o", color=color, label=f"P={P}")
        axes[1].plot(xs, [r["per_session_decode_tps"] for r in pts], linestyle="--", color=color, alpha=0.6)
        axes[2].plot(xs, [r["peak_kv_bytes"] / MIB for r in pts], marker="o", color=color, label=f"P={P}")
    for ax, ylab in zip(axes, ["TTFT s (solid p50, dashed p95)", "decode tok/s (solid aggregate, dashed per session)",
                               "peak KV (MiB)"]):
        ax.set_xscale("log", base=2)
        xs_all = sorted({r["sessions"] for r in rows})
        ax.set_xticks(xs_all)
        ax.set_xticklabels([str(x) for x in xs_all])
        ax.set_xlabel("N sessions")
        ax.set_ylabel(ylab)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"opencoti with a pool, every (P, N) (Q = {cfg['suffix']}, G = {cfg['gen']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _breakdown_figure(payload: dict, out: Path) -> Path | None:
    prof = payload.get("profile") or {}
    if not prof.get("decode_steps"):
        return None
    parts = prof["parts_ms"]
    names = {"gemm": "GEMMs (projections, MLP, lm_head)", "attention": "attention", "attention_plan":
             "attention planning", "model_other_ops": "other model ops", "model_python": "forward's Python",
             "schedule": "scheduling", "metadata": "attention metadata", "sampling": "sampling",
             "token_handling": "token handling", "step_rest": "rest of step"}
    colors = ["#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#b2182b", "#d6604d", "#f4a582", "#fddbc7",
              "#bababa"]
    fig, ax = plt.subplots(figsize=(10, 3.0))
    left = 0.0
    for (key, ms), color in zip(parts.items(), colors):
        ms = max(ms, 0.0)
        ax.barh([0], [ms], left=left, color=color, edgecolor="#555555", linewidth=0.3,
                label=f"{names.get(key, key)} {ms:.1f} ms")
        left += ms
    ov = payload.get("overhead") or {}
    if ov.get("model_ms_median") is not None and ov.get("period_ms_median") is not None:
        m, per = ov["model_ms_median"], ov["period_ms_median"]
        ax.barh([1], [m], color="#2166ac")
        ax.barh([1], [per - m], left=m, color="#b2182b")
        ax.text(per, 1, f"  unprofiled: model {m:.1f} ms + rest {per - m:.1f} ms per step-loop period", va="center",
                fontsize=8)
        ax.set_xlim(0, max(left, per) * 1.6)
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["profiled step", "unprofiled\n(StepStats)"])
    ax.set_xlabel("ms per decode step")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    ax.set_title(f"opencoti decode step at P = {prof['prefix']}, N = {prof['sessions']} "
                 f"({prof['decode_steps']} steps, torch.profiler)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_fanout(payload: dict, out_dir: Path) -> list[Path]:
    """Write the fan-out PNGs; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outs = [_scaling_figure(payload, "sessions", out_dir / "fanout_scaling_n.png"),
            _scaling_figure(payload, "prefix", out_dir / "fanout_scaling_p.png"),
            _grid_figure(payload, out_dir / "fanout_grid_opencoti.png"),
            _breakdown_figure(payload, out_dir / "fanout_step_breakdown.png")]
    return [o for o in outs if o is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="?", default=str(BENCH_DIR / "results" / "fanout.json"))
    p.add_argument("--out", default=str(BENCH_DIR.parent / "docs" / "img"))
    args = p.parse_args(argv)
    payload = json.loads(Path(args.results).read_text())
    if payload.get("benchmark") != "fanout":
        print(f"no plots for benchmark {payload.get('benchmark')!r}", file=sys.stderr)
        return 2
    for png in plot_fanout(payload, Path(args.out)):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
