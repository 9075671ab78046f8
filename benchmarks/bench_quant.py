#!/usr/bin/env python
"""Weight formats and thread adaptation vs today's fp32 engine, measured in ONE run (issue 15).

Engines on the bundled SmolLM2-135M-Instruct, all in this process (an idle engine costs nothing):

* ``fp32-fixed``: the engine as it was: fp32 weights, torch threads fixed at the usable cores,
  decode attention by gathering pages + torch SDPA (the native decode kernel off).
* ``auto`` (the new default): the weight format ``auto`` picks here, threads adapted at run time.
* one engine per explicit format (``--formats``), threads adapted.

Measured, rounds interleaving the engines so drift in the machine's load hits them alike (median
of ``--repeats``): single-session decode tok/s (llama.cpp's ``predicted_per_second``), the
aggregate decode tok/s of ``--concurrency`` sessions (definition in bench_engine.py), the weight
bytes read per step x steps/s against the machine's memory read bandwidth (measured here: best
of a few ``sum()`` passes over 512 MiB), and the single-session decode of ``fp32-fixed`` and
``auto`` while a process burns one CPU (``taskset -c 0``), against the same engines quiet.
The accuracy-gate numbers of each format (perplexity on the gate text and greedy top-1 agreement
with fp32 over 256 forced-decoding positions) are printed too.

Targets (issue 15): single-session decode >= 3x fp32-fixed; 8-session aggregate >= 1.5x
fp32-fixed; with a busy neighbour, single-session decode >= 30 % of the same engine quiet.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from bench_engine import OTHER_PROMPTS, SINGLE_PROMPT, chat_tokens, run_engine_concurrent, run_engine_single  # noqa: E402
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
        self.proc = subprocess.Popen(cmd)
        time.sleep(0.5)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def gate_numbers(engines: dict, ids) -> dict:
    from opencoti.engine.model.weights import gate_metrics

    ref = engines["fp32-fixed"]._call(engines["fp32-fixed"].model.dense_logits, ids)
    out = {}
    for name, eng in engines.items():
        if name == "fp32-fixed" or eng.model.weights == "fp32":
            continue
        m = gate_metrics(ref, eng._call(eng.model.dense_logits, ids), ids, 256)
        out[name] = {"format": eng.model.weights, **m}
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="rounds (median reported)")
    p.add_argument("--concurrency", type=int, default=8, help="sessions decoding together")
    p.add_argument("--formats", default="fp32,bf16,int8,int4", help="explicit formats to measure besides auto")
    p.add_argument("--no-burner", action="store_true", help="skip the busy-neighbour measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = min(args.tokens, 32), 1
    formats = [f for f in args.formats.split(",") if f]

    import torch

    from opencoti.engine import Engine, EngineConfig
    from opencoti.engine.model.gate_text import GATE_TEXT
    from opencoti.engine.model.loader import load_model
    from opencoti.engine.model.threads import usable_cpus

    t_start = now()
    machine = common.machine_info()
    cores = usable_cpus()
    log(f"machine: {common.describe_machine(machine)}")
    bandwidth = {n: read_bandwidth_gbs(n) for n in sorted({1, cores})}
    log(f"memory read bandwidth (sum over 512 MiB): {', '.join(f'{n} thr {v:.1f} GB/s' for n, v in bandwidth.items())}")

    loaded = load_model(None, progress=lambda m: log(f"load: {m}"))
    specs = {"fp32-fixed": dict(weights="fp32", num_threads=cores), "auto": dict(weights="auto")}
    specs.update({f: dict(weights=f) for f in formats})
    engines = {}
    for name, spec in specs.items():
        mine = copy.copy(loaded)
        mine.state_dict = dict(loaded.state_dict)
        t0 = now()
        engines[name] = Engine(EngineConfig(page_size=16, kv_budget_tokens=8192, **spec), loaded=mine)
        if name == "fp32-fixed":
            engines[name].backend.native = False  # as it was: no native decode attention
        info = engines[name].model.weights_info
        log(f"{name}: {info['format']} {info['weight_bytes'] / 1e6:.1f} MB/step, built in {now() - t0:.1f}s; "
            f"{engines[name].model.weights_choice['reason']}; fused decode layers: "
            f"{engines[name].model.fused_layers is not None}")
    first = engines["fp32-fixed"]
    single = chat_tokens(first, SINGLE_PROMPT)
    prompts = [single] + [chat_tokens(first, t) for t in OTHER_PROMPTS[: args.concurrency - 1]]
    n, c = args.tokens, args.concurrency

    log("warm-up")
    for name, eng in engines.items():
        run_engine_single(eng, single, 8, f"warm-{name}")
    runs: dict = {name: {"single": [], "agg": [], "busy": [], "load": []} for name in engines}
    for r in range(args.repeats):
        for name, eng in engines.items():
            log(f"round {r + 1}/{args.repeats}: {name} single, {c} sessions")
            runs[name]["load"].append(os.getloadavg()[0])
            runs[name]["single"].append(run_engine_single(eng, single, n, f"s-{name}-{r}")["decode_tps"])
            runs[name]["agg"].append(run_engine_concurrent(eng, prompts, n, f"c-{name}-{r}")["aggregate_decode_tps"])
    busy_load = None
    if not args.no_burner:
        burner = Burner()
        try:
            for eng in ("fp32-fixed", "auto"):  # let the adapter see the neighbour, as a server would
                run_engine_single(engines[eng], single, 16, f"warm-busy-{eng}")
            busy_load = os.getloadavg()[0]
            for r in range(args.repeats):
                for name in ("fp32-fixed", "auto"):
                    log(f"busy neighbour on CPU 0, round {r + 1}/{args.repeats}: {name}")
                    runs[name]["busy"].append(run_engine_single(engines[name], single, n, f"b-{name}-{r}")["decode_tps"])
        finally:
            burner.stop()
    log("accuracy gate (dense forward over the gate text)")
    ids = torch.tensor(loaded.tokenizer.encode(GATE_TEXT), dtype=torch.long)
    gate = gate_numbers(engines, ids)

    med = {name: {k: summarize([v for v in x[k] if v])["median"] for k in ("single", "agg", "busy")}
           for name, x in runs.items()}
    base = med["fp32-fixed"]
    bw = max(bandwidth.values())
    rows = []
    for name, eng in engines.items():
        wb = eng.model.weight_bytes
        m = med[name]
        gbs = wb * m["single"] / 1e9 if m["single"] else None
        rows.append([name, eng.model.weights, wb / 1e6, m["single"], ratio(m["single"], base["single"]), m["agg"],
                     ratio(m["agg"], base["agg"]), gbs, ratio(gbs, bw), m["busy"], ratio(m["busy"], m["single"])])
    print(f"\nopencoti weight formats: {first.model_name}, greedy, prompt {len(single)} tokens, {n} new tokens, "
          f"median of {args.repeats}; {c}-session aggregate")
    print(f"machine: {common.describe_machine(machine)}")
    print("memory read bandwidth "
          f"{', '.join(f'{k} thread(s) {v:.1f} GB/s' for k, v in bandwidth.items())}")
    print_table(["engine", "weights", "MB/step", "1-sess tok/s", "x fp32", f"{c}-sess agg tok/s", "x fp32",
                 "weight GB/s", "x bandwidth", "busy 1-sess", "busy/quiet"], rows)
    print(f"  load average (1 min) during the rounds: {fmt(min(x for r in runs.values() for x in r['load']))}-"
          f"{fmt(max(x for r in runs.values() for x in r['load']))}; with the burner {fmt(busy_load)}")
    auto = engines["auto"].model
    print(f"  auto chose {auto.weights}: {auto.weights_choice['reason']}")
    if auto.threads is not None:
        print(f"  auto thread adapter: {auto.threads.state()}")
    print("\n  accuracy gate (vs fp32; perplexity over the gate text, top-1 over 256 forced positions):")
    for name, g in gate.items():
        print(f"    {name:>5} ({g['format']}): ppl {g['ppl']:.3f} vs {g['ppl_fp32']:.3f} (x{g['ppl_ratio']:.4f}) on "
              f"{g['tokens']} tokens; top-1 agreement {g['top1_agreement']:.1%}  {'PASS' if g['passed'] else 'FAIL'}")
    r1, ra = ratio(med["auto"]["single"], base["single"]), ratio(med["auto"]["agg"], base["agg"])
    rb = ratio(med["auto"]["busy"], med["auto"]["single"])
    print(f"\n  target single-session decode >= 3x fp32-fixed: {fmt(r1)}x  {check_mark(r1, 3.0)}")
    print(f"  target {c}-session aggregate >= 1.5x fp32-fixed: {fmt(ra)}x  {check_mark(ra, 1.5)}")
    print(f"  target busy-neighbour single-session >= 30% of quiet (auto): {fmt(rb)}  {check_mark(rb, 0.3)}"
          f"  (fp32-fixed: {fmt(ratio(base['busy'], base['single']))})")
    payload = {
        "config": {"tokens": n, "repeats": args.repeats, "concurrency": c, "formats": formats, "quick": args.quick,
                   "usable_cpus": cores},
        "machine": machine, "read_bandwidth_gbs": bandwidth,
        "engines": {name: {"weights_info": {k: v for k, v in eng.model.weights_info.items()},
                           "choice": eng.model.weights_choice, "runs": runs[name], "median": med[name]}
                    for name, eng in engines.items()},
        "gate": gate,
        "ratios": {"single_vs_fp32_fixed": r1, "aggregate_vs_fp32_fixed": ra, "busy_over_quiet_auto": rb,
                   "busy_over_quiet_fp32_fixed": ratio(base["busy"], base["single"])},
        "total_seconds": now() - t_start,
        "loadavg_end": os.getloadavg(),
    }
    path = common.write_json("quant", payload, args.out)
    print(f"\nwrote {path} ({now() - t_start:.0f}s total)")
    for eng in engines.values():
        eng.shutdown()
    return 0


if __name__ == "__main__":
    _rc = main()
    if _rc:
        sys.exit(_rc)
