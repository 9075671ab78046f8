"""`opencoti demo` pieces without the bundled model: the report's math on scripted data, the recorder
on a tiny random-weight engine (its numbers against the engine's own), the report files, the live
views (rich render and the plain, non-terminal output) and the CLI's argument checks.

The whole scenario needs the bundled model (its prompts do not fit the tiny model's 512-token
context): tests/live/test_demo_live.py runs it end to end."""

from __future__ import annotations

import io
import json
import threading

import pytest

from opencoti.client import PolyKVClient
from opencoti.demo.live import PlainView, RichView, make_view, pool_tree_lines, status_line
from opencoti.demo.recorder import Recorder, kv_accounting, pages_for
from opencoti.demo.report import (admission_summary, build_report, cross_check, kv_summary, request_totals,
                                  session_names, settle_windows, summarize, time_under_floor, ttft_summary)
from opencoti.demo.hooks import RequestLog

SYSTEM = [{"role": "system", "content": "You are a tiny test agent."}]


# ============================================================================ pure math
def _row(sid, tps, state="decode", warming=False, pool=1, ctx=10):
    return {"session_id": sid, "pool_id": pool, "tps_ewma": tps, "state": state, "warming": warming, "ctx_used": ctx}


def test_time_under_floor_counts_only_measured_decoding_intervals():
    samples = [
        {"t": 0.0, "n_active": 1, "mean_active_tps": 12.0, "sessions": [_row("a", 12.0), _row("b", 0.0, warming=True)]},
        {"t": 1.0, "n_active": 2, "mean_active_tps": 9.0, "sessions": [_row("a", 10.0), _row("b", 8.0)]},
        {"t": 2.0, "n_active": 1, "mean_active_tps": 7.0, "sessions": [_row("a", 7.0), _row("b", 0.0, state="idle")]},
        {"t": 4.0, "n_active": 0, "mean_active_tps": 0.0, "sessions": [_row("a", 7.0, state="idle")]},
    ]
    r = time_under_floor(samples, floor=9.5)
    a, b = r["sessions"]["a"], r["sessions"]["b"]
    # a: decoding for the intervals of samples 0, 1, 2 (1 s, 1 s, 2 s); below 9.5 only in sample 2
    assert a["active_s"] == pytest.approx(4.0) and a["under_s"] == pytest.approx(2.0)
    assert a["min_tps"] == 7.0 and a["mean_tps"] == pytest.approx((12 + 10 + 7 * 2) / 4)
    # b: warming in sample 0 (not counted), decoding below the floor in sample 1, idle after
    assert b["active_s"] == pytest.approx(1.0) and b["under_s"] == pytest.approx(1.0)
    assert r["engine"] == {"active_s": pytest.approx(4.0), "under_s": pytest.approx(3.0)}
    assert r["session_under_s"] == pytest.approx(3.0)
    assert time_under_floor(samples, None)["session_under_s"] == 0.0


def test_time_under_floor_caps_a_stalled_sampler():
    samples = [{"t": 0.0, "n_active": 1, "mean_active_tps": 5.0, "sessions": [_row("a", 5.0)]},
               {"t": 30.0, "n_active": 1, "mean_active_tps": 5.0, "sessions": [_row("a", 5.0)]}]
    assert time_under_floor(samples, 10.0, max_gap_s=2.0)["sessions"]["a"]["under_s"] == pytest.approx(4.0)


def test_settle_windows_pair_admits_with_settle_ends_per_pool():
    events = [
        {"t": 1.0, "event": "admit", "pool_id": 1, "session_id": "a"},
        {"t": 1.5, "event": "admit", "pool_id": 2, "session_id": "x"},
        {"t": 1.8, "event": "admit", "pool_id": 1, "session_id": "b"},  # inside the open window: extends it
        {"t": 2.0, "event": "settle_end", "pool_id": 1, "by": "tokens", "drop": 1.5},
        {"t": 2.2, "event": "policy", "pool_id": 1},
        {"t": 3.0, "event": "admit", "pool_id": 1, "session_id": "c"},
    ]
    w = settle_windows(events, t_end=9.0)
    assert [(x["pool_id"], x["t_start"], x["t_end"]) for x in w] == [(1, 1.0, 2.0), (2, 1.5, 9.0), (1, 3.0, 9.0)]
    assert w[0]["sessions"] == ["a", "b"] and w[0]["admits"] == 2 and w[0]["by"] == "tokens"
    assert w[1]["by"] == "open at the end"


