"""`opencoti` command line: demo (the main job), serve, cluster serve, bench."""

from __future__ import annotations

import argparse
import sys


def cmd_demo(args) -> int:
    """The main job: a LangGraph multi-agent run on the bundled model (or ``--server``) that builds a
    pool tree, fans out under a tps floor, nests, branches, compacts and gathers, with a live view and
    a report (markdown + charts) written to ``--out``."""
    from .demo import DemoConfig, run_demo
    from .demo.live import make_view
    from .engine.errors import OpencotiError

    cfg = DemoConfig(agents=args.agents, floor=args.floor, max_tokens=args.max_tokens, seed=args.seed, out=args.out,
                     model=args.model, server=args.server, api_key=args.api_key, num_threads=args.threads,
                     weights=args.weights,
                     charts=not args.no_charts)
    view = make_view(plain=True if args.plain else None)
    try:
        res = run_demo(cfg, view=view)
    except (OpencotiError, ValueError) as e:
        print(f"opencoti demo: {e}", file=sys.stderr)
        return 1
    s = res.summary
    kv = s["kv"].get("at_peak") or {}
    tt = s["ttft"]
    lines = [f"done in {res.wall_s:.1f} s (model load {res.load_s:.1f} s); report: {res.paths['report']}"]
    if kv.get("used"):
        lines.append(f"KV at the busiest moment: {kv['used'] / 2**20:.1f} MiB in use, "
                     f"{kv['without_sharing'] / 2**20:.1f} MiB without sharing")
    base = tt["control"] or tt["full_prefill"]
    if tt["attach"] and base:
        lines.append(f"TTFT: {tt['attach']['median_ms']:.0f} ms attached to a pool (median) vs "
                     f"{base['median_ms']:.0f} ms full prefill")
    waited = s["admission"]["agents_that_waited"]
    lines.append(f"floor {res.run['config']['floor']:g} tok/s: {s['concurrency']['max_decoding']} sessions decoding "
                 f"at most, {len(waited)} agents waited for capacity; {len(s['compactions'])} compaction(s)")
    for r in s["cross_check"]:
        if not r["match"]:
            lines.append(f"warning: {r['name']} differs from the engine's counter ({r['report']} vs {r['engine']})")
    for ln in lines:
        view.print(ln)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="opencoti", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the main job: a multi-agent LangGraph run with a live view and a report")
    d.add_argument("--agents", type=int, default=6, help="sub-agents fanned out on the task pool (default 6)")
    d.add_argument("--floor", type=float, default=None,
                   help="per-session tps floor (default: 0.75 x the lead agent's solo decode speed measured in the run)")
    d.add_argument("--max-tokens", type=int, default=48, help="tokens per answer at most (default 48)")
    d.add_argument("--seed", type=int, default=None, help="sample with this seed (default: greedy)")
    d.add_argument("--out", default="demo-report", help="folder for the report (default ./demo-report)")
    d.add_argument("--model", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    d.add_argument("--server", default=None, metavar="URL", help="run against a running `opencoti serve` instead")
    d.add_argument("--api-key", default=None, help="the server's API key (with --server)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (in-process)")
    d.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="projection weight format (in-process; default auto)")
    d.add_argument("--plain", action="store_true", help="plain log lines even on a terminal")
    d.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    d.set_defaults(fn=cmd_demo)
    sv = sub.add_parser("serve", help="HTTP server: llama.cpp/OpenAI-compatible API + /polykv control plane")
    from .server.serve import add_arguments as _serve_arguments
    _serve_arguments(sv)
    sv.set_defaults(fn=cmd_serve)
    cl = sub.add_parser("cluster", help="several engine replicas behind one endpoint (Ray Serve; the cluster extra)")
    cl_sub = cl.add_subparsers(dest="cluster_cmd", required=True)
    cls = cl_sub.add_parser("serve", help="N replicas with pool- and prefix-affine routing")
    from .cluster.serve import add_arguments as _cluster_arguments
    _cluster_arguments(cls)
    cls.set_defaults(fn=cmd_cluster_serve)
    st = sub.add_parser("state", help="maintain a state directory (see docs/persistence.md)")
    st_sub = st.add_subparsers(dest="state_cmd", required=True)
    pr = st_sub.add_parser("prune", help="remove unpinned pools with no session that nobody released")
    from .engine.persist.prune import add_arguments as _prune_arguments
    _prune_arguments(pr)
    pr.set_defaults(fn=cmd_state_prune)
    b = sub.add_parser("bench", help="run the headline benchmarks (results + docs/benchmarks.md), or one of them",
                       description="With no name: every headline benchmark, each in its own process, then "
                                   "benchmarks/report.py (results in benchmarks/results/<machine-id>/, the tables "
                                   "of docs/benchmarks.md regenerated). With a name: benchmarks/bench_<name>.py "
                                   "(or <name>.py) with the arguments that follow.")
    b.add_argument("--quick", action="store_true", help="the short subset (~10 min on 2 cores, once llama-server "
                                                        "is built)")
    b.add_argument("--only", default=None, help="comma-separated headline benchmarks to run (default: all)")
    b.add_argument("name", nargs="?", default=None, help="one benchmark: engine, quant, pools, cascade, fanout, "
                                                          "cluster, admission_sim, peer_llamacpp, ... ('all': the "
                                                          "headline set)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    return args.fn(args)


def cmd_serve(args) -> int:
    from .server.serve import run
    return run(args)


def cmd_cluster_serve(args) -> int:
    from .cluster.serve import run
    return run(args)


def cmd_state_prune(args) -> int:
    from .engine.persist.prune import run
    return run(args)


def cmd_bench(args) -> int:
    import runpy
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    if not root.is_dir():
        print("the benchmarks live in a checkout of the repository (benchmarks/ next to opencoti/)", file=sys.stderr)
        return 2
    if args.name in (None, "all"):
        cmd = [sys.executable, str(root / "run_all.py")] + (["--quick"] if args.quick else []) \
            + (["--only", args.only] if args.only else [])
        import signal

        proc = subprocess.Popen(cmd)  # SIGTERM (timeout, kill) is handed on: the run stops its benchmarks' servers
        old = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
        try:
            return proc.wait()
        finally:
            signal.signal(signal.SIGTERM, old)
    for path in (root / f"bench_{args.name}.py", root / f"{args.name}.py"):
        if path.exists():
            break
    else:
        print(f"unknown benchmark {args.name!r} (no bench_{args.name}.py in {root})", file=sys.stderr)
        return 2
    sys.argv = [str(path), *(["--quick"] if args.quick else []), *args.rest]
    runpy.run_path(str(path), run_name="__main__")
    return 0
