"""The benchmark baselines measure what they say: no-pool runs reuse nothing, weight formats and
cluster routers are compared in rotated order, the cluster hit rate counts the pools' prefill, the
transformers baselines run without our OpenMP settings, the simulator's headline is on seeds the
policy was not tuned on and every profile's ``fit`` follows the rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_admission_sim  # noqa: E402
import bench_cluster  # noqa: E402
import bench_fanout  # noqa: E402
import bench_pools  # noqa: E402
import bench_quant  # noqa: E402
import common  # noqa: E402
import hf_fanout  # noqa: E402

from opencoti.sim.profile import StepProfile, profile_names  # noqa: E402
from opencoti.sim.ramp import choose_fit  # noqa: E402


# ============================================================================ pools: salted baselines
class FakeEngine:
    """Records the keyword arguments of every generate(); answers with the given cache_n."""

    def __init__(self, cache_n: int = 0):
        self.calls: list[dict] = []
        self.cache_n = cache_n

    def generate(self, prompt, **kw):
        self.calls.append(kw)
        return SimpleNamespace(timings={"prompt_ms": 1.0, "prompt_n": len(prompt), "cache_n": self.cache_n},
                               token_ids=[7] * kw["params"].max_tokens)

    def release_session(self, sid):
        pass

    def pools(self):
        return {"kv_bytes_used": 0, "kv_pages_used": 0}

    def check_integrity(self):
        pass

    def stats(self):
        return {}


def test_every_pools_request_runs_under_a_salt_of_its_own():
    eng = FakeEngine()
    bench_pools.ttft_once(eng, [1, 2, 3], "full-0", None)
    bench_pools.ttft_once(eng, [1, 2, 3], "full-1", None)
    bench_pools.run_sessions(eng, [[1, 2], [1, 3], [1, 4]], 2, "nopool", None, 0)
    salts = [c.get("cache_salt") for c in eng.calls]
    assert None not in salts and len(set(salts)) == len(salts) == 5


def test_a_baseline_that_reused_cached_tokens_stops_the_run():
    common.assert_cache_n([0, 0, 0], 0, "full prefill")
    common.assert_cache_n([1024, 1024], 1024, "attach")
    with pytest.raises(RuntimeError, match="expected 0 cached prompt tokens"):
        common.assert_cache_n([0, 1008, 0], 0, "full prefill")
    with pytest.raises(RuntimeError):
        common.assert_cache_n([1056], 1024, "attach")  # the suffix too came from the prefix cache


# ============================================================================ weight formats
def test_weight_formats_rotate_and_fp32_fixed_is_not_privileged():
    names = list(bench_quant.engine_specs(["fp32", "bf16", "int8", "int4"]))
    assert names[0] != "fp32-fixed" and {"auto", "fp32", "bf16", "int8", "int4", "fp32-fixed"} == set(names)
    orders = [common.rotated(names, r) for r in range(len(names))]
    assert sorted(o[0] for o in orders) == sorted(names)  # each goes first once
    assert all(sorted(o) == sorted(names) for o in orders)


def test_auto_is_judged_against_the_fastest_format():
    med = {"auto": {"single": 19.0}, "fp32": {"single": 12.0}, "int4": {"single": 20.5}, "int8": {"single": None}}
    r = bench_quant.auto_vs_fastest(med, ["fp32", "int8", "int4"])
    assert r["fastest"] == "int4" and r["ratio"] == pytest.approx(19.0 / 20.5) and r["within_5pct"] is False
    med["auto"]["single"] = 19.6
    assert bench_quant.auto_vs_fastest(med, ["fp32", "int8", "int4"])["within_5pct"] is True
    # with the chosen format named, its own row is judged (the auto process beside it is the same engine)
    r = bench_quant.auto_vs_fastest(med, ["fp32", "int8", "int4"], "fp32")
    assert r["chosen_ratio"] == pytest.approx(12.0 / 20.5) and r["within_5pct"] is False
    med["auto"]["single"] = 18.0
    r = bench_quant.auto_vs_fastest(med, ["fp32", "int8", "int4"], "int4")
    assert r["chosen_ratio"] == 1.0 and r["within_5pct"] is True and r["ratio"] == pytest.approx(18.0 / 20.5)


def test_a_format_runs_in_a_process_of_its_own(monkeypatch):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return SimpleNamespace(returncode=0, stderr="", stdout='RESULT {"single": 1.0}\n')

    monkeypatch.setattr(bench_quant.subprocess, "run", fake_run)
    args = SimpleNamespace(tokens=8, concurrency=2)
    assert bench_quant.run_worker("int4", args)["single"] == 1.0
    assert seen[0][0] == sys.executable and "--worker" in seen[0] and "int4" in seen[0]


# ============================================================================ cluster
def test_cluster_hit_rate_counts_pool_prefill_as_computed():
    # the published run: 46,332 prompt tokens, 4,972 computed of which 3,610 the pools' prefill
    assert bench_cluster.hit_rate(46332, 46332 - 1362, 3610) == pytest.approx(1 - 4972 / 46332)
    assert bench_cluster.hit_rate(46332, 46332 - 1362, 3610) < 0.90  # not 97.1 %
    assert bench_cluster.hit_rate(100, 70) == pytest.approx(0.70)  # no pools: cached / prompt
    assert bench_cluster.hit_rate(0, 0) is None


def test_cluster_runs_rotate_and_include_rays_prefix_router():
    assert "ray-prefix" in bench_cluster.MODES and "pow2" in bench_cluster.MODES
    firsts = {common.rotated(bench_cluster.MODES, r)[0] for r in range(len(bench_cluster.MODES))}
    assert firsts == set(bench_cluster.MODES)


# ============================================================================ fan-out
def test_transformers_baselines_run_without_our_openmp_settings():
    env = hf_fanout.baseline_env({"GOMP_SPINCOUNT": "20000", "OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}
    code = "import sys; sys.path.insert(0, sys.argv[1]); import hf_fanout; print('opencoti' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fanout_labels_name_each_sides_weights():
    lab = bench_fanout.labels("int4", "float32")
    assert "int4" in lab["opencoti-pool"] and "int4" in lab["opencoti-nopool"]
    assert all("fp32" in lab[s] and "int4" not in lab[s] for s in lab if s.startswith("hf-"))


def test_fanout_table_says_fail_when_a_target_is_missed():
    d = {"config": {"target": {"prefix": 8, "sessions": 2}, "suffix": 8, "gen": 4, "repeats": 1, "systems": [],
                    "kv_bytes_per_token": 1, "torch_threads": 2, "weights": "int4", "hf_dtype": "float32"},
         "table": [], "labels": {}, "runs": [], "seconds": {"total": 60},
         "targets": {"wall_vs_hf-recompute": {"ratio": 4.83, "target": 5.0, "pass": False}},
         "machine": {"cpu": "x", "cpu_affinity": 2, "cpu_count": 2, "torch": "t", "transformers": "t", "python": "3",
                     "loadavg": [1, 1, 1], "git": {"commit": "abc", "dirty": False}}, "loadavg_end": [1, 1, 1]}
    md = bench_fanout.markdown_report(d)
    assert "| wall vs hf-recompute | 4.83x | ≥ 5.0x | FAIL |" in md and "int4 weights" in md


# ============================================================================ admission simulator
@pytest.mark.parametrize("name", profile_names())
def test_every_profile_fit_follows_the_rule(name):
    prof = StepProfile.load(name)
    assert prof.ramp["fit"] == choose_fit(prof), name


def test_the_rule_on_a_line_and_on_a_knee():
    line = StepProfile(name="line", base_s=0.012, seq_s=0.0045, ctx_s=0.0, prefill_s=0.0, noise_sigma=0.0,
                       ramp={"tasks": 4, "tokens": 10})
    # per-session tps 1/(a + b k): k qualifies while b > 0.1 (a + b k), i.e. k < 7.33
    assert choose_fit(line) == 7
    knee = StepProfile(name="knee", base_s=0.012, seq_s=0.0025, knee=8, ctx_s=0.0, prefill_s=0.0,
                       noise_sigma=0.0, ramp={"tasks": 4, "tokens": 10})
    assert choose_fit(knee) == 13


def test_the_headline_is_on_seeds_the_policy_was_not_tuned_on():
    sets = bench_admission_sim.seed_sets(40, 20, 20)
    assert sets["held_out"] == list(range(20, 60)) and sets["tuning"] == list(range(20))
    assert not set(sets["held_out"]) & set(range(bench_admission_sim.TUNING_SEEDS))
    quick = bench_admission_sim.seed_sets(40, 20, 20, quick=True)
    assert quick["held_out"] == [20, 21, 22] and quick["tuning"] == [0, 1, 2]
    with pytest.raises(ValueError, match="tuned on"):
        bench_admission_sim.seed_sets(20, 0, 20)
