"""The code blocks of README.md and docs/*.md (tests/docblocks.py says how they are found and run):
every block is tagged, every python block compiles (each file's blocks as one script), every shell
block parses (bash -n), and the directives are known. Running them needs the bundled model and a
server: tests/live/test_docs_live.py runs every block as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import docblocks  # noqa: E402

BLOCKS = docblocks.all_blocks()
KNOWN_DIRECTIVES = {"server", "dry-run", "timeout"}


def test_docs_have_blocks_and_the_parser_finds_them(tmp_path):
    assert any(b.path.name == "README.md" for b in BLOCKS) and any(b.path.name == "langgraph.md" for b in BLOCKS)
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- doc-test: server -->\n```bash\necho hi\n```\n\n- item\n\n   ```python\n   x = 1\n"
                   "   ```\n")
    a, b = docblocks.parse(doc)
    assert (a.lang, a.code, a.directives) == ("bash", "echo hi\n", {"server": True})
    assert (b.lang, b.code, b.directives) == ("python", "x = 1\n", {})


def test_every_block_is_tagged():
    untagged = [b.where for b in BLOCKS if not b.lang]
    unknown = [f"{b.where} ({b.lang})" for b in BLOCKS
               if b.lang and b.lang not in docblocks.PYTHON | docblocks.SHELL | docblocks.TEXT]
    assert not untagged, f"untagged blocks (python / bash to run them, text if they are not code): {untagged}"
    assert not unknown, f"unknown block languages: {unknown}"


@pytest.mark.parametrize("path", [p for p in docblocks.doc_files() if docblocks.python_script(p)],
                         ids=lambda p: p.name)
def test_python_blocks_compile(path):
    compile(docblocks.python_script(path), str(path), "exec")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in docblocks.SHELL], ids=lambda b: b.where)
def test_shell_blocks_parse(block):
    r = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert set(block.directives) <= KNOWN_DIRECTIVES, block.directives
    if "server" in block.directives:
        assert "PORT" in block.code, "a server block must listen on $PORT (e.g. --port ${PORT:-8080})"
    if "--port" in block.code or "langgraph dev" in block.code:
        assert "${PORT" in block.code or "$PORT" in block.code, \
            "a block that starts a server takes its port from $PORT, so the doc test can give it a free one"


def test_shell_runner_handles_servers_and_failures(tmp_path):
    ok, _ = docblocks.run_shell(docblocks.Block(tmp_path / "x.md", 1, "bash", "true\n"), tmp_path / "a.log")
    assert ok
    ok, out = docblocks.run_shell(docblocks.Block(tmp_path / "x.md", 1, "bash", "echo nope; false\n"),
                                  tmp_path / "b.log")
    assert not ok and "nope" in out
    server = ("python3 -m http.server --bind 127.0.0.1 ${PORT:-8000}\n")
    ok, _ = docblocks.run_shell(docblocks.Block(tmp_path / "x.md", 1, "bash", server, {"server": True,
                                                                                        "timeout": 30}),
                                tmp_path / "c.log")
    assert ok
    # a background server a block leaves behind is stopped with the block's process group
    bg = "python3 -m http.server --bind 127.0.0.1 $PORT >/dev/null 2>&1 & echo $! > " + str(tmp_path / "pid") + "\n"
    ok, _ = docblocks.run_shell(docblocks.Block(tmp_path / "x.md", 1, "bash", bg), tmp_path / "d.log")
    pid = int((tmp_path / "pid").read_text())
    assert ok
    import os
    import time
    for _ in range(20):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the block's background server is still running")
    dry = docblocks.Block(tmp_path / "x.md", 1, "bash", "make test\n", {"dry-run": True})
    ok, out = docblocks.run_shell(dry, tmp_path / "e.log")
    assert ok and "pytest" in out  # make -n printed the recipe, ran nothing
