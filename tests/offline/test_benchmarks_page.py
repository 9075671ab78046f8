"""docs/benchmarks.md is generated from committed results, and every number on it is in one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

NUMBER = re.compile(r"(?<![\w.\-/])\d+(?:[.,]\d+)*")


def numbers_of(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def result_numbers() -> set[str]:
    """Every number in the committed result files, as written and as floats rounded to 0-3 places."""
    out: set[str] = set()

    def walk(x):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            out.add(str(x))
            if isinstance(x, float):
                out.update(f"{x:.{d}f}" for d in range(4))
        elif isinstance(x, dict):
            for k, v in x.items():
                out.update(numbers_of(str(k)))
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str):
            out.update(numbers_of(x))

    for path in report.RESULTS.glob("*/*.json"):
        walk(json.loads(path.read_text()))
    return out


def prose(page: str) -> str:
    """The page's own text: without the generated blocks (checked against their results by
    ``report.py --check``), code blocks and inline code (commands, paths, flags, identifiers)."""
    page = report.BLOCK.sub("", page)
    page = re.sub(r"```.*?```", "", page, flags=re.S)
    return re.sub(r"`[^`]*`", "", page)


def test_page_is_what_the_committed_results_give():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_number_on_the_page_is_in_a_committed_result():
    known = result_numbers()
    missing = sorted(numbers_of(prose(report.PAGE.read_text())) - known)
    assert not missing, f"numbers on docs/benchmarks.md found in no committed result: {missing}"


def test_a_hand_edited_table_is_caught(tmp_path, monkeypatch):
    results = tmp_path / "results" / "box-2c-0000"
    results.mkdir(parents=True)
    payload = {"benchmark": "demo", "time": "2026-12-03T10:00:00+0000", "machine": {"cpu": "CPU", "loadavg": [0.5]},
               "report": {"headers": ["case", "tok/s"], "rows": [["one session", 93.25]]}}
    (results / "demo.json").write_text(json.dumps(payload))
    page = tmp_path / "page.md"
    page.write_text("# x\n\n<!-- generated: demo -->\n<!-- end generated: demo -->\n")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    assert report.main(["--page", str(page)]) == 0
    text = page.read_text()
    assert "| one session | 93.25 |" in text and "benchmarks/results/box-2c-0000/demo.json" in text
    assert report.main(["--page", str(page), "--check"]) == 0
    page.write_text(text.replace("93.25", "99.00"))  # a number typed in by hand
    assert report.main(["--page", str(page), "--check"]) == 1
    payload["report"]["rows"][0][1] = 91.0  # a new measurement changes the table
    (results / "demo.json").write_text(json.dumps(payload))
    report.main(["--page", str(page)])
    assert "| one session | 91.00 |" in page.read_text()


def test_the_newest_full_run_is_the_table_and_the_others_are_listed(tmp_path, monkeypatch):
    def put(machine, time, rows, quick=False):
        (tmp_path / "results" / machine).mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": "demo", "time": time, "config": {"quick": quick},
                   "machine": {"cpu": "CPU", "loadavg": [0.5]}, "report": {"headers": ["case", "tok/s"], "rows": rows}}
        (tmp_path / "results" / machine / "demo.json").write_text(json.dumps(payload))

    put("old-box", "2026-12-03T10:00:00+0000", [["one", 11.5]])
    put("new-box", "2026-12-04T10:00:00+0000", [["one", 22.5]])
    put("quick-box", "2026-12-05T10:00:00+0000", [["one", 33.5]], quick=True)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    text = report.block("demo")
    assert "| one | 22.50 |" in text and "11.5" not in text and "33.5" not in text
    for box in ("old-box", "new-box", "quick-box"):
        assert f"benchmarks/results/{box}/demo.json" in text
    assert "reduced run (`--quick`)" in text.split("Earlier or other runs")[1]


def test_number_extraction_skips_names_and_code():
    assert numbers_of("SmolLM2-135M ran 93.5 tok/s on 2 cores, 1,024 tokens") == {"93.5", "2", "1024"}
    assert numbers_of(prose("run `--rounds 3` and\n```\nx 7\n```\n then 4")) == {"4"}
    assert numbers_of(prose("a 5\n<!-- generated: x -->\n| 9 |\n<!-- end generated: x -->\n")) == {"5"}


@pytest.mark.parametrize("block", ["peer_llamacpp", "quant", "pools", "cascade", "fanout", "admission_sim",
                                   "cluster"])
def test_each_headline_benchmark_has_a_generated_block(block):
    assert f"<!-- generated: {block} -->" in report.PAGE.read_text()


# ---------------------------------------------------------------------------- the renderers
import copy  # noqa: E402

import report_tables  # noqa: E402

COMMITTED = sorted(p for p in report.RESULTS.glob("*/*.json") if p.stem in report_tables.RENDER)


def committed(name: str) -> dict:
    paths = [p for p in COMMITTED if p.stem == name]
    if not paths:
        pytest.fail(f"no committed {name}.json to take the shape from")
    return json.loads(paths[0].read_text())


def test_every_headline_benchmark_has_a_renderer_and_a_block():
    import run_all

    page = report.PAGE.read_text()
    for name, *_ in run_all.HEADLINE:
        assert name in report_tables.RENDER, f"{name}: no renderer, the page would show no table"
        assert f"<!-- generated: {name} -->" in page
    assert set(report_tables.RENDER) - {h[0] for h in run_all.HEADLINE} == {"admission_sim_loaded"}


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_committed_result_renders_a_table(path):
    text = report.block(path.stem)
    assert "|---|" in text and f"`benchmarks/results/{path.parent.name}/{path.stem}.json`" in text
    assert "no table" not in text and "Not measured" not in text


def test_the_load_and_a_reduced_run_are_said():
    d = {"config": {"quick": True}, "machine": {"cpu_affinity": 2, "loadavg": [19.6, 1, 1]},
         "load_at_end": {"loadavg": [16.2, 1, 1]}}
    s = report.conditions("quant", d)
    assert "reduced run" in s and "heavy load" in s and "19.60 → 16.20 on 2 cores" in s
    assert "simulated clock" in report.conditions("admission_sim", d)
    quiet = {"config": {"quick": False}, "machine": {"cpu_affinity": 2, "loadavg": [1.6, 1, 1]},
             "load_at_end": {"loadavg": [2.2, 1, 1]}}
    assert report.conditions("quant", quiet) == ""
    quiet["args"] = {"quick": True}  # bench_cluster / bench_crash record their arguments
    assert "reduced run" in report.conditions("cluster", quiet)


def test_quant_says_auto_missed_the_fastest_format_and_why():
    d = committed("quant")
    eng = d["engines"]
    eng["int4"]["median"]["single"] = 10.0
    eng["auto"]["median"]["single"] = 4.0
    d["auto_chose"] = "fp32"
    eng["fp32"]["median"]["single"] = 4.2  # auto's format in its own processes: also far from int4
    eng["auto"]["choice"]["gate"] = {"int4": {"passed": False, "top1_agreement": 0.98,
                                              "decode_path": {"top1_agreement": 0.9}}}
    d["auto_vs_fastest"] = {"fastest": "int4", "fastest_single_tps": 10.0, "auto_single_tps": 4.0, "ratio": 0.4,
                            "within_5pct": False}
    text = report_tables.render_quant(d)
    assert "Where we lose — `auto` loaded fp32" in text and "0.42x of it (target: within 5 %): **missed**" in text
    assert ("The auto process's own median, 4.00 tok/s, is 0.40x of it (this run was made under the earlier "
            "rule, which judged that median: **missed**)") in text
    d["auto_vs_fastest"]["chosen_ratio"] = 0.42  # a run made under today's rule: no earlier verdict to recall
    assert "earlier rule" not in report_tables.render_quant(d)
    del d["auto_vs_fastest"]["chosen_ratio"]
    assert "int4 failed auto's accuracy gate" in text and "| int4 |" in text
    eng["fp32"]["median"]["single"] = 9.7  # the chosen format within 5 % of the fastest: met
    assert "within 5 %): met" in report_tables.render_quant(d)
    eng["int4"]["median"]["single"] = 0.5 * eng["fp32"]["median"]["single"]  # a format slower than fp32
    assert "Where we lose — int4 decodes one session slower than fp32 (0.50x)" in report_tables.render_quant(d)


def test_pools_flags_a_baseline_that_reused_the_cache_and_a_missed_target():
    d = committed("pools")
    assert "The baseline reused nothing" in report_tables.render_pools(d)
    d = copy.deepcopy(d)
    d["ttft"]["full_runs"][0]["cache_n"] = 1024
    d["ttft"].update(speedup=4.0, target_10x=False)
    text = report_tables.render_pools(d)
    assert "**The baseline reused cached tokens**" in text and "| 4.00x | ≥ 10x | **missed** |" in text
    assert "Where we lose — attaching is 4.00x faster" in text


def test_admission_sim_headline_is_the_held_out_seeds():
    d = copy.deepcopy(committed("admission_sim"))
    name, prof = next(iter(d["profiles"].items()))
    prof["held_out"]["adaptive"].update(wall_ratio=1.3, under_ratio=0.1, deep_ratio=0.0, overshoot_max=0)
    prof["held_out"]["verdict"] = "miss: wall 1.30"
    prof["tuning"]["adaptive"].update(wall_ratio=1.0, under_ratio=0.1, deep_ratio=0.0, overshoot_max=0)
    text = report_tables.render_admission_sim(d)
    row = next(r for r in text.splitlines() if r.startswith(f"| {name} |"))
    assert "| 1.30x |" in row and row.endswith("| **missed: wall** | met |")  # held-out missed, tuning met
    assert f"Where we lose — {name}: miss: wall 1.30" in text and f"{name} (1.30x)" in text
    assert f"{len(d['seeds']['held_out'])} held-out seed(s), {d['seeds']['held_out'][0]}–" in text


def test_cascade_renders_the_scripts_shape():
    runs = {"on": [{"steps": 9, "cascade_steps": 9, "model_ms": 20.0, "agg_tps": 40.0}],
            "off": [{"steps": 9, "cascade_steps": 0, "model_ms": 30.0, "agg_tps": 20.0}]}
    d = {"machine": {}, "decode_tokens": 10, "repeats": 1, "config": {"quick": True},
         "results": [{"prefix": 512, "sessions": 4, "step_ms_off": 10.0, "step_ms_on": 11.0, "agg_tps_off": 50.0,
                      "agg_tps_on": 45.0, "speedup": 0.9, "runs": runs},
                     {"prefix": 2048, "sessions": 16, "step_ms_off": 30.0, "step_ms_on": 20.0, "agg_tps_off": 20.0,
                      "agg_tps_on": 50.0, "speedup": 2.5, "runs": runs}]}
    text = report_tables.render_cascade(d)
    assert "| P = 512, N = 4 | 10.00 | 11.00 | 50.00 | 45.00 | 0.90x | ≥ 1.3x | **missed** |" in text
    assert "| P = 2048, N = 16 |" in text and "| 2.50x | ≥ 3.0x | **missed** |" in text
    assert "Where we lose — P = 512, N = 4: cascade is slower than plain paged attention (0.90x)" in text


def fanout_payload(point=(1024, 8, 32, 64)) -> dict:
    """A results JSON shaped as bench_fanout.main writes it (checked below against the script's own report)."""
    from hf_fanout import finish_run

    P, N, Q, G = point
    systems = ["opencoti-pool", "hf-recompute", "hf-batch"]
    walls = {"opencoti-pool": 10.0, "hf-recompute": 48.0, "hf-batch": 9.0}
    runs = [dict(finish_run(s, P, N, G, [1.0] * N, [w] * N, [[1] * G] * N, 2 ** 20, {}), repeat_tag=f"t0-{s}")
            for s, w in walls.items()]
    for r in runs:
        r.pop("token_ids")
    table = [{k: r[k] for k in ("system", "prefix", "sessions", "wall_s", "ttft_p50_s", "ttft_p95_s",
                                "per_session_decode_tps", "aggregate_decode_tps", "end_to_end_tps",
                                "peak_kv_bytes")} | {"repeats": 1} for r in runs]
    targets = {"wall_vs_hf-recompute": {"ratio": 4.8, "target": 5.0, "pass": False},
               "wall_vs_hf-batch": {"ratio": 0.9, "target": 2.0, "pass": False},
               "overhead_at_target_N": {"in_step": 0.05, "loop": 0.08, "target": 0.15, "pass": True}}
    return {"config": {"target": {"prefix": P, "sessions": N}, "suffix": Q, "gen": G, "repeats": 1,
                       "systems": systems, "weights": "int8", "hf_dtype": "float32", "kv_bytes_per_token": 46080,
                       "openmp_env_transformers": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None},
                       "torch_threads": 2, "quick": point != (1024, 8, 32, 64)},
            "labels": {s: f"{s} label" for s in systems}, "table": table, "targets": targets, "runs": runs,
            "profile": None, "seconds": {"total": 60.0}, "loadavg_end": [1.0, 1.0, 1.0],
            "machine": {"cpu": "CPU", "cpu_affinity": 2, "cpu_count": 2, "torch": "t", "transformers": "x",
                        "python": "3", "loadavg": [1.0, 1.0, 1.0], "git": {"commit": "abc", "dirty": False}}}


