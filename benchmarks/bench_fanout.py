#!/usr/bin/env python
"""Shared-prefix fan-out: opencoti vs the alternatives users would pick, in one run (issue 8).

Workload: a shared prefix of P tokens (an agent system prompt with tool definitions, from
bench_pools), N sessions, each with its own Q=32-token user turn and G=64 greedy generated
tokens (ignore EOS). All N sessions are "spawned" at t0 (a fan-out); everything needed from
scratch (the prefix KV included) happens after t0 and counts.

Systems, all on the bundled model (transformers loads the engine's converted HF directory),
float32, the same token ids:

  opencoti-pool     create a pool from the prefix, then N sessions attach (pool_id) and run
                    concurrently (continuous batching, shared-prefix attention where it pays)
  opencoti-nopool   N fresh sessions, no pool: each computes prefix + suffix itself
  hf-recompute      transformers generate(), one session at a time, prefix recomputed each time
  hf-copy           transformers' prompt-reuse recipe: prefix into a DynamicCache once, then per
                    session copy.deepcopy(cache) + generate(past_key_values=copy)
  hf-batch          transformers generate() on the N prompts as one batch (no padding needed:
                    every prompt has exactly P+Q tokens)
  hf-cb             transformers continuous batching, generate_batch() (paged cache, prefix block
                    sharing on), its cache sized for the workload (see CB_NOTE)

Metrics (per system, P, N): total wall time (t0 to the last token of the last session), TTFT
p50/p95 (first token of each session - t0), per-session decode tok/s ((G-1) / (last - first
token), median over sessions), aggregate decode tok/s (N(G-1) / time during which at least one
session was decoding), peak KV bytes (see KV_DEFINITION). The scheduling/Python overhead of the
engine at N = 8 comes from its per-step StepStats (model_s vs total_s, and the step-loop period),
and a torch.profiler run splits one decode step into GEMMs, attention, other model ops and the
non-model parts (scheduling, metadata, sampling, token handling).

Targets (P=1024, N=8): wall time >= 5x faster than hf-recompute and hf-copy, >= 2x faster than
hf-batch and hf-cb; peak KV >= 4.5x less than hf-copy (ideal 5.0x); overhead <= 15% of step time.

Run: .venv/bin/python benchmarks/bench_fanout.py [--quick]   (or: opencoti bench fanout)
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from bench_pools import QUESTIONS, build_prefix, build_suffix  # noqa: E402
from hf_fanout import baseline_env, finish_run, percentile, union_length  # noqa: E402,F401
from common import check_mark, fmt, log, now, print_table, ratio  # noqa: E402

ALL_SYSTEMS = ["opencoti-pool", "opencoti-nopool", "hf-recompute", "hf-copy", "hf-batch", "hf-cb"]
HF_PER_SESSION = ["hf-recompute", "hf-copy"]
HF_BATCHED = ["hf-batch", "hf-cb"]
LABELS = {  # the weight format of each side is added at run time (labels())
    "opencoti-pool": "opencoti, pool + attached sessions",
    "opencoti-nopool": "opencoti, sessions only (no pool, nothing reused)",
    "hf-recompute": "transformers generate, per session, prefix recomputed",
    "hf-copy": "transformers generate, prefix cache deep-copied per session",
    "hf-batch": "transformers generate, one padded batch",
    "hf-cb": "transformers generate_batch (continuous batching)",
}

KV_DEFINITION = (
    "Peak KV bytes held for the workload, every session's cache kept after its request (a multi-agent "
    "server keeps sessions for their next turn; the engine does too, until release). opencoti: KV pages "
    "in use (engine.kv.num_used x page_bytes, pool pages included, read every 10 ms without going through "
    "the step thread) minus the value before the run. hf-recompute / hf-copy / hf-batch: bytes of the key "
    "and value tensors of the live DynamicCaches (hf-copy: the prefix template too, until the last copy is "
    "made). hf-cb: bytes of the cache blocks in use (1 - free capacity) x cache size, polled while running; "
    "its whole preallocated cache is reported separately.")
CB_NOTE = (
    "transformers' continuous batching sizes its paged cache from device memory when num_blocks is not "
    "given; on CPU that means most of RAM, and it sizes its attention masks by the whole cache: an 8-session "
    "trial took ~10x longer. We give it the cache the workload needs: page_size 256 (its "
    "default), num_blocks = ceil(N(P+Q+G)/256) + 2, max_batch_tokens 512 (our engine's default), prefix "
    "block sharing on (its default).")


def labels(engine_weights: str, hf_dtype: str) -> dict:
    """LABELS with the weights each side runs: ours in the engine's format (int4 under ``auto`` on
    most CPUs), transformers in its dtype, so a table never reads as the same precision on both sides."""
    hf = {"float32": "fp32", "bfloat16": "bf16"}.get(hf_dtype, hf_dtype)
    return {k: f"{v} [{engine_weights if k.startswith('opencoti') else hf} weights]" for k, v in LABELS.items()}


def run_hf_process(system: str, job: dict, env: dict) -> dict:
    """One transformers measurement in a process of its own (hf_fanout.py), under ``env``."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        jp, op = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jp.write_text(json.dumps({**job, "system": system}))
        r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "hf_fanout.py"), str(jp), str(op)],
                           env=env, capture_output=True, text=True, timeout=7200)
        if r.returncode or not op.exists():
            raise RuntimeError(f"{system} failed (rc {r.returncode}): {r.stderr[-2000:]}")
        return json.loads(op.read_text())


