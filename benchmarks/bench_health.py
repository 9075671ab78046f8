#!/usr/bin/env python
"""Event loop under load: /health latency of a real `opencoti serve` while heavy requests run.

Starts ``opencoti serve`` on a free loopback port (the bundled model, or ``--model``) and polls
``GET /health`` every 20 ms from its own connection: first idle (the baseline, same run), then
while each load runs - a ~15 MB ``/tokenize`` body (read, parsed, tokenized, a multi-megabyte
answer encoded), a ~15 MB ``/completion`` body of token ids (parsed and validated, then refused:
beyond the context), the same ids to ``/detokenize`` (decoded, a multi-megabyte text answered),
and ``--streams`` concurrent streaming chats. Reports p50 / p99 / max of the
health latency per phase, the ratio of p99 to the idle p99, and PASS when every answer (the max)
came under ``--target-ms`` (100). ``--server URL`` measures a running server instead.
``--probe`` runs the server under ``stall_probe.py`` and prints, per phase, the longest stalls of
the GIL and of the event loop with the stacks that caused them. A machine shared with other work
moves these numbers: the load average is recorded per phase.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, print_table, ratio  # noqa: E402


def start_server(model: str | None, probe_log: str | None = None) -> tuple[subprocess.Popen, str]:
    opts = ["--port", "0", "--log-level", "warning", "--state-dir", "none"] + (["--model", model] if model else [])
    if probe_log:
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "stall_probe.py"), *opts]
        env = {**os.environ, "STALL_LOG": probe_log}
    else:
        cmd, env = [sys.executable, "-m", "opencoti", "serve", *opts], None
    proc = common.track(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env))
    while True:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("the server exited before listening")
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def poll_health(base: str, stop, conn) -> None:
    """In a process of its own (the load generators' work in this process must not delay the polls):
    GET /health every 20 ms until ``stop`` is set, then send (wall-clock start, latency) of each
    poll through ``conn``."""
    import httpx

    out: list[tuple[float, float]] = []
    with httpx.Client(base_url=base, timeout=600) as c:
        c.get("/health")  # the connection is open before the first timed poll
        conn.send("ready")
        while not stop.is_set():
            wall, t = time.time(), time.perf_counter()
            c.get("/health")
            out.append((wall, time.perf_counter() - t))
            time.sleep(0.02)
    conn.send(out)


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    p.add_argument("--body-mib", type=float, default=15.0, help="size of the large bodies")
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming chats in the stream phase")
    p.add_argument("--target-ms", type=float, default=100.0, help="every /health answer must come faster")
    p.add_argument("--server", default=None, help="measure a running server at URL instead of starting one")
    p.add_argument("--repeat", type=int, default=1, help="run the load phases this many times")
    p.add_argument("--probe", action="store_true", help="run the server under stall_probe.py and print the "
                                                        "longest GIL / event-loop stalls of each phase")
    args = p.parse_args()
    if args.quick:
        args.body_mib, args.streams = 2.0, 4
    import httpx

    info = common.machine_info()
    log(common.describe_machine(info))
    probe_log = None
    if args.probe and not args.server:
        common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        probe_log = str(common.RESULTS_DIR / "health_stalls.log")
    proc, base = (None, args.server.rstrip("/")) if args.server else start_server(args.model, probe_log)
    try:
        with httpx.Client(base_url=base, timeout=600) as c:
            while c.get("/health").status_code != 200:
                time.sleep(0.2)
        words = int(args.body_mib * 2**20 / 12)
        json_h = {"content-type": "application/json"}

        # the bodies are built before the phases (encoding them is no part of the server's load)
        text_body = json.dumps({"content": "hello world " * words}).encode()
        n_ids = int(args.body_mib * 2**20 / 5)  # ~5 bytes per id in JSON ("123, ")
        ids_body = json.dumps({"prompt": (list(range(100, 1000)) * (n_ids // 900 + 1))[:n_ids],
                               "n_predict": 1}).encode()

        def tokenize():
            return httpx.post(base + "/tokenize", content=text_body, headers=json_h, timeout=900).status_code

        def completion_ids():
            return httpx.post(base + "/completion", content=ids_body, headers=json_h, timeout=900).status_code

        detok_body = ids_body.replace(b'"prompt"', b'"tokens"', 1)

        def detokenize():
            return httpx.post(base + "/detokenize", content=detok_body, headers=json_h, timeout=900).status_code

        def streams():
            def one(i):
                body = {"messages": [{"role": "user", "content": f"Count to twenty, agent {i}."}], "max_tokens": 64,
                        "stream": True, "temperature": 0}
                with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900) as r:
                    for _ in r.iter_lines():
                        pass
            common.run_threads(args.streams, one)
            return 200

        loads = [(f"/tokenize {args.body_mib:g} MiB", tokenize),
                 (f"/completion {args.body_mib:g} MiB of ids", completion_ids),
                 (f"/detokenize {args.body_mib:g} MiB of ids", detokenize),
                 (f"{args.streams} streaming chats", streams)]
        phases = [("idle", lambda: time.sleep(3.0) or 200)] + loads * args.repeat
        rows, results, idle_p99 = [], [], None
        mp = multiprocessing.get_context("spawn")
        for name, load in phases:
            stop = mp.Event()
            ours, theirs = mp.Pipe()
            poller = mp.Process(target=poll_health, args=(base, stop, theirs), daemon=True)
            poller.start()
            ours.recv()  # "ready"
            t0, wall0 = time.perf_counter(), time.time()
            load_before = os.getloadavg()[0]
            status = load()
            took = time.perf_counter() - t0
            load_after = os.getloadavg()[0]
            stop.set()
            polls: list[tuple[float, float]] = ours.recv()
            poller.join()
            lat = [latency for _, latency in polls]
            p50, p99, mx = percentile(lat, 0.5), percentile(lat, 0.99), max(lat) if lat else None
            idle_p99 = p99 if name == "idle" else idle_p99
            ok = mx is not None and mx * 1e3 < args.target_ms
            rows.append([name, status, took, len(lat), p50 * 1e3, p99 * 1e3, mx * 1e3, ratio(p99, idle_p99),
                         f"{load_before:.1f}-{load_after:.1f}", "PASS" if ok else "FAIL"])
            results.append({"phase": name, "status": status, "seconds": took, "polls": len(lat), "p50_ms": p50 * 1e3,
                            "p99_ms": p99 * 1e3, "max_ms": mx * 1e3, "p99_vs_idle": ratio(p99, idle_p99),
                            "loadavg_1m": [load_before, load_after], "target_ms": args.target_ms, "pass": ok})
            log(f"{name}: {fmt(took)} s, /health p99 {fmt(p99 * 1e3)} ms, max {fmt(mx * 1e3)} ms, "
                f"load {load_before:.1f}-{load_after:.1f}")
            if probe_log:
                import stall_probe

                time.sleep(0.2)  # the probe's last lines
                stalls = stall_probe.summarize(probe_log, wall0, time.time(), top=3)
                results[-1]["stalls"] = stalls
                for block in stalls:
                    print("    " + block.replace("\n", "\n    "))
                slow = []  # the slowest polls and what the probe logged while each was waiting
                for wall, latency in sorted(polls, key=lambda p: -p[1])[:2]:
                    during = stall_probe.summarize(probe_log, wall - 0.005, wall + latency + 0.005, top=4)
                    slow.append({"at": wall, "ms": latency * 1e3, "stalls": during})
                    print(f"    slow poll {latency * 1e3:.1f} ms at {wall:.3f}: "
                          + ("; ".join(b.splitlines()[0] for b in during) or "nothing logged meanwhile"))
                results[-1]["slowest_polls"] = slow
        print_table(["phase", "status", "s", "polls", "p50 ms", "p99 ms", "max ms", "p99 / idle", "load 1m",
                     f"max < {args.target_ms:g} ms"], rows, title="/health latency under load")
        path = common.write_json("health", {"machine": info, "args": vars(args), "results": results}, args.out)
        log(f"wrote {path}")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