def test_fanout_renders_the_scripts_shape_and_says_where_we_lose():
    import bench_fanout

    d = fanout_payload()
    assert "| hf-batch |" in bench_fanout.markdown_report(d)  # the script's own report reads this shape too
    text = report_tables.render_fanout(d)
    assert "| hf-recompute label | 48.00 |" in text and "| 4.80x |" in text
    assert "| wall vs hf-recompute | 4.80x | ≥ 5.0x | **missed** |" in text
    assert "Where we lose — hf-batch finished the fan-out faster than opencoti with a pool (0.90x)" in text
    assert "opencoti ran int8 weights, transformers float32" in text and "left at their defaults" in text
    quick = report_tables.render_fanout(fanout_payload((512, 4, 32, 8)))
    assert "shows its ratios without a verdict" in quick and "**missed**" not in quick


def test_cluster_renders_the_scripts_shape_and_counts_pool_prefill():
    from bench_cluster import hit_rate, summarize_runs

    def run(mode, rnd, cached, pool_prefill, wall):
        return {"mode": mode, "round": rnd, "prompt_tokens": 1000, "cached_tokens": cached,
                "hit_rate": hit_rate(1000, cached, pool_prefill), "prefill_tokens": 1000 - cached + pool_prefill,
                "pool_prefill_tokens": pool_prefill, "agents_wall_s": wall, "total_wall_s": wall, "errors": []}

    results = [run(m, r, c, p, w) for r in range(3) for m, c, p, w in
               [("opencoti", 990, 80, 20.0), ("pow2", 600, 0, 18.0), ("ray-prefix", 900, 0, 25.0)]]
    per = summarize_runs(results)
    d = {"complete": True, "args": {"agents": 16, "teams": 4, "turns": 3, "rounds": 3, "quick": False},
         "results": results, "summary": {"per_mode": per, "hit_rate_target_met": False}}
    text = report_tables.render_cluster(d)
    assert "| our router, pools | 3 | 91.0 % (91.0–91.0) | 90 |" in text  # the 80 pool-prefill tokens count
    assert "(target ≥ 95 %): **missed**" in text and "misses the 95 % target" in text
    assert "Where we lose — Ray Serve's default router finished faster than our router with pools (0.90x" in text
    assert "PrefixCacheAffinityRouter | 3 |" in text
    assert "incomplete run" in report_tables.render_cluster({"complete": False, "results": results[:2]})


