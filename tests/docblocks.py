"""The code blocks of README.md and docs/*.md, and how the doc tests run them.

Every fenced block carries a language: ``python`` / ``py``, ``bash`` / ``sh`` / ``shell`` /
``console`` (run), or a non-code tag such as ``text``, ``json``, ``yaml`` (not run). An HTML comment
right before a block can direct how it is run:

* ``<!-- doc-test: server -->``: the block starts a long-running server in the foreground; it
  passes when ``http://127.0.0.1:$PORT/`` answers (any status) before the timeout, then it is stopped.
* ``<!-- doc-test: dry-run -->``: the block is the test suite or the demo itself: its ``make``
  commands are checked with ``make -n`` (the target exists and its recipe expands), not run.
* ``<!-- doc-test: timeout 600 -->``: seconds the block may take (default 300).

Python blocks of one file run in order as one script (later blocks use earlier names). Shell
blocks run with ``bash -e`` from the repository root, with ``$PORT`` set to a free port (docs
that start a server write ``--port ${PORT:-8080}``), ``.venv/bin`` first on ``PATH``, in their own
process group, which is killed afterwards (servers a block started in the background go with it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
TEXT = {"text", "txt", "json", "jsonc", "yaml", "yml", "toml", "ini", "http", "mermaid", "diff", "csv", "jinja",
        "markdown", "md", "gbnf", "lark", "sql", "html", "xml"}
_FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)\s*(.*)$")
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    directives: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def timeout(self) -> float:
        return float(self.directives.get("timeout", 300))


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    pending: dict = {}
    while i < len(lines):
        m = _FENCE.match(lines[i])
        d = _DIRECTIVE.search(lines[i])
        if d and not m:
            key, _, value = d.group(1).partition(" ")
            pending[key] = value.strip() or True
            i += 1
            continue
        if not m:
            if lines[i].strip():
                pending = {}
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        body = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append(Block(path, i + 1, lang, "\n".join(body) + "\n", pending))
        pending = {}
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse(f)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(port: int | None = None) -> dict:
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "LANGGRAPH_CLI_NO_ANALYTICS": "1", "LANGSMITH_TRACING": "false"}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.pop("OPENCOTI_BASE_URL", None)
    if port is not None:
        e["PORT"] = str(port)
    return e


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            time.sleep(0.5)  # let the group's other members go too
        except subprocess.TimeoutExpired:
            continue


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer: the server is up
    except OSError:
        return False


def run_shell(block: Block, log: Path) -> tuple[bool, str]:
    """Run a shell block as the docs direct; (passed, the tail of its output)."""
    port = free_port()
    code = block.code
    if "dry-run" in block.directives:
        code = "make() { command make -n \"$@\"; }\n" + code
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-e", "-c", code], cwd=ROOT, env=env(port), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        ok = False
        try:
            deadline = time.monotonic() + block.timeout
            if "server" in block.directives:
                while time.monotonic() < deadline and proc.poll() is None:
                    if _answers(port):
                        ok = True
                        break
                    time.sleep(0.5)
            else:
                try:
                    ok = proc.wait(max(1.0, deadline - time.monotonic())) == 0
                except subprocess.TimeoutExpired:
                    ok = False
        finally:
            _kill_group(proc)
    return ok, log.read_text()[-4000:]


def python_script(path: Path) -> str | None:
    """The python blocks of one doc, in order, as one script (None: the doc has none)."""
    blocks = [b for b in parse(path) if b.lang in PYTHON]
    if not blocks:
        return None
    parts = [f"print('--- doc block {b.where}', flush=True)\n{b.code}" for b in blocks]
    return "\n".join(parts)


def run_python(path: Path, log: Path, timeout: float) -> tuple[bool, str]:
    script = python_script(path)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env(free_port()), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ok = proc.wait(timeout) == 0
        except subprocess.TimeoutExpired:
            ok = False
        finally:
            _kill_group(proc)
    return ok, log.read_text()[-4000:]
