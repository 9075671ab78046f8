"""The demo's report: markdown + PNG charts (matplotlib) from what the recorder measured.

Every figure is computed here from the run record (``Recorder.snapshot()`` plus the runner's
``config`` / ``final`` / ``outputs``); the pure functions below are what the tests check.

    summary = summarize(run)                   # the numbers (a dict, also written to summary.json)
    paths = build_report(run, "demo-report")   # report.md, tps.png, kv.png, ttft.png, run.json
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .plots import plot_kv, plot_tps, plot_ttft
from .report_calc import (_f, _mib, _oneline, admission_summary, cross_check, kv_summary, max_concurrency,
                          request_totals, session_names, settle_windows, summarize, time_under_floor, ttft_summary)

__all__ = ["admission_summary", "build_report", "cross_check", "kv_summary", "max_concurrency", "render_markdown",
           "request_totals", "session_names", "settle_windows", "summarize", "time_under_floor", "ttft_summary",
           "plot_kv", "plot_tps", "plot_ttft"]


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
    ge = summary.get("gate_effect")
    if ge:
        add(f"| share of decoding below the floor, with / without the gate (this run replayed) | "
            f"{_pct(ge['with_gate']['under_share'])} / {_pct(ge['without_gate']['under_share'])} |")
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
    if ge:
        add(gate_effect_markdown(ge, uf, summary["concurrency"]["max_decoding"], summary["wall_s"]))

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


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def gate_effect_markdown(ge: dict, uf: dict, max_decoding: int | None = None, wall_s: float | None = None) -> str:
    """The with / without the gate table (``gate_effect.gate_effect``), and the run as measured
    (how close the replay with the gate is to what happened)."""
    measured = uf["session_under_s"] / uf["session_active_s"] if uf.get("session_active_s") else None
    speed = ", ".join(f"{b}: {_f(v)}" for b, v in ge["speed_tps"].items())
    rows = ["### With and without the gate\n",
            "The run without the gate did not happen, so both are replayed on the simulator "
            "(`opencoti.sim`) with this run's own speed (per-session tok/s by sessions decoding: "
            f"{speed}; noise sigma {_f(ge['noise_sigma'], 2)}) and its own model calls: with the gate each call "
            "starts when it started here; without it, the agents that waited at a gate "
            f"({', '.join(ge['agents_held']) or 'none'}; {ge['held_s']:.1f} s of waiting in all) start when they reached "
            f"it. Shares are of session-decode seconds (rate over a session's last 8 tokens), means over "
            f"{len(ge['seeds'])} seeds.\n",
            "| | below the floor | below 80 % of it | most sessions decoding | run time |",
            "|---|---:|---:|---:|---:|"]
    for name, key in (("with the gate", "with_gate"), ("without the gate", "without_gate")):
        g = ge[key]
        rows.append(f"| {name} | {_pct(g['under_share'])} | {_pct(g['deep_share'])} | {g['max_decoding']} | "
                    f"{g['wall_s']:.1f} s |")
    rows.append(f"| with the gate, as measured in this run (sampled session EWMAs) | {_pct(measured)} | | "
                f"{_f(max_decoding)} | {_f(wall_s)} s |")
    return "\n".join(rows) + "\n"


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