# ---------------------------------------------------------------------------- opencoti vs llama.cpp (issue 53)
import peer_llamacpp  # noqa: E402


def fake_stream(log: list):
    """peer_llamacpp.stream without servers: records (url, path, body) and answers at once, with a
    decode rate and drafts that depend on the server (its port)."""

    def stream(url, path, body):
        log.append((url, path, body))
        port = int(url.rsplit(":", 1)[1])
        n = body.get("n_predict") or body.get("max_tokens") or 8
        t = {"predicted_n": n, "prompt_n": 10}
        if port in (1, 2):  # the opencoti servers
            t.update(draft_n=4 if port == 1 else 0, draft_n_accepted=3 if port == 1 else 0)
        return {"sent": 0.0, "first": 1.0, "last": 1.0 + (n - 1) / (100.0 * port), "chunks": n, "tokens": n,
                "final": {"timings": t}, "timings": t}

    return stream


def test_peer_round_interleaves_every_request_and_no_prompt_repeats(monkeypatch):
    import types

    log: list = []
    monkeypatch.setattr(peer_llamacpp, "stream", fake_stream(log))
    monkeypatch.setattr(peer_llamacpp, "burn", lambda: types.SimpleNamespace(kill=lambda: None, wait=lambda: None))
    monkeypatch.setattr(peer_llamacpp, "create_pool", lambda url, nonce: 7)
    monkeypatch.setattr(peer_llamacpp.time, "sleep", lambda s: None)
    urls = {n: f"http://127.0.0.1:{i + 1}" for i, n in enumerate(peer_llamacpp.SERVERS)}
    args = types.SimpleNamespace(tokens=16)
    out = peer_llamacpp.run_round(urls, args, 0)
    for n, kind in ((n, k) for n, (k, _) in peer_llamacpp.SERVERS.items()):
        for w in peer_llamacpp.WORKLOADS:
            if w in peer_llamacpp.PEER_OF and kind == "llama.cpp":
                assert w not in out[n]
                continue
            assert len(out[n][w]) == peer_llamacpp.REPEATS.get(w, 1), (n, w)
            # every opencoti measurement records its drafts (the default drafts, --speculative off does not)
            if kind == "opencoti":
                assert out[n][w][0]["draft_n"] is not None, (n, w)
    assert out["opencoti"]["decode_1"][0]["draft_n"] == 4 and out["opencoti-off"]["decode_1"][0]["draft_n"] == 0
    # the single-session requests: each text went to all four servers, one after the other, in an order
    # rotated per request; no text twice on one server (nothing an earlier answer could be copied from)
    single = [(u, b["prompt"]) for u, p, b in log if p == "/completion" and "Tell me everything" not in b["prompt"]]
    texts = list(dict.fromkeys(t for _, t in single))
    firsts = []
    for t in texts:
        servers = [u for u, x in single if x == t]
        assert sorted(servers) == sorted(urls.values()), t[:60]
        firsts.append(servers[0])
    assert len(set(firsts[1:])) >= 3  # the first server changes from request to request
    bodies = [t.split("] ", 1)[1] for t in texts if "-warmup]" not in t]
    assert len(bodies) == len(set(bodies))  # the busy neighbour's prompt is one no earlier request had
    assert any(peer_llamacpp.BUSY_PROMPT in t for t in texts)


