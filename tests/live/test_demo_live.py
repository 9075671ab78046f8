"""`opencoti demo` end to end on the bundled model, small configuration: every step of the scenario
happens, the report is written, and its numbers match the engine's own counters and pool status.
Then the same graph against a real `opencoti serve` subprocess (``--server``)."""

from __future__ import annotations

import copy
import io
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from opencoti.demo import DemoConfig, run_demo
from opencoti.demo.live import PlainView

pytestmark = pytest.mark.bundled

CTX = 2048
STEPS = ["root pool", "task brief", "task pool (extend)", "full-prefill control", "fan-out", "long-running agent",
         "COW branch", "nested fork", "compaction", "gather", "done"]


def small_config(out) -> DemoConfig:
    return DemoConfig(agents=3, nested_agents=2, review_agents=1, max_tokens=16, out=str(out), max_context=CTX,
                      long_max_turns=8, interval_s=0.2, gate_wait_s=10.0)


@pytest.fixture(scope="module")
def demo_engine(bundled_model):
    """A fresh engine (its counters count this run only) configured like the demo's own."""
    from opencoti.engine import Engine, EngineConfig

    loaded = copy.copy(bundled_model)
    loaded.state_dict = dict(bundled_model.state_dict)
    eng = Engine(EngineConfig(page_size=16, max_context=CTX, kv_budget_tokens=12288), loaded=loaded)
    yield eng
    eng.check_integrity()
    eng.shutdown()


def _check_structure(run: dict, summary: dict) -> dict:
    """Every step of the scenario happened, in the pool tree and in the admission log."""
    names = [p["name"] for p in run["phases"]]
    assert set(STEPS) <= set(names), names
    made = {p["pool_id"]: p for p in summary["pools_made"]}
    kinds = {}
    for p in made.values():
        kinds.setdefault(p["kind"], []).append(p)
    assert set(kinds) == {"root", "extend", "branch (COW)", "extend (nested)", "compacted (re-fork)"}, kinds
    root = kinds["root"][0]
    assert root["parent"] is None and root["branch_pos"] == 0
    task = next(p for p in kinds["extend"] if p["label"] == "task brief")
    assert task["parent"] == root["pool_id"] and task["branch_pos"] == root["prefix_len"]  # extend: D == parent L
    branch = kinds["branch (COW)"][0]
    assert branch["parent"] == root["pool_id"] and 0 < branch["branch_pos"] < root["prefix_len"]  # COW: D < L
    nested = kinds["extend (nested)"][0]
    assert nested["parent"] == task["pool_id"] and nested["branch_pos"] == task["prefix_len"]
    compacted = kinds["compacted (re-fork)"][0]
    assert compacted["parent"] == root["pool_id"] and compacted["branch_pos"] == root["prefix_len"]
    # compaction by re-fork: the old working pool was released, the session moved on
    (c,) = run["compactions"]
    assert c["old_pool_released"] and c["new_pool_id"] == compacted["pool_id"] and c["pressure"] >= c["threshold"]
    later = [r for r in run["requests"] if r["agent"] == "logistics" and r["t_end"] > c["t"]]
    assert later and all(r["pool_id"] == compacted["pool_id"] and r["cached_tokens"] >= compacted["prefix_len"] - 1
                         for r in later)
    assert {p["pool_id"] for p in summary["pools_released"]} >= {nested["pool_id"], c["old_pool_id"]}
    # admission: every agent passed its gate and was admitted. Whether any had to wait depends on the
    # machine: the advisory floor's settle windows measure without blocking (docs/polykv.md), and the
    # learned step-time forecast admits everyone when one more session costs little; waits are recorded.
    spawned = {d["agent"] for d in run["decisions"] if d["decision"] == "spawn"}
    assert spawned >= {"sub-0", "sub-1", "sub-2", "sub-0.0", "sub-0.1", "reviewer-0", "logistics"}
    waited = set(summary["admission"]["agents_that_waited"])
    assert waited <= {d["agent"] for d in run["decisions"]}, run["decisions"]
    assert summary["admission"]["events"].get("admit", 0) >= len(spawned)
    assert summary["settle_windows"]
    # every attach reused exactly its pool's prefix
    prefix = {p["pool_id"]: p["prefix_len"] for p in made.values()}
    for r in run["requests"]:
        if r["role"] in ("sub-agent", "coordinator", "nested", "reviewer"):
            assert r["cached_tokens"] >= prefix[r["pool_id"]], r  # the prefix cache may reuse more
    # the control prefilled sub-agent 0's exact prompt with nothing cached, and attaching was faster
    (control,) = [r for r in run["requests"] if r["role"] == "control"]
    sub0 = next(r for r in run["requests"] if r["agent"] == "sub-0")
    assert control["cached_tokens"] == 0 and control["prompt_tokens"] == sub0["prompt_tokens"]
    assert summary["ttft"]["attach"]["median_ms"] < summary["ttft"]["control"]["median_ms"]
    assert run["outputs"]["answer"]
    return made


