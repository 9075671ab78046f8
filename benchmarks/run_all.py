"""Every headline benchmark, each in its own process, then the report (``opencoti bench`` / ``make bench``).

Runs the scripts of :data:`HEADLINE` one after the other with their defaults — the published
configuration: no script takes other flags here — writes ``benchmarks/results/<machine-id>/run.json``
(commit, machine, load before and after each, seconds, exit codes, the command of each) and
regenerates the tables of ``docs/benchmarks.md`` from the result files (``benchmarks/report.py``).
``--quick`` runs their short modes into files of their own (``<name>_quick.json``, ``run_quick.json``):
a quick run never replaces a full one, and the page shows a quick result only where no full run
exists. Every earlier result a run replaces is kept in ``history/`` (``common.write_json``). A
benchmark that fails is reported and the others still run; the exit code is non-zero when any failed.
A run ended by SIGTERM or Ctrl-C hands the signal on to the benchmark it runs (which stops its servers)
and still writes its record, the interrupted benchmark marked ``interrupted``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# (result name, script, extra arguments of the full run, of the quick run)
HEADLINE = [
    ("peer_llamacpp", "peer_llamacpp.py", [], ["--quick"]),
    ("quant", "bench_quant.py", [], ["--quick"]),
    ("pools", "bench_pools.py", [], ["--quick"]),
    ("cascade", "bench_cascade.py", [], ["--quick"]),
    ("fanout", "bench_fanout.py", [], ["--quick"]),
    ("admission_sim", "bench_admission_sim.py", [], ["--quick"]),
    ("cluster", "bench_cluster.py", [], ["--quick"]),
    ("speculative", "bench_speculative.py", [], ["--quick"]),
    ("kv_tier", "bench_kv_tier.py", [], ["--quick"]),
    ("kv_tier_steps", "bench_kv_tier_steps.py", [], ["--quick"]),  # decode steps while the tier writes
    ("kv_tier_reclaim", "bench_kv_tier_reclaim.py", [], ["--quick"]),  # reclaims beside a decoder, write-ahead on/off
    # the model sizes users run: the bundled file, then generated 1B and 8B Q4_K_M files (the size table)
    ("peer_sizes", "peer_sizes.py", [], ["--quick"]),
    ("kquant_kernels", "bench_kquant_kernels.py", [], ["--quick"]),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the short modes of each benchmark")
    p.add_argument("--only", default=None, help="comma-separated result names to run (default: all)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate docs/benchmarks.md")
    args = p.parse_args(argv)
    names = [h[0] for h in HEADLINE]
    only = names if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = sorted(set(only) - set(names))
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    runs: list[dict] = []
    failed: list[str] = []
    interrupted = None
    try:
        for name, script, full, quick in HEADLINE:
            if name not in only:
                continue
            cmd = [sys.executable, str(common.BENCH_DIR / script), *(quick if args.quick else full)]
            if args.quick:  # its own file: a quick run never replaces the full run's
                cmd += ["--out", str(common.results_dir() / f"{name}_quick.json")]
            common.log(f"{name}: {' '.join(cmd[1:])}")
            before = common.load_snapshot()
            t0 = time.perf_counter()
            interrupted = {"name": name, "command": cmd[1:], "rc": None, "load_before": before, "t0": t0}
            proc = common.track(subprocess.Popen(cmd, cwd=common.REPO_ROOT))  # stopped (SIGTERM) if this run
            rc = proc.wait()  # is ended: the benchmark then stops its own servers (subprocess.call: SIGKILL)
            interrupted = None
            runs.append({"name": name, "command": cmd[1:], "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                         "load_before": before, "load_after": common.load_snapshot()})
            if rc != 0:
                failed.append(name)
                common.log(f"{name}: FAILED (exit {rc})")
    finally:  # an interrupted run (SIGTERM, Ctrl-C) records what it ran, and which benchmark it stopped
        if interrupted is not None:
            t0 = interrupted.pop("t0")
            runs.append({**interrupted, "seconds": round(time.perf_counter() - t0, 1), "interrupted": True,
                         "load_after": common.load_snapshot()})
            failed.append(interrupted["name"])
        common.write_json("run_quick" if args.quick else "run",
                          {"quick": args.quick, "only": only if args.only else None, "runs": runs, "failed": failed,
                           "interrupted": interrupted is not None, "machine": common.machine_info()})
    if not args.no_report:
        rc = subprocess.call([sys.executable, str(common.BENCH_DIR / "report.py")], cwd=common.REPO_ROOT)
        if rc != 0:
            failed.append("report")
    if failed:
        common.log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