def peer_payload(ratios_by_round: list[dict], targets=None) -> dict:
    """A peer_llamacpp result from per-round values {server: {workload: value}}."""
    raw: dict = {}
    for rnd in ratios_by_round:
        for n, ws in rnd.items():
            raw.setdefault(n, []).append({w: [{"value": v, "tokens": 10, "draft_n": 10 if n == "opencoti" else None,
                                               "draft_n_accepted": 6 if n == "opencoti" else None}]
                                          for w, v in ws.items()})
    med, drafted, comps = peer_llamacpp.summarize(raw)
    return {"config": {"rounds": len(ratios_by_round), "threads": 2, "tokens": 128, "llama_server_flags": ["-c", "16"],
                       "llama_cpp_source": "llama-cpp-python==0 (vendored)", "opencoti_weights": ["int4"],
                       "targets": targets if targets is not None else peer_llamacpp.TARGETS, "quick": False},
            "raw": raw, "median": med, "drafts": drafted, "comparisons": comps, "time": "2026-12-06T10:00:00+0000",
            "machine": {}}


def test_peer_table_has_the_three_comparisons_with_pair_spreads_and_losses():
    rounds = [{"opencoti": {"decode_1": 150.0, "sessions_8": 300.0, "fanout_cold": 3.0, "fanout_pool_cold": 2.0},
               "opencoti-off": {"decode_1": 90.0, "sessions_8": 250.0, "fanout_cold": 3.0},
               "llama.cpp": {"decode_1": 100.0, "sessions_8": 150.0, "fanout_cold": 30.0},
               "llama.cpp-ngram": {"decode_1": 140.0, "sessions_8": 160.0, "fanout_cold": 30.0}},
              {"opencoti": {"decode_1": 160.0, "sessions_8": 300.0, "fanout_cold": 3.0, "fanout_pool_cold": 2.0},
               "opencoti-off": {"decode_1": 110.0, "sessions_8": 250.0, "fanout_cold": 3.0},
               "llama.cpp": {"decode_1": 100.0, "sessions_8": 150.0, "fanout_cold": 30.0},
               "llama.cpp-ngram": {"decode_1": 150.0, "sessions_8": 160.0, "fanout_cold": 30.0}}]
    d = peer_payload(rounds)
    r = d["comparisons"]["spec_off"]["workloads"]["decode_1"]
    assert r["ratios"] == [0.9, 1.1] and r["ratio_median"] == pytest.approx(1.0) and r["pairs"] == 2
    # the pool rows are against llama.cpp's plain fan-out of the same round
    assert d["comparisons"]["default"]["workloads"]["fanout_pool_cold"]["ratios"] == [15.0, 15.0]
    text = report_tables.render_peer_llamacpp(d)
    for label in ("each with its defaults: opencoti's n-gram speculation on, llama.cpp none",
                  "speculation off on both (the per-token claim)",
                  "n-gram speculation on both (llama.cpp --spec-type ngram-simple)"):
        assert f"| {label} | 1 session decode |" in text
    assert "| 0.90–1.10 | 2 |" in text  # the spread of the per-pair ratios
    assert "| 12 / 20 (60 %) |" in text  # opencoti's drafts over the row's requests
    assert ("speculation off on both (the per-token claim), 1 session decode: the median pair is 1.00x, but "
            "llama.cpp was faster in 1 of 2 pair(s) (lowest 0.90x)") in text
    lost = report_tables.render_peer_llamacpp(peer_payload([{**rounds[0], "llama.cpp": {
        "decode_1": 200.0, "sessions_8": 150.0, "fanout_cold": 30.0}}]))
    assert "Where we lose — speculation off on both (the per-token claim), 1 session decode: llama.cpp is faster " \
           "(opencoti 0.45x" in lost


