"""The demo report's numbers: pure functions over the run record (what the tests check)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .gate_effect import gate_effect

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
        "gate_effect": gate_effect(run),
        "settle_windows": settle_windows(run.get("events", []), run.get("t_end")),
        "admission": admission_summary(run.get("events", []), run.get("decisions", [])),
        "concurrency": max_concurrency(samples),
        "totals": request_totals(run.get("requests", [])),
        "cross_check": cross_check(run.get("requests", []), (run.get("final") or {}).get("counters")),
        "pools_made": [p for p in run.get("pool_ops", []) if p.get("op") != "release"],
        "pools_released": [p for p in run.get("pool_ops", []) if p.get("op") == "release"],
        "compactions": run.get("compactions", []),
    }


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