# ============================================================================ opencoti
class PagePoller:
    """Peak of ``engine.kv.num_used`` (an int read; no command on the step thread)."""

    def __init__(self, engine, interval: float = 0.01):
        self.engine, self.interval = engine, interval
        self.peak = engine.kv.num_used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.engine.kv.num_used)

    def __enter__(self) -> "PagePoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.engine.kv.num_used)


def run_opencoti(engine, prefix: list[int], suffixes: list[list[int]], G: int, use_pool: bool, tag: str) -> dict:
    """N concurrent streams released together; with ``use_pool`` the pool is created first
    (after t0: computing the prefix is part of the workload). Each session has a ``cache_salt`` of
    its own, so nothing is shared through the automatic prefix cache: without a pool every session
    computes prefix + suffix (asserted: cache_n == 0), with one it reuses exactly the pool's P tokens."""
    from opencoti.engine import SamplingParams

    N, P = len(suffixes), len(prefix)
    go = threading.Event()
    times: list[list[float]] = [[] for _ in range(N)]
    results: list = [None] * N
    errors: list[BaseException] = []
    pool_id: list[int | None] = [None]
    steps: list[tuple] = []

    def on_event(kind: str, data: dict) -> None:
        if kind == "step":
            st = data["stats"]
            steps.append((now(), st.num_seqs, st.num_tokens, st.num_decode, st.model_s, st.total_s,
                          engine.backend.last_used_cascade))

    def worker(i: int) -> None:
        try:
            go.wait()
            s = engine.stream(prefix + suffixes[i], params=SamplingParams.greedy(G, ignore_eos=True),
                              session_id=f"{tag}-{i}", pool_id=pool_id[0], cache_salt=common.fresh_salt(f"{tag}-{i}"))
            for _ in s:
                times[i].append(now())
            results[i] = s.result
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    base_pages = engine.kv.num_used
    engine.core.listeners.append(on_event)
    try:
        with PagePoller(engine) as poller:
            t0 = now()
            if use_pool:
                pool_id[0] = engine.create_pool(tokens=prefix, label=tag).pool_id
            t_pool = now() - t0
            go.set()
            for t in threads:
                t.join()
    finally:
        engine.core.listeners.remove(on_event)
    for i in range(N):
        try:
            engine.release_session(f"{tag}-{i}")
        except Exception:  # noqa: BLE001 - never created
            pass
    if pool_id[0] is not None:
        engine.release_pool(pool_id[0])
    engine.check_integrity()
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]!r}") from errors[0]
    if any(len(ts) != G for ts in times):
        raise RuntimeError(f"a session got {[len(ts) for ts in times]} tokens, wanted {G}")
    # every session under a salt of its own: the pool is the only thing shared
    common.assert_cache_n([r.timings["cache_n"] for r in results], P if use_pool else 0,
                          "opencoti with a pool" if use_pool else "opencoti without a pool")
    left = engine.kv.num_used - base_pages
    steps_rel = [(ts - t0, *rest) for ts, *rest in steps]
    return finish_run(
        "opencoti-pool" if use_pool else "opencoti-nopool", P, N, G,
        [ts[0] - t0 for ts in times], [ts[-1] - t0 for ts in times], [r.token_ids for r in results],
        (poller.peak - base_pages) * engine.kv.page_bytes,
        {"pool_create_s": t_pool if use_pool else None,
         "cache_n": [r.timings["cache_n"] for r in results],
         "steps": steps_rel, "kv_pages_left_after_release": left})


def step_overhead(run: dict) -> dict:
    """Scheduling/Python overhead from the engine's StepStats, over the steps in which all N
    sessions decode (one token each, no prefill), the first such step excluded (it overlaps with
    admission bookkeeping). in-step: 1 - model_s / total_s (total_s = EngineCore.step());
    loop: 1 - model_s / (time between consecutive step ends), which adds the step thread's
    command handling, listeners and metrics."""
    N = run["sessions"]
    steps = run["steps"]
    idx = [i for i, s in enumerate(steps) if s[1] == N and s[2] == N and s[3] == N]
    idx = idx[1:] or idx
    if not idx:
        return {"decode_steps": 0}
    model = [steps[i][4] for i in idx]
    total = [steps[i][5] for i in idx]
    periods = [(steps[i][0] - steps[i - 1][0], steps[i][4]) for i in idx if i > 0 and steps[i - 1][3] == N
               and steps[i - 1][1] == N]
    all_model = sum(s[4] for s in steps)
    all_total = sum(s[5] for s in steps)
    return {
        "decode_steps": len(idx),
        "cascade_steps": sum(1 for i in idx if steps[i][6]),
        "model_ms_median": 1e3 * statistics.median(model),
        "step_ms_median": 1e3 * statistics.median(total),
        "period_ms_median": 1e3 * statistics.median(p for p, _ in periods) if periods else None,
        "overhead_in_step": 1 - sum(model) / sum(total),
        "overhead_loop": 1 - sum(m for _, m in periods) / sum(p for p, _ in periods) if periods else None,
        "overhead_in_step_all_steps": 1 - all_model / all_total if all_total else None,
    }


