"""The demo's report: markdown + PNG charts (matplotlib) from what the recorder measured.

Every figure is computed here from the run record (``Recorder.snapshot()`` plus the runner's
``config`` / ``final`` / ``outputs``); the pure functions below are what the tests check.

    summary = summarize(run)                   # the numbers (a dict, also written to summary.json)
    paths = build_report(run, "demo-report")   # report.md, tps.png, kv.png, ttft.png, run.json
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

MiB = 2 ** 20


# ============================================================================ pure computations
def sample_durations(samples: list[dict], max_gap_s: float | None = None) -> list[float]:
    """How long each sample stands for: the time to the next sample (the last: the median gap).
    Gaps longer than ``max_gap_s`` (a stalled sampler) are cut to it."""
    ts = [s["t"] for s in samples]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    med = statistics.median(gaps) if gaps else 0.0
    out = gaps + [med] if samples else []
    if max_gap_s is not None:
        out = [min(g, max_gap_s) for g in out]
    return [max(g, 0.0) for g in out]


def _is_active(row: dict) -> bool:
    """Decoding and measured (not warming): the sessions the floor is about."""
    return row.get("state") == "decode" and not row.get("warming") and (row.get("tps_ewma") or 0) > 0


def time_under_floor(samples: list[dict], floor: float | None, max_gap_s: float = 2.0) -> dict:
    """Seconds each session spent decoding (measured), and how many of them below ``floor``;
    the same for the engine-wide ``mean_active_tps``.

    Returns ``{"floor", "sessions": {sid: {"active_s", "under_s", "min_tps", "mean_tps"}},
    "engine": {"active_s", "under_s"}, "session_active_s", "session_under_s"}``.
    """
    dur = sample_durations(samples, max_gap_s)
    per: dict[str, dict] = {}
    eng_active = eng_under = 0.0
    for s, dt in zip(samples, dur):
        for row in s.get("sessions", ()):
            if not _is_active(row):
                continue
            d = per.setdefault(row["session_id"], {"active_s": 0.0, "under_s": 0.0, "min_tps": math.inf,
                                                   "_sum": 0.0})
            tps = float(row["tps_ewma"])
            d["active_s"] += dt
            d["_sum"] += tps * dt
            d["min_tps"] = min(d["min_tps"], tps)
            if floor is not None and tps < floor:
                d["under_s"] += dt
        if (s.get("n_active") or 0) > 0 and s.get("mean_active_tps"):
            eng_active += dt
            if floor is not None and s["mean_active_tps"] < floor:
                eng_under += dt
    for d in per.values():
        d["mean_tps"] = d.pop("_sum") / d["active_s"] if d["active_s"] else None
        if d["min_tps"] == math.inf:
            d["min_tps"] = None
    return {"floor": floor, "sessions": per, "engine": {"active_s": eng_active, "under_s": eng_under},
            "session_active_s": sum(d["active_s"] for d in per.values()),
            "session_under_s": sum(d["under_s"] for d in per.values())}


def settle_windows(events: list[dict], t_end: float | None = None) -> list[dict]:
    """Settle windows from the engine's admission events: a window opens at an ``admit`` on a pool
    with none open (an admit inside an open window extends it) and closes at its ``settle_end``.
    A window still open at the end closes at ``t_end``."""
    open_: dict[Any, dict] = {}
    out: list[dict] = []
    for e in sorted(events, key=lambda e: e["t"]):
        pid = e.get("pool_id")
        if e.get("event") == "admit":
            w = open_.get(pid)
            if w is None:
                open_[pid] = {"pool_id": pid, "t_start": e["t"], "sessions": [e.get("session_id")], "admits": 1}
            else:
                w["sessions"].append(e.get("session_id"))
                w["admits"] += 1
        elif e.get("event") == "settle_end" and pid in open_:
            w = open_.pop(pid)
            w.update(t_end=e["t"], by=e.get("by"), drop=e.get("drop"), mean_at_admit=e.get("mean_at_admit"),
                     mean_settled=e.get("mean_settled"))
            out.append(w)
    for w in open_.values():
        w.update(t_end=t_end if t_end is not None else w["t_start"], by="open at the end")
        out.append(w)
    return sorted(out, key=lambda w: w["t_start"])


def kv_summary(samples: list[dict]) -> dict:
    """Peak and final KV: physical bytes in use vs what the same sessions would hold without
    sharing (see ``recorder.kv_accounting``)."""
    rows = [s["kv"] for s in samples if s.get("kv")]
    if not rows:
        return {"peak_used": 0, "peak_without_sharing": 0, "final": None, "at_peak": None, "ratio_at_peak": None}
    at_peak = max(rows, key=lambda k: (k["without_sharing"], -k["used"]))
    final = rows[-1]
    return {"peak_used": max(k["used"] for k in rows), "peak_without_sharing": max(k["without_sharing"] for k in rows),
            "at_peak": at_peak, "final": final,
            "ratio_at_peak": at_peak["without_sharing"] / at_peak["used"] if at_peak["used"] else None,
            "max_saved": max(k["saved"] for k in rows)}


def ttft_summary(requests: list[dict]) -> dict:
    """Time to first token of requests that attached to a pool vs requests that prefilled their
    whole prompt (nothing cached), both measured in this run (``timings.prompt_ms``)."""
    attach = [r for r in requests if r.get("pool_id") is not None and (r.get("cached_tokens") or 0) > 0
              and r.get("ttft_ms") is not None]
    full = [r for r in requests if (r.get("cached_tokens") or 0) == 0 and r.get("ttft_ms") is not None]
    control = [r for r in full if r.get("role") == "control"]

    def stats(rs: list[dict]) -> dict | None:
        if not rs:
            return None
        ms = [r["ttft_ms"] for r in rs]
        return {"n": len(rs), "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                "median_prompt_tokens": statistics.median(r.get("prompt_tokens") or 0 for r in rs),
                "median_computed_tokens": statistics.median((r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0)
                                                            for r in rs)}

    out = {"attach": stats(attach), "full_prefill": stats(full), "control": stats(control)}
    base = out["control"] or out["full_prefill"]
    out["speedup_median"] = (base["median_ms"] / out["attach"]["median_ms"]
                             if base and out["attach"] and out["attach"]["median_ms"] > 0 else None)
    return out


def request_totals(requests: list[dict]) -> dict:
    """Sums over the recorded model calls (compared with the engine's own counters)."""
    return {"requests": len(requests),
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in requests),
            "cached_prompt_tokens": sum(r.get("cached_tokens") or 0 for r in requests),
            "generated_tokens": sum(r.get("completion_tokens") or 0 for r in requests)}


