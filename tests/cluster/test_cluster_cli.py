"""``opencoti cluster serve`` and the ``serve run`` builder (needs the cluster extra; skipped without it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'")

ROOT = Path(__file__).resolve().parents[2]


def test_build_takes_serve_run_arguments():
    from opencoti.cluster.app import ClusterConfig, build

    app = build({"replicas": "3", "model": "tiny:llama", "kv_budget_tokens": "2048", "router": "pow2",
                 "auto_replicate": "false", "api_key": "k"})
    assert app is not None
    with pytest.raises(ValueError, match="unknown option 'replica'"):
        build({"replica": "3"})
    with pytest.raises(ValueError, match="router"):
        build({"router": "random"})
    with pytest.raises(ValueError, match="pool_id_base"):
        ClusterConfig(engine={"pool_id_base": 5})
    with pytest.raises(ValueError, match="replicas"):
        ClusterConfig(replicas=0)
    from opencoti.engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="page_size"):
        ClusterConfig(engine={"page_size": 0})


def test_cli_bad_options_exit_2():
    r = subprocess.run([sys.executable, "-m", "opencoti", "cluster", "serve", "--replicas", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "replicas must be a positive integer" in r.stderr


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_cluster_serve_command(tmp_path):
    """Two tiny-model replicas started by the command: it listens, serves, and stops on SIGINT with 0."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "opencoti", "cluster", "serve", "--replicas", "2", "--model",
                             "tiny:llama", "--kv-budget-tokens", "2048", "--port", str(port)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and "listening on" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            assert c.get("/health").json()["replicas_ok"] == 2
            r = c.post("/completion", json={"prompt": "hello", "n_predict": 2})
            assert r.status_code == 200 and r.headers["x-opencoti-replica"] in ("1", "2")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
