"""Regenerate the tables of ``docs/benchmarks.md`` from the committed result files.

The page holds blocks between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``;
each is rewritten from ``benchmarks/results/<machine-id>/NAME.json`` (every machine that has that
result, newest first), so a table and its data cannot drift apart. Text outside the blocks is left
as it is. ``--check`` changes nothing and exits 1 when the page differs from what the results give
(the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
PAGE = BENCH_DIR.parent / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)",
                   re.S)


def results(name: str) -> list[tuple[str, dict]]:
    """(machine id, payload) of every committed ``name.json``, newest first."""
    out = []
    for path in sorted(RESULTS.glob(f"*/{name}.json")):
        try:
            out.append((path.parent.name, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: unreadable result ({e})")
    return sorted(out, key=lambda r: r[1].get("time", ""), reverse=True)


def num(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def machine_line(machine_id: str, payload: dict) -> str:
    m = payload.get("machine") or {}
    load = m.get("loadavg")
    end = (payload.get("load_at_end") or {}).get("loadavg")
    git = m.get("git") or {}
    commit = (git.get("commit") or "?")[:10] + (" + uncommitted changes" if git.get("dirty") else "")
    simd = "/".join(m.get("cpu_flags_of_interest") or []) or "?"
    cores = m.get("cpu_affinity") or m.get("cpu_count")
    loads = " → ".join(f"{v[0]:.2f}" for v in (load, end) if v)
    return (f"*Machine `{machine_id}`: {m.get('cpu', '?')} [{simd}], {cores} cores, torch {m.get('torch', '?')}; "
            f"commit `{commit}`; {payload.get('time', '?')}; load average {loads or '?'}; raw data "
            f"`benchmarks/results/{machine_id}/{payload.get('benchmark', '?')}.json`.*")


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(num(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- renderers
def render_peer_llamacpp(machine_id: str, d: dict) -> str:
    med, ratio = d["median"], d["ratio"]
    peer_of = {"fanout_pool_cold": "fanout_cold", "fanout_pool_warm": "fanout_warm"}
    labels = {"decode_1": "1 session decode", "decode_1_busy": "1 session decode, a core-burning neighbour",
              "sessions_8": "8 short sessions, aggregate", "fanout_cold": "8-agent fan-out, cold (no pool)",
              "fanout_warm": "8-agent fan-out, warm (no pool)",
              "fanout_pool_cold": "8-agent fan-out, cold, opencoti with a pool",
              "fanout_pool_warm": "8-agent fan-out, warm, opencoti with a pool"}
    rows = []
    for w, r in ratio.items():
        ours = med.get("opencoti", {}).get(w)
        theirs = med.get("llama.cpp", {}).get(peer_of.get(w, w))
        unit = "s" if w.startswith("fanout") else "tok/s"
        verdict = "–" if r is None else ("faster" if r >= 1 else "**slower**")
        rows.append([labels.get(w, w), unit, ours, theirs, f"{r:.2f}x" if r is not None else "–", verdict])
    cfg = d["config"]
    ours = (d.get("servers") or {}).get("opencoti") or {}
    head = (f"{cfg['rounds']} round(s), {cfg['threads']} threads, {cfg['tokens']} tokens per decode request, "
            f"medians; llama-server `{' '.join(cfg['llama_server_flags'])}` from {cfg['llama_cpp_source']}; "
            f"opencoti with no flags: `auto` loaded the GGUF's weights as `{ours.get('weights')}`.")
    return "\n".join([head, "", table(["workload", "unit", "opencoti", "llama.cpp", "ratio", ""], rows), "",
                      machine_line(machine_id, d)])


def render_generic(machine_id: str, d: dict) -> str:
    """A result that carries its own ``report`` table: {"headers": [...], "rows": [[...]], "notes": [...]}."""
    rep = d.get("report")
    if not rep:
        return f"(no table in `benchmarks/results/{machine_id}/{d.get('benchmark')}.json`)\n\n" + \
            machine_line(machine_id, d)
    parts = [table(rep["headers"], rep["rows"])]
    parts += [""] + [f"- {n}" for n in rep.get("notes", [])] if rep.get("notes") else []
    return "\n".join(parts + ["", machine_line(machine_id, d)])


RENDER = {"peer_llamacpp": render_peer_llamacpp}


def block(name: str) -> str:
    found = results(name)
    if not found:
        return f"*Not measured yet: run `opencoti bench {name}`.*\n"
    fn = RENDER.get(name, render_generic)
    return "\n\n".join(fn(mid, d) for mid, d in found) + "\n"


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + block(m.group("name")) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not what the results give")
    p.add_argument("--page", default=str(PAGE))
    args = p.parse_args(argv)
    page = Path(args.page)
    old = page.read_text()
    new = regenerate(old)
    if args.check:
        if new != old:
            print(f"{page} differs from its results: run benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        page.write_text(new)
        print(f"updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