def test_peer_target_met_on_one_run_and_missed_on_another_is_said_as_both():
    def run(ours, when):
        d = peer_payload([{"opencoti": {"sessions_8": ours}, "opencoti-off": {"sessions_8": ours},
                           "llama.cpp": {"sessions_8": 100.0}, "llama.cpp-ngram": {"sessions_8": 100.0}}])
        d["time"] = when
        return d

    now = run(160.0, "2026-12-06T11:00:00+0000")
    now["_history"] = [run(140.0, "2026-12-05T11:00:00+0000"),
                       {"time": "2026-12-04T11:00:00+0000", "ratio": {"sessions_8": 1.52}}]  # a run before labels
    text = report_tables.render_peer_llamacpp(now)
    line = next(x for x in text.splitlines() if "Target ≥ 1.5x, 8 short sessions, aggregate, each with its defaults" in x)
    assert line.startswith("- Where we lose — ") and "met on 2026-12-04T11:00:00+0000 (1.52x), " \
        "2026-12-06T11:00:00+0000 (1.60x)" in line and "**missed** on 2026-12-05T11:00:00+0000 (1.40x)" in line
    only_met = report_tables.render_peer_llamacpp(run(160.0, "2026-12-06T11:00:00+0000"))
    assert "Target ≥ 1.5x, 8 short sessions, aggregate, speculation off on both (the per-token claim): met on" \
        in only_met and "**missed**" not in only_met


