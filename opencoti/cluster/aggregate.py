"""Merging the answers of several replicas into one cluster-wide answer (pure functions).

Every merged object keeps the shape of the single-server answer (clients written for
``opencoti serve`` read it unchanged) and adds ``replica`` fields and a ``replicas`` breakdown.
"""

from __future__ import annotations

import re
import time

SUM_KEYS_POOLS = ("pools_used", "pools_max", "kv_pages_total", "kv_pages_used", "kv_bytes_used")
SUM_KEYS_TPS = ("aggregate_tps", "n_active", "n_warming", "n_decoding", "prefill_tps", "kv_free_cells",
                "kv_total_cells")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def merge_pools(per_replica: dict[int, dict], copies: dict[int, dict[int, int]]) -> dict:
    """GET /polykv/pools: every replica's pools (each with ``replica``); a pool with copies lists
    them in ``copies`` and each copy names its logical pool in ``copy_of``."""
    copy_of = {(t, local): logical for logical, cs in copies.items() for t, local in cs.items()}
    pools, replicas = [], []
    out: dict = {}
    for tag in sorted(per_replica):
        snap = per_replica[tag]
        replicas.append({"replica": tag, **{k: v for k, v in snap.items() if k != "pools"}})
        for p in snap.get("pools", []):
            p = {**p, "replica": tag}
            logical = copy_of.get((tag, p["pool_id"]))
            if logical is not None:
                p["copy_of"] = logical
            cs = copies.get(p["pool_id"])
            if cs:
                p["copies"] = [{"replica": t, "pool_id": local} for t, local in sorted(cs.items())
                               if t in per_replica]
            pools.append(p)
    for k in SUM_KEYS_POOLS:
        vals = [s.get(k) for s in per_replica.values()]
        if vals and all(_num(v) for v in vals):
            out[k] = sum(vals)
    depths = [s.get("tree_depth") for s in per_replica.values() if _num(s.get("tree_depth"))]
    out["tree_depth"] = max(depths, default=0)
    sizes = {s.get("page_size") for s in per_replica.values()}
    if len(sizes) == 1:
        out["page_size"] = sizes.pop()
    return {"pools": pools, **out, "replicas": replicas}


def merge_tps(per_replica: dict[int, dict]) -> dict:
    """GET /polykv/tps snapshot: totals summed, mean_active_tps weighted by active sessions (null,
    as on one server, when no session is decoding anywhere), sessions concatenated (each with
    ``replica``)."""
    out: dict = {"ts": time.time()}
    for k in SUM_KEYS_TPS:
        vals = [s.get(k) for s in per_replica.values() if _num(s.get(k))]
        out[k] = sum(vals) if vals else None
    active = [s for s in per_replica.values() if _num(s.get("mean_active_tps")) and _num(s.get("n_active"))
              and s["n_active"] > 0]
    n = sum(s["n_active"] for s in active)
    out["mean_active_tps"] = sum(s["mean_active_tps"] * s["n_active"] for s in active) / n if n else None
    if out.get("kv_total_cells"):
        used = out["kv_total_cells"] - (out.get("kv_free_cells") or 0)
        out["compaction_pressure"] = max((s.get("compaction_pressure") or 0) for s in per_replica.values())
        out["kv_used_cells"] = used
    out["sessions"] = [{**s, "replica": tag} for tag in sorted(per_replica)
                       for s in per_replica[tag].get("sessions", [])]
    out["replicas"] = [{"replica": tag, **{k: v for k, v in per_replica[tag].items() if k != "sessions"}}
                       for tag in sorted(per_replica)]
    return out


def merge_history(per_replica: dict[int, dict]) -> dict:
    out: dict = {"interval_s": None, "aggregate": [], "sessions": {}}
    for tag in sorted(per_replica):
        h = per_replica[tag]
        out["interval_s"] = out["interval_s"] or h.get("interval_s")
        out["aggregate"] += [{**a, "replica": tag} for a in h.get("aggregate", [])]
        for sid, series in (h.get("sessions") or {}).items():
            out["sessions"][sid] = series
    out["aggregate"].sort(key=lambda a: a.get("ts", 0))
    return out


def merge_events(per_replica: dict[int, dict]) -> dict:
    ev = [{**e, "replica": tag} for tag in sorted(per_replica) for e in per_replica[tag].get("events", [])]
    ev.sort(key=lambda e: e.get("ts", 0))
    return {"events": ev}


def merge_integrity(per_replica: dict[int, tuple[int, dict]]) -> tuple[int, dict]:
    ok = all(st == 200 and body.get("ok") for st, body in per_replica.values())
    out = {"ok": ok, "replicas": [{"replica": t, **body} for t, (st, body) in sorted(per_replica.items())]}
    for k in ("kv_pages_used", "kv_pages_total"):
        vals = [b.get(k) for _, b in per_replica.values()]
        if vals and all(_num(v) for v in vals):
            out[k] = sum(vals)
    return (200 if ok else 500), out


def merge_slots(per_replica: dict[int, list]) -> list:
    out = []
    for tag in sorted(per_replica):
        v = per_replica[tag]
        out += [{**s, "replica": tag} if isinstance(s, dict) else s for s in (v if isinstance(v, list) else [v])]
    return out


def merge_capacity(pool_id: int, per_copy: dict[int, tuple[int, dict]], primary: int | None) -> dict:
    """GET /polykv/pools/{id}/capacity over the pool and its copies: one more session fits when any
    copy admits it; the primary's report is the base, the copies' reports are listed."""
    base_tag = primary if primary in per_copy else min(per_copy)
    out = dict(per_copy[base_tag][1])
    out["pool_id"] = pool_id
    out["can_admit"] = any(c.get("can_admit") for _, c in per_copy.values())
    for k in ("sessions_remaining", "headroom_sessions"):
        vals = [c.get(k) for _, c in per_copy.values()]
        if vals and all(_num(v) for v in vals):
            out[k] = sum(vals)
    out["copies"] = [{"replica": t, **c} for t, (_, c) in sorted(per_copy.items())]
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s.*)$")


def label_metrics(text: str, tag: int) -> list[str]:
    """Prometheus text with ``replica="<tag>"`` added to every sample."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        m = _SAMPLE.match(line)
        if m is None:
            out.append(line)
            continue
        name, _, labels, rest = m.groups()
        lab = f'replica="{tag}"' + (f",{labels}" if labels else "")
        out.append(f"{name}{{{lab}}}{rest}")
    return out


def merge_metrics(per_replica: dict[int, str], extra: str = "") -> str:
    """One exposition: each metric family's HELP/TYPE once, samples of all replicas under it."""
    families: dict[str, list[str]] = {}
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    for tag in sorted(per_replica):
        current = None
        for line in label_metrics(per_replica[tag], tag):
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                fam = line.split()[2]
                if fam not in heads:
                    heads[fam] = []
                    families[fam] = []
                    order.append(fam)
                if line not in heads[fam]:
                    heads[fam].append(line)
                current = fam
            elif line and not line.startswith("#"):
                fam = current if current is not None else line.split("{")[0].split()[0]
                if fam not in families:
                    families[fam] = []
                    heads.setdefault(fam, [])
                    order.append(fam)
                families[fam].append(line)
    lines = []
    for fam in order:
        lines += heads.get(fam, []) + families[fam]
    return "\n".join(lines) + "\n" + extra
