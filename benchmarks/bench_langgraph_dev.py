"""How long `langgraph dev` takes to start on the examples, against the same CLI serving an empty graph.

Measures, per start (median over ``--repeats``): seconds from launching ``langgraph dev`` until
``GET /ok`` answers 200, and until ``POST /assistants/search`` lists every graph of the config. The
baseline is a one-node graph that imports nothing of this project, started by the same CLI in the
same run: the difference is what the examples' imports cost (the in-process engine itself loads
in the background, so it is not part of the start). Target: examples ready in <= 5 s.

    .venv/bin/python benchmarks/bench_langgraph_dev.py [--repeats 3]
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, track, base_parser, describe_machine, log, machine_info, print_table,  # noqa: E402
                    summarize, write_json)

EMPTY_GRAPH = '''from typing import TypedDict

from langgraph.graph import END, START, StateGraph


class S(TypedDict):
    x: int


def node(state: S) -> S:
    return {"x": state["x"] + 1}


graph = StateGraph(S).add_node("node", node).add_edge(START, "node").add_edge("node", END).compile()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_ok(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/ok", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _graphs(base: str) -> set[str]:
    req = urllib.request.Request(f"{base}/assistants/search", data=b"{}",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return {a["graph_id"] for a in json.loads(r.read())}
    except OSError:
        return set()


def start_once(folder: Path, expect: set[str], timeout: float) -> dict:
    exe = Path(sys.executable).with_name("langgraph")
    port = _free_port()
    env = {**os.environ, "LANGGRAPH_CLI_NO_ANALYTICS": "1", "LANGSMITH_TRACING": "false"}
    env.pop("OPENCOTI_BASE_URL", None)
    base = f"http://127.0.0.1:{port}"
    logf = open(folder / "dev.log", "w")
    t0 = time.monotonic()
    proc = track(subprocess.Popen([str(exe), "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port",
                             str(port), "--config", str(folder / "langgraph.json")],
                            cwd=folder, env=env, stdout=logf, stderr=subprocess.STDOUT))
    ok_s = ready_s = None
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError((folder / "dev.log").read_text()[-3000:])
            if ok_s is None and _get_ok(base):
                ok_s = time.monotonic() - t0
            if ok_s is not None and _graphs(base) >= expect:
                ready_s = time.monotonic() - t0
                break
            time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()
    if ready_s is None:
        raise RuntimeError(f"not ready in {timeout} s: " + (folder / "dev.log").read_text()[-3000:])
    return {"ok_s": ok_s, "ready_s": ready_s}


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=180.0)
    args = p.parse_args()
    if not Path(sys.executable).with_name("langgraph").exists():
        sys.exit("langgraph-cli is not installed (the dev extra has it: pip install -e '.[dev]')")
    info = machine_info()
    log(describe_machine(info))
    work = Path(tempfile.mkdtemp(prefix="bench-lgdev-"))
    examples = shutil.copytree(REPO_ROOT / "examples", work / "examples")
    expect = set(json.loads((examples / "langgraph.json").read_text())["graphs"])
    empty = work / "empty"
    empty.mkdir()
    (empty / "graph.py").write_text(EMPTY_GRAPH)
    (empty / "langgraph.json").write_text(json.dumps({"dependencies": ["."], "graphs": {"empty": "./graph.py:graph"}}))
    runs: dict[str, list[dict]] = {"empty graph (CLI baseline)": [], "examples": []}
    for i in range(args.repeats):  # interleaved, so load drift hits both
        for name, folder, exp in (("empty graph (CLI baseline)", empty, {"empty"}), ("examples", examples, expect)):
            r = start_once(folder, exp, args.timeout)
            log(f"round {i + 1} {name}: /ok {r['ok_s']:.2f} s, graphs listed {r['ready_s']:.2f} s")
            runs[name].append(r)
    rows, summary = [], {}
    for name, rs in runs.items():
        ok = summarize([r["ok_s"] for r in rs])
        ready = summarize([r["ready_s"] for r in rs])
        summary[name] = {"ok_s": ok, "ready_s": ready}
        rows.append([name, ok["median"], ready["median"]])
    ex, base = summary["examples"]["ready_s"]["median"], summary["empty graph (CLI baseline)"]["ready_s"]["median"]
    print_table(["config", "/ok s (median)", "graphs listed s (median)"], rows,
                title=f"langgraph dev start, {args.repeats} rounds; {describe_machine(machine_info())}")
    print(f"\nexamples ready in {ex:.2f} s (target <= 5 s: {'PASS' if ex <= 5 else 'FAIL'}); "
          f"the examples' own cost over the empty graph: {ex - base:+.2f} s")
    path = write_json("langgraph_dev", {"machine": info, "runs": runs, "summary": summary,
                                        "examples_ready_s": ex, "empty_ready_s": base,
                                        "loadavg_end": os.getloadavg()}, args.out)
    log(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