def test_peer_memory_is_like_for_like_and_says_the_overhead():
    def side(flags, bpt, ready, full, small):
        return {"kv_budget_tokens": 16384, "flags": flags, "kv_bytes_per_token": bpt,
                "kv_budget_mib": 16384 * bpt / 2 ** 20,
                "full_kv": {"ready": {"rss_mib": ready}, "after_fill": {"rss_mib": full, "anon_mib": full - 90},
                            "tokens_held": 16000},
                "small_kv": {"kv_budget_tokens": 512, "after_request": {"rss_mib": small}},
                "rss_full_mib": full, "rss_without_kv_mib": small, "rss_beyond_kv_mib": full - 16384 * bpt / 2 ** 20}

    mem = {"kv_tokens": 16384, "generated_per_session": 128,
           "sides": {"opencoti-off": side(["--kv-budget-tokens", "16384"], 23040, 500.0, 700.0, 420.0),
                     "llama.cpp": side(["-c", "16384"], 23040, 480.0, 560.0, 200.0)},
           "extra_full_mib": 140.0, "extra_without_kv_mib": 220.0}
    text = report_tables.render_peer_memory(mem)
    assert "both with 16384 fp16 KV tokens" in text and "| KV budget, MiB | 360.00 | 360.00 | – |" in text
    assert "| RSS with a 512-token KV after one request (without KV), MiB | 420.00 | 200.00 | 0.48x |" in text
    notes = report_tables.memory_notes(mem)
    assert notes == ["Where we lose — memory after filling the 16384-token budget: opencoti's RSS is 140 MiB above "
                     "llama.cpp's.",
                     "Where we lose — memory without KV (a 512-token budget, after one request): opencoti's RSS is "
                     "220 MiB above llama.cpp's."]