def cross_check(requests: list[dict], counters: dict | None) -> list[dict]:
    """Rows ``{name, report, engine, match}``: the recorded requests' sums vs the engine's lifetime
    counters (only meaningful when the engine served nothing but this run: the in-process demo)."""
    if not counters:
        return []
    tot = request_totals(requests)
    eng = counters.get("totals", counters)
    rows = []
    for k in ("requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens"):
        if k in eng:
            rows.append({"name": k, "report": tot[k], "engine": eng[k], "match": tot[k] == eng[k]})
    return rows


def admission_summary(events: list[dict], decisions: list[dict]) -> dict:
    """Counts of engine admission events and of the gates' decisions (by decision and reason)."""
    ev: dict[str, int] = {}
    for e in events:
        ev[e.get("event")] = ev.get(e.get("event"), 0) + 1
    dec: dict[str, int] = {}
    reasons: dict[str, int] = {}
    waited: dict[str, float] = {}
    first_wait: dict[str, float] = {}
    for d in sorted(decisions, key=lambda d: d["t"]):
        dec[d["decision"]] = dec.get(d["decision"], 0) + 1
        if d["decision"] != "spawn":
            reasons[d.get("reason") or ""] = reasons.get(d.get("reason") or "", 0) + 1
            first_wait.setdefault(d["agent"], d["t"])
        elif d["agent"] in first_wait:
            waited[d["agent"]] = d["t"] - first_wait[d["agent"]]
    return {"events": ev, "decisions": dec, "wait_reasons": reasons, "waited_s": waited,
            "agents_that_waited": sorted(waited) + sorted(set(first_wait) - set(waited))}


