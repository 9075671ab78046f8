"""Regenerate the tables of ``docs/benchmarks.md`` from the committed result files.

The page holds blocks between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``;
each is rewritten from ``benchmarks/results/<machine-id>/NAME.json`` (every machine that has that
result, newest first), so a table and its data cannot drift apart. The renderer of each benchmark
is in ``report_tables.py``: a short table with ratios against the baseline the same run measured,
and sentences that say where opencoti loses; a note says when a run was reduced (``--quick``) or
taken under heavy load. Text outside the blocks is left as it is. ``--check`` changes nothing and
exits 1 when the page differs from what the results give (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_tables import RENDER, bullets, table  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
PAGE = BENCH_DIR.parent / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)",
                   re.S)
HEAVY_LOAD_PER_CORE = 1.5  # a load average above this many runnable tasks per core: other work shared the machine
SIMULATED = {"admission_sim", "admission_sim_loaded"}  # simulated clock: load does not change the numbers


def results(name: str) -> list[tuple[str, dict]]:
    """(machine id, payload) of every committed ``name.json`` and ``name_quick.json`` (a ``--quick`` run
    of ``opencoti bench``: its own file, never the full run's), newest first."""
    out = []
    for path in sorted([*RESULTS.glob(f"*/{name}.json"), *RESULTS.glob(f"*/{name}_quick.json")]):
        try:
            out.append((path.parent.name, {**json.loads(path.read_text()),
                                           "_file": f"benchmarks/results/{path.relative_to(RESULTS)}"}))
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: unreadable result ({e})")
    return sorted(out, key=lambda r: r[1].get("time", ""), reverse=True)


def history(name: str) -> list[tuple[str, dict]]:
    """(machine id, payload) of the earlier runs kept in ``<machine-id>/history/`` (``common.write_json``
    moves a result there before a new run of the same name replaces it), oldest first."""
    out = []
    for path in RESULTS.glob(f"*/history/{name}-*.json"):
        try:
            out.append((path.parent.parent.name, {**json.loads(path.read_text()),
                                                  "_file": f"benchmarks/results/{path.relative_to(RESULTS)}"}))
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: unreadable result ({e})")
    return sorted(out, key=lambda r: r[1].get("time", ""))


def loads_of(payload: dict) -> tuple[list | None, list | None]:
    """(load average before, after) of a run: the snapshot taken before it started, else the machine's."""
    before = (payload.get("load_before") or {}).get("loadavg") or (payload.get("machine") or {}).get("loadavg")
    return before, (payload.get("load_at_end") or {}).get("loadavg")


def quick_of(payload: dict) -> bool:
    return bool((payload.get("config") or {}).get("quick") or (payload.get("args") or {}).get("quick"))


def conditions(name: str, payload: dict) -> str:
    """A sentence when the run was reduced (``--quick``) or taken on a heavily loaded machine, else ''."""
    m = payload.get("machine") or {}
    cores = m.get("cpu_affinity") or m.get("cpu_count") or 1
    loads = [v[0] for v in loads_of(payload) if v]
    heavy = bool(loads) and max(loads) > HEAVY_LOAD_PER_CORE * cores
    parts = []
    if quick_of(payload):
        parts.append("a reduced run (`--quick`: fewer tokens, rounds, seeds or points than the full benchmark)")
    if heavy:
        how = ("the simulated clock keeps its numbers as they are" if name in SIMULATED else
               "absolute times and rates are well below a quiet machine's, and the ratios are noisier")
        parts.append(f"taken under heavy load (load average {' → '.join(f'{x:.2f}' for x in loads)} on {cores} "
                     f"cores from other work): {how}")
    return f"**This is {'; '.join(parts)}.**" if parts else ""


def machine_line(machine_id: str, payload: dict, name: str) -> str:
    m = payload.get("machine") or {}
    git = m.get("git") or {}
    commit = (git.get("commit") or "?")[:10] + (" + uncommitted changes" if git.get("dirty") else "")
    simd = "/".join(m.get("cpu_flags_of_interest") or []) or "?"
    cores = m.get("cpu_affinity") or m.get("cpu_count")
    loads = " → ".join(f"{v[0]:.2f}" for v in loads_of(payload) if v)
    return (f"*Machine `{machine_id}`: {m.get('cpu', '?')} [{simd}], {cores} cores, torch {m.get('torch', '?')}; "
            f"commit `{commit}`; {payload.get('time', '?')}; load average {loads or '?'}; raw data "
            f"`{payload.get('_file') or f'benchmarks/results/{machine_id}/{name}.json'}`"
            f"{made_by(machine_id, payload, name)}.*")


def made_by(machine_id: str, payload: dict, name: str) -> str:
    """``; made by `opencoti bench` (run.json ...)`` when one of that machine's run records (``run.json``
    or an earlier one kept in ``history/``: ``opencoti bench --only X`` runs, one after another, each
    replace the record) lists this result's run: the first record written after the result that has
    the benchmark with exit code 0. Else that it was run by hand."""
    stem = "run_quick" if quick_of(payload) else "run"
    by_hand = "; run by hand, not by `opencoti bench` (its options may differ from the script's defaults)"
    when = str(payload.get("time", ""))
    found = []
    for path in [RESULTS / machine_id / f"{stem}.json", *(RESULTS / machine_id / "history").glob(f"{stem}-*.json")]:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        entry = next((r for r in run.get("runs") or [] if r.get("name") == name), None)
        if entry is not None and entry.get("rc") == 0 and str(run.get("time", "")) >= when:
            found.append((str(run.get("time", "")), path, run, entry))
    if not found:
        return by_hand
    _, path, run, entry = min(found, key=lambda f: f[0])
    cmd = " ".join(entry.get("command") or [])
    return (f"; made by `opencoti bench`{' --quick' if run.get('quick') else ''} "
            f"(`benchmarks/results/{path.relative_to(RESULTS)}`, {run.get('time', '?')}: `{cmd}`, "
            f"{entry.get('seconds', '?')} s)")


def render_generic(d: dict) -> str:
    """A result that carries its own ``report`` table: {"headers": [...], "rows": [[...]], "notes": [...]}."""
    rep = d.get("report")
    if not rep:
        return "(no table for this result)"
    parts = [table(rep["headers"], rep["rows"])]
    return "\n".join(parts + bullets(rep.get("notes") or []))


def block(name: str) -> str:
    found = results(name)
    if not found:
        return f"*Not measured yet: run `opencoti bench {name}`.*\n"
    fn = RENDER.get(name) or render_generic  # None: the result carries its own table
    # the newest full run is the table (a reduced --quick run only where no full one exists); the
    # others, from other machines or earlier, are one line each with their raw data
    found.sort(key=lambda r: (not quick_of(r[1]), r[1].get("time", "")), reverse=True)
    (mid, d), rest = found[0], found[1:]
    kept = history(name)
    # every other full run, oldest first (a renderer judges targets on all of them: met on one run and
    # missed on another is said as both)
    earlier = sorted([(m, e) for m, e in rest if not quick_of(e)] + [(m, e) for m, e in kept if not quick_of(e)],
                     key=lambda r: r[1].get("time", ""))
    d = {**d, "_history": [{**e, "time": f"{e.get('time', '?')} on `{m}`"} for m, e in earlier]}
    out = ["\n\n".join(p for p in (fn(d), conditions(name, d), machine_line(mid, d, name)) if p)]
    if rest or kept:
        out.append("Earlier or other runs of this benchmark, with their raw data:\n\n"
                   + "\n".join(f"- {earlier_line(m, e, name)}" for m, e in rest)
                   + "".join(f"\n- {earlier_line(m, e, name, kept=True)}" for m, e in reversed(kept)))
    return "\n\n".join(out) + "\n"


def earlier_line(machine_id: str, payload: dict, name: str, kept: bool = False) -> str:
    m = payload.get("machine") or {}
    git = m.get("git") or {}
    simd = "/".join(m.get("cpu_flags_of_interest") or []) or "?"
    how = "reduced run (`--quick`)" if quick_of(payload) else "full run"
    file = payload.get("_file") or f"benchmarks/results/{machine_id}/{name}.json"
    return (f"`{machine_id}` ({m.get('cpu', '?')} [{simd}]), {payload.get('time', '?')}, commit "
            f"`{(git.get('commit') or '?')[:10]}`, {how}" + (", kept when a later run replaced it" if kept else "")
            + f": `{file}`")


def run_costs() -> str:
    """What each headline benchmark costs: the seconds of its latest full and quick run in the committed
    ``opencoti bench`` records (``run.json``, ``run_quick.json`` and those kept in ``history/``)."""
    import run_all

    latest: dict[tuple[str, bool], tuple[str, str, dict]] = {}  # (name, quick) -> (time, machine, entry)
    for path in [*RESULTS.glob("*/run.json"), *RESULTS.glob("*/run_quick.json"),
                 *RESULTS.glob("*/history/run-*.json"), *RESULTS.glob("*/history/run_quick-*.json")]:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        machine = path.parent.parent.name if path.parent.name == "history" else path.parent.name
        for entry in run.get("runs") or []:
            key = (entry.get("name"), bool(run.get("quick")))
            when = str(run.get("time", ""))
            if entry.get("rc") == 0 and (key not in latest or latest[key][0] < when):
                latest[key] = (when, machine, {**entry, "_record": f"benchmarks/results/{path.relative_to(RESULTS)}"})

    def cell(name: str, quick: bool) -> str:
        if (name, quick) not in latest:
            return "not run by `opencoti bench` yet"
        when, machine, e = latest[(name, quick)]
        load = [f"{x:.1f}" for x in ((e.get("load_before") or {}).get("loadavg") or [])[:1]
                + ((e.get("load_after") or {}).get("loadavg") or [])[:1]]
        return (f"{e.get('seconds')} s (`{machine}`, {when[:16]}, load {' → '.join(load) or '?'}; "
                f"`{e['_record']}`)")

    rows = [[f"`{name}`", cell(name, False), cell(name, True)] for name, *_ in run_all.HEADLINE]
    return table(["benchmark", "full run (the published configuration)", "quick run (`--quick`)"], rows) + "\n"


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + (run_costs() if m.group("name") == "run_costs" else block(m.group("name")))
                     + m.group(4), text)


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