def test_every_run_is_kept_and_a_quick_run_never_replaces_a_full_one(tmp_path, monkeypatch):
    import common
    import run_all

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(common, "results_dir", lambda: tmp_path / "results" / "box-2c-0000")
    monkeypatch.setattr(common, "_WRITTEN", set())
    monkeypatch.setattr(common.time, "strftime", lambda fmt: "2026-12-06T10:00:00+0000")
    common.write_json("demo", {"config": {"quick": False}, "n": 1})
    monkeypatch.setattr(common, "_WRITTEN", set())  # another process
    monkeypatch.setattr(common.time, "strftime", lambda fmt: "2026-12-06T11:00:00+0000")
    common.write_json("demo", {"config": {"quick": False}, "n": 2})
    folder = tmp_path / "results" / "box-2c-0000"
    assert json.loads((folder / "demo.json").read_text())["n"] == 2
    assert json.loads((folder / "history" / "demo-20261206T100000.json").read_text())["n"] == 1
    common.write_json("demo", {"config": {"quick": False}, "n": 3})  # the same process again (a partial write)
    assert len(list((folder / "history").iterdir())) == 1
    common.write_json("demo", {"config": {"quick": True}, "n": 4})  # a script run by hand with --quick
    assert json.loads((folder / "demo.json").read_text())["n"] == 3
    assert json.loads((folder / "demo_quick.json").read_text())["n"] == 4
    # opencoti bench --quick: every script into its own <name>_quick.json; the full run: the scripts' defaults
    calls = []

    class Finished:  # a benchmark that ran and exited 0 (run_all waits on a Popen: SIGTERM is handed on)
        def __init__(self, cmd, cwd=None):
            calls.append(cmd)
            self.pid, self.returncode = -1, 0

        def wait(self):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(run_all.subprocess, "Popen", Finished)
    monkeypatch.setattr(common, "machine_info", lambda: {})
    monkeypatch.setattr(common, "load_snapshot", lambda: {})
    assert run_all.main(["--quick", "--no-report"]) == 0
    for (name, *_), cmd in zip(run_all.HEADLINE, calls):
        assert cmd[-2:] == ["--out", str(folder / f"{name}_quick.json")]
    assert (folder / "run_quick.json").exists() and not (folder / "run.json").exists()
    calls.clear()
    assert run_all.main(["--no-report"]) == 0
    assert all(h[2] == [] for h in run_all.HEADLINE)  # make bench: the published configuration is the defaults
    assert [c[2:] for c in calls] == [[] for _ in run_all.HEADLINE]
    assert json.loads((folder / "run.json").read_text())["runs"][0]["command"][1:] == []