# ============================================================================ profiler
def profile_step_breakdown(engine, prefix, suffixes, G: int) -> dict:
    """One opencoti-pool run under torch.profiler (started on the step thread, where the engine
    computes), each part of a step wrapped in a record_function label. Only steps in which all N
    sessions decode are split: GEMMs (the outermost mm/addmm/linear-like ops outside attention,
    oneDNN's packed linear included), attention (the backend's forward), attention planning,
    other model ops (norms, RoPE, SiLU, embedding, residuals), the forward's own Python (self time
    of the forward between its ops), and outside the model: scheduling, attention metadata,
    sampling, token handling (detokenize, stop strings, streaming) and the rest of
    EngineCore.step() (plan, run, apply)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import opencoti.engine.core.runner as runner_mod

    core = engine.core
    sch = core.scheduler
    model, backend, sampler = engine.model, engine.backend, core.sampler

    def wrap(label: str, fn):
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return inner

    patches = [(core, "step"), (sch, "schedule"), (core, "_on_token"), (model, "forward"), (backend, "plan"),
               (backend, "forward"), (sampler, "sample")]
    labels = {"step": "fanout::step", "schedule": "fanout::schedule", "_on_token": "fanout::on_token",
              "forward": None, "plan": "fanout::attn_plan", "sample": "fanout::sample"}
    originals = [(obj, name, obj.__dict__.get(name)) for obj, name in patches]
    orig_meta = runner_mod.build_metadata
    for obj, name in patches:
        label = labels[name] or ("fanout::model" if obj is model else "fanout::attention")
        setattr(obj, name, wrap(label, getattr(obj, name)))
    runner_mod.build_metadata = wrap("fanout::metadata", orig_meta)
    prof = profile(activities=[ProfilerActivity.CPU])
    try:
        engine.run_on_step_thread(prof.start)  # the profiler only sees the thread it was started on
        run = run_opencoti(engine, prefix, suffixes, G, True, "prof")
        engine.run_on_step_thread(prof.stop)
    finally:
        for obj, name, orig in originals:
            if orig is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, orig)
        runner_mod.build_metadata = orig_meta
    N = len(suffixes)
    step_evts = sorted((e for e in prof.events() if e.name == "fanout::step"), key=lambda e: e.time_range.start)
    stats = run["steps"]
    if len(step_evts) != len(stats):
        log(f"profiler: {len(step_evts)} step events vs {len(stats)} step stats; matching by order")
    gemm_names = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
                  "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::mkldnn_linear",
                  "onednn::qlinear_pointwise", "aten::_mkldnn_linear"}
    parts_sum: dict[str, float] = {}
    n_steps = 0
    gemm_seen: dict[str, float] = {}

    attn_ops: dict[str, float] = {}

    def attn_walk(ev) -> None:  # self time of every op inside attention, by name
        for ch in ev.cpu_children:
            attn_ops[ch.name] = attn_ops.get(ch.name, 0.0) + ch.self_cpu_time_total
            attn_walk(ch)

    def walk(ev, inside_attn: bool, acc: dict) -> None:
        for ch in ev.cpu_children:
            if ch.name == "fanout::attention":
                acc["attention"] += ch.cpu_time_total
                acc["attention_self"] += ch.self_cpu_time_total
                attn_walk(ch)
                walk(ch, True, acc)
                continue
            if ch.name == "fanout::attn_plan":
                acc["attn_plan"] += ch.cpu_time_total
                continue
            if not inside_attn and (ch.name in gemm_names or "linear" in ch.name or ch.name.endswith("_mm")):
                # count the outermost GEMM-like op once (its children are part of it)
                acc["gemm"] += ch.cpu_time_total
                gemm_seen[ch.name] = gemm_seen.get(ch.name, 0.0) + ch.cpu_time_total
                continue
            walk(ch, inside_attn, acc)

    for k, ev in enumerate(step_evts):
        if k >= len(stats) or k == 0:
            continue
        s = stats[k]
        if not (s[1] == N and s[2] == N and s[3] == N):
            continue
        acc = {"step": ev.cpu_time_total, "model": 0.0, "model_self": 0.0, "attention": 0.0, "attention_self": 0.0,
               "attn_plan": 0.0, "gemm": 0.0, "schedule": 0.0, "metadata": 0.0, "sample": 0.0, "on_token": 0.0}
        for ch in ev.cpu_children:
            key = {"fanout::model": "model", "fanout::schedule": "schedule", "fanout::metadata": "metadata",
                   "fanout::sample": "sample", "fanout::on_token": "on_token"}.get(ch.name)
            if key is None:
                continue
            acc[key] += ch.cpu_time_total
            if key == "model":
                acc["model_self"] += ch.self_cpu_time_total
                walk(ch, False, acc)
        n_steps += 1
        for key, v in acc.items():
            parts_sum[key] = parts_sum.get(key, 0.0) + v
    if not n_steps:
        return {"decode_steps": 0}
    avg = {k: v / n_steps / 1e3 for k, v in parts_sum.items()}  # us -> ms per step
    model_other = avg["model"] - avg["attention"] - avg["attn_plan"] - avg["gemm"] - avg["model_self"]
    rest = avg["step"] - avg["model"] - avg["schedule"] - avg["metadata"] - avg["sample"] - avg["on_token"]
    parts_ms = {"gemm": avg["gemm"], "attention": avg["attention"], "attention_plan": avg["attn_plan"],
                "model_other_ops": model_other, "model_python": avg["model_self"], "schedule": avg["schedule"],
                "metadata": avg["metadata"], "sampling": avg["sample"], "token_handling": avg["on_token"],
                "step_rest": rest}
    top = sorted(((e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages()),
                 key=lambda x: -x[1])[:15]
    return {
        "decode_steps": n_steps, "sessions": N, "prefix": len(prefix),
        "step_ms": avg["step"], "model_ms": avg["model"], "parts_ms": parts_ms,
        "parts_share": {k: v / avg["step"] for k, v in parts_ms.items()},
        "non_model_share": 1 - avg["model"] / avg["step"],
        "attention_python_ms": avg["attention_self"],
        "attention_ops_ms": dict(sorted(((k, v / n_steps / 1e3) for k, v in attn_ops.items()),
                                        key=lambda x: -x[1])[:12]),
        "gemm_ops_ms_total": {k: v / 1e3 for k, v in gemm_seen.items()},
        "top_ops_self_ms_whole_run": top,
        "note": "profiled run (profiler overhead inflates the Python-heavy parts); per decode step, averaged",
    }


# ============================================================================ driver
def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Sessions with identical greedy tokens, and the mean length of the agreeing prefix."""
    same, pref = 0, []
    for x, y in zip(a, b):
        same += x == y
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        pref.append(n)
    return {"identical_sessions": same, "sessions": len(a), "mean_agreeing_tokens": statistics.mean(pref)}


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--prefix", type=int, nargs="+", default=[256, 1024, 2048], help="shared prefix sizes P")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="session counts N")
    p.add_argument("--suffix", type=int, default=32, help="per-session suffix tokens Q")
    p.add_argument("--gen", type=int, default=64, help="generated tokens per session G")
    p.add_argument("--target-prefix", type=int, default=1024)
    p.add_argument("--target-sessions", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds at the target point, systems interleaved (median reported); the other points run once")
    p.add_argument("--systems", nargs="+", default=ALL_SYSTEMS, choices=ALL_SYSTEMS)
    p.add_argument("--baseline-points", default="light", choices=["target", "light", "cross", "full"],
                   help="where the systems other than opencoti-pool run (opencoti-pool always runs the whole "
                        "grid): 'target' = only the target point; 'light' = the target point plus N = 1 at "
                        "every P; 'cross' = light plus every N at the target P (the per-session transformers "
                        "recipes up to the target N); 'full' = the whole grid (hours on 2 cores)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler step breakdown")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--plot-dir", default=str(common.REPO_ROOT / "docs" / "img"), help="where the PNGs go")
    p.add_argument("--report-only", metavar="JSON", default=None,
                   help="measure nothing: write the markdown tables and PNGs from an existing results JSON")
    args = p.parse_args(argv)
    if args.report_only:
        path = Path(args.report_only)
        write_outputs(json.loads(path.read_text()), path, args)
        return 0
    if args.quick:
        args.prefix, args.sessions = [256, 512], [1, 4]
        args.target_prefix, args.target_sessions = 512, 4
        args.gen, args.repeats = 8, 1
    if args.target_prefix not in args.prefix:
        args.prefix = sorted({*args.prefix, args.target_prefix})
    if args.target_sessions not in args.sessions:
        args.sessions = sorted({*args.sessions, args.target_sessions})
    if max(args.sessions) > len(QUESTIONS) or min(args.sessions) < 1:
        p.error(f"--sessions must be in [1, {len(QUESTIONS)}]")
    if min(args.prefix) < 1 or args.suffix < 8 or args.gen < 2 or args.repeats < 1:
        p.error("--prefix >= 1, --suffix >= 8, --gen >= 2 and --repeats >= 1")
    common.set_threads(args.threads)

    import torch

    t_start = now()
    load_before = common.load_snapshot()
    machine = common.machine_info()
    log(f"machine: {common.describe_machine(machine)}")
    Q, G = args.suffix, args.gen
    TP, TN = args.target_prefix, args.target_sessions
    maxP, maxN = max(args.prefix), max(args.sessions)
    engine = common.make_engine(args, kv_budget_tokens=maxN * (maxP + Q + G) + maxP + 4096, max_pools=16,
                                max_running=max(64, maxN), pool_grace_ttl_s=0.0)
    log(f"engine loaded in {engine.load_seconds:.1f}s ({engine.model_name}, {engine.dtype}, {engine.device}); "
        f"KV {engine.kv.num_pages} pages x {engine.kv.page_size} tokens, {engine.kv.page_bytes} B/page; "
        f"cascade={engine.backend.cascade}")
    hf_env = baseline_env()  # the transformers baselines: their own processes, OpenMP's own defaults
    weights = engine.model.weights
    run_labels = labels(weights, args.dtype)
    bytes_per_token = engine.kv.page_bytes // engine.kv.page_size
    prefixes = {}
    for P in args.prefix:
        prefixes[P], _ = build_prefix(engine, P)
    suffixes = [build_suffix(engine, q, Q) for q in QUESTIONS[:maxN]]

    runners = {
        "opencoti-pool": lambda P, N, tag: run_opencoti(engine, prefixes[P], suffixes[:N], G, True, tag),
        "opencoti-nopool": lambda P, N, tag: run_opencoti(engine, prefixes[P], suffixes[:N], G, False, tag),
    }
    wP = min(args.prefix)

    def hf_runner(system: str):
        def run(P: int, N: int, tag: str) -> dict:
            if tag.startswith("warm-"):  # each measuring process warms up by itself
                return {}
            job = {"model_dir": str(engine.loaded.model_dir), "dtype": args.dtype, "threads": args.threads,
                   "prefix": prefixes[P], "suffixes": suffixes[:N], "gen": G,
                   "warm": {"prefix": prefixes[wP], "suffixes": suffixes[:min(2, maxN)]}}
            return run_hf_process(system, job, hf_env)
        return run

    runners.update({s: hf_runner(s) for s in ALL_SYSTEMS if s.startswith("hf-")})

    def points_for(system: str) -> list[tuple[int, int]]:
        grid = [(P, N) for P in args.prefix for N in args.sessions]
        if system == "opencoti-pool" or args.baseline_points == "full":
            return grid
        n1 = min(args.sessions)
        pts = {(TP, TN)}
        if args.baseline_points in ("light", "cross"):
            pts |= {(TP, n1)} | {(P, n1) for P in args.prefix}  # N = 1: the single-session cost at every P
        if args.baseline_points == "cross":  # every N at the target P (per-session recipes: up to the target N)
            pts |= {(TP, N) for N in args.sessions if system not in HF_PER_SESSION or N <= TN}
        return sorted(pts, key=lambda x: grid.index(x))

    # ---------------------------------------------------------------- warm-up
    log("warm-up (our engine; each transformers process warms up by itself)")
    for system in args.systems:
        runners[system](wP, min(2, maxN), f"warm-{system}")
    gc.collect()

    runs: list[dict] = []

    def do(system: str, P: int, N: int, tag: str) -> dict:
        t = now()
        r = runners[system](P, N, tag)
        r["repeat_tag"] = tag
        runs.append(r)
        log(f"{system:16s} P={P:5d} N={N:2d}: wall {r['wall_s']:7.2f}s, TTFT p50 {r['ttft_p50_s']:6.2f}s, "
            f"agg decode {fmt(r['aggregate_decode_tps'], 1)} tok/s, peak KV {r['peak_kv_bytes'] / 2**20:7.1f} MiB "
            f"({now() - t:.0f}s, load {os.getloadavg()[0]:.2f})")
        gc.collect()
        return r

    # ---------------------------------------------------------------- target point, interleaved rounds
    t_target = now()
    for rep in range(args.repeats):
        order = args.systems if rep % 2 == 0 else list(reversed(args.systems))
        log(f"target P={TP} N={TN}: round {rep + 1}/{args.repeats}")
        for system in order:
            do(system, TP, TN, f"t{rep}-{system}")
    secs_target = now() - t_target

    # ---------------------------------------------------------------- the rest of the grid (1 repeat)
    t_grid = now()
    for P in args.prefix:
        for N in args.sessions:
            if (P, N) == (TP, TN):
                continue
            for system in args.systems:
                if (P, N) in points_for(system):
                    do(system, P, N, f"g-{system}-{P}-{N}")
    secs_grid = now() - t_grid

    # ---------------------------------------------------------------- profiler at the target N
    profile = None
    if not args.no_profile and "opencoti-pool" in args.systems:
        log(f"profiler: opencoti-pool P={TP} N={TN}")
        profile = profile_step_breakdown(engine, prefixes[TP], suffixes[:TN], G)

    # ---------------------------------------------------------------- summaries
    summary: dict[str, dict] = {}
    for r in runs:
        summary.setdefault(r["system"], {}).setdefault(f"{r['prefix']}x{r['sessions']}", []).append(r)

    def med(system: str, P: int, N: int, key: str):
        rs = summary.get(system, {}).get(f"{P}x{N}", [])
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    table: list[dict] = []
    for system in args.systems:
        for key, rs in summary.get(system, {}).items():
            P, N = rs[0]["prefix"], rs[0]["sessions"]
            table.append({"system": system, "prefix": P, "sessions": N, "repeats": len(rs),
                          **{k: med(system, P, N, k) for k in ("wall_s", "ttft_p50_s", "ttft_p95_s",
                                                               "per_session_decode_tps", "aggregate_decode_tps",
                                                               "end_to_end_tps", "peak_kv_bytes")}})

    ours = "opencoti-pool"
    t_wall = med(ours, TP, TN, "wall_s")
    targets = {}
    for other, goal in [("hf-recompute", 5.0), ("hf-copy", 5.0), ("hf-batch", 2.0), ("hf-cb", 2.0),
                        ("opencoti-nopool", None)]:
        if other in args.systems:
            rr = ratio(med(other, TP, TN, "wall_s"), t_wall)
            targets[f"wall_vs_{other}"] = {"ratio": rr, "target": goal,
                                           "pass": None if goal is None or rr is None else rr >= goal}
    if "hf-copy" in args.systems:
        rr = ratio(med("hf-copy", TP, TN, "peak_kv_bytes"), med(ours, TP, TN, "peak_kv_bytes"))
        targets["peak_kv_vs_hf-copy"] = {"ratio": rr, "target": 4.5, "pass": rr is not None and rr >= 4.5,
                                         "ideal": TN * (TP + Q + G) / (TP + TN * (Q + G))}
    target_runs = summary.get(ours, {}).get(f"{TP}x{TN}", [])
    overheads = [step_overhead(r) for r in target_runs]
    ov = {k: statistics.median(o[k] for o in overheads if o.get(k) is not None)
          for k in ("overhead_in_step", "overhead_loop", "model_ms_median", "step_ms_median", "period_ms_median",
                    "overhead_in_step_all_steps") if any(o.get(k) is not None for o in overheads)}
    ov["per_run"] = overheads
    targets["overhead_at_target_N"] = {"in_step": ov.get("overhead_in_step"), "loop": ov.get("overhead_loop"),
                                       "target": 0.15,
                                       "pass": ov.get("overhead_loop") is not None and ov["overhead_loop"] <= 0.15}

    # greedy agreement with opencoti-pool at the target point (informational)
    agree = {}
    base_ids = target_runs[0]["token_ids"] if target_runs else None
    for system in args.systems:
        rs = summary.get(system, {}).get(f"{TP}x{TN}", [])
        if rs and base_ids is not None and system != ours:
            agree[system] = agreement(base_ids, rs[0]["token_ids"])

    # ---------------------------------------------------------------- print
    mib = 2**20
    print(f"\nopencoti shared-prefix fan-out benchmark: {engine.model_name}, dtype {args.dtype}, device "
          f"{engine.device}, page size {engine.kv.page_size}, Q={Q} suffix, G={G} generated tokens")
    print(f"machine: {common.describe_machine(machine)}")
    rows = []
    for system in args.systems:
        rows.append([run_labels[system], med(system, TP, TN, "wall_s"), med(system, TP, TN, "ttft_p50_s"),
                     med(system, TP, TN, "ttft_p95_s"), med(system, TP, TN, "per_session_decode_tps"),
                     med(system, TP, TN, "aggregate_decode_tps"),
                     (med(system, TP, TN, "peak_kv_bytes") or 0) / mib,
                     ratio(med(system, TP, TN, "wall_s"), t_wall)])
    print_table(["system", "wall s", "TTFT p50 s", "TTFT p95 s", "per-sess dec tok/s", "agg dec tok/s",
                 "peak KV MiB", "wall / ours"], rows,
                title=f"target point P={TP}, N={TN} (median of {args.repeats}, systems interleaved per round)")
    if (TP, TN, Q, G) != (1024, 8, 32, 64):
        print("  (the targets are defined for P=1024, N=8, Q=32, G=64; shown here for orientation only)")
    for name, t in targets.items():
        if name == "overhead_at_target_N":
            print(f"  scheduling/Python overhead at N={TN}: in-step {fmt(t['in_step'] and 100 * t['in_step'], 1)}%, "
                  f"step loop {fmt(t['loop'] and 100 * t['loop'], 1)}%   target <= 15%: "
                  f"{'PASS' if t['pass'] else 'FAIL'}")
        elif t["target"] is not None:
            extra = f" (ideal {t['ideal']:.2f}x)" if "ideal" in t else ""
            print(f"  {name}: {fmt(t['ratio'])}x   target >= {t['target']}x{extra}: "
                  f"{check_mark(t['ratio'], t['target'])}")
        else:
            print(f"  {name}: {fmt(t['ratio'])}x (what pooling buys)")
    if agree:
        print("  greedy agreement with opencoti-pool at the target: " + ", ".join(
            f"{k} {v['identical_sessions']}/{v['sessions']} identical (mean {v['mean_agreeing_tokens']:.0f} tokens)"
            for k, v in agree.items()))
    cb_runs = summary.get("hf-cb", {}).get(f"{TP}x{TN}", [])
    if cb_runs:
        cbd = cb_runs[0].get("cb_decode") or {}
        print(f"  hf-cb prefix-cache hits (tokens per request): {cb_runs[0].get('cb_prefix_hit_tokens')}; "
              f"cache allocated {(cb_runs[0].get('cache_allocated_bytes') or 0) / mib:.0f} MiB; decode step "
              f"{fmt(cbd.get('step_ms_median'), 0)} ms of which attention {fmt(cbd.get('attention_ms_median'), 0)} ms "
              f"(q, k shapes {cbd.get('attention_shapes_q_k')})")
    grid_rows = [[f"{r['system']} P={r['prefix']} N={r['sessions']}", r["wall_s"], r["ttft_p50_s"], r["ttft_p95_s"],
                  r["per_session_decode_tps"], r["aggregate_decode_tps"], (r["peak_kv_bytes"] or 0) / mib]
                 for r in sorted(table, key=lambda r: (args.systems.index(r["system"]), r["prefix"], r["sessions"]))]
    print_table(["run", "wall s", "TTFT p50 s", "TTFT p95 s", "per-sess dec tok/s", "agg dec tok/s", "peak KV MiB"],
                grid_rows, title="all measured points (median over repeats where repeated)")
    if profile and profile.get("decode_steps"):
        print_table(["part of a decode step", "ms", "share"],
                    [[k, v, f"{100 * profile['parts_share'][k]:.1f}%"] for k, v in profile["parts_ms"].items()]
                    + [["step (EngineCore.step)", profile["step_ms"], "100%"]],
                    title=f"torch.profiler, opencoti-pool P={TP} N={TN}, {profile['decode_steps']} decode steps "
                          f"(profiled: Python-heavy parts inflated)")
    print(f"\n  time: target {secs_target:.0f}s, grid {secs_grid:.0f}s")

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k not in ("token_ids",)}

    payload = {
        "config": {"model": engine.model_name, "model_dir": engine.loaded.model_dir, "dtype": args.dtype,
                   "device": str(engine.device), "page_size": engine.kv.page_size,
                   "kv_bytes_per_token": bytes_per_token, "prefix": args.prefix, "sessions": args.sessions,
                   "suffix": Q, "gen": G, "target": {"prefix": TP, "sessions": TN}, "repeats": args.repeats,
                   "systems": args.systems, "baseline_points": args.baseline_points,
                   "points": {s: points_for(s) for s in args.systems}, "quick": args.quick,
                   "cascade": engine.backend.cascade, "max_batch_tokens": engine.config.max_batch_tokens,
                   "torch_threads": torch.get_num_threads(),
                   "weights": weights, "weights_choice": {k: (getattr(engine.model, "weights_choice", None) or {}).get(k) for k in
                                                          ("reason", "measured", "disturbed", "cached")},
                   "hf_dtype": args.dtype,
                   "openmp_env_ours": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                   "openmp_env_transformers": {k: hf_env.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                   "transformers_processes": "each transformers measurement in a process of its own "
                                             "(hf_fanout.py, no opencoti import), warmed up in it first"},
        "load_before": load_before,
        "machine_end": common.machine_info(),
        "machine": machine,
        "labels": run_labels,
        "definitions": {
            "t0": "the moment the fan-out starts: before the pool is created (opencoti-pool) / the prefix cache "
                  "is computed (hf-copy) / the first request is made",
            "wall_s": "t0 to the last token of the last session",
            "ttft": "first token of a session - t0 (sequential recipes: includes waiting for earlier sessions)",
            "per_session_decode_tps": "(G-1) / (last token - first token) of a session; median over sessions",
            "aggregate_decode_tps": "N(G-1) / length of the union of the sessions' [first token, last token] "
                                    "intervals (time during which at least one session was decoding)",
            "end_to_end_tps": "N*G / wall_s",
            "peak_kv_bytes": KV_DEFINITION,
            "hf_cb": CB_NOTE,
            "overhead": step_overhead.__doc__,
            "profile": profile_step_breakdown.__doc__,
        },
        "targets": targets,
        "overhead": ov,
        "profile": profile,
        "greedy_agreement_with_opencoti_pool": agree,
        "table": table,
        "runs": [strip(r) for r in runs],
        "seconds": {"target": secs_target, "grid": secs_grid, "total": now() - t_start},
        "loadavg_end": os.getloadavg(),
    }
    path = common.write_json("fanout", payload, args.out)
    print(f"\nwrote {path} ({now() - t_start:.0f}s total)")
    engine.shutdown()
    write_outputs(json.loads(path.read_text()), path, args)
    return 0


def write_outputs(payload: dict, json_path: Path, args) -> None:
    """The markdown tables (next to the JSON, .md) and, unless --no-plots, the PNGs."""
    md = json_path.with_suffix(".md")
    md.write_text(markdown_report(payload))
    print(f"wrote {md}")
    if not args.no_plots and not args.quick:  # (the docs' plots are the full run's: a quick run never replaces them)
        try:
            import plots

            for png in plots.plot_fanout(payload, Path(args.plot_dir)):
                print(f"wrote {png}")
        except ImportError as e:
            log(f"plots skipped ({e}); pip install matplotlib")


def markdown_report(d: dict) -> str:
    """The tables of docs/benchmarks.md's fan-out section, from a results JSON."""
    cfg = d["config"]
    TP, TN = cfg["target"]["prefix"], cfg["target"]["sessions"]
    mib = 2**20
    rows = {(r["system"], r["prefix"], r["sessions"]): r for r in d["table"]}
    base = rows.get(("opencoti-pool", TP, TN))

    def f(x, digits=2):
        return fmt(x, digits) if x is not None else "–"

    weights = (f" opencoti runs {cfg['weights']} weights, transformers {cfg['hf_dtype']} (each transformers run in "
               f"a process of its own, OpenMP defaults)." if cfg.get("weights") else "")
    out = [f"Target point P = {TP}, N = {TN}, Q = {cfg['suffix']}, G = {cfg['gen']} "
           f"(median of {cfg['repeats']} interleaved rounds).{weights}", "",
           "| system | wall s | TTFT p50 s | TTFT p95 s | per-session decode tok/s | aggregate decode tok/s "
           "| peak KV MiB | wall vs opencoti-pool |", "|---|---|---|---|---|---|---|---|"]
    for system in cfg["systems"]:
        r = rows.get((system, TP, TN))
        if r is None:
            continue
        out.append(f"| {d['labels'][system]} | {f(r['wall_s'])} | {f(r['ttft_p50_s'])} | {f(r['ttft_p95_s'])} | "
                   f"{f(r['per_session_decode_tps'], 1)} | {f(r['aggregate_decode_tps'], 1)} | "
                   f"{f(r['peak_kv_bytes'] / mib, 1)} | "
                   f"{f(ratio(r['wall_s'], base['wall_s']) if base else None)}x |")
    out += ["", "| target | measured | goal | |", "|---|---|---|---|"]
    for name, t in d["targets"].items():
        if name == "overhead_at_target_N":
            out.append(f"| scheduling/Python overhead at N = {TN} (step loop; in-step) | "
                       f"{f(100 * t['loop'], 1)}%; {f(100 * t['in_step'], 1)}% | ≤ 15% | "
                       f"{'PASS' if t['pass'] else 'FAIL'} |")
        elif t["target"] is None:
            out.append(f"| {name.replace('_', ' ')} (what pooling buys) | {f(t['ratio'])}x | – | |")
        else:
            ideal = f" (ideal {t['ideal']:.2f}x)" if "ideal" in t else ""
            out.append(f"| {name.replace('_', ' ')} | {f(t['ratio'])}x | ≥ {t['target']}x{ideal} | "
                       f"{check_mark(t['ratio'], t['target'])} |")
    per_round = [r for r in d["runs"] if r["prefix"] == TP and r["sessions"] == TN and r["repeat_tag"].startswith("t")]
    if per_round:
        out += ["", "Per round (wall s; load average at the start of each run):", "",
                "| system | " + " | ".join(f"round {i + 1}" for i in range(cfg["repeats"])) + " |",
                "|---|" + "---|" * cfg["repeats"]]
        for system in cfg["systems"]:
            rs = [r for r in per_round if r["system"] == system]
            out.append(f"| {system} | " + " | ".join(f"{r['wall_s']:.1f} ({r['loadavg'][0]:.1f})" for r in rs) + " |")
    out += ["", "opencoti with a pool over the whole grid (one run per point except the target):", "",
            "| P | N | wall s | TTFT p50 s | TTFT p95 s | per-session tok/s | aggregate tok/s | peak KV MiB | "
            "ideal KV MiB |", "|---|---|---|---|---|---|---|---|---|"]
    bpt = cfg["kv_bytes_per_token"]
    for (system, P, N), r in sorted(rows.items(), key=lambda x: (x[0][1], x[0][2])):
        if system != "opencoti-pool":
            continue
        ideal = (P + N * (cfg["suffix"] + cfg["gen"])) * bpt / mib
        out.append(f"| {P} | {N} | {f(r['wall_s'])} | {f(r['ttft_p50_s'])} | {f(r['ttft_p95_s'])} | "
                   f"{f(r['per_session_decode_tps'], 1)} | {f(r['aggregate_decode_tps'], 1)} | "
                   f"{f(r['peak_kv_bytes'] / mib, 1)} | {ideal:.1f} |")
    others = sorted(((s, P, N) for (s, P, N) in rows if s != "opencoti-pool" and (P, N) != (TP, TN)),
                    key=lambda x: (x[2], x[1], cfg["systems"].index(x[0])))
    if others:
        out += ["", "The alternatives away from the target point (one run each):", "",
                "| system | P | N | wall s | TTFT p50 s | per-session tok/s | aggregate tok/s | peak KV MiB |",
                "|---|---|---|---|---|---|---|---|"]
        for key in others:
            r = rows[key]
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | {f(r['wall_s'])} | {f(r['ttft_p50_s'])} | "
                       f"{f(r['per_session_decode_tps'], 1)} | {f(r['aggregate_decode_tps'], 1)} | "
                       f"{f(r['peak_kv_bytes'] / mib, 1)} |")
    prof = d.get("profile") or {}
    if prof.get("decode_steps"):
        out += ["", f"Decode step at P = {prof['prefix']}, N = {prof['sessions']} under torch.profiler "
                f"({prof['decode_steps']} steps, mean per step):", "", "| part | ms | share |", "|---|---|---|"]
        for k, v in prof["parts_ms"].items():
            out.append(f"| {k.replace('_', ' ')} | {v:.2f} | {100 * prof['parts_share'][k]:.1f}% |")
        out.append(f"| **step (EngineCore.step)** | **{prof['step_ms']:.2f}** | 100% |")
        out += ["", "Inside attention (self time per step): " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in list(prof.get("attention_ops_ms", {}).items())[:5])]
    m = d["machine"]
    out += ["", f"Machine: {m['cpu']}, {m['cpu_affinity'] or m['cpu_count']} cores, torch {m['torch']} "
            f"({cfg['torch_threads']} threads), transformers {m['transformers']}, Python {m['python']}; "
            f"load average at start {'/'.join(f'{x:.2f}' for x in m['loadavg'])}, at end "
            f"{'/'.join(f'{x:.2f}' for x in d['loadavg_end'])}; commit {str(m['git']['commit'])[:10]}"
            f"{' (dirty)' if m['git']['dirty'] else ''}; run time {d['seconds']['total'] / 60:.1f} min."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    _rc = main()
    if _rc:  # no SystemExit on success: `opencoti bench all` runs the next benchmark in this process
        sys.exit(_rc)
