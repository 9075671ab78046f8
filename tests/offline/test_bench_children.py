"""Issue 53 (9): a benchmark stops the servers it started on any exit but SIGKILL - SIGTERM (``timeout``,
``kill``), Ctrl-C, an exception - and ``opencoti bench`` (``run_all``) ended by SIGTERM hands it on to the
benchmark it runs, which then stops its own (``common.track`` / ``stop_children``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

# a "benchmark": starts a server-like child in its own session (as peer_llamacpp's servers are), says its
# pid, then waits, raises or is interrupted
SCRIPT = textwrap.dedent(f"""
    import subprocess, sys, time
    sys.path.insert(0, {str(BENCH)!r})
    import common
    common.install_exit_handlers()  # (a benchmark script gets them at import; this one lives elsewhere)
    child = common.track(subprocess.Popen(["sleep", "1000"], start_new_session=True))
    print(child.pid, flush=True)
    if sys.argv[1] == "raise":
        time.sleep(0.5)
        raise RuntimeError("a benchmark failed")
    time.sleep(100)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()[:1] != "Z"


def _gone(pid: int, within: float = 20.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["sigterm", "sigint", "raise"])
def test_a_benchmark_stops_its_servers_however_it_ends(tmp_path, how):
    script = tmp_path / "bench_fake.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        assert _alive(child)
        if how != "raise":
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        rc = proc.wait(timeout=60)
        assert rc != 0
        assert _gone(child), f"the server-like child {child} outlived its benchmark ({how})"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_run_all_ended_by_sigterm_lets_the_running_benchmark_stop_its_servers(tmp_path):
    script = tmp_path / "bench_fake.py"
    script.write_text(SCRIPT)
    pid_file = tmp_path / "child.pid"
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(BENCH)!r})
        import common, run_all
        common.install_exit_handlers()
        common.results_dir = lambda: __import__("pathlib").Path({str(tmp_path)!r})
        run_all.HEADLINE = [("fake", {str(script)!r}, ["wait"], ["wait"])]
        sys.exit(run_all.main(["--no-report"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    pid_file.write_text(str(child))
    try:
        assert _alive(child)
        proc.send_signal(signal.SIGTERM)  # as `timeout` does: only run_all gets it
        proc.wait(timeout=60)
        assert _gone(child), "the benchmark run_all was running left its server behind"
        import json

        record = json.loads((tmp_path / "run.json").read_text())  # what an interrupted run ran is recorded
        assert record["interrupted"] is True and record["failed"] == ["fake"]
        assert record["runs"][0]["name"] == "fake" and record["runs"][0]["interrupted"] is True
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