def test_demo_end_to_end_in_process(demo_engine, tmp_path):
    out = io.StringIO()
    t0 = time.perf_counter()
    res = run_demo(small_config(tmp_path / "report"), view=PlainView(out), engine=demo_engine)
    print(f"demo (small configuration) ran in {time.perf_counter() - t0:.1f} s")
    run, summary = res.run, res.summary
    assert not res.errors
    _check_structure(run, summary)

    # the report is there
    for key in ("report", "summary", "run", "tps", "kv", "ttft"):
        assert res.paths[key].exists() and res.paths[key].stat().st_size > 0
    md = res.paths["report"].read_text()
    for heading in ("## Headline", "## Pool tree", "## KV cache", "## Time to first token", "## Decode speed",
                    "## Admission", "## Compaction by re-fork", "## Cross-check"):
        assert heading in md

    # its numbers are the engine's: counters, pool status, per-pool queries
    counters = demo_engine.metrics_counters()
    assert summary["cross_check"] and all(r["match"] for r in summary["cross_check"]), summary["cross_check"]
    assert "MISMATCH" not in md
    per_pool: dict[int, int] = {}
    for r in run["requests"]:
        if r["pool_id"] is not None:
            per_pool[r["pool_id"]] = per_pool.get(r["pool_id"], 0) + 1
    assert per_pool == {pid: c["queries"] for pid, c in counters["pools"].items() if c["queries"]}
    status = run["final"]["pools"]  # the recorder's final sample's pools() answer (one atomic answer)
    final = summary["kv"]["final"]
    assert final["used"] == status["kv_bytes_used"]
    assert final["pools"] == sum(p["own_kv_bytes"] for p in status["pools"])
    assert final["sessions"] == sum(s["marginal_kv_bytes"] for p in status["pools"] for s in p["sessions"])
    assert final["other"] == final["used"] - final["pools"] - final["sessions"] >= 0
    # the engine's own page count, asked right after that sample
    assert run["final"]["stats"]["kv_pages_used"] == status["kv_pages_used"]
    assert final["saved"] == final["without_sharing"] - final["used"]
    peak = summary["kv"]["at_peak"]
    assert peak["without_sharing"] > peak["used"] > 0  # sharing saves KV at the busiest moment
    assert f"| the same sessions without sharing | {peak['without_sharing'] / 2**20:.1f} MiB" in md
    assert run["final"]["integrity"] == "ok"

    # the non-terminal output: plain lines, every step and the gates' decisions
    text = out.getvalue()
    assert "\x1b[" not in text
    for step in STEPS:
        assert f"phase      {step}" in text, step
    assert "decision   gate: " in text
    # machine-dependent who waits (see _check_structure); every agent that waited has its gate's line
    # (sub-agents "sub-1", nested ones "sub-0.1", reviewers "reviewer-0")
    for agent in res.summary["admission"]["agents_that_waited"]:
        assert re.search(rf"decision   gate: {re.escape(agent)} (waits|held) on pool \d+ \(", text), agent
    assert "compaction compacted logistics: pool" in text


@pytest.fixture(scope="module")
def server(opencoti_cache, bundled_model):
    env = {**os.environ, "OPENCOTI_CACHE": str(opencoti_cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "opencoti", "serve", "--port", "0", "--ctx-size", str(CTX),
                             "--kv-budget-tokens", "12288", "--log-level", "warning", "--pool-grace-ttl", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base, lines = None, []
    deadline = time.monotonic() + 300
    while base is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "server exited:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            base = m.group(1)
        assert time.monotonic() < deadline, "".join(lines)
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_demo_over_http_server(server, tmp_path):
    """The same graph through the client's HTTP transport; the demo waits for the model to load and
    releases what it made at the end."""
    out = io.StringIO()
    cfg = small_config(tmp_path / "report")
    cfg.server = server
    res = run_demo(cfg, view=PlainView(out))
    run, summary = res.run, res.summary
    assert run["info"]["transport"] == f"opencoti serve at {server}"
    assert run["info"]["ctx_total"] == CTX
    _check_structure(run, summary)
    assert res.paths["report"].exists() and res.paths["tps"].exists()
    assert summary["cross_check"] == []  # a server's counters are not this run's alone: no cross-check
    http = httpx.Client(base_url=server, timeout=60)
    assert http.get("/polykv/integrity").json()["ok"] is True
    # cleaned up: releases within a pool's grace TTL take effect when it ends (2 s here, one per tree level)
    deadline = time.monotonic() + 60
    while http.get("/polykv/pools").json()["pools"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert http.get("/polykv/pools").json()["pools"] == []
    assert "phase      gather" in out.getvalue()
