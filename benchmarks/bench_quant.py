#!/usr/bin/env python
"""Weight formats: every format in a process of its own, rounds in rotated order (issue 15).

Engines on the bundled SmolLM2-135M-Instruct, each measured in a FRESH PROCESS per round (a
subprocess of this script, ``--worker``), so no engine shares a process, its threads or its
allocator with another, and the order of the formats rotates by one each round (each goes first
as often as the others):

* one row per weight format: ``fp32``, ``bf16``, ``int8``, ``int4`` (``--formats``), threads adapted;
* ``auto`` (the default) as its own row, with the format it chose;
* ``fp32-fixed``: the engine as it was before the weight formats: fp32 weights, torch threads fixed
  at the usable cores, decode attention by gathering pages + torch SDPA (the native decode kernel
  off); a row like the others (rotated, its own process), kept as the reference of the old targets.

Measured per process (after an 8-token warm-up): single-session decode tok/s (llama.cpp's
``predicted_per_second``) and the aggregate decode tok/s of ``--concurrency`` sessions (definition
in bench_engine.py); medians over ``--repeats`` rounds. The weight bytes read per step x steps/s
against the machine's memory read bandwidth (best of a few ``sum()`` passes over 512 MiB), and the
single-session decode of ``fp32-fixed`` and ``auto`` while a process burns one CPU (``taskset -c 0``)
against the same engines quiet. The accuracy-gate numbers of each format (perplexity on the gate
text and greedy top-1 agreement with fp32 over 256 forced-decoding positions) come from one last
process (accuracy, not timing).

Targets: ``auto`` picks the fastest format: the chosen format's own row within 5 % of the fastest
format's single-session decode (the ``auto`` process's own median is printed beside it: the same
weights and kernels in another process, so the two differ only by the spread between processes);
single-session decode >= 3x fp32-fixed; 8-session aggregate >= 1.5x fp32-fixed; with a busy neighbour,
single-session decode >= 30 % of the same engine quiet.

Full run: .venv/bin/python benchmarks/bench_quant.py   (quick: --quick)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from bench_engine import OTHER_PROMPTS, SINGLE_PROMPT, chat_tokens, run_engine_concurrent, run_engine_single  # noqa: E402,I001
from common import check_mark, fmt, log, now, print_table, ratio, summarize  # noqa: E402

def read_bandwidth_gbs(threads: int) -> float:
    """Best-of-5 GB/s of ``x.sum()`` over 512 MiB of fp32 with ``threads`` torch threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(128 << 20, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = now()
        x.sum()
        best = min(best, now() - t0)
    torch.set_num_threads(old)
    return x.numel() * 4 / best / 1e9


class Burner:
    """A process that keeps CPU 0 busy (``taskset -c 0 python -c 'while 1: pass'``)."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-c", "while 1: pass"]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", "0"] + cmd
        self.proc = common.track(subprocess.Popen(cmd))
        time.sleep(0.5)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


ENGINE_SPECS = {"fp32-fixed": {"weights": "fp32", "fixed_threads": True}, "auto": {"weights": "auto"}}


def engine_specs(formats: list[str]) -> dict:
    """name -> spec of every engine measured: auto, one per format, fp32-fixed."""
    specs = dict(ENGINE_SPECS)
    specs.update({f: {"weights": f} for f in formats})
    return {k: specs[k] for k in ["auto", *formats, "fp32-fixed"]}


def auto_vs_fastest(med: dict, formats: list[str], chose: str | None = None) -> dict:
    """Did ``auto`` choose the fastest format? The chosen format's own row (its own processes) against
    the fastest explicit format's median single-session decode (target: within 5 %); the auto
    process's own median beside it (the same weights and kernels: the two differ by the spread
    between processes of one configuration)."""
    cands = {f: med[f]["single"] for f in formats if med.get(f, {}).get("single")}
    if not cands or not med.get("auto", {}).get("single"):
        return {"fastest": None, "ratio": None, "within_5pct": None}
    fastest = max(cands, key=cands.get)
    r = med["auto"]["single"] / cands[fastest]
    out = {"fastest": fastest, "fastest_single_tps": cands[fastest], "auto_single_tps": med["auto"]["single"],
           "ratio": r, "chose": chose}
    if chose in cands:
        out.update(chosen_single_tps=cands[chose], chosen_ratio=cands[chose] / cands[fastest])
    out["within_5pct"] = out.get("chosen_ratio", r) >= 0.95
    return out


def build_engine(name: str, spec: dict, cores: int):
    from opencoti.engine import Engine, EngineConfig

    cfg = {"weights": spec["weights"]}
    if spec.get("fixed_threads"):
        cfg["num_threads"] = cores
    eng = Engine(EngineConfig(page_size=16, kv_budget_tokens=8192, **cfg))
    if spec.get("fixed_threads"):
        eng.backend.native = False  # as it was: no native decode attention
    return eng


def worker(args) -> int:
    """One engine in this process: warm-up, then single-session decode and the concurrent aggregate
    (or only the single session, ``--busy``); one JSON line on stdout."""
    from opencoti.engine.model.threads import usable_cpus

    spec = engine_specs([args.worker] if args.worker not in ENGINE_SPECS else [])[args.worker]
    t0 = now()
    eng = build_engine(args.worker, spec, usable_cpus())
    built_s = now() - t0
    single = chat_tokens(eng, SINGLE_PROMPT)
    prompts = [single] + [chat_tokens(eng, t) for t in OTHER_PROMPTS[: args.concurrency - 1]]
    run_engine_single(eng, single, 16 if args.busy else 8, "warm")
    load = os.getloadavg()[0]
    out = {"name": args.worker, "weights": eng.model.weights, "choice": eng.model.weights_choice,
           "weights_info": dict(eng.model.weights_info), "built_s": built_s, "loadavg": load, "pid": os.getpid()}
    out["single"] = run_engine_single(eng, single, args.tokens, "single")["decode_tps"]
    if not args.busy:
        out["agg"] = run_engine_concurrent(eng, prompts, args.tokens, "conc")["aggregate_decode_tps"]
    if eng.model.threads is not None:
        out["threads"] = eng.model.threads.state()
    eng.shutdown()
    print("RESULT " + json.dumps(out, default=repr), flush=True)
    return 0


def run_worker(name: str, args, busy: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--tokens", str(args.tokens),
           "--concurrency", str(args.concurrency)] + (["--busy"] if busy else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise RuntimeError(f"worker {name} failed (rc {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def gate_numbers(formats: list[str]) -> dict:
    """Accuracy of each format against fp32 (dense forward over the gate text), all in this process."""
    import torch

    from opencoti.engine.model.gate_text import GATE_TEXT
    from opencoti.engine.model.weights import gate_metrics

    ref_eng = build_engine("fp32", {"weights": "fp32"}, 1)
    ids = torch.tensor(ref_eng.loaded.tokenizer.encode(GATE_TEXT), dtype=torch.long)
    ref = ref_eng.run_on_step_thread(ref_eng.model.dense_logits, ids)
    ref_eng.shutdown()
    out = {}
    for name in formats:  # auto's row is the gate of the format it chose
        if name == "fp32":
            continue
        eng = build_engine(name, {"weights": name}, 1)
        if eng.model.weights != "fp32":
            out[name] = {"format": eng.model.weights, **gate_metrics(ref, eng.run_on_step_thread(eng.model.dense_logits, ids),
                                                                      ids, 256)}
        eng.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="rounds, the order rotated each round (median reported)")
    p.add_argument("--concurrency", type=int, default=8, help="sessions decoding together")
    p.add_argument("--formats", default="fp32,bf16,int8,int4", help="explicit formats to measure besides auto")
    p.add_argument("--no-burner", action="store_true", help="skip the busy-neighbour measurement")
    p.add_argument("--no-gate", action="store_true", help="skip the accuracy gate")
    p.add_argument("--worker", default=None, help=argparse_hidden())
    p.add_argument("--busy", action="store_true", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.tokens, args.repeats = min(args.tokens, 32), min(args.repeats, 2)
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in ("fp32", "bf16", "int8", "int4") for f in formats) or args.repeats < 1:
        p.error("--formats: a comma-separated subset of fp32,bf16,int8,int4; --repeats >= 1")

    from opencoti.engine.model.threads import usable_cpus

    t_start = now()
    load_before = common.load_snapshot()
    machine = common.machine_info()
    cores = usable_cpus()
    log(f"machine: {common.describe_machine(machine)}")
    bandwidth = {n: read_bandwidth_gbs(n) for n in sorted({1, cores})}
    log(f"memory read bandwidth (sum over 512 MiB): {', '.join(f'{n} thr {v:.1f} GB/s' for n, v in bandwidth.items())}")
    names = list(engine_specs(formats))
    n, c = args.tokens, args.concurrency
    runs: dict = {name: {"single": [], "agg": [], "busy": [], "load": [], "order": []} for name in names}
    info: dict = {}
    for r in range(args.repeats):
        order = common.rotated(names, r)
        log(f"round {r + 1}/{args.repeats}: {', '.join(order)} (each in its own process)")
        for pos, name in enumerate(order):
            res = run_worker(name, args)
            info[name] = {k: res[k] for k in ("weights", "choice", "weights_info")}
            runs[name]["single"].append(res["single"])
            runs[name]["agg"].append(res["agg"])
            runs[name]["load"].append(res["loadavg"])
            runs[name]["order"].append(pos)
            log(f"  {name} ({res['weights']}): single {fmt(res['single'], 1)} tok/s, {c}-session "
                f"{fmt(res['agg'], 1)} tok/s (load {res['loadavg']:.2f})")
    busy_load = None
    if not args.no_burner:
        burner = Burner()
        try:
            busy_load = os.getloadavg()[0]
            for r in range(args.repeats):
                for name in common.rotated(["fp32-fixed", "auto"], r):
                    log(f"busy neighbour on CPU 0, round {r + 1}/{args.repeats}: {name}")
                    runs[name]["busy"].append(run_worker(name, args, busy=True)["single"])
        finally:
            burner.stop()
    gate = {} if args.no_gate else gate_numbers(formats)

    med = {name: {k: summarize([v for v in x[k] if v])["median"] for k in ("single", "agg", "busy")}
           for name, x in runs.items()}
    base = med["fp32-fixed"]
    bw = max(bandwidth.values())
    rows = []
    for name in names:
        wb = info[name]["weights_info"].get("weight_bytes")
        m = med[name]
        gbs = wb * m["single"] / 1e9 if m["single"] and wb else None
        rows.append([name, info[name]["weights"], (wb or 0) / 1e6, m["single"], ratio(m["single"], base["single"]),
                     m["agg"], ratio(m["agg"], base["agg"]), gbs, ratio(gbs, bw), m["busy"],
                     ratio(m["busy"], m["single"])])
    print(f"\nopencoti weight formats: bundled model, greedy, {n} new tokens, median of {args.repeats} rounds "
          f"(each engine in its own process, order rotated); {c}-session aggregate")
    print(f"machine: {common.describe_machine(machine)}")
    print("memory read bandwidth "
          f"{', '.join(f'{k} thread(s) {v:.1f} GB/s' for k, v in bandwidth.items())}")
    print_table(["engine", "weights", "MB/step", "1-sess tok/s", "x fp32-fixed", f"{c}-sess agg tok/s",
                 "x fp32-fixed", "weight GB/s", "x bandwidth", "busy 1-sess", "busy/quiet"], rows)
    loads = [x for rr in runs.values() for x in rr["load"]]
    print(f"  load average (1 min) during the rounds: {fmt(min(loads))}-{fmt(max(loads))}; with the burner "
          f"{fmt(busy_load)}")
    avf = auto_vs_fastest(med, formats, info["auto"]["weights"])
    print(f"  auto chose {info['auto']['weights']}: {(info['auto']['choice'] or {}).get('reason')}")
    print(f"  target auto's format within 5 % of the fastest format's single-session decode: "
          f"{avf.get('chose')} {fmt(avf.get('chosen_ratio'))}x of {avf['fastest']} "
          f"({fmt(avf.get('fastest_single_tps'), 1)} tok/s; the auto process itself {fmt(avf['ratio'])}x)  "
          f"{'n/a' if avf['within_5pct'] is None else ('PASS' if avf['within_5pct'] else 'FAIL')}")
    if gate:
        print("\n  accuracy gate (vs fp32; perplexity over the gate text, top-1 over 256 forced positions):")
        for name, g in gate.items():
            print(f"    {name:>5} ({g['format']}): ppl {g['ppl']:.3f} vs {g['ppl_fp32']:.3f} (x{g['ppl_ratio']:.4f}) "
                  f"on {g['tokens']} tokens; top-1 agreement {g['top1_agreement']:.1%}  "
                  f"{'PASS' if g['passed'] else 'FAIL'}")
    r1, ra = ratio(med["auto"]["single"], base["single"]), ratio(med["auto"]["agg"], base["agg"])
    rb = ratio(med["auto"]["busy"], med["auto"]["single"])
    print(f"\n  target single-session decode (auto) >= 3x fp32-fixed: {fmt(r1)}x  {check_mark(r1, 3.0)}")
    print(f"  target {c}-session aggregate (auto) >= 1.5x fp32-fixed: {fmt(ra)}x  {check_mark(ra, 1.5)}")
    print(f"  target busy-neighbour single-session >= 30% of quiet (auto): {fmt(rb)}  {check_mark(rb, 0.3)}"
          f"  (fp32-fixed: {fmt(ratio(base['busy'], base['single']))})")
    payload = {
        "config": {"tokens": n, "repeats": args.repeats, "concurrency": c, "formats": formats, "quick": args.quick,
                   "usable_cpus": cores, "engines": names,
                   "method": "each engine in a fresh process per round (bench_quant.py --worker NAME), the order "
                             "rotated by one each round; medians over rounds"},
        "machine": machine, "load_before": load_before, "read_bandwidth_gbs": bandwidth,
        "engines": {name: {**info[name], "runs": runs[name], "median": med[name]} for name in names},
        "auto_chose": info["auto"]["weights"],
        "auto_vs_fastest": avf,
        "gate": gate,
        "ratios": {"single_vs_fp32_fixed": r1, "aggregate_vs_fp32_fixed": ra, "busy_over_quiet_auto": rb,
                   "busy_over_quiet_fp32_fixed": ratio(base["busy"], base["single"]),
                   "single_vs_fp32": {name: ratio(med[name]["single"], med.get("fp32", {}).get("single"))
                                      for name in names}},
        "total_seconds": now() - t_start,
        "machine_end": common.machine_info(),
    }
    path = common.write_json("quant", payload, args.out)
    print(f"\nwrote {path} ({now() - t_start:.0f}s total)")
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    _rc = main()
    if _rc:
        sys.exit(_rc)
