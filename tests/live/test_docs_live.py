"""Every code block of README.md and docs/*.md, run as written on the bundled model
(tests/docblocks.py: each doc's python blocks as one script; each shell block with a free $PORT,
servers stopped afterwards, the test suite / demo themselves checked with make -n)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import docblocks  # noqa: E402

SCRIPTS = [p for p in docblocks.doc_files() if docblocks.python_script(p)]
SHELL = [b for b in docblocks.all_blocks() if b.lang in docblocks.SHELL]


@pytest.mark.bundled
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, opencoti_cache):
    blocks = [b for b in docblocks.parse(path) if b.lang in docblocks.PYTHON]
    ok, out = docblocks.run_python(path, tmp_path / "out.log", timeout=sum(b.timeout for b in blocks))
    assert ok, f"{path.name}: its python blocks failed:\n{out}"


@pytest.mark.bundled
@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_shell_blocks_run(block, tmp_path, opencoti_cache):
    ok, out = docblocks.run_shell(block, tmp_path / "out.log")
    assert ok, f"{block.where} failed:\n{block.code}\n--- output\n{out}"