def test_kv_accounting_by_ownership_and_without_sharing():
    status = {"kv_bytes_used": 20 * 100, "kv_pages_used": 20, "page_size": 4, "pools": [
        {"pool_id": 1, "own_kv_bytes": 10 * 100, "sessions": [
            {"session_id": "a", "ctx_used": 45, "marginal_kv_bytes": 2 * 100},   # 12 pages privately
            {"session_id": "b", "ctx_used": 41, "marginal_kv_bytes": 1 * 100}]},  # 11 pages privately
        {"pool_id": 2, "own_kv_bytes": 3 * 100, "sessions": []}]}
    k = kv_accounting(status)
    assert k["page_bytes"] == 100 and k["used"] == 2000
    assert (k["pools"], k["sessions"], k["other"]) == (1300, 300, 400)  # other: 4 pages of unpooled sessions
    assert k["without_sharing"] == (12 + 11) * 100 + 400
    assert k["saved"] == k["without_sharing"] - k["used"] and k["n_pool_sessions"] == 2
    assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2
    empty = kv_accounting({"kv_bytes_used": 0, "kv_pages_used": 0, "page_size": 16, "pools": []})
    assert empty["used"] == empty["without_sharing"] == empty["saved"] == 0


def test_kv_summary_peak_and_final():
    mk = lambda used, without: {"kv": {"used": used, "without_sharing": without, "saved": without - used}}  # noqa: E731
    s = kv_summary([mk(10, 0), mk(30, 90), mk(25, 80), mk(20, 40)])
    assert s["peak_used"] == 30 and s["peak_without_sharing"] == 90 and s["ratio_at_peak"] == 3.0
    assert s["final"]["used"] == 20 and s["max_saved"] == 60
    assert kv_summary([])["final"] is None


def test_ttft_summary_attach_vs_control():
    reqs = [{"agent": "control", "role": "control", "pool_id": None, "cached_tokens": 0, "prompt_tokens": 100,
             "ttft_ms": 900.0},
            {"agent": "a", "role": "sub-agent", "pool_id": 2, "cached_tokens": 90, "prompt_tokens": 100, "ttft_ms": 40.0},
            {"agent": "b", "role": "sub-agent", "pool_id": 2, "cached_tokens": 90, "prompt_tokens": 101, "ttft_ms": 60.0},
            {"agent": "s", "role": "summary", "pool_id": None, "cached_tokens": 0, "prompt_tokens": 50, "ttft_ms": 300.0},
            {"agent": "x", "role": "sub-agent", "pool_id": 2, "cached_tokens": 0, "prompt_tokens": 5, "ttft_ms": None}]
    t = ttft_summary(reqs)
    assert t["attach"]["n"] == 2 and t["attach"]["median_ms"] == 50.0 and t["attach"]["median_computed_tokens"] == 10.5
    assert t["control"]["median_ms"] == 900.0 and t["full_prefill"]["n"] == 2
    assert t["speedup_median"] == pytest.approx(18.0)