def max_concurrency(samples: list[dict]) -> dict:
    """Most sessions decoding at once, and most agents waiting at a gate at once."""
    dec = max((s.get("n_decoding") or 0 for s in samples), default=0)
    waiting = max((sum(1 for v in (s.get("agents") or {}).values() if v == "waiting") for s in samples), default=0)
    return {"max_decoding": dec, "max_waiting": waiting}


def summarize(run: dict) -> dict:
    """All the report's numbers from the run record."""
    samples = run.get("samples", [])
    cfg = run.get("config", {})
    floor = cfg.get("floor")
    return {
        "wall_s": (run.get("t_end") or 0) - (run.get("t0") or 0),
        "kv": kv_summary(samples),
        "ttft": ttft_summary(run.get("requests", [])),
        "under_floor": time_under_floor(samples, floor),
        "settle_windows": settle_windows(run.get("events", []), run.get("t_end")),
        "admission": admission_summary(run.get("events", []), run.get("decisions", [])),
        "concurrency": max_concurrency(samples),
        "totals": request_totals(run.get("requests", [])),
        "cross_check": cross_check(run.get("requests", []), (run.get("final") or {}).get("counters")),
        "pools_made": [p for p in run.get("pool_ops", []) if p.get("op") != "release"],
        "pools_released": [p for p in run.get("pool_ops", []) if p.get("op") == "release"],
        "compactions": run.get("compactions", []),
    }


# ============================================================================ charts
def _mpl():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


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
    ax.set_ylabel("experienced decode tok/s (EWMA)")
    ax.set_title("Per-session decode speed, the tps floor and the settle windows after each admit")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    ax2.step(xs, [s.get("n_decoding") or 0 for s in samples], where="post", label="sessions decoding")
    ax2.step(xs, [sum(1 for v in (s.get("agents") or {}).values() if v == "waiting") for s in samples],
             where="post", label="agents waiting at a gate", color="red")
    for p in run.get("phases", []):
        for a in (ax, ax2):
            a.axvline(p["t"] - t0, color="grey", lw=0.6, ls=":")
        ax2.annotate(p["name"], (p["t"] - t0, 0), fontsize=6, rotation=90, va="bottom", color="grey")
    ax2.set_xlabel("seconds since the run started")
    ax2.set_ylabel("count")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("KV cache MiB")
    ax.set_title("KV cache in use vs. the same run without prefix sharing")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ============================================================================ markdown
def _short(sid: str) -> str:
    return sid if len(sid) <= 22 else sid[:21] + "…"


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:.1f} MiB"


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, bool) or isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def session_names(requests: list[dict]) -> dict[str, str]:
    """session id -> the agent that used it (anonymous sessions, e.g. the summary, get a name)."""
    out = {}
    for r in requests:
        sid = r.get("session_id")
        if sid and r.get("agent") and r["agent"] != sid:
            out[sid] = f"{r['agent']} ({sid})"
    return out


def _oneline(text: str, n: int = 160) -> str:
    t = " ".join(str(text or "").split()).replace("|", "\\|")
    return t if len(t) <= n else t[: n - 1] + "…"