def test_the_machine_line_names_the_opencoti_bench_run_that_made_the_table(tmp_path, monkeypatch):
    box = tmp_path / "results" / "box-2c-0000"
    box.mkdir(parents=True)
    payload = {"benchmark": "demo", "time": "2026-12-06T10:00:00+0000", "machine": {"cpu": "CPU", "loadavg": [0.5]},
               "report": {"headers": ["case", "tok/s"], "rows": [["one", 1.5]]}}
    (box / "demo.json").write_text(json.dumps(payload))
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    assert "run by hand, not by `opencoti bench`" in report.block("demo")  # a script run by hand
    run = {"time": "2026-12-06T10:30:00+0000", "quick": False,
           "runs": [{"name": "demo", "command": ["benchmarks/demo.py"], "rc": 0, "seconds": 61.5}]}
    (box / "run.json").write_text(json.dumps(run))
    assert ("made by `opencoti bench` (`benchmarks/results/box-2c-0000/run.json`, 2026-12-06T10:30:00+0000: "
            "`benchmarks/demo.py`, 61.5 s)") in report.block("demo")
    payload["time"] = "2026-12-06T11:00:00+0000"  # written after that run: not its result
    (box / "demo.json").write_text(json.dumps(payload))
    assert "made by" not in report.block("demo") and "run by hand" in report.block("demo")
    # a later `opencoti bench --only other` replaced run.json: the record that made the table is in history/
    (box / "history").mkdir()
    (box / "history" / "run-20261206T113000.json").write_text(json.dumps({**run, "time": "2026-12-06T11:30:00+0000"}))
    (box / "run.json").write_text(json.dumps({"time": "2026-12-06T12:00:00+0000", "quick": False, "runs": [
        {"name": "other", "command": ["benchmarks/other.py"], "rc": 0, "seconds": 5}]}))
    assert "(`benchmarks/results/box-2c-0000/history/run-20261206T113000.json`, 2026-12-06T11:30:00+0000" \
        in report.block("demo")
    (box / "history" / "run-20261206T113000.json").write_text(json.dumps(
        {**run, "time": "2026-12-06T11:30:00+0000", "runs": [{**run["runs"][0], "rc": 1}]}))
    assert "run by hand" in report.block("demo")  # that run failed: not its table
    (box / "demo.json").unlink()
    (box / "demo_quick.json").write_text(json.dumps({**payload, "config": {"quick": True}}))
    assert "raw data `benchmarks/results/box-2c-0000/demo_quick.json`" in report.block("demo")