def test_cross_check_and_totals():
    reqs = [{"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3},
            {"prompt_tokens": 7, "cached_tokens": 0, "completion_tokens": 2}]
    assert request_totals(reqs) == {"requests": 2, "prompt_tokens": 17, "cached_prompt_tokens": 4, "generated_tokens": 5}
    rows = cross_check(reqs, {"totals": {"requests": 2, "prompt_tokens": 17, "cached_prompt_tokens": 4,
                                         "generated_tokens": 6}})
    assert {r["name"]: r["match"] for r in rows} == {"requests": True, "prompt_tokens": True,
                                                     "cached_prompt_tokens": True, "generated_tokens": False}
    assert cross_check(reqs, None) == []


def test_admission_summary_counts_waits_and_wait_time():
    decisions = [{"t": 1.0, "agent": "a", "decision": "spawn", "reason": "guaranteed minimum"},
                 {"t": 1.1, "agent": "b", "decision": "wait", "reason": "measurement settling"},
                 {"t": 2.0, "agent": "b", "decision": "wait", "reason": "projected mean tps below floor"},
                 {"t": 4.5, "agent": "b", "decision": "spawn", "reason": "ok"},
                 {"t": 5.0, "agent": "c", "decision": "hold", "reason": "another spawn is being admitted"}]
    s = admission_summary([{"event": "admit"}, {"event": "admit"}, {"event": "settle_end"}], decisions)
    assert s["events"] == {"admit": 2, "settle_end": 1}
    assert s["decisions"] == {"spawn": 2, "wait": 2, "hold": 1}
    assert s["waited_s"] == {"b": pytest.approx(3.4)} and s["agents_that_waited"] == ["b", "c"]
    assert session_names([{"session_id": "s-1", "agent": "summary"}, {"session_id": "a", "agent": "a"}]) == \
        {"s-1": "summary (s-1)"}


# ============================================================================ recorder on a real (tiny) engine
def test_recorder_numbers_match_the_engine(engine):
    """Sessions decode on two pools while the recorder samples in its thread; its KV accounting,
    events and request log agree with what the engine itself reports."""
    from langchain_core.messages import HumanMessage, SystemMessage

    from opencoti.langgraph import OpencotiChatModel

    client = PolyKVClient(engine=engine)
    rec = Recorder(PolyKVClient(engine=engine), interval_s=0.02).start()
    root = client.create_pool(messages=SYSTEM)
    child = client.fork_pool(root.pool_id, messages=SYSTEM + [{"role": "user", "content": "shared task"}])
    model = OpencotiChatModel(engine=engine, max_tokens=12, temperature=0, ignore_eos=True)
    log = RequestLog(rec)

    def agent(i: int) -> None:
        pool = root if i % 2 else child
        msgs = [SystemMessage(SYSTEM[0]["content"])] + ([HumanMessage("shared task")] if pool is child else [])
        model.invoke(msgs + [HumanMessage(f"question {i}")], config={"callbacks": [log],
                                                                     "metadata": {"demo_agent": f"agent-{i}"}},
                     pool_id=pool.pool_id, session_id=f"agent-{i}", ignore_eos=True)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.stop()  # takes a final sample of the (now idle) engine
    last = rec.latest
    status = engine.pools()
    assert last["kv"] == kv_accounting(status)
    assert last["kv"]["used"] == status["kv_bytes_used"] > 0
    own = sum(p["own_kv_bytes"] for p in status["pools"])
    marginal = sum(s["marginal_kv_bytes"] for p in status["pools"] for s in p["sessions"])
    assert last["kv"]["pools"] == own and last["kv"]["sessions"] == marginal and last["kv"]["other"] == 0
    assert last["kv"]["n_pool_sessions"] == 4 and last["kv"]["without_sharing"] > last["kv"]["used"]
    # the request log: one row per call, with the engine's own timings, summing to its counters
    assert sorted(r["agent"] for r in rec.requests) == [f"agent-{i}" for i in range(4)]
    assert all(r["cached_tokens"] > 0 and r["ttft_ms"] > 0 and r["completion_tokens"] == 12 for r in rec.requests)
    assert all(r["match"] for r in cross_check(rec.requests, engine.metrics_counters()))
    # admission events reached the recorder on the local clock (in-process: no offset)
    admits = [e for e in rec.events if e["event"] == "admit"]
    assert sorted(e["session_id"] for e in admits) == [f"agent-{i}" for i in range(4)]
    assert rec.clock_offset == pytest.approx(0.0, abs=0.05)
    assert len({(e["ts_engine"], e["event"], e.get("session_id")) for e in rec.events}) == len(rec.events)
    # samples saw decoding sessions with their pools
    assert any(s["n_decoding"] for s in rec.samples)
    assert {p["pool_id"] for p in last["pools"]} == {root.pool_id, child.pool_id}


def test_recorder_scenario_log_and_feed():
    class NoClient:
        pass

    rec = Recorder(NoClient(), clock=iter([100.0 + i for i in range(100)]).__next__)
    rec.phase("root pool", "the root")
    rec.agent("sub-1", "waiting", pool_id=2)
    rec.decision("sub-1", 2, "wait", {"reason": "measurement settling", "can_admit": False})
    rec.decision("sub-1", 2, "spawn", {"reason": "ok", "projected_mean_tps_if_admitted": 12.5})
    rec.pool_op("create", {"pool_id": 2, "parent": 1, "branch_pos": 10, "prefix_len": 20, "label": "task"},
                kind="extend")
    rec.pool_op("release", {"pool_id": 2, "label": "task"})
    lines, nxt = rec.feed_since(0)
    assert nxt == len(lines) == 5
    texts = [ln["text"] for ln in lines]
    assert texts[0] == "root pool: the root"
    assert "sub-1 waits on pool 2 (measurement settling" in texts[1]
    assert "sub-1 admitted on pool 2 (ok, projected 12.5 tok/s)" in texts[2]
    assert texts[3] == "pool 2 extend from pool 1: task owns [10, 20)" and texts[4] == "pool 2 released (task)"
    assert rec.feed_since(5) == ([], 5)
    snap = rec.snapshot()
    assert [d["decision"] for d in snap["decisions"]] == ["wait", "spawn"]
    assert snap["agents"]["sub-1"]["reason"] is None  # admitted: no reason to wait any more
    json.dumps(snap)


# ============================================================================ the report
def _synthetic_run(tmp_floor: float = 10.0) -> dict:
    t0 = 1000.0
    pools = [{"pool_id": 1, "parent": None, "branch_pos": 0, "prefix_len": 64, "own_kv_bytes": 16 * 100,
              "subtree_kv_bytes": 24 * 100, "label": "root", "sessions": []},
             {"pool_id": 2, "parent": 1, "branch_pos": 64, "prefix_len": 80, "own_kv_bytes": 4 * 100,
              "subtree_kv_bytes": 8 * 100, "label": "task",
              "sessions": [{"session_id": "sub-0", "ctx_used": 90, "suffix_n_tokens": 10, "marginal_kv_bytes": 300,
                            "state": "decode"},
                           {"session_id": "sub-1", "ctx_used": 85, "suffix_n_tokens": 5, "marginal_kv_bytes": 100,
                            "state": "decode"}]}]
    status = {"kv_bytes_used": 2400, "kv_pages_used": 24, "page_size": 4, "pools": pools}
    samples = []
    for i in range(12):
        tps = 14.0 - i
        samples.append({"t": t0 + 0.5 * i, "aggregate_tps": 2 * tps, "mean_active_tps": tps, "n_active": 2,
                        "n_warming": 0, "n_decoding": 2, "kv_bytes_used": 2400, "kv_pages_used": 24, "page_size": 4,
                        "sessions": [_row("sub-0", tps, pool=2, ctx=90), _row("sub-1", tps, pool=2, ctx=85)],
                        "pools": pools, "kv": kv_accounting(status),
                        "agents": {"sub-0": "running", "sub-1": "running", "sub-2": "waiting"}})
    reqs = [{"agent": "control", "role": "control", "pool_id": None, "prompt_tokens": 90, "cached_tokens": 0,
             "completion_tokens": 1, "ttft_ms": 500.0, "decode_tps": 0.0, "t_end": t0 + 1},
            {"agent": "sub-0", "role": "coordinator", "pool_id": 2, "session_id": "sub-0", "prompt_tokens": 90,
             "cached_tokens": 80, "completion_tokens": 8, "ttft_ms": 30.0, "decode_tps": 11.0, "t_end": t0 + 5},
            {"agent": "sub-1", "role": "sub-agent", "pool_id": 2, "session_id": "sub-1", "prompt_tokens": 85,
             "cached_tokens": 80, "completion_tokens": 8, "ttft_ms": 20.0, "decode_tps": 12.0, "t_end": t0 + 6}]
    events = [{"t": t0 + 0.2, "event": "admit", "pool_id": 2, "session_id": "sub-0"},
              {"t": t0 + 1.2, "event": "settle_end", "pool_id": 2, "by": "tokens", "settle_ms": 1000.0,
               "mean_at_admit": None, "mean_settled": 13.0}]
    decisions = [{"t": t0 + 0.1, "agent": "sub-0", "pool_id": 2, "decision": "spawn", "reason": "guaranteed minimum"},
                 {"t": t0 + 0.3, "agent": "sub-1", "pool_id": 2, "decision": "wait", "reason": "measurement settling"},
                 {"t": t0 + 1.3, "agent": "sub-1", "pool_id": 2, "decision": "spawn", "reason": "ok",
                  "mean_active_tps": 13.0, "projected_mean_tps_if_admitted": 11.5}]
    return {"t0": t0, "t_end": t0 + 6.0, "info": {"model": "tiny", "transport": "an in-process engine"},
            "config": {"agents": 2, "floor": tmp_floor, "floor_source": "given", "max_tokens": 8, "seed": None,
                       "settle_tokens": 12, "settle_max_ms": 3000.0},
            "samples": samples, "events": events, "decisions": decisions, "requests": reqs,
            "phases": [{"t": t0, "name": "root pool", "text": "made the root"},
                       {"t": t0 + 0.1, "name": "fan-out", "text": "2 sub-agents"}],
            "pool_ops": [{"t": t0, "op": "create", "kind": "root", "pool_id": 1, "parent": None, "branch_pos": 0,
                          "prefix_len": 64, "own_kv_bytes": 1600, "label": "root"},
                         {"t": t0 + 0.05, "op": "create", "kind": "extend", "pool_id": 2, "parent": 1,
                          "branch_pos": 64, "prefix_len": 80, "own_kv_bytes": 400, "label": "task"},
                         {"t": t0 + 5.5, "op": "release", "pool_id": 2, "label": "task"}],
            "compactions": [{"t": t0 + 4, "agent": "long", "pressure": 0.71, "threshold": 0.7, "ctx_before": 90,
                             "ctx_after": 70, "old_pool_id": 3, "new_pool_id": 4, "ancestor_pool_id": 1,
                             "n_summarized": 6, "n_kept": 2, "kv_pages_before": 30, "kv_pages_after": 24,
                             "old_pool_released": True}],
            "final": {"counters": {"totals": {"requests": 3, "prompt_tokens": 265, "cached_prompt_tokens": 160,
                                              "generated_tokens": 17}}},
            "outputs": {"answer": "the plan | with a pipe", "agents": {"sub-0": "part one", "sub-1": "part two"}},
            "graph_mermaid": "graph TD;\n  a-->b;", "errors": []}


def test_build_report_writes_markdown_charts_and_data(tmp_path):
    run = _synthetic_run()
    paths = build_report(run, tmp_path / "out")
    for key in ("report", "summary", "run", "tps", "kv", "ttft"):
        assert paths[key].exists() and paths[key].stat().st_size > 0, key
    for png in ("tps", "kv", "ttft"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["report"].read_text()
    summary = json.loads(paths["summary"].read_text())
    assert json.loads(paths["run"].read_text())["config"]["floor"] == 10.0
    # the numbers in the markdown are the summary's
    kv = summary["kv"]["at_peak"]
    assert f"| the same sessions without sharing | {kv['without_sharing'] / 2**20:.1f} MiB" in md
    assert "| median TTFT attaching to a pool | 25 ms (8 tokens computed) |" in md  # medians of (30, 20) ms, (10, 5)
    assert "| TTFT of a full prefill of the same prompt | 500 ms (90 tokens computed) |" in md
    assert "| agents that waited for capacity | 1 (sub-1) |" in md
    assert "| requests | 3 | 3 | ok |" in md and "| generated_tokens | 17 | 17 | ok |" in md
    assert "![tps](tps.png)" in md and "![KV](kv.png)" in md and "![TTFT](ttft.png)" in md
    assert "| 2 | extend | 1 | 64 | 80 | 0.0 MiB | task |" in md  # the pool table: ints stay ints
    assert "pool 3 was released (yes); KV pages in use 30 -> 24" in md
    assert "the plan \\| with a pipe" in md  # table-safe text
    assert "```mermaid" in md
    # time under the floor: tps falls from 14 by 1 per 0.5 s sample: 9, 8, ... 3 are below 10 (7 samples)
    uf = summary["under_floor"]
    assert uf["sessions"]["sub-0"]["under_s"] == pytest.approx(7 * 0.5)
    assert summary["settle_windows"][0]["t_end"] == pytest.approx(1001.2)


def test_report_without_charts_and_without_data(tmp_path):
    run = {"t0": 0.0, "t_end": 1.0, "config": {"floor": None}, "samples": [], "requests": []}
    paths = build_report(run, tmp_path, charts=False)
    assert set(paths) == {"report", "summary", "run"}
    md = paths["report"].read_text()
    assert "No compaction happened in this run." in md
    s = summarize(run)
    assert s["kv"]["final"] is None and s["ttft"]["attach"] is None and s["cross_check"] == []


# ============================================================================ live views
def _recorder_with(run: dict) -> Recorder:
    class NoClient:
        pass

    rec = Recorder(NoClient())
    rec.t0 = run["t0"]
    rec.samples = [run["samples"][-1]]
    rec.phase("fan-out", "two sub-agents")
    for name, state in run["samples"][-1]["agents"].items():
        rec.agent(name, state, pool_id=2, session_id=name)
    rec.decision("sub-2", 2, "wait", {"reason": "projected mean tps below floor", "can_admit": False})
    return rec


def test_status_line_and_pool_tree():
    run = _synthetic_run()
    s = run["samples"][-1]
    line = status_line(s, 10.0)
    assert "mean active 3.0" in line and "floor 10.0" in line and "agents running 2 waiting 1" in line
    assert "KV 0.0 MiB" in line and "without sharing" in line
    assert status_line(None, None) == "no sample yet"
    tree = pool_tree_lines(s)
    assert tree[0] == (0, "pool 1 root [0, 64) own 0.0 MiB, subtree 0.0 MiB")
    assert tree[1][0] == 1 and tree[1][1].startswith("pool 2 task [64, 80)")
    assert tree[2][0] == 2 and tree[2][1].startswith("· sub-0 decode 3.0 tok/s ctx 90")


def test_plain_view_prints_feed_and_status_lines():
    run = _synthetic_run()
    rec = _recorder_with(run)
    out = io.StringIO()
    view = make_view(out)  # a StringIO is not a terminal: plain lines
    assert isinstance(view, PlainView)
    view.progress("converting GGUF")
    view.start(rec, "opencoti demo · test")
    view.stop()
    text = out.getvalue()
    assert text.startswith("[load] converting GGUF\nopencoti demo · test\n")
    assert "phase      fan-out: two sub-agents" in text
    assert "decision   gate: sub-2 waits on pool 2 (projected mean tps below floor" in text
    assert text.count("status     tps aggregate") == 1  # the final status line, once
    assert "\x1b[" not in text  # no terminal escapes in plain mode
    # lines already printed are not printed again
    view.flush()
    assert out.getvalue().count("fan-out: two sub-agents") == 1


def test_rich_view_renders_the_dashboard():
    from rich.console import Console

    run = _synthetic_run()
    rec = _recorder_with(run)
    console = Console(record=True, width=160, file=io.StringIO())
    view = RichView(console=console)
    view.recorder, view.title = rec, "opencoti demo · test"
    view.set_floor(10.0)
    console.print(view.render())
    text = console.export_text()
    for needle in ("opencoti demo · test", "step: fan-out", "floor 10.0", "pool 1 root [0, 64)",
                   "pool 2 task [64, 80)", "sub-0 decode 3.0 tok/s", "sub-2", "waiting",
                   "projected mean tps below floor", "gate: sub-2 waits on pool 2"):
        assert needle in text, needle
    with view.loading():
        view.progress("loading weights")
    assert "loading model" in console.export_text()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_make_view_picks_rich_on_a_terminal():
    assert isinstance(make_view(_Tty()), RichView)
    assert isinstance(make_view(_Tty(), plain=True), PlainView)


# ============================================================================ CLI
def test_cli_demo_rejects_bad_arguments_before_loading_a_model(capsys):
    from opencoti.cli import main

    assert main(["demo", "--agents", "1", "--plain"]) == 1
    assert "--agents must be at least 2" in capsys.readouterr().err
    assert main(["demo", "--floor", "-3", "--plain"]) == 1
    assert "--floor must be a positive number" in capsys.readouterr().err
    assert main(["demo", "--max-tokens", "4096", "--plain"]) == 1
    assert "--max-tokens must be in [4, 256]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--agents", "many"])


def test_cli_demo_help_lists_the_flags(capsys):
    from opencoti.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--agents", "--floor", "--max-tokens", "--seed", "--out", "--model", "--server"):
        assert flag in out