def render_markdown(run: dict, summary: dict, charts: dict[str, str]) -> str:
    cfg, info = run.get("config", {}), run.get("info", {})
    t0 = run.get("t0", 0.0)
    kv, tt, uf, adm = summary["kv"], summary["ttft"], summary["under_floor"], summary["admission"]
    L: list[str] = []
    add = L.append
    add("# opencoti demo report\n")
    add(f"Model **{info.get('model', '?')}** on **{info.get('transport', '?')}**"
        f"{' (' + info['device'] + ')' if info.get('device') else ''}; "
        f"{cfg.get('agents')} fan-out sub-agents, max {cfg.get('max_tokens')} tokens per answer, "
        f"{'greedy' if cfg.get('seed') is None else 'seed ' + str(cfg.get('seed'))}. "
        f"Run time {summary['wall_s']:.1f} s. Every number below was measured in this run "
        f"(raw data: `run.json`).\n")
    floor = cfg.get("floor")
    add(f"**tps floor: {_f(floor)} tok/s per session** ({cfg.get('floor_source', '')}).\n")

    add("## Headline\n")
    add("| | |\n|---|---|")
    if kv.get("at_peak"):
        add(f"| KV in use at the busiest moment | {_mib(kv['at_peak']['used'])} |")
        add(f"| the same sessions without sharing | {_mib(kv['at_peak']['without_sharing'])} "
            f"({_f(kv['ratio_at_peak'], 2)}x) |")
    if tt["attach"]:
        base = tt["control"] or tt["full_prefill"]
        add(f"| median TTFT attaching to a pool | {tt['attach']['median_ms']:.0f} ms "
            f"({_f(tt['attach']['median_computed_tokens'], 0)} tokens computed) |")
        if base:
            add(f"| TTFT of a full prefill {'of the same prompt' if tt['control'] else ''} | "
                f"{base['median_ms']:.0f} ms ({_f(base['median_computed_tokens'], 0)} tokens computed) |")
    add(f"| most sessions decoding at once / agents waiting at once | {summary['concurrency']['max_decoding']} / "
        f"{summary['concurrency']['max_waiting']} |")
    add(f"| agents that waited for capacity | {len(adm['agents_that_waited'])} "
        f"({', '.join(adm['agents_that_waited']) or 'none'}) |")
    if floor is not None:
        add(f"| session-seconds decoding below the floor | {uf['session_under_s']:.1f} s of "
            f"{uf['session_active_s']:.1f} s |")
    add(f"| tokens generated / prompt tokens / of which cached | {summary['totals']['generated_tokens']} / "
        f"{summary['totals']['prompt_tokens']} / {summary['totals']['cached_prompt_tokens']} |")
    add(f"| compactions | {len(summary['compactions'])} |")
    add("")

    add("## What happened\n")
    add("| t (s) | step | |\n|---:|---|---|")
    for p in run.get("phases", []):
        add(f"| {p['t'] - t0:.1f} | {p['name']} | {_oneline(p.get('text', ''), 200)} |")
    add("")

    add("## Pool tree\n")
    add("Pools made in this run (D = branch position; the pool owns and computed only `[D, L)`).\n")
    add("| t (s) | pool | kind | parent | D | L | own KV | label |\n|---:|---:|---|---:|---:|---:|---:|---|")
    for p in summary["pools_made"]:
        add(f"| {p['t'] - t0:.1f} | {p.get('pool_id')} | {p.get('kind') or p.get('op')} | {_f(p.get('parent'))} | "
            f"{p.get('branch_pos')} | {p.get('prefix_len')} | {_mib(p.get('own_kv_bytes'))} | {p.get('label') or ''} |")
    if summary["pools_released"]:
        add("\nReleased: " + ", ".join(f"pool {p.get('pool_id')} at {p['t'] - t0:.1f} s"
                                       for p in summary["pools_released"]) + ".")
    add("")

    add("## KV cache: shared vs. not shared\n")
    if "kv" in charts:
        add(f"![KV]({charts['kv']})\n")
    if kv.get("at_peak"):
        k = kv["at_peak"]
        add("Physical KV is attributed by ownership: each pool owns its `[D, L)`, each session its suffix; "
            "the sum is the bytes in use. *Without sharing* = every session attached to a pool holding its whole "
            f"context privately: pages(ctx_used) x {k['page_bytes']} bytes per {k['page_size']}-token page, "
            "plus the KV of sessions that share nothing anyway.\n")
        add("| | busiest moment | end of run |\n|---|---:|---:|")
        f = kv["final"]
        for name, key in (("pools own", "pools"), ("sessions own", "sessions"), ("other (unpooled)", "other"),
                          ("**in use**", "used"), ("**without sharing**", "without_sharing"), ("saved", "saved")):
            add(f"| {name} | {_mib(k[key])} | {_mib(f[key])} |")
        add(f"| sessions on pools | {k['n_pool_sessions']} | {f['n_pool_sessions']} |")
    add("")

    add("## Time to first token: attach vs. full prefill\n")
    if "ttft" in charts:
        add(f"![TTFT]({charts['ttft']})\n")
    add("TTFT is the engine's `timings.prompt_ms` (prefill start to first token) of each request.\n")
    add("| agent | pool | prompt tokens | cached | computed | TTFT ms | decode tok/s | tokens out |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(run.get("requests", []), key=lambda r: r.get("t_end") or 0):
        add(f"| {r.get('agent')} | {_f(r.get('pool_id'))} | {r.get('prompt_tokens')} | {r.get('cached_tokens')} | "
            f"{(r.get('prompt_tokens') or 0) - (r.get('cached_tokens') or 0)} | {_f(r.get('ttft_ms'), 0)} | "
            f"{_f(r.get('decode_tps'))} | {r.get('completion_tokens')} |")
    add("")

    add("## Decode speed and the floor\n")
    if "tps" in charts:
        add(f"![tps]({charts['tps']})\n")
    add(f"Shaded: settle windows (after a new session is admitted the pool waits until it has decoded "
        f"{cfg.get('settle_tokens', '?')} tokens or {cfg.get('settle_max_ms', '?')} ms before judging the next admit). "
        "Time under the floor counts sample intervals in which a decoding, measured session's EWMA was below it.\n")
    add("| session | decoding s | under floor s | mean tok/s | min tok/s |\n|---|---:|---:|---:|---:|")
    names = session_names(run.get("requests", []))
    for sid, d in sorted(uf["sessions"].items()):
        add(f"| {names.get(sid, sid)} | {d['active_s']:.1f} | {d['under_s']:.1f} | {_f(d['mean_tps'])} | {_f(d['min_tps'])} |")
    add(f"| **engine mean_active_tps** | {uf['engine']['active_s']:.1f} | {uf['engine']['under_s']:.1f} | | |")
    add("")

    add("## Admission\n")
    add("Gate decisions (the graph's `CapacityGateNode`s): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(adm["decisions"].items())) + ". ")
    if adm["wait_reasons"]:
        add("Reasons to wait: " + ", ".join(f"{k} ({v})" for k, v in sorted(adm["wait_reasons"].items())) + ".")
    if adm["waited_s"]:
        add("\nWaited for capacity: " + ", ".join(f"{a} {s:.1f} s" for a, s in sorted(adm["waited_s"].items())) + ".")
    add("\nEngine admission events: " + ", ".join(f"{k}: {v}" for k, v in sorted(adm["events"].items())) + ".\n")
    add("| t (s) | pool | event | session | detail |\n|---:|---:|---|---|---|")
    for e in sorted(run.get("events", []), key=lambda e: e["t"]):
        detail = ""
        if e.get("event") == "settle_end":
            detail = (f"by {e.get('by')} after {_f(e.get('settle_ms'), 0)} ms; mean {_f(e.get('mean_at_admit'))} -> "
                      f"{_f(e.get('mean_settled'))} tok/s; drop/admit EWMA {_f(e.get('drop_per_admit_ewma'), 2)}")
        elif e.get("event") == "policy":
            detail = f"floor {_f(e.get('target_tps_per_session'))}, {e.get('mode')}, settle {e.get('settle_tokens')} tokens"
        elif e.get("event") == "admit":
            detail = f"mean at admit {_f(e.get('mean_at_admit'))} tok/s"
        else:
            detail = str(e.get("reason") or e.get("kind") or "")
        add(f"| {e['t'] - t0:.1f} | {e.get('pool_id')} | {e.get('event')} | {e.get('session_id') or ''} | {detail} |")
    add("\nGate decisions that admitted an agent:\n")
    add("| t (s) | agent | pool | reason | mean tok/s | projected if admitted |\n|---:|---|---:|---|---:|---:|")
    for d in run.get("decisions", []):
        if d["decision"] == "spawn":
            add(f"| {d['t'] - t0:.1f} | {d['agent']} | {d['pool_id']} | {d.get('reason')} | "
                f"{_f(d.get('mean_active_tps'))} | {_f(d.get('projected_mean_tps_if_admitted'))} |")
    add("")

    add("## Compaction by re-fork\n")
    if not summary["compactions"]:
        add("No compaction happened in this run.\n")
    for c in summary["compactions"]:
        add(f"- at {c.get('t_start', c['t']) - t0:.1f} s, **{c.get('agent')}** crossed the threshold (compaction pressure "
            f"{_f(c.get('pressure'), 2)} >= {_f(c.get('threshold'), 2)}, context {c.get('ctx_before')} tokens): "
            f"its {c.get('n_summarized')} older messages were summarized, the stable ancestor pool "
            f"{c.get('ancestor_pool_id')} (system + tools) was forked into pool {c.get('new_pool_id')} with the summary "
            f"+ {c.get('n_kept')} recent messages, pool {c.get('old_pool_id')} was released "
            f"({'yes' if c.get('old_pool_released') else 'no'}); KV pages in use {c.get('kv_pages_before')} -> "
            f"{c.get('kv_pages_after')}, context {c.get('ctx_before')} -> {c.get('ctx_after')} tokens "
            f"(done at {c['t'] - t0:.1f} s).")
    add("")

    if summary["cross_check"]:
        add("## Cross-check with the engine's own counters\n")
        add("| counter | sum over this report's requests | engine | |\n|---|---:|---:|---|")
        for r in summary["cross_check"]:
            add(f"| {r['name']} | {r['report']} | {r['engine']} | {'ok' if r['match'] else 'MISMATCH'} |")
        add("")

    outs = run.get("outputs", {})
    if outs:
        add("## What the agents wrote\n")
        if outs.get("answer"):
            add("**Final answer (main agent):**\n")
            add("> " + _oneline(outs["answer"], 1200) + "\n")
        for name, text in outs.get("agents", {}).items():
            add(f"- **{name}**: {_oneline(text, 220)}")
        add("")
    if run.get("graph_mermaid"):
        add("## The graph\n")
        add("The LangGraph graph that ran (subgraphs expanded one level):\n")
        add("```mermaid\n" + run["graph_mermaid"].strip() + "\n```\n")
    if run.get("errors"):
        add("## Errors during the run\n")
        for e in run["errors"]:
            add(f"- {e}")
    return "\n".join(L) + "\n"


def _json_default(o: Any):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "model_dump"):
        return o.model_dump()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def build_report(run: dict, out_dir: str | Path, *, charts: bool = True) -> dict[str, Path]:
    """Write ``report.md``, ``summary.json``, ``run.json`` and (``charts``) the PNGs into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    paths: dict[str, Path] = {}
    names: dict[str, str] = {}
    if charts:
        for key, fn in (("tps", plot_tps), ("kv", plot_kv), ("ttft", plot_ttft)):
            paths[key] = fn(run, summary, out / f"{key}.png")
            names[key] = f"{key}.png"
    md = render_markdown(run, summary, names)
    paths["report"] = out / "report.md"
    paths["report"].write_text(md)
    paths["summary"] = out / "summary.json"
    paths["summary"].write_text(json.dumps(summary, indent=1, default=_json_default))
    paths["run"] = out / "run.json"
    paths["run"].write_text(json.dumps(run, default=_json_default))
    return paths
