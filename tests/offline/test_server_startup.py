"""``opencoti serve`` whose start-up fails exits non-zero with the reason on stderr (a process
supervisor then acts), instead of answering 500 on every route; while it loads normally ``/health``
answers 503 with ``Retry-After``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from opencoti.engine.persist.store import DB_NAME, StateStore


def serve(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "opencoti", "serve", "--model", "tiny:llama", "--port", "0",
                             "--kv-budget-tokens", "256", "--page-size", "4", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finished(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the server kept running after its start-up failed: {err[-2000:]}")
    return proc.returncode, err


def test_a_locked_state_dir_ends_the_process(tmp_path):
    store = StateStore(tmp_path / "state")  # another server holds the directory
    try:
        t0 = time.monotonic()
        code, err = finished(serve("--state-dir", str(tmp_path / "state")))
    finally:
        store.close()
    assert code == 1, err[-2000:]
    assert "start-up failed" in err and "in use by another process" in err, err[-2000:]
    assert time.monotonic() - t0 < 120


def test_an_unreadable_state_database_ends_the_process(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    (d / DB_NAME).write_bytes(b"this is not a database" * 300)
    code, err = finished(serve("--state-dir", str(d)))
    assert code == 1 and "start-up failed" in err and str(d) in err, err[-2000:]
